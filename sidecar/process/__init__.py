"""The process: the command line, the wiring, start-up checks, signals and shutdown."""
