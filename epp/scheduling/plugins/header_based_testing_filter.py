"""header-based-testing-filter: keep only the endpoints a request header names (conformance and debugging).

Reads: the request header `test-epp-endpoint-selection` ("ip:port[,ip:port...]"), in the order given; endpoints
not in the pool are ignored. Without the header every candidate passes.
Parameters: headerName (default "test-epp-endpoint-selection").
Trade-offs: lets a client steer routing, so it belongs only in test configurations, never in production ones.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Filter, Parameters, register
from epp.scheduling.types import CycleState, SchedulingRequest


@register("header-based-testing-filter")
class HeaderBasedTestingFilter(Filter):
    def __init__(self, parameters: dict | None):
        p = Parameters("header-based-testing-filter", parameters)
        self.header = p.get("headerName", "test-epp-endpoint-selection", str).lower()
        p.done()

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        wanted = request.headers.get(self.header)
        if wanted is None:
            return endpoints
        by_address = {e.hostport: e for e in endpoints}
        return [by_address[a] for a in (s.strip() for s in wanted.split(",")) if a in by_address]
