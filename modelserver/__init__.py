"""Reference model server: an OpenAI API over a continuous-batching engine (paged KV cache, prefix caching,
multi-LoRA) with vLLM's V1 metrics. The forward pass is pluggable: `sim` (a GPU timing model) or `torch`."""
