"""The scheduler's inputs and outputs, the names plugins go by, and the per-cycle state they share."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import cython

from epp.datalayer.endpoint import Endpoint
from protocol.openai import RequestKind

T = TypeVar("T")


class TypedName(NamedTuple):
    """A plugin instance's identity: its registered type and its instance name (the type unless configured). A named
    tuple: a key of the metrics' per-plugin series, hashed in C on every request."""

    type: str
    name: str

    def __str__(self) -> str:
        return f"{self.type}/{self.name}"


class StateKey(Generic[T]):
    """A typed key of the CycleState. Keys compare by identity: the module that writes a value defines its key once
    and readers import it, so two plugins cannot collide on a spelling."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


@cython.cclass
class CycleState:
    """Data any plugin may write and read during one scheduling cycle; the SchedulingResult carries it on to the
    request's later hooks (pre-request, response-complete). One request at a time: no locking."""

    _data = cython.declare(dict)

    def __init__(self) -> None:
        self._data: dict[StateKey[Any], Any] = {}

    def read(self, key: StateKey[T]) -> T | None:
        return self._data.get(key)

    def write(self, key: StateKey[T], value: T) -> None:
        self._data[key] = value


@cython.cclass
@dataclass
class ResponseInfo:
    """How a routed request's response went, as the EPP saw it (for ResponseComplete plugins; its timings go to
    ResponseTimed plugins). The usage's figures are None unless the response body streamed through the EPP."""

    status: str  # the HTTP status, "" when no response headers came through (a reset)
    output_tokens: int | None = None
    prompt_tokens: int | None = None  # the usage's prompt_tokens
    cached_tokens: int | None = None  # the usage's prompt_tokens_details.cached_tokens: the server's prefix hit


@cython.cclass
@dataclass
class SchedulingRequest:
    """What the scheduler may read of one request. Built once per request on the ext_proc path."""

    request_id: str
    model: str  # the model (or LoRA adapter) name after any rewrite: what the model server will see
    prompt: str = ""  # protocol.openai.prompt_text(...) of the body; "" for header-only requests
    prompt_tokens_estimate: int = 0  # len(prompt) // 4 unless a tokenizer is known
    priority: int = 0  # from the InferenceObjective named by x-gateway-inference-objective
    objective: str | None = None
    fairness_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None  # allowed "ip:port" from the proxy's subset hint; None = no hint
    max_tokens: int | None = None  # the body's max_tokens / max_completion_tokens, when it gives one
    streamed: bool = False  # the body asks for a streamed response: only its timings can come back (a TTFT)
    payload: dict[str, Any] | None = None  # the parsed JSON body (PrepareData plugins tokenize it)
    kind: RequestKind | None = None  # the API its path names (Completions, Chat, Responses, Messages); None: another


@cython.cclass
@dataclass
class SchedulingResult:
    """One scheduling cycle's outcome.

    endpoints: best first; the first is the pick, the rest are fallbacks.
    candidates: the endpoints the scorers rated (after the filters), in the order of each scorer's scores.
    raw_scores: per scorer that expressed a preference, its unweighted scores as it returned them, in the
        candidates' order (a scorer that abstained has no entry); `scores` gives them clamped to [0, 1], as the
        totals used them.
    timings: seconds each filter, scorer and the picker took, in the order they ran.
    totals: per candidate, its scorers' weighted sum, as the picker saw it.
    cycle_state: what the plugins stored during the cycle, for the request's later hooks.
    """

    endpoints: list[Endpoint]
    profile: str = "default"
    candidates: list[Endpoint] = field(default_factory=list)
    raw_scores: dict[TypedName, list[float]] = field(default_factory=dict)
    timings: list[tuple[TypedName, float]] = field(default_factory=list)
    cycle_state: CycleState = field(default_factory=CycleState)
    totals: list[float] = field(default_factory=list)

    @property
    def primary(self) -> Endpoint:
        return self.endpoints[0]

    @property
    def scores(self) -> dict[TypedName, list[float]]:
        """Per scorer, its scores clamped to [0, 1] (NaN as 0): what the totals were made of. Clamped here, on
        demand, because nothing on the request path reads them (the scheduler clamps each score as it sums it)."""
        return {name: [clamp_score(s) for s in scores] for name, scores in self.raw_scores.items()}


def clamp_score(score: float) -> float:
    """A score in [0, 1]: above 1 counts as 1; below 0 and NaN (every comparison with NaN is false) as 0."""
    return score if 0.0 <= score <= 1.0 else (1.0 if score > 1.0 else 0.0)


def add_best_scored(picked: list[Endpoint], endpoints: list[Endpoint], scores: list[float], count: int) -> None:
    """Appends to `picked` the highest-scored of `endpoints` (scores in the same order) that it lacks, until it holds
    `count`. One sort in C; ties keep the order of a list that starts at a random place, so that equal endpoints
    share what comes after the pick (the proxy's retries)."""
    if len(picked) >= count:
        return
    size = len(endpoints)
    start = int(random.random() * size)  # (random.randrange runs as Python, three frames deep)
    order = [*range(start, size), *range(start)]
    order.sort(key=scores.__getitem__, reverse=True)  # stable: ties stay in the rotated order
    for i in order:
        endpoint = endpoints[i]
        if endpoint not in picked:  # (a few at most; endpoints compare by identity)
            picked.append(endpoint)
            if len(picked) >= count:
                return
