"""A request as the engine tracks it, its sampling parameters, and what each step returns for it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, auto


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16  # resolved by the frontend: min(requested, max_model_len - prompt length)
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1  # only for the request_params_n histogram: the frontend fans out n > 1 itself


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason:
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[dict[int, float]] | None = None


class Request:
    """Engine-side state of one sequence. `token_ids` is prompt + output, grown in place."""

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "block_ids",
        "finish_reason",
        "first_token_ts",
        "last_token_ts",
        "lora_name",
        "lora_slot",
        "max_len",
        "min_len",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_registered_blocks",
        "params",
        "queued_ts",
        "request_id",
        "scheduled",
        "scheduled_ts",
        "status",
        "stop_ids",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_name: str | None = None,
        arrival_time: float | None = None,
    ):
        now = time.monotonic()
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.lora_name = lora_name
        self.lora_slot = 0
        self.arrival_time = now if arrival_time is None else arrival_time
        self.queued_ts = now
        self.scheduled_ts = 0.0  # first SCHEDULED (vLLM V1: preemption in prefill counts into prefill/TTFT)
        self.first_token_ts = 0.0
        self.last_token_ts = 0.0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first scheduling; -1 until then
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.num_registered_blocks = 0  # leading blocks already entered in the prefix cache
        self.scheduled = None  # the executor's view of this request (ScheduledSequence), reused every step
        self.block_hashes: list[bytes] = []  # vLLM block digests of this request's full blocks, computed as they fill
        # Stop conditions, set by the scheduler when the request is added (they depend on the engine's limits).
        self.max_len = self.num_prompt_tokens + params.max_tokens  # finish with "length" at this many tokens
        self.min_len = self.num_prompt_tokens + params.min_tokens  # no "stop" before this many tokens
        self.stop_ids: set[int] = set(params.stop_token_ids)  # stop token ids, with EOS unless ignore_eos

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
