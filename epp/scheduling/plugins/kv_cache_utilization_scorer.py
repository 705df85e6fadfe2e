"""kv-cache-utilization-scorer: prefer endpoints with free KV cache.

Reads: `kv_usage` (0-1) from each endpoint's last scrape; endpoints never scraped count as empty.
Score: 1 - usage.
Parameters: none.
Trade-offs: absolute, so it barely separates endpoints that are all lightly used (0.10 vs 0.12); it reacts to
long prompts before the queue does, which is what keeps preemptions away.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, Scorer, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest


@register("kv-cache-utilization-scorer", Stability.BETA)
class KVCacheUtilizationScorer(Scorer):
    consumes = ("kv_usage",)

    def __init__(self, parameters: dict | None):
        Parameters("kv-cache-utilization-scorer", parameters).done()

    def score(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        return [1.0 if (m := e.metrics) is None else 1.0 - m.kv_usage for e in endpoints]
