"""in-flight-tokens-scorer: prefer endpoints with fewer prompt tokens in flight from this EPP.

Reads: the EPP's own count of estimated prompt tokens of the requests it routed to each endpoint and that have not
finished (no scrape needed, so it is exact within a burst).
Score: inverted min-max over the candidates.
Parameters: none.
Trade-offs: a long prompt's prefill stalls every request that joins its batch, which request counts do not show;
tokens do; they are counted until the endpoint answers (its response headers), an estimate of when its prefill is done.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Parameters, Scorer, Stability, register
from epp.scheduling.load import inverted_min_max
from epp.scheduling.types import CycleState, SchedulingRequest


@register("in-flight-tokens-scorer", Stability.BETA)
class InFlightTokensScorer(Scorer):
    consumes = ("in_flight_tokens",)

    def __init__(self, parameters: dict | None):
        Parameters("in-flight-tokens-scorer", parameters).done()

    def score(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        return inverted_min_max([e.in_flight_tokens for e in endpoints])
