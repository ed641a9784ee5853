"""lora-sidecar: stage LoRA adapters from S3 onto a GPU node for Triton + vLLM."""
