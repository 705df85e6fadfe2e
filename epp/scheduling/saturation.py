"""Saturation and admission: when every endpoint is saturated, sheddable requests (negative priority) get 429.

An endpoint is saturated when its queue is at least `queue_depth_threshold` (5), its KV usage at least
`kv_cache_util_threshold` (0.8), or its metrics are stale (an endpoint we cannot see is assumed full).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.errors import ShedError
from epp.scheduling.load import kv_usage, queue_depth
from epp.scheduling.types import SchedulingRequest


@dataclass
class SaturationDetector:
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8

    def endpoint_saturated(self, endpoint: Endpoint) -> bool:
        return (
            endpoint.stale
            or endpoint.metrics is None
            or queue_depth(endpoint) >= self.queue_depth_threshold
            or kv_usage(endpoint) >= self.kv_cache_util_threshold
        )

    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
        return all(self.endpoint_saturated(e) for e in endpoints)


def admit(request: SchedulingRequest, endpoints: Sequence[Endpoint], detector: SaturationDetector) -> None:
    """Raise ShedError for a sheddable request when the pool is saturated; everything else is admitted."""
    if request.priority < 0 and detector.is_saturated(endpoints):
        raise ShedError(f"pool saturated; request with priority {request.priority} shed")
