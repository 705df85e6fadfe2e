"""What the director keeps per request and what it answers."""

from __future__ import annotations

from dataclasses import dataclass

from epp.datalayer.endpoint import Endpoint
from epp.flowcontrol import DEFAULT_FLOW
from epp.scheduling.types import SchedulingRequest, SchedulingResult
from protocol.openai import RequestKind


class RequestContext:
    """One request's state from its headers to the end of its response; owned by the director, held by the
    handler of the request's ext_proc stream."""

    __slots__ = (
        "dispatched",
        "endpoint",
        "error_style",
        "first_chunk_at",
        "headers",
        "in_flight_tokens",
        "kind",
        "labels",
        "metrics_age",
        "model",
        "request",
        "response_head",
        "response_tail",
        "result",
        "routed_at",
        "scheduling_seconds",
        "served",
        "status",
        "streamed",
        "subset",
        "target_model",
        "trace",
        "trace_times",
    )

    def __init__(self, headers: dict[str, str], subset: frozenset[str] | None):
        self.headers = headers
        self.subset = subset  # allowed "ip:port" from the proxy's subset hint; None = no hint
        self.model = self.target_model = ""  # the client's model name and the one the model server will see
        # the per-request metrics' labels (epp.metrics.REQUEST_LABELS): model, target model (bounded:
        # EPPMetrics.model_label), fairness id (bounded: EPPMetrics.fairness_label) and priority, as llm-d's are before
        # it knows them
        self.labels = ("", "", DEFAULT_FLOW, "0")
        self.request: SchedulingRequest | None = None
        self.result: SchedulingResult | None = None
        self.endpoint: Endpoint | None = None  # the pick, while the request is in flight
        self.in_flight_tokens = 0  # its prompt tokens counted in the pick's in_flight_tokens, until it answers
        self.routed_at = 0.0
        self.metrics_age = -1.0  # how old the pick's metrics (its latest scrape) were when it was picked; -1 = none
        self.scheduling_seconds = 0.0  # the decision's time, until its histograms observe it (Director.after_routed)
        self.served: str | None = None  # the endpoint that answered, as the proxy reports it
        self.status = ""  # the response's HTTP status
        self.response_tail = b""  # the last bytes of the response body (where the usage is)
        self.dispatched = False  # flow control let it through: its completion frees the turn
        self.first_chunk_at = 0.0  # when the first response body chunk came through (monotonic), 0 = none yet
        self.streamed = False  # the client asked for a streamed response (its first chunk is then the first token)
        self.kind: RequestKind | None = None  # the API its path names (None: another path)
        self.error_style = "openai"  # the shape of the errors the EPP answers it with (protocol.openai.error_style)
        self.response_head: bytes | None = None  # a stored Responses answer's first bytes, until its id is learnt
        self.trace = None  # its gateway.request span, when traced (epp.requestcontrol.tracing)
        # when traced: (queued from, queued until or 0, scheduled from, scheduled until), time_ns(), until its spans
        # are made (Director.after_routed)
        self.trace_times: list[int] | None = None


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
