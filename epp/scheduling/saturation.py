"""Saturation and admission: when every endpoint is saturated, sheddable requests (negative priority) get 429.

An endpoint is saturated when its queue (waiting requests plus what this EPP routed there that the last scrape
does not show yet) is at least `queueDepthThreshold` (5), its KV-cache usage at least `kvCacheUtilThreshold`
(0.8), or its metrics are stale or missing: an endpoint we cannot see is assumed full. The pool is saturated when
every endpoint is (an empty pool is).
Trade-offs: pool-wide, so one idle endpoint keeps sheddable traffic flowing even while the rest are full (the
scorers send it there); per-request priorities above zero are never shed, however deep the queues.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.errors import ShedError
from epp.scheduling.framework import Parameters
from epp.scheduling.load import queue_depth
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
        """Flow control's dispatch signal: some endpoint is not saturated (its queue counts what this EPP routed
        there that the last scrape does not show yet, so a burst cannot overfill it). A pool none of whose
        endpoints has fresh metrics (a broken metrics endpoint) is not held back forever: it takes up to
        `queueDepthThreshold` requests per endpoint in flight, as if each had that queue."""
        if not self.is_saturated(endpoints):
            return True
        blind = all(e.stale or e.metrics is None for e in endpoints)
        return blind and in_flight < self.queue_depth_threshold * len(endpoints)

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """The share of the pool's endpoints that are saturated (1.0 for an empty pool): the metrics' gauge."""
        if not endpoints:
            return 1.0
        return sum(1 for e in endpoints if self.endpoint_saturated(e)) / len(endpoints)


def admit(request: SchedulingRequest, endpoints: Sequence[Endpoint], detector: SaturationDetector) -> None:
    """Raise ShedError (429) for a sheddable request (priority < 0) when the pool is saturated; admit the rest."""
    if request.priority < 0 and detector.is_saturated(endpoints):
        raise ShedError(f"the pool is saturated; a request with priority {request.priority} is shed")
