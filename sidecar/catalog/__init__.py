"""vLLM's multi_lora.json catalog: generations, spare names, Triton reloads and engine state."""
