"""The `torch` executor: a Llama/Qwen2-family transformer on the engine's paged KV cache, with batched multi-LoRA."""
