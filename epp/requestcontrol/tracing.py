"""The EPP's request traces (--otlp-traces-endpoint, --trace-sampling-ratio): a `gateway.request` span per request,
continuing the client's W3C traceparent, else the one Envoy's ext_proc call carried in its gRPC metadata (Envoy's
own trace of the request), else a new trace; children for flow control (the time queued) and scheduling (every
candidate, each scorer's scores in the candidates' order, each plugin's time, the totals, the pick and the
fallbacks). The request sent upstream carries the request span's traceparent (a header mutation), so the model
server's spans join the trace (a gateway that traces, Envoy with its tracer on, makes its own upstream span their
parent instead: still the same trace).

What the request path pays: the request span's start (when the request's headers arrive: its traceparent goes
upstream with the answer) and two clock readings around scheduling. The children are built after the answer has gone
out (`Director.after_routed`), from the scheduler's result and the recorded times, and the batch span processor
exports them from its own thread. A request that is not sampled gets a non-recording span and costs almost nothing.
"""

from __future__ import annotations

from time import time_ns
from typing import Any

from epp.scheduling.types import SchedulingRequest, SchedulingResult
from protocol import tracing


class RequestTracing:
    """Spans for the director's requests, from an OpenTelemetry tracer (`protocol.tracing.tracer`)."""

    def __init__(self, tracer: Any):
        from opentelemetry.trace import SpanKind, StatusCode

        self.tracer = tracer
        self._server_kind = SpanKind.SERVER
        self._error = StatusCode.ERROR

    def start(self, headers: dict[str, str], stream_traceparent: str | None) -> Any | None:
        """The request span, continuing the client's traceparent, else the ext_proc stream's; None when the request
        is not sampled."""
        client = headers.get(tracing.TRACEPARENT_HEADER)
        parent = tracing.parent_context(
            client or stream_traceparent, headers.get(tracing.TRACESTATE_HEADER) if client else None
        )
        span = self.tracer.start_span(tracing.EPP_REQUEST_SPAN, parent, self._server_kind)
        return span if span.is_recording() else None

    def decided(
        self,
        span: Any,
        request: SchedulingRequest,
        result: SchedulingResult,
        queued: tuple[int, int] | None,
        scheduled: tuple[int, int],
    ) -> None:
        """The request's flow-control span (`queued`: when it entered and left the queue, ns) and scheduling span
        (`scheduled`: its start and end, ns) under its request span."""
        from opentelemetry.trace import set_span_in_context

        parent = set_span_in_context(span)
        span.set_attribute("gateway.request_id", request.request_id)
        span.set_attribute("gen_ai.request.model", request.model)
        if queued is not None:
            self.tracer.start_span(tracing.EPP_FLOW_CONTROL_SPAN, parent, start_time=queued[0]).end(queued[1])
        candidates = result.candidates
        attributes: dict[str, Any] = {
            "gateway.candidates": [e.spec.hostport for e in candidates],
            "gateway.totals": result.totals,
            "gateway.pick": result.endpoints[0].spec.hostport,
            "gateway.fallbacks": [e.spec.hostport for e in result.endpoints[1:]],
            "gateway.profile": result.profile,
        }
        for name, scores in result.raw_scores.items():
            attributes[f"gateway.scorer.{name.name}.scores"] = scores
        for name, seconds in result.timings:
            attributes[f"gateway.plugin.{name.name}.seconds"] = seconds
        self.tracer.start_span(tracing.EPP_SCHEDULING_SPAN, parent, attributes=attributes, start_time=scheduled[0]).end(
            scheduled[1]
        )

    def failed(self, span: Any, status: int, message: str) -> None:
        """The EPP answered the request with an error."""
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("gateway.error", message)
        if status >= 500:
            span.set_status(self._error, message)

    def finished(self, span: Any, status: str) -> None:
        """The request is over (`status`: the response's HTTP status, "" when the proxy has not told it)."""
        if status[:3].isdigit():
            span.set_attribute("http.response.status_code", int(status[:3]))
        span.end(time_ns())
