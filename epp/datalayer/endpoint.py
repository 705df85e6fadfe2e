"""The pool as discovery reports it (`PoolState`, `EndpointSpec`) and as the scheduler reads it (`Endpoint`)."""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.metrics import EndpointMetrics

# The endpoint's inter-token latency totals are kept at most every INTER_TOKEN_SAMPLE_SECONDS for the last
# INTER_TOKEN_SAMPLES samples (half a minute, ~26 KB an endpoint): a decode of 0.3 s or more has two samples inside
# it, and one of up to half a minute is covered.
INTER_TOKEN_SAMPLE_SECONDS = 0.1
INTER_TOKEN_SAMPLES = 300
# A request's time per output token is read off its endpoint's totals only when samples span at least this share of
# its decode and saw at least this many tokens: a shorter window says more about the scrapes than the request.
INTER_TOKEN_MIN_COVER = 0.5
INTER_TOKEN_MIN_TOKENS = 4
# Each TTFT moves `recent_ttft` this share of the way: about the last ten responses count, so it follows a queue that
# builds within a second or two at tens of requests a second.
TTFT_SMOOTHING = 0.2
# The most adapter slots believed of one endpoint's max_lora (vLLM's --max-loras is single digits to tens): a bound
# on what is remembered per endpoint when a page claims more.
MAX_ADAPTER_SLOTS = 256
# LoRA adapter names a plugin remembers as adapters (names endpoints reported running or waiting): a bound against a
# pool that loads and unloads adapters at runtime for good.
MAX_KNOWN_ADAPTERS = 4096


def adapter_listed(model: str, endpoints: Iterable[Endpoint], known: set[str]) -> bool:
    """Whether `model` is a LoRA adapter: `known` holds it, or one of `endpoints` lists it running or waiting (then
    `known` remembers it, while it holds fewer than MAX_KNOWN_ADAPTERS). Endpoints never list their base model, so a
    request for an adapter that none of them holds right now is still told from a base-model request."""
    if model in known:
        return True
    for e in endpoints:
        m = e.metrics
        if m is not None and (model in m.running_adapters or model in m.waiting_adapters):
            if len(known) < MAX_KNOWN_ADAPTERS:
                known.add(model)
            return True
    return False


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """One model-server endpoint as discovery knows it. `name` is unique in the pool (Kubernetes: `<pod>-rank-<i>`)."""

    name: str
    address: str
    port: int
    engine: str = "vllm"
    labels: tuple[tuple[str, str], ...] = ()
    # "ip:port" ("[ip6]:port"), read on every request by the scheduler and the answers: computed once
    hostport: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        address = f"[{self.address}]" if ":" in self.address else self.address
        object.__setattr__(self, "hostport", f"{address}:{self.port}")


@dataclass(frozen=True, slots=True)
class ModelRewrite:
    """Requests for `model` are sent as one of `targets` (name, weight), chosen by weight."""

    model: str
    targets: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class PoolState:
    """Everything discovery knows at one moment. Discovery sources publish a whole new PoolState on each change."""

    endpoints: tuple[EndpointSpec, ...] = ()
    objectives: dict[str, int] = field(default_factory=dict)  # objective name -> priority (negative = sheddable)
    models: frozenset[str] | None = None  # models the pool serves, when declared; None = any
    rewrites: tuple[ModelRewrite, ...] = ()


