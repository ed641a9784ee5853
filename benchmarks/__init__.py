"""Benchmarks of lora-sidecar against the alternatives; run with `benchmarks/run.sh`."""
