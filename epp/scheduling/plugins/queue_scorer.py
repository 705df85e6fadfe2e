"""queue-scorer: prefer endpoints with short queues.

Reads: each endpoint's waiting requests from its last scrape, plus requests this EPP routed there that the scrape
does not show yet, less those it saw that have finished since (`epp.datalayer.load.queue_depth`). Writes: those
depths to the cycle state (QUEUE_DEPTHS), where the prefix scorer's load guard finds them.
Score: inverted min-max over the candidates (shortest queue 1, longest 0; all 1 when equal).
Parameters: none.
Trade-offs: relative, so it separates endpoints even when all queues are short; it does not know how long each
queued request will take (a long-prompt queue of 2 may be slower than a chat queue of 5).
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.load import QUEUE_DEPTH_READS
from epp.scheduling.framework import Parameters, Scorer, Stability, register
from epp.scheduling.load import QUEUE_DEPTHS, inverted_min_max, queue_depths
from epp.scheduling.types import CycleState, SchedulingRequest


@register("queue-scorer", Stability.BETA)
class QueueScorer(Scorer):
    consumes = (*QUEUE_DEPTH_READS, QUEUE_DEPTHS)
    produces = (QUEUE_DEPTHS,)

    def __init__(self, parameters: dict | None):
        Parameters("queue-scorer", parameters).done()

    def score(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        return inverted_min_max(queue_depths(cycle_state, endpoints))
