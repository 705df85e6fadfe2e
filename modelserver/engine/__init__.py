"""The engine core: requests, scheduler, KV block manager with prefix caching, LoRA slots, executors."""
