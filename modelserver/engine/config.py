"""Engine configuration, named like vLLM's flags."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.kv_events import DEFAULT_HASH_ALGO, HASH_ALGOS


@dataclass
class EngineConfig:
    block_size: int = 16
    num_gpu_blocks: int = 8192
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO  # vLLM's block hash: sha256 (pickle) or sha256_cbor
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None  # adapters kept in host memory, LRU (None: max_loras)
    max_lora_rank: int = 16
    gpu_memory_utilization: float = 0.9
    cache_dtype: str = "auto"
    swap_space: int = 0
    kv_cache_metrics_sample: float = 0.0  # fraction of blocks whose residency is recorded; 0 = off

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}")
        if not 0.0 <= self.kv_cache_metrics_sample <= 1.0:
            raise ValueError("kv_cache_metrics_sample must be in [0, 1]")

    def cache_config_labels(self) -> dict[str, str]:
        """The labels of vllm:cache_config_info: every cache setting, integers where they are integers."""
        return {
            "block_size": str(self.block_size),
            "cache_dtype": self.cache_dtype,
            "calculate_kv_scales": "False",
            "cpu_offload_gb": "0",
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu_memory_utilization),
            "is_attention_free": "False",
            "num_cpu_blocks": "0",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_gpu_blocks_override": str(self.num_gpu_blocks),
            "prefix_caching_hash_algo": self.prefix_caching_hash_algo,
            "sliding_window": "None",
            "swap_space": str(self.swap_space),
        }