@dataclass(eq=False)
class Endpoint:
    """Live state of one endpoint: identity, the latest scrape, and what the EPP routed there and is not finished.

    The data layer mutates it in place (one object per endpoint for its lifetime in the pool), so the scheduler's
    per-request path reads plain attributes with no copying or locking (single event loop).
    """

    spec: EndpointSpec
    metrics: EndpointMetrics | None = None  # None until the first successful scrape
    stale: bool = True  # no successful scrape within the staleness threshold
    stale_reason: str = ""  # why, as the latest failed scrape said ("" before the first scrape's outcome)
    in_flight_requests: int = 0  # with peer replicas (epp.replicas), theirs included
    in_flight_tokens: int = 0  # estimated prompt tokens of in-flight requests not answered yet (pending prefill)
    recent_ttft: float = 0.0  # mean TTFT of the streamed responses it served lately, weighted to the latest; 0 = none
    routed_total: int = 0
    # For a load estimate fresher than the last scrape: what the EPP had in flight when that scrape was taken (the
    # requests routed and finished since then are the difference), and the most requests the endpoint was seen
    # running while others waited (its batch is full at that count; None until a scrape showed a waiting request).
    in_flight_at_scrape: int = 0
    # Of in_flight_requests and in_flight_tokens, what peer EPP replicas said they routed there (`epp.replicas`):
    # the counts every reader sees are the pool's; the director's own accounting is the rest.
    peer_in_flight_requests: int = 0
    peer_in_flight_tokens: int = 0
    batch_slots: int | None = None
    # (scraped_at, inter-token seconds, inter-tokens): the engine's histogram totals over time (`inter_token_latency`)
    inter_token_totals: deque[tuple[float, float, float]] = field(
        default_factory=lambda: deque(maxlen=INTER_TOKEN_SAMPLES), repr=False
    )
    # the last `max_lora` distinct LoRA adapters its scrapes saw running or the EPP sent it, most recent last
    # (`adapters_used`)
    recent_adapters: OrderedDict[str, None] = field(default_factory=OrderedDict, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def observe_ttft(self, seconds: float) -> None:
        """A streamed response it served had its first token `seconds` after the EPP routed it there."""
        recent = self.recent_ttft
        self.recent_ttft = seconds if not recent else recent + TTFT_SMOOTHING * (seconds - recent)

    def adapters_used(self, names: Iterable[str], slots: int | None) -> None:
        """These adapters ran here (a scrape saw them running) or were just sent here, in an engine with `slots`
        adapter slots. The engine keeps an idle adapter in its slot until another one needs the slot (least recently
        used first), and `running_adapters` names only those with requests: the last `slots` distinct adapters used
        here are probably still loaded (`adapter_loaded`). Wrong only when the engine evicts sooner than that (an
        adapter another client loaded and finished between two scrapes took a slot unseen)."""
        recent = self.recent_adapters
        for name in names:
            recent[name] = None
            recent.move_to_end(name)
        limit = min(slots or 0, MAX_ADAPTER_SLOTS)
        while len(recent) > limit:
            recent.popitem(last=False)

    def adapter_loaded(self, adapter: str) -> bool:
        """Whether `adapter` runs here, or was used lately and probably still holds its slot (`adapters_used`)."""
        m = self.metrics
        return (m is not None and adapter in m.running_adapters) or adapter in self.recent_adapters

    def inter_token_sample_due(self, at: float) -> bool:
        """Whether a scrape at `at` should add a sample: none for INTER_TOKEN_SAMPLE_SECONDS."""
        totals = self.inter_token_totals
        return not totals or at - totals[-1][0] >= INTER_TOKEN_SAMPLE_SECONDS

    def record_inter_token_totals(self, at: float, seconds: float, tokens: float) -> None:
        """Keep a scrape's inter-token latency totals (its engine's histogram `_sum` and `_count`)."""
        totals = self.inter_token_totals
        if totals and tokens < totals[-1][2]:
            totals.clear()  # the server restarted: its totals began again
        totals.append((at, seconds, tokens))

    def inter_token_latency(self, start: float, end: float) -> float | None:
        """The endpoint's mean gap between tokens from `start` to `end` (time.monotonic() seconds), from its totals
        at the first sample in that span and the last one. Every request in an engine's batch gets one token per
        step, so this is the time per output token of a request that decoded there then, seen from the server: no
        response body needed. None when the samples cover too little of the span (INTER_TOKEN_MIN_COVER) or saw too
        few tokens."""
        totals = self.inter_token_totals
        first = bisect.bisect_left(totals, start, key=_sample_time)
        last = bisect.bisect_right(totals, end, key=_sample_time) - 1
        if first >= last:
            return None
        (first_at, first_seconds, first_tokens), (last_at, last_seconds, last_tokens) = totals[first], totals[last]
        tokens = last_tokens - first_tokens
        if last_at - first_at < INTER_TOKEN_MIN_COVER * (end - start) or tokens < INTER_TOKEN_MIN_TOKENS:
            return None
        return (last_seconds - first_seconds) / tokens

    @property
    def hostport(self) -> str:
        return self.spec.hostport


def _sample_time(sample: tuple[float, float, float]) -> float:
    return sample[0]
