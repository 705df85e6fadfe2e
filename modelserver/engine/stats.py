"""What the engine core reports, as plain data (vLLM V1's design: the scheduler schedules and updates, the engine
core produces stats, stat loggers consume them; `modelserver.metrics` has the Prometheus logger and the periodic
log line). Nothing here knows how the numbers are exported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's state after a change (a step, a new request, an abort)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


@dataclass(slots=True)
class FinishedRequestStats:
    """One request's intervals, from its first SCHEDULED and its first and last NEW_TOKENS events."""

    finish_reason: str
    e2e: float
    num_prompt_tokens: int
    num_generation_tokens: int
    n: int
    max_tokens: int | None
    decode: float | None = None  # None: it never produced a token (aborted in the queue or during prefill)
    inference: float | None = None
    tpot: float | None = None


@dataclass(slots=True)
class IterationStats:
    """What happened in one engine step (`is_step`), or between steps (an abort: only `finished`).

    The sequences that are usually empty are empty tuples until something is recorded: a step at 256 sequences
    allocates ~690 tracked objects, just under the interpreter's 700 that trigger a gen-0 collection, and a dozen
    empty lists per step pushed it over, every step (measured: tests/modelserver/engine/bench_step.py)."""

    is_step: bool = True
    num_prompt_tokens: int = 0  # of the prefills that completed this step
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step, and found there
    prefix_cache_hits: int = 0
    scheduled_prompts: list[tuple[int, int]] | tuple = ()  # (prompt, cached) tokens, newly scheduled
    queue_times: list[float] | tuple = ()
    ttfts: list[float] | tuple = ()
    prefill_times: list[float] | tuple = ()
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] | tuple = ()
    kv_block_lifetimes: list[float] | tuple = ()  # sampled blocks' residency (when enabled)
    kv_block_idle_before_evict: list[float] | tuple = ()
    kv_block_reuse_gaps: list[float] | tuple = ()


class StatLogger(Protocol):
    """Consumes the engine's stats. `log_interval`: seconds between the logger's periodic outputs, or None; an
    idle engine still calls `record(scheduler_stats, None)` that often so the last busy interval is reported."""

    log_interval: float | None

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None: ...
