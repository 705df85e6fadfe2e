"""running-requests-size-scorer: prefer endpoints running fewer requests (a smaller decode batch, so lower ITL).

Reads: running requests from the last scrape, corrected by this EPP's in-flight count.
Score: inverted min-max over the candidates.
Parameters: none.
Trade-offs: complements queue-scorer when queues are empty; blind to how long each running request still has.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.load import RUNNING_REQUESTS_READS, running_requests
from epp.scheduling.framework import Parameters, Scorer, Stability, register
from epp.scheduling.load import inverted_min_max
from epp.scheduling.types import CycleState, SchedulingRequest


@register("running-requests-size-scorer", Stability.BETA)
class RunningRequestsSizeScorer(Scorer):
    consumes = RUNNING_REQUESTS_READS

    def __init__(self, parameters: dict | None):
        Parameters("running-requests-size-scorer", parameters).done()

    def score(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        return inverted_min_max([running_requests(e) for e in endpoints])
