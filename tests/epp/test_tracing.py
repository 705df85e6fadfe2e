"""The EPP's request traces (epp/requestcontrol/tracing.py) through the ext_proc handler: which context the request
span continues, the scheduling span's scores, the traceparent sent upstream, sampling; and the model server's spans
(modelserver/tracing.py) from an engine request's timestamps."""

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (OpenTelemetry SDK) is not installed")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from epp.requestcontrol.tracing import RequestTracing
from modelserver.engine.request import Request, SamplingParams
from modelserver.tracing import RequestTracer
from protocol.tracing import GenAI, tracer
from tests.epp.test_server import BASE_HEADERS, QUEUE_SCORER, body_message, headers_message, make_picker, new_stream
from tests.epp.test_server import set_headers as answer_headers

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
STREAM_TRACE, STREAM_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def in_memory(ratio: float = 1.0) -> tuple[object, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def traced_request(ratio=1.0, client: str | None = None, stream: str | None = None):
    otel, exporter = in_memory(ratio)
    director = make_picker(config=QUEUE_SCORER)
    director.tracing = RequestTracing(otel)
    handler = new_stream(director)
    handler.traceparent = stream
    headers = {**BASE_HEADERS, **({"traceparent": client} if client else {})}
    handler.handle(headers_message(headers))
    (head, *_) = handler.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    handler.after_reply()
    handler.finish()
    return answer_headers(head), {s.name: s for s in exporter.get_finished_spans()}


def test_a_request_span_continues_the_clients_trace_and_goes_upstream():
    headers, spans = traced_request(
        client=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", stream=f"00-{STREAM_TRACE}-{STREAM_SPAN}-01"
    )
    request, scheduling = spans["gateway.request"], spans["gateway.scheduling"]
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE and f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert scheduling.parent.span_id == request.context.span_id
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{request.context.span_id:016x}-01"  # the upstream request's
    attributes = scheduling.attributes
    assert attributes["gateway.pick"] == headers["x-gateway-destination-endpoint"]
    assert sorted(attributes["gateway.candidates"]) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert len(attributes["gateway.scorer.queue.scores"]) == 2 and len(attributes["gateway.totals"]) == 2
    assert "gateway.plugin.queue.seconds" in attributes and "gateway.flow_control" not in spans  # not queued
    assert request.start_time <= scheduling.start_time <= scheduling.end_time <= request.end_time


def test_without_a_client_trace_the_proxys_stream_context_is_continued_or_a_trace_starts():
    _, spans = traced_request(stream=f"00-{STREAM_TRACE}-{STREAM_SPAN}-01")
    assert f"{spans['gateway.request'].parent.span_id:016x}" == STREAM_SPAN
    headers, spans = traced_request()
    assert spans["gateway.request"].parent is None
    assert headers["traceparent"].split("-")[1] == f"{spans['gateway.request'].context.trace_id:032x}"


def test_unsampled_requests_make_no_spans_and_send_no_traceparent():
    headers, spans = traced_request(ratio=0.0)
    assert spans == {} and "traceparent" not in headers
    # a parent's decision stands: a sampled client trace is kept whatever the ratio
    _, spans = traced_request(ratio=0.0, client=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    assert "gateway.request" in spans


def test_the_model_servers_spans_carry_vllms_attributes_and_its_phases():
    otel, exporter = in_memory()
    request = Request("cmpl-1-0-0", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=100.0)
    request.queued_ts, request.scheduled_ts, request.first_token_ts, request.last_token_ts = 100.0, 100.5, 101.0, 102.0
    request.token_ids += [7, 8]
    RequestTracer(otel, "sim-llama-8b").finished(request, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server = spans["llm_request"]
    assert f"{server.parent.span_id:016x}" == CLIENT_SPAN
    assert server.attributes[GenAI.LATENCY_TIME_IN_QUEUE] == 0.5
    assert server.attributes[GenAI.LATENCY_TIME_TO_FIRST_TOKEN] == 1.0
    assert server.attributes[GenAI.USAGE_COMPLETION_TOKENS] == 2
    assert server.attributes[GenAI.RESPONSE_MODEL] == "sim-llama-8b"
    durations = {name: (spans[name].end_time - spans[name].start_time) / 1e9 for name in ("queue", "prefill", "decode")}
    assert durations == pytest.approx({"queue": 0.5, "prefill": 0.5, "decode": 1.0}, abs=1e-6)
    assert all(spans[name].parent.span_id == server.context.span_id for name in durations)


def test_a_ratio_outside_0_to_1_is_refused():
    with pytest.raises(ValueError, match="within"):
        tracer("127.0.0.1:4317", 1.5, "epp")
