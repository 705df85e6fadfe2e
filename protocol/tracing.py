"""Traces both sides write: the W3C trace-context header that joins them, the span and attribute names, and the
model server's OpenTelemetry set-up (`--otlp-traces-endpoint`, as vLLM's flag: an OTLP/gRPC exporter behind a batch
span processor, sampled by ratio). The EPP writes its spans itself (epp/requestcontrol/tracing.py says why).

The OpenTelemetry SDK is optional (the `tracing` extra): `tracer(...)` imports it only when tracing is asked for,
and says how to install it when it is missing. Spans are built from timestamps taken on the request path, after the
fact (explicit start and end times), and exported by the batch processor's thread, off the request path.
"""

from __future__ import annotations

import time
from typing import Any

TRACEPARENT_HEADER = "traceparent"  # W3C trace context: 00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>
TRACESTATE_HEADER = "tracestate"

# The EPP's spans (llm-d's router names its request span gateway.request)
EPP_REQUEST_SPAN = "gateway.request"
EPP_FLOW_CONTROL_SPAN = "gateway.flow_control"
EPP_SCHEDULING_SPAN = "gateway.scheduling"
# The model server's, as vLLM names its request span, and one child per phase
SERVER_REQUEST_SPAN = "llm_request"
SERVER_PHASE_SPANS = ("queue", "prefill", "decode")


class GenAI:
    """vLLM's span attribute names (vllm/tracing: SpanAttributes)."""

    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_N = "gen_ai.request.n"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for and the OpenTelemetry SDK is not installed."""


def tracer(endpoint: str, ratio: float, service_name: str) -> Any:
    """An OpenTelemetry tracer exporting to the OTLP/gRPC collector at `endpoint` ("host:port" or a URL) through a
    batch span processor; a new trace is kept with probability `ratio`, a continued one as its parent decided
    (ParentBased). Raises TracingUnavailable without the SDK, ValueError for a ratio outside [0, 1]."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"the trace sampling ratio must be within [0, 1], got {ratio}")
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as error:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK ({error.name} is missing): "
            "pip install 'llm-routing-reference[tracing]'"
        ) from None
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}), sampler=ParentBased(TraceIdRatioBased(ratio))
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, insecure=url.startswith("http:"))))
    return provider.get_tracer(service_name)


def parent_context(traceparent: str | None, tracestate: str | None = None) -> Any:
    """The OpenTelemetry context a W3C `traceparent` (and `tracestate`) continue; an empty context (a new trace)
    without one or for a malformed one."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {TRACEPARENT_HEADER: traceparent} if traceparent else {}
    if traceparent and tracestate:
        carrier[TRACESTATE_HEADER] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def wall_ns(monotonic_seconds: float, now_monotonic: float | None = None, now_ns: int | None = None) -> int:
    """A time.monotonic() reading as a wall-clock timestamp in nanoseconds (what spans carry)."""
    now_monotonic = time.monotonic() if now_monotonic is None else now_monotonic
    now_ns = time.time_ns() if now_ns is None else now_ns
    return now_ns - int((now_monotonic - monotonic_seconds) * 1e9)
