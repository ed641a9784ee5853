"""The exit codes of `lora-sidecar` (docs/reference.md documents them; scripts depend on them)."""

EXIT_OK = 0
EXIT_FAILED = 1  # a command failed, or `serve` could not bind or failed while running
EXIT_USAGE = 2  # bad arguments, or a configuration that cannot work (every problem listed)
EXIT_CACHE_OWNED = 3  # `serve` refused: another process owns the cache root
