"""header-based-testing-filter: keep only the endpoints a request header names (conformance and debugging).

Reads: the request header `test-epp-endpoint-selection`, a comma list in the order given of "ip:port" (that one
endpoint) or a bare "ip" (every data-parallel rank of that pod: each of its ports in the pool, for the picker to choose
among, as the Gateway API Inference Extension's conformance tests designate pods); entries not in the pool are
ignored. Without the header every candidate passes.
Parameters: headerName (default "test-epp-endpoint-selection").
Trade-offs: lets a client steer routing, so it belongs only in test configurations, never in production ones.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.framework import Filter, Parameters, Stability, register
from epp.scheduling.types import CycleState, SchedulingRequest


@register("header-based-testing-filter", Stability.BETA)
class HeaderBasedTestingFilter(Filter):
    def __init__(self, parameters: dict | None):
        p = Parameters("header-based-testing-filter", parameters)
        self.header = p.get("headerName", "test-epp-endpoint-selection", str).lower()
        p.done()

    def filter(self, cycle_state: CycleState, request: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        wanted = request.headers.get(self.header)
        if wanted is None:
            return endpoints
        named: dict[str, list[Endpoint]] = {}  # "ip:port", and the pod's "ip" (bracketed too if IPv6): all its ranks
        for e in endpoints:
            address = e.spec.address
            for key in (e.hostport, address, f"[{address}]") if ":" in address else (e.hostport, address):
                named.setdefault(key, []).append(e)
        kept: dict[str, Endpoint] = {}  # by name, in the header's order, each once
        for item in wanted.split(","):
            for e in named.get(item.strip(), ()):
                kept.setdefault(e.name, e)
        return list(kept.values())
