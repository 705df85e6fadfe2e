"""The simulated executor: the real scheduler and KV bookkeeping run, only the forward pass is replaced by a GPU
timing model, so a pool of dozens of "GPUs" fits on one small machine and every metric is real.

Step time = prefill_overhead (when the step prefills) + uncached prefill tokens x prefill_time_per_token
          + decode_base + decode_per_seq x decode sequences (when the step decodes)
          + lora_load_time per adapter loaded into a slot (+ lora_cold_load_time when it was not among the
            max_cpu_loras adapters in host memory), all times (1 + jitter x N(0, 1)) when jitter is set,
            and divided by speed (a pool mixing GPU generations: 0.5 for one half as fast as the defaults).
Defaults approximate an 8B model on one H100 (bf16): ~12 ms inter-token latency at low batch rising to ~25 ms at
256 sequences, ~0.1 ms per uncached prompt token (~10k prefill tokens/s), LoRA load ~20 ms from host memory and
~70 ms from storage.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, fields

from modelserver.engine.executor import ScheduledBatch, ScheduledSequence, StepOutput, load_loras


@dataclass
class SimTiming:
    prefill_overhead: float = 0.004  # seconds per step that prefills
    prefill_time_per_token: float = 0.0001  # seconds per uncached prompt token
    decode_base: float = 0.012  # seconds per decode step at batch size 1
    decode_per_seq: float = 0.00005  # extra seconds per sequence in the decode batch
    lora_load_time: float = 0.02  # seconds to load an adapter into a GPU slot
    lora_cold_load_time: float = 0.05  # extra seconds when the adapter is not in host memory (--max-cpu-loras)
    jitter: float = 0.0  # relative standard deviation of the step time
    speed: float = 1.0  # relative to the defaults' GPU: every step time is divided by it
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"SimTiming: speed must be a finite number > 0, got {self.speed!r}")

    @classmethod
    def zero(cls) -> SimTiming:
        """No modelled time at all: for measuring the software's own overhead."""
        return cls(**{f.name: 0.0 for f in fields(cls) if f.name not in ("seed", "speed")})

    def step_time(self, batch: ScheduledBatch, rng: random.Random) -> float:
        num_decode_seqs = batch.num_decode_tokens
        seconds = len(batch.new_lora_loads) * self.lora_load_time + batch.num_cold_lora_loads * self.lora_cold_load_time
        if batch.num_uncached_prefill_tokens:
            seconds += self.prefill_overhead + batch.num_uncached_prefill_tokens * self.prefill_time_per_token
        if num_decode_seqs:
            seconds += self.decode_base + self.decode_per_seq * num_decode_seqs
        if self.jitter:
            seconds *= max(0.0, 1.0 + self.jitter * rng.gauss(0.0, 1.0))
        return seconds / self.speed


class SimExecutor:
    """Sleeps the modelled step time and returns deterministic filler tokens (never EOS, so lengths are exact)."""

    def __init__(self, timing: SimTiming, block_size: int, num_gpu_blocks: int, filler_token_ids: list[int]):
        if not filler_token_ids:
            raise ValueError("the sim executor needs at least one filler token id")
        self.timing = timing
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.eos_token_id: int | None = None
        self._filler = filler_token_ids
        self._rng = random.Random(timing.seed)
        self.loaded_loras: dict[int, str] = {}

    async def execute(self, batch: ScheduledBatch) -> StepOutput:
        failed = load_loras(self, batch.new_lora_loads) if batch.new_lora_loads else {}
        await asyncio.sleep(self.timing.step_time(batch, self._rng))
        tokens = [self._filler_token(s) if s.samples else None for s in batch.sequences]
        if not any(s.params.logprobs is not None for s in batch.sequences):
            return StepOutput(tokens, failed_lora_loads=failed)
        # The filler is deterministic: the sampled token has probability 1.
        logprobs = [
            {t: 0.0} if t is not None and s.params.logprobs is not None else None
            for s, t in zip(batch.sequences, tokens, strict=True)
        ]
        return StepOutput(tokens, logprobs, failed)

    def _filler_token(self, s: ScheduledSequence) -> int:
        """Deterministic like greedy decoding: the same prompt length (or seed) gives the same text."""
        base = s.params.seed if s.params.seed is not None else len(s.token_ids) - s.num_sampled
        return self._filler[(base * 31 + s.num_sampled) % len(self._filler)]

    def load_lora(self, slot: int, name: str, path: str) -> None:
        self.loaded_loras[slot] = name

    async def close(self) -> None:
        return None
