"""Flow control: at saturation requests wait in the EPP, by priority band and fairly between flows (tenants).

A request's band is its objective's priority; its flow is its `x-llm-d-inference-fairness-id` (none = one
default flow). Each flow has one queue in its band. `try_dispatch` is the fast path: with nothing queued and room
in the pool it answers True synchronously (no queue, no future, no await). Otherwise `wait` queues the request and
resolves when `pump` (called when a request completes or a scrape shows room) takes it: highest non-empty band
first; within a band the flows in fair order (`round-robin`: deficit round robin costed by requests or by tokens;
`global-strict`: the oldest request of any flow); within a flow arrival order (`fcfs`) or earliest deadline
(`edf`). Every request ends in exactly one outcome (GIE's names): Dispatched, RejectedCapacity, EvictedTTL,
EvictedContextCancelled, counted per band and flow.

Limits: global and per-band `maxRequests` / `maxBytes`. TTL: per objective (`objectiveRequestTTL`), else per band,
else `defaultRequestTTL`. A request that does not fit displaces the newest request
of the band's largest flow when that flow holds more than the newcomer's (so a noisy tenant cannot fill the band
against a quiet one); otherwise it is rejected. Config keys follow GIE's EndpointPickerConfig `flowControl`.
Trade-offs: `has_room` is polled on each pump, so the caller's saturation signal must be cheap; deficit by tokens
needs a token estimate at enqueue time (the prompt's, not the output's).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from epp.config import ConfigError
from epp.config.loader import EndpointPickerConfig, load
from epp.config.parameters import Parameters
from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import Endpoint
from epp.metrics import EPPMetrics

DISPATCHED = "Dispatched"
REJECTED_CAPACITY = "RejectedCapacity"
EVICTED_TTL = "EvictedTTL"
EVICTED_CANCELLED = "EvictedContextCancelled"
OUTCOMES = (DISPATCHED, REJECTED_CAPACITY, EVICTED_TTL, EVICTED_CANCELLED)

DEFAULT_FLOW = "default-flow"  # the flow of requests without x-llm-d-inference-fairness-id (llm-d's name)
# llm-d's policy names (its bands name their policies with fairnessPolicyRef / orderingPolicyRef)
FAIRNESS_POLICIES = {"round-robin-fairness-policy": "round-robin", "global-strict-fairness-policy": "global-strict"}
ORDERING_POLICIES = {"fcfs-ordering-policy": "fcfs", "edf-ordering-policy": "edf"}
_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_QUANTITY_UNITS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _quantity(p: Parameters, key: str, default: int) -> int:
    """A Kubernetes resource quantity ("1Gi", "500M", "1k") or a plain integer, >= 0."""
    value = p.get(key, default, (int, str))
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{p.owner}: {key} must be >= 0, got {value!r}")
        return value
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ConfigError(f"{p.owner}: {key} must be an integer or a quantity like 1Gi, 500M or 1k, got {value!r}")
    return int(match.group(1)) * _QUANTITY_UNITS[match.group(2)]


def _duration(p: Parameters, key: str, default: float) -> float:
    """Seconds from a number or a Go duration ("60s", "500ms", "1m30s")."""
    value = p.get(key, default, (int, float, str))
    if isinstance(value, str):
        text = value.strip()
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ConfigError(f"{p.owner}: {key} must be seconds or a duration like 60s or 500ms, got {value!r}")
        value = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if value < 0:
        raise ConfigError(f"{p.owner}: {key} must be >= 0, got {value!r}")
    return float(value)


class FlowControlRejected(Exception):
    """The request was not dispatched: `outcome` says why (429 with retry-after for every reason here)."""

    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome


# llm-d's defaults (pkg/epp/flowcontrol: registry and controller config): each band holds at most 5,000 requests and
# 1 GB, a request waits at most 60 s; a band's 0 means its default. Ours adds a limit over all bands together
# (MAX_REQUESTS, MAX_BYTES; llm-d's global limits are unset by default): bands come and go with the objectives'
# priorities, and what clients can make the EPP hold must have one bound.
BAND_MAX_REQUESTS = 5000
BAND_MAX_BYTES = 1_000_000_000
DEFAULT_REQUEST_TTL = 60.0
MAX_REQUESTS = 10_000
MAX_BYTES = 1 << 30


@dataclass
class BandConfig:
    priority: int
    max_requests: int = BAND_MAX_REQUESTS
    max_bytes: int = BAND_MAX_BYTES
    fairness_policy: str = "round-robin"
    fairness_cost: str = "requests"  # or "tokens": deficit round robin by prompt tokens
    quantum: int = 1
    ordering_policy: str = "fcfs"
    request_ttl: float = 0.0  # 0 = the global defaultRequestTTL (ours: llm-d has one TTL for all bands)


@dataclass
class FlowControlConfig:
    enabled: bool = True
    max_requests: int = MAX_REQUESTS
    max_bytes: int = MAX_BYTES
    default_request_ttl: float = DEFAULT_REQUEST_TTL
    bands: dict[int, BandConfig] = field(default_factory=dict)
    default_band: BandConfig = field(default_factory=lambda: BandConfig(priority=0))
    default_negative_band: BandConfig | None = None  # the template of priorities below 0 (else default_band's)
    objective_ttls: dict[str, float] = field(default_factory=dict)  # objective name -> its requests' TTL

    def request_ttl(self, objective: str | None) -> float | None:
        """The TTL of a request for `objective` when one is configured for it (else its band's or the default)."""
        return self.objective_ttls.get(objective) if objective else None

    def band(self, priority: int) -> BandConfig:
        cfg = self.bands.get(priority)
        if cfg is None:
            template = self.default_negative_band if priority < 0 and self.default_negative_band else self.default_band
            cfg = BandConfig(**{**template.__dict__, "priority": priority})
        return cfg

    @property
    def longest_ttl(self) -> float:
        """The longest a request may wait (what the proxy must be told to wait for an answer)."""
        templates = [self.default_band, *([self.default_negative_band] if self.default_negative_band else [])]
        bands = (b.request_ttl for b in (*templates, *self.bands.values()))
        return max(self.default_request_ttl, *bands, *self.objective_ttls.values())  # bands: one at least

    @classmethod
    def from_text(cls, config_text: str | None) -> FlowControlConfig:
        """From EndpointPickerConfig YAML, read by the config loader; see from_sections."""
        return cls.from_sections(load(config_text))

    @classmethod
    def from_sections(cls, config: EndpointPickerConfig) -> FlowControlConfig:
        """From the sections of a loaded EndpointPickerConfig flow control owns: `flowControl`, and llm-d's feature
        gate `flowControl=false` in `featureGates`, which turns it off like `flowControl: {enabled: false}`."""
        cfg = cls.from_config(config.flow_control)
        gates = config.feature_gates or []
        if not isinstance(gates, list) or not all(isinstance(g, str) for g in gates):
            raise ConfigError(f"featureGates must be a list of strings like flowControl=false, got {gates!r}")
        for gate in gates:
            name, _, value = gate.partition("=")
            if name.strip() == "flowControl":
                if value.strip().lower() not in ("", "true", "false"):
                    raise ConfigError(f"featureGates: {gate!r} must be flowControl, flowControl=true or =false")
                cfg.enabled = cfg.enabled and value.strip().lower() != "false"
        return cfg

    @classmethod
    def from_config(cls, raw: dict[str, Any] | None) -> FlowControlConfig:
        """From the EndpointPickerConfig's `flowControl` mapping; ConfigError when it is invalid."""
        p = Parameters("flowControl", raw)
        cfg = cls(
            enabled=p.get("enabled", True, bool),
            max_requests=_quantity(p, "maxRequests", MAX_REQUESTS) or MAX_REQUESTS,  # 0: unset, llm-d's convention
            max_bytes=_quantity(p, "maxBytes", MAX_BYTES) or MAX_BYTES,
            default_request_ttl=_duration(p, "defaultRequestTTL", DEFAULT_REQUEST_TTL),
        )
        if cfg.default_request_ttl <= 0:
            raise ConfigError("flowControl: defaultRequestTTL must be > 0 (a request must not wait forever)")
        cfg.default_band = _band_from(p.get("defaultPriorityBand", None, (dict, type(None))), 0)
        negative = p.get("defaultNegativePriorityBand", None, (dict, type(None)))
        cfg.default_negative_band = _band_from(negative, -1) if negative is not None else None
        raw_ttls = p.get("objectiveRequestTTL", {}, dict)
        ttls = Parameters("flowControl objectiveRequestTTL", raw_ttls)
        for objective in raw_ttls:
            cfg.objective_ttls[str(objective)] = ttl = _duration(ttls, objective, 0.0)
            if ttl <= 0:
                raise ConfigError(f"flowControl: objectiveRequestTTL {objective} must be > 0")
        for raw_band in p.get("priorityBands", [], list):
            if not isinstance(raw_band, dict) or not isinstance(raw_band.get("priority"), int):
                raise ConfigError(f"flowControl: each of priorityBands needs an integer priority, got {raw_band!r}")
            band = _band_from(raw_band, raw_band["priority"])
            if band.priority in cfg.bands:
                raise ConfigError(f"flowControl: priority band {band.priority} is listed twice")
            cfg.bands[band.priority] = band
        p.done()
        return cfg


def _band_from(raw: dict[str, Any] | None, priority: int) -> BandConfig:
    p = Parameters(f"flowControl band {priority}", raw)
    p.get("priority", priority, int)
    fairness = p.get("fairnessPolicyRef", "round-robin-fairness-policy", str)
    ordering = p.get("orderingPolicyRef", "fcfs-ordering-policy", str)
    if fairness not in FAIRNESS_POLICIES:
        raise ConfigError(f"flowControl band {priority}: fairnessPolicyRef must be one of {sorted(FAIRNESS_POLICIES)}")
    if ordering not in ORDERING_POLICIES:
        raise ConfigError(f"flowControl band {priority}: orderingPolicyRef must be one of {sorted(ORDERING_POLICIES)}")
    band = BandConfig(
        priority=priority,
        max_requests=_quantity(p, "maxRequests", BAND_MAX_REQUESTS) or BAND_MAX_REQUESTS,
        max_bytes=_quantity(p, "maxBytes", BAND_MAX_BYTES) or BAND_MAX_BYTES,
        fairness_policy=FAIRNESS_POLICIES[fairness],
        fairness_cost=p.get("fairnessCost", "requests", str),
        quantum=p.get("quantum", 1, int, minimum=1),
        ordering_policy=ORDERING_POLICIES[ordering],
        request_ttl=_duration(p, "defaultRequestTTL", 0.0),
    )
    p.done()
    if band.fairness_cost not in ("requests", "tokens"):
        raise ConfigError(f"flowControl band {priority}: fairnessCost must be requests or tokens")
    return band


class QueuedRequest:
    __slots__ = ("deadline", "done", "enqueued", "flow", "future", "seq", "size_bytes", "timer", "tokens")

    def __init__(self, flow: Flow, size_bytes: int, tokens: int, enqueued: float, deadline: float, seq: int):
        self.flow = flow
        self.size_bytes = size_bytes
        self.tokens = tokens
        self.enqueued = enqueued
        self.deadline = deadline
        self.seq = seq
        self.future: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.done = False

    def __lt__(self, other: QueuedRequest) -> bool:  # EDF heap order; seq breaks ties in arrival order
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class Flow:
    """One tenant's queue in one band; removed entries stay in the container until they reach its head."""

    def __init__(self, band: Band, flow_id: str):
        self.band = band
        self.id = flow_id
        self.items: deque[QueuedRequest] | list[QueuedRequest] = [] if band.config.ordering_policy == "edf" else deque()
        self.count = 0
        self.bytes = 0
        self.deficit = 0

    def push(self, item: QueuedRequest) -> None:
        if isinstance(self.items, list):
            heapq.heappush(self.items, item)
        else:
            self.items.append(item)

    def head(self) -> QueuedRequest | None:
        items = self.items
        while items and items[0].done:
            heapq.heappop(items) if isinstance(items, list) else items.popleft()
        return items[0] if items else None

    def newest(self) -> QueuedRequest | None:
        live = [i for i in self.items if not i.done]
        return max(live, key=lambda i: i.seq) if live else None


class Band:
    def __init__(self, config: BandConfig):
        self.config = config
        self.flows: dict[str, Flow] = {}
        self.active: deque[Flow] = deque()  # flows with queued requests, in round-robin order
        self.count = 0
        self.bytes = 0


Observer = Callable[[int, str, str, float], None]  # (priority, flow id, outcome, seconds in the queue)


class FlowController:
    """`has_room(in_flight)` is the saturation signal: True while the pool can take one more request now, given
    the requests this controller has dispatched that have not completed (the caller calls `complete()` for each,
    however it ended), so a burst of dispatches cannot overfill the pool before the next scrape shows them.
    `observer` hears every request's outcome once (the metrics). While requests wait, the pool is polled every
    `poll_interval` seconds (the scrape interval: a scrape that shows room dispatches them), besides each
    `complete()`."""

    def __init__(
        self,
        config: FlowControlConfig,
        has_room: Callable[[int], bool],
        clock=time.monotonic,
        observer: Observer | None = None,
        poll_interval: float = 0.05,
    ):
        self.config = config
        self.longest_ttl = config.longest_ttl  # read for every queued request; the config is fixed from here on
        self.has_room = has_room
        self.clock = clock
        self.observer = observer
        self.poll_interval = poll_interval
        self.bands: dict[int, Band] = {}
        self.order: list[Band] = []  # highest priority first
        self.count = 0
        self.bytes = 0
        self.in_flight = 0
        self._poll: asyncio.TimerHandle | None = None
        self._pump_soon = False
        self._seq = itertools.count()

    # The fast path: synchronous, allocates nothing when the pool has room and nothing waits.
    def try_dispatch(self, priority: int, flow_id: str) -> bool:
        if self.count == 0 and self.has_room(self.in_flight):
            self.in_flight += 1
            if self.observer is not None:
                self.observer(priority, flow_id, DISPATCHED, 0.0)
            return True
        return False

    def complete(self) -> None:
        """A dispatched request finished (served, failed or abandoned): its room goes to the next in line."""
        self.in_flight -= 1
        if self.count:
            self.pump()

    async def wait(self, priority: int, flow_id: str, size_bytes: int, tokens: int, ttl: float | None = None) -> None:
        """Queue the request until it is dispatched (returns) or not (raises FlowControlRejected). Cancelling the
        awaiting task (the client went away) removes it from its queue at once."""
        item = self._enqueue(priority, flow_id, size_bytes, tokens, ttl)
        if item.done:  # dispatched at once by the pump inside _enqueue
            return
        loop = asyncio.get_running_loop()
        item.future = loop.create_future()
        item.timer = loop.call_at(loop.time() + (item.deadline - self.clock()), self._expire, item)
        if self._poll is None:
            self._poll = loop.call_later(self.poll_interval, self._poll_pool)
        try:
            await item.future
        except asyncio.CancelledError:
            if not item.done:
                self._finish(item, EVICTED_CANCELLED)
            elif not item.future.cancelled() and item.future.exception() is None:
                self.complete()  # dispatched, but the waiter went away before it could use its turn
            raise

    def _poll_pool(self) -> None:
        self._poll = None
        self.pump()
        if self.count:
            self._poll = asyncio.get_running_loop().call_later(self.poll_interval, self._poll_pool)

    def _enqueue(self, priority: int, flow_id: str, size_bytes: int, tokens: int, ttl: float | None):
        band = self._band(priority)
        flow = band.flows.get(flow_id)
        if flow is None:
            flow = band.flows[flow_id] = Flow(band, flow_id)
        now = self.clock()
        ttl = ttl or band.config.request_ttl or self.config.default_request_ttl
        item = QueuedRequest(flow, size_bytes, tokens, now, now + ttl, next(self._seq))
        while not self._fits(band, size_bytes):
            victim = self._displaceable(band, flow)
            if victim is None:
                if self.observer is not None:
                    self.observer(priority, flow_id, REJECTED_CAPACITY, 0.0)
                raise FlowControlRejected(REJECTED_CAPACITY, f"flow control: band {priority} is full")
            self._finish(victim, REJECTED_CAPACITY)
        if flow.count == 0:
            band.active.append(flow)
        flow.push(item)
        flow.count += 1
        flow.bytes += size_bytes
        band.count += 1
        band.bytes += size_bytes
        self.count += 1
        self.bytes += size_bytes
        self.pump()
        return item

    def _fits(self, band: Band, size: int) -> bool:
        c, b = band.config, self.config
        return (
            self.count < b.max_requests
            and self.bytes + size <= b.max_bytes
            and (not c.max_requests or band.count < c.max_requests)
            and (not c.max_bytes or band.bytes + size <= c.max_bytes)
        )

    def _displaceable(self, band: Band, newcomer: Flow) -> QueuedRequest | None:
        """The newest request of the band's largest flow, if that flow holds more than the newcomer's plus one."""
        largest = max(band.active, key=lambda f: f.count, default=None)
        if largest is None or largest is newcomer or largest.count <= newcomer.count + 1:
            return None
        return largest.newest()

    def pump(self) -> int:
        """Dispatch the next queued request if the pool has room; returns how many were dispatched (0 or 1).

        One at a time: the dispatched request is routed when its waiter resumes (the next turn of the event loop),
        and only then does the saturation signal see it, so the next dispatch is decided after that (a call_soon
        queued behind the waiter's wake-up). Dispatching every queued request in one go would release a whole
        queue onto a pool that has room for one."""
        if not self.count or not self.has_room(self.in_flight):
            return 0
        item = self._next()
        while item is not None and item.future is not None and item.future.cancelled():
            # its waiter went away and has not yet taken it out of its queue: not a dispatch (the slot would never
            # come back, since that waiter gives back only a turn it was given)
            self._finish(item, EVICTED_CANCELLED)
            item = self._next()
        if item is None:
            return 0
        self._finish(item, DISPATCHED)
        if self.count and item.future is not None and not self._pump_soon:
            self._pump_soon = True
            asyncio.get_running_loop().call_soon(self._pump_again)
        return 1

    def _pump_again(self) -> None:
        self._pump_soon = False
        self.pump()

    def _next(self) -> QueuedRequest | None:
        for band in self.order:
            if band.count:
                return self._pick(band)
        return None

    def _pick(self, band: Band) -> QueuedRequest | None:
        if band.config.fairness_policy == "global-strict":
            heads = [h for f in band.active if (h := f.head()) is not None]
            return min(heads, key=lambda i: i.seq, default=None)
        by_tokens = band.config.fairness_cost == "tokens"
        while band.active:  # deficit round robin; cost 1 and quantum 1 is plain round robin
            flow = band.active[0]
            head = flow.head()
            cost = max(1, head.tokens) if by_tokens else 1
            if flow.deficit >= cost:
                flow.deficit -= cost
                return head
            flow.deficit += band.config.quantum
            if flow.deficit < cost:
                band.active.rotate(-1)
        return None

    def _expire(self, item: QueuedRequest) -> None:
        if not item.done:
            self._finish(item, EVICTED_TTL)

    def _finish(self, item: QueuedRequest, outcome: str) -> None:
        item.done = True
        flow = item.flow
        band = flow.band
        flow.count -= 1
        flow.bytes -= item.size_bytes
        band.count -= 1
        band.bytes -= item.size_bytes
        self.count -= 1
        self.bytes -= item.size_bytes
        if flow.count == 0:
            flow.deficit = 0
            band.active.remove(flow)
            del band.flows[flow.id]  # flows hold no memory once drained, however many fairness ids clients send
        elif (
            outcome == DISPATCHED
            and band.config.fairness_policy == "round-robin"
            and band.active[0] is flow
            and (band.config.fairness_cost == "requests" or flow.deficit < max(1, flow.head().tokens))
        ):
            band.active.rotate(-1)  # its turn is over: the next flow in the band goes next
        if outcome == DISPATCHED:
            self.in_flight += 1
        if self.observer is not None:
            self.observer(band.config.priority, flow.id, outcome, self.clock() - item.enqueued)
        if item.timer is not None:
            item.timer.cancel()
        future = item.future
        if future is not None and not future.done():
            if outcome == DISPATCHED:
                future.set_result(None)
            else:
                future.set_exception(FlowControlRejected(outcome, f"flow control: {outcome}"))

    def queued(self) -> list[tuple[int, str, int, int]]:
        """(priority, flow id, requests, bytes) of every flow with queued requests (the metrics' gauges)."""
        return [(b.config.priority, f.id, f.count, f.bytes) for b in list(self.order) for f in list(b.flows.values())]

    def _band(self, priority: int) -> Band:
        band = self.bands.get(priority)
        if band is None:
            band = self.bands[priority] = Band(self.config.band(priority))
            self.order = sorted(self.bands.values(), key=lambda b: -b.config.priority)
        return band


class FlowControlCollector:
    """Flow control's queues (per band and flow), the pool's saturation and the autoscaler signal (requests queued
    per ready endpoint), read when Prometheus scrapes. With flow control off (`controller` None) nothing is queued and
    the pool's gauges are still exported. `saturation`: the share of saturated endpoints (the saturation detector's)."""

    def __init__(
        self,
        metrics: EPPMetrics,
        controller: FlowController | None,
        datastore: Datastore,
        saturation: Callable[[Sequence[Endpoint]], float],
    ):
        self.metrics = metrics
        self.controller = controller
        self.datastore = datastore
        self.saturation = saturation

    def collect(self):
        pool = self.metrics.pool_name
        labels = ["fairness_id", "priority", "inference_pool"]
        size = GaugeMetricFamily(
            "inference_extension_flow_control_queue_size",
            "Current count of requests in the flow control buffer.",
            labels=labels,
        )
        size_bytes = GaugeMetricFamily(
            "inference_extension_flow_control_queue_bytes",
            "Current size in bytes of all buffered requests.",
            labels=labels,
        )
        saturation = GaugeMetricFamily(
            "inference_extension_flow_control_pool_saturation",
            "Share of the pool's endpoints that are saturated.",
            labels=["inference_pool"],
        )
        saturation.add_metric([pool], self.saturation(self.datastore.endpoints))
        per_endpoint = GaugeMetricFamily(
            "inference_extension_flow_control_queued_requests_per_ready_endpoint",
            "Requests waiting in flow control per ready endpoint (an autoscaling signal).",
            labels=["inference_pool"],
        )
        controller = self.controller
        totals: dict[tuple[str, str], list[int]] = {}
        for priority, flow, count, size_of in controller.queued() if controller is not None else ():
            key = (self.metrics.fairness_label(flow), str(priority))
            total = totals.setdefault(key, [0, 0])
            total[0] += count
            total[1] += size_of
        for (flow, priority), (count, size_of) in totals.items():
            size.add_metric([flow, priority, pool], count)
            size_bytes.add_metric([flow, priority, pool], size_of)
        ready = sum(1 for e in self.datastore.endpoints if not e.stale and e.metrics is not None)
        queued = controller.count if controller is not None else 0
        per_endpoint.add_metric([pool], queued / ready if ready else float(queued))
        yield from (size, size_bytes, saturation, per_endpoint)
