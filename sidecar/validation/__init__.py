"""What makes an adapter servable: config, safetensors header, tensor shapes and values."""
