"""Saturation and admission: when every endpoint is saturated, sheddable requests (negative priority) get 429.

An endpoint is saturated when its queue (waiting requests plus what this EPP routed there that the last scrape
does not show yet) is at least `queueDepthThreshold` (5), its KV-cache usage at least `kvCacheUtilThreshold`
(0.8), or its metrics are stale or missing: an endpoint we cannot see is assumed full. The pool is saturated when
every endpoint is (an empty pool is).
Trade-offs: pool-wide, so one idle endpoint keeps sheddable traffic flowing even while the rest are full (the
scorers send it there); per-request priorities above zero are never shed, however deep the queues.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from epp.config.parameters import Parameters
from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.load import queue_depth
from epp.scheduling.errors import ShedError
from epp.scheduling.types import SchedulingRequest


class SaturationDetector:
    def __init__(self, queue_depth_threshold: int = 5, kv_cache_util_threshold: float = 0.8):
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_cache_util_threshold = kv_cache_util_threshold

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> SaturationDetector:
        """From the EndpointPickerConfig's `saturationDetector` mapping; ConfigError when it is invalid."""
        p = Parameters("saturationDetector", config)
        detector = cls(
            queue_depth_threshold=p.get("queueDepthThreshold", 5, int, minimum=1),
            kv_cache_util_threshold=float(p.get("kvCacheUtilThreshold", 0.8, (int, float), minimum=0, maximum=1)),
        )
        p.done()
        return detector

    def endpoint_saturated(self, endpoint: Endpoint) -> bool:
        m = endpoint.metrics
        return (
            endpoint.stale
            or m is None
            or queue_depth(endpoint) >= self.queue_depth_threshold
            or m.kv_usage >= self.kv_cache_util_threshold
        )

    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
        return all(self.endpoint_saturated(e) for e in endpoints)

    def has_room(self, endpoints: Sequence[Endpoint], in_flight: int) -> bool:
        """Flow control's dispatch signal: some endpoint can start one more request now (`endpoint_has_room`), so
        the pool is kept just full and the rest wait in the EPP, in priority and fair order, instead of in the
        servers' own FIFO queues. A pool none of whose endpoints has fresh metrics (a broken metrics endpoint) is
        not held back forever: it takes up to `queueDepthThreshold` requests per endpoint in flight, as if each had
        that queue."""
        for endpoint in endpoints:
            if self.endpoint_has_room(endpoint):
                return True
        blind = all(e.stale or e.metrics is None for e in endpoints)
        return blind and in_flight < self.queue_depth_threshold * len(endpoints)

    def room_in(self, datastore: Datastore) -> Callable[[int], bool]:
        """Flow control's `has_room(in_flight)` over the datastore's endpoints as they are at each call. Defined here,
        the release build compiles it: a lambda in the wiring ran as Python, 1.4 calls a request at concurrency 32."""

        def has_room(in_flight: int) -> bool:
            return self.has_room(datastore.endpoints, in_flight)

        return has_room

    def with_room(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        """The endpoints that can start one more request now; all of them when none can (a blind pool)."""
        roomy = [e for e in endpoints if self.endpoint_has_room(e)]
        return roomy if roomy and len(roomy) < len(endpoints) else endpoints

    def endpoint_has_room(self, endpoint: Endpoint) -> bool:
        """Fresh metrics, KV-cache usage under the threshold, and a load under the endpoint's batch slots: the last
        scrape's running + waiting, plus what this EPP routed there since, less what finished since (so a completion
        frees its slot at once). It errs towards one request too many (a request routed just before a scrape that
        reaches the server after it; a completion the server shows before the EPP hears of it), which waits in the
        server's queue and keeps its batch full; taking the larger of that and the EPP's own in-flight count erred
        the other way: the sim pool at 2x overload ran 2.67 of 4 slots (the stream's end reaches the EPP late).
        Before the endpoint has been seen full (`Endpoint.batch_slots` unknown), its queue depth under
        `queueDepthThreshold`.
        Trade-off: a limit learnt while something else made requests wait (the KV cache, a long prompt's prefill
        taking a step's token budget) is too low; it grows by one each time a scrape shows every slot busy and
        nothing waiting (`PrometheusExtractor`), one scrape interval per slot."""
        m = endpoint.metrics
        if endpoint.stale or m is None or m.kv_usage >= self.kv_cache_util_threshold:
            return False
        slots = endpoint.batch_slots
        if slots is None:
            return queue_depth(endpoint) < self.queue_depth_threshold
        return m.running + m.waiting + endpoint.in_flight_requests - endpoint.in_flight_at_scrape < slots

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """The share of the pool's endpoints that are saturated (1.0 for an empty pool): the metrics' gauge."""
        if not endpoints:
            return 1.0
        return sum(1 for e in endpoints if self.endpoint_saturated(e)) / len(endpoints)


def admit(request: SchedulingRequest, endpoints: Sequence[Endpoint], detector: SaturationDetector) -> None:
    """Raise ShedError (429) for a sheddable request (priority < 0) when the pool is saturated; admit the rest."""
    if request.priority < 0 and detector.is_saturated(endpoints):
        raise ShedError(f"the pool is saturated; a request with priority {request.priority} is shed")
