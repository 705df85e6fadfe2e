"""The executor interface: everything above it (scheduler, KV bookkeeping, LoRA slots, metrics) is the same code
whether a real transformer (`torch`) or a timing model (`sim`) runs the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from modelserver.engine.request import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    request_id: str
    token_ids: list[int]  # all tokens so far (prompt + output); the executor reads, never writes
    start: int  # first position computed this step (cached prefix and earlier chunks are skipped)
    num_new_tokens: int  # positions [start, start + num_new_tokens)
    block_table: list[int]  # physical blocks covering positions [0, start + num_new_tokens)
    samples: bool  # the chunk reaches the end of the sequence: sample the next token
    params: SamplingParams
    lora_slot: int  # 0 = no adapter
    num_sampled: int  # output tokens so far (seeded sampling stays reproducible across steps)


@dataclass(slots=True)
class ScheduledBatch:
    sequences: list[ScheduledSequence]
    num_uncached_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    new_lora_loads: dict[int, tuple[str, str]] = field(default_factory=dict)  # slot -> (name, path)
    num_cold_lora_loads: int = 0  # of new_lora_loads, those not in host memory (read from storage first)


@dataclass(slots=True)
class StepOutput:
    tokens: list[int | None]  # the next token of each sequence that samples (None for the others), in order
    logprobs: list[dict[int, float] | None] | None = None  # per sequence, when one asked: token id -> logprob
    # adapters whose load failed this step (name -> reason): their sequences' tokens are meaningless, the engine
    # fails those requests alone and forgets the slot, so the next request for the adapter tries the load again
    failed_lora_loads: dict[str, str] = field(default_factory=dict)


def load_loras(executor: Executor, loads: dict[int, tuple[str, str]]) -> dict[str, str]:
    """Load the step's adapters into their slots; a failure (missing or unreadable files) is returned, not raised,
    so one bad adapter never stops the step of every other request."""
    failed = {}
    for slot, (name, path) in loads.items():
        try:
            executor.load_lora(slot, name, path)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


class Executor(Protocol):
    block_size: int
    num_gpu_blocks: int
    eos_token_id: int | None

    async def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step: the next token of each sequence with `samples`, and logprobs where they were asked for
        (the sampled token and the top `params.logprobs` alternatives)."""
        ...

    def load_lora(self, slot: int, name: str, path: str) -> None: ...

    async def close(self) -> None: ...
