"""What the director answers (its per-request state, `RequestContext`, is beside it in `director.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import cython

from epp.datalayer.endpoint import Endpoint


@cython.cclass
@dataclass
class RoutingDecision:
    """Where the request goes. `body` is the request body to send (the client's, or re-serialized after a model
    rewrite; None for a request without body); `body_changed` says whether it differs from the client's; `scores`:
    each scored candidate's ("ip:port") weighted total, when the EPP emits them (--emit-endpoint-scores)."""

    request_id: str
    endpoints: list[Endpoint]  # the pick first, then fallbacks
    body: bytes | None
    body_changed: bool = False
    scores: dict[str, float] | None = None
    traceparent: str | None = None  # the request span's, for the request sent upstream (when traced)
