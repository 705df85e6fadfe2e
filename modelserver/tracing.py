"""The model server's request traces (--otlp-traces-endpoint, as vLLM's flag): an `llm_request` span per engine
request with vLLM's `gen_ai.*` attributes, continuing the W3C traceparent the request came with (the gateway's
trace) or starting a trace, and a child span for each phase: `queue` (arrival to first scheduled), `prefill` (to
the first token) and `decode` (to the last). Built once the request is over, from the engine request's timestamps,
and exported by the batch span processor's thread (`protocol.tracing.tracer`): the engine step pays nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from time import monotonic, time_ns
from typing import Any

from modelserver.engine.request import Request
from protocol import tracing
from protocol.tracing import GenAI


class RequestTracer:
    def __init__(self, tracer: Any, model_name: str):
        from opentelemetry.trace import SpanKind

        self.tracer = tracer
        self.model_name = model_name
        self._server_kind = SpanKind.SERVER

    def finished(self, request: Request, trace_headers: Mapping[str, str]) -> None:
        """Spans for an engine request that is over (finished or aborted)."""
        from opentelemetry.trace import set_span_in_context

        parent = tracing.parent_context(
            trace_headers.get(tracing.TRACEPARENT_HEADER), trace_headers.get(tracing.TRACESTATE_HEADER)
        )
        now, now_ns = monotonic(), time_ns()

        def at(ts: float) -> int:
            return tracing.wall_ns(ts, now, now_ns)

        arrival = request.arrival_time
        scheduled, first, last = request.scheduled_ts, request.first_token_ts, request.last_token_ts
        end = last or now
        params = request.params
        attributes: dict[str, Any] = {
            GenAI.REQUEST_ID: request.request_id,
            GenAI.RESPONSE_MODEL: request.lora_name or self.model_name,
            GenAI.USAGE_PROMPT_TOKENS: request.num_prompt_tokens,
            GenAI.USAGE_COMPLETION_TOKENS: request.num_output_tokens,
            GenAI.REQUEST_MAX_TOKENS: params.max_tokens,
            GenAI.REQUEST_TEMPERATURE: params.temperature,
            GenAI.REQUEST_TOP_P: params.top_p,
            GenAI.REQUEST_N: params.n,
            GenAI.LATENCY_E2E: end - arrival,
        }
        if request.finish_reason:
            attributes[GenAI.RESPONSE_FINISH_REASONS] = [request.finish_reason]
        if scheduled:
            attributes[GenAI.LATENCY_TIME_IN_QUEUE] = scheduled - request.queued_ts
        if first:
            attributes[GenAI.LATENCY_TIME_TO_FIRST_TOKEN] = first - arrival
            attributes[GenAI.LATENCY_TIME_IN_MODEL_PREFILL] = first - scheduled
            attributes[GenAI.LATENCY_TIME_IN_MODEL_DECODE] = last - first
            attributes[GenAI.LATENCY_TIME_IN_MODEL_INFERENCE] = last - scheduled
        span = self.tracer.start_span(
            tracing.SERVER_REQUEST_SPAN, parent, self._server_kind, attributes=attributes, start_time=at(arrival)
        )
        if not span.is_recording():
            return
        inside = set_span_in_context(span)
        bounds = (arrival, scheduled, first, last)  # each phase from one timestamp to the next, when both came
        for name, start, stop in zip(tracing.SERVER_PHASE_SPANS, bounds, bounds[1:], strict=False):
            if start and stop:
                self.tracer.start_span(name, inside, start_time=at(start)).end(at(stop))
        span.end(at(end))
