"""From shards to a model people can run: Hugging Face folders and LoRA adapters."""
