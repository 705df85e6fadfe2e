"""The EPP's request traces (epp/requestcontrol/tracing.py) through the ext_proc handler, parsed with
opentelemetry-proto as a collector would: which context the request span continues, the scheduling span's scores, the
traceparent sent upstream, sampling; and the model server's spans (modelserver/tracing.py, the OpenTelemetry SDK)
from an engine request's timestamps."""

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (OpenTelemetry SDK) is not installed")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from epp.requestcontrol.tracing import OTLPExporter, RequestTracing, export_request
from epp.scheduling.types import SchedulingRequest, SchedulingResult, TypedName
from harness.bench.ports import free_ports
from harness.otlp import TraceCollector
from modelserver.engine.request import Request, SamplingParams
from modelserver.tracing import RequestTracer
from protocol.tracing import GenAI, tracer
from tests.epp.helpers import endpoint
from tests.epp.test_server import BASE_HEADERS, QUEUE_SCORER, body_message, headers_message, make_picker, new_stream
from tests.epp.test_server import set_headers as answer_headers

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
STREAM_TRACE, STREAM_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def in_memory(ratio: float = 1.0) -> tuple[object, InMemorySpanExporter]:
    """An SDK tracer keeping its spans in memory (the model server's tracer)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


class Collected(list):
    """The EPP's exporter in memory: each request's spans, parsed as the collector would."""

    def add(self, spans: bytes) -> None:
        self.extend(trace_pb2.ScopeSpans.FromString(spans).spans)


def attributes(span) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}


def traced_request(ratio=1.0, client: str | None = None, stream: str | None = None):
    spans = Collected()
    director = make_picker(config=QUEUE_SCORER)
    director.tracing = RequestTracing(spans, ratio)
    handler = new_stream(director)
    handler.traceparent = stream
    headers = {**BASE_HEADERS, **({"traceparent": client} if client else {})}
    handler.handle(headers_message(headers))
    (head, *_) = handler.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    handler.after_reply()
    handler.finish()
    return answer_headers(head), {s.name: s for s in spans}


def test_a_request_span_continues_the_clients_trace_and_goes_upstream():
    headers, spans = traced_request(
        client=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", stream=f"00-{STREAM_TRACE}-{STREAM_SPAN}-01"
    )
    request, scheduling = spans["gateway.request"], spans["gateway.scheduling"]
    assert request.trace_id.hex() == CLIENT_TRACE and request.parent_span_id.hex() == CLIENT_SPAN
    assert request.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert scheduling.trace_id == request.trace_id and scheduling.parent_span_id == request.span_id
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{request.span_id.hex()}-01"  # the upstream request's
    found = attributes(scheduling)
    assert found["gateway.pick"] == headers["x-gateway-destination-endpoint"]
    assert sorted(found["gateway.candidates"]) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert len(found["gateway.scorer.queue.scores"]) == 2 and len(found["gateway.totals"]) == 2
    assert found["gateway.plugins"] == ["queue", "max-score-picker"] and len(found["gateway.plugin_seconds"]) == 2
    assert "gateway.flow_control" not in spans  # not queued
    assert attributes(request)["gateway.request_id"] == headers["x-request-id"]
    assert request.start_time_unix_nano <= scheduling.start_time_unix_nano <= scheduling.end_time_unix_nano
    assert scheduling.end_time_unix_nano <= request.end_time_unix_nano


@pytest.mark.parametrize("candidates", [3, 1, 0])
def test_the_scheduling_span_holds_every_number_of_the_decision_in_its_place(candidates):
    """Each scorer's scores, the totals and each plugin's seconds as the result has them (all packed by one struct
    per layout: tracing._Shape), the candidates, the pick and the fallbacks; a queued request's flow-control span."""
    pool = [endpoint(i) for i in range(3)]
    scored = pool[:candidates]
    timings = [(TypedName("queue-scorer", "queue"), 1.5e-6), (TypedName("max-score-picker", "max-score-picker"), 2e-7)]
    raw = {TypedName("queue-scorer", "queue"): [0.25 * i for i in range(candidates)]}
    raw[TypedName("lora-affinity-scorer", "lora")] = [1.0 - 0.5 * i for i in range(candidates)]
    result = SchedulingResult(
        [pool[2], pool[0]], "p", scored, raw, timings, totals=[float(i) for i in range(candidates)]
    )
    added = []
    traced = RequestTracing(SimpleNamespace(add=added.append))
    for layout in ("new", "known"):  # the second decision reuses the first's layout
        trace = traced.start({}, None)
        request = SchedulingRequest(request_id=f"r-{layout}", model="m", prompt="x")
        traced.decided(trace, request, result, (10, 20), (20, 30))
        traced.finished(trace, "200")
        spans = {s.name: s for s in trace_pb2.ScopeSpans.FromString(added.pop()).spans}
        found = attributes(spans["gateway.scheduling"])
        assert found["gateway.scorer.queue.scores"] == raw[TypedName("queue-scorer", "queue")]
        assert found["gateway.scorer.lora.scores"] == raw[TypedName("lora-affinity-scorer", "lora")]
        assert found["gateway.totals"] == result.totals and found["gateway.profile"] == "p"
        assert found["gateway.plugins"] == ["queue", "max-score-picker"]
        assert found["gateway.plugin_seconds"] == [1.5e-6, 2e-7]
        assert found["gateway.candidates"] == [e.hostport for e in scored]
        assert found["gateway.pick"] == pool[2].hostport and found["gateway.fallbacks"] == [pool[0].hostport]
        queued = spans["gateway.flow_control"]
        assert (queued.start_time_unix_nano, queued.end_time_unix_nano) == (10, 20)
        assert queued.parent_span_id == spans["gateway.request"].span_id != spans["gateway.scheduling"].span_id
        assert attributes(spans["gateway.request"]) == {
            "gateway.request_id": f"r-{layout}",
            "gen_ai.request.model": "m",
            "http.response.status_code": 200,
        }


def test_without_a_client_trace_the_proxys_stream_context_is_continued_or_a_trace_starts():
    _, spans = traced_request(stream=f"00-{STREAM_TRACE}-{STREAM_SPAN}-01")
    assert spans["gateway.request"].parent_span_id.hex() == STREAM_SPAN
    headers, spans = traced_request()
    assert spans["gateway.request"].parent_span_id == b""
    assert headers["traceparent"].split("-")[1] == spans["gateway.request"].trace_id.hex()


@pytest.mark.parametrize("traceparent", ["00-zz-00f067aa0ba902b7-01", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "x"])
def test_a_malformed_traceparent_starts_a_new_trace(traceparent):
    _, spans = traced_request(client=traceparent)
    assert spans["gateway.request"].parent_span_id == b""


def test_unsampled_requests_make_no_spans_and_send_no_traceparent():
    headers, spans = traced_request(ratio=0.0)
    assert spans == {} and "traceparent" not in headers
    # a parent's decision stands: a sampled client trace is kept whatever the ratio, an unsampled one is not
    _, spans = traced_request(ratio=0.0, client=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    assert "gateway.request" in spans
    _, spans = traced_request(ratio=1.0, client=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00")
    assert spans == {}


def test_the_exporter_batches_into_one_export_request():
    added = []
    traced = RequestTracing(SimpleNamespace(add=added.append))
    for _ in range(3):
        trace = traced.start({}, None)
        traced.finished(trace, "200")
    request = trace_service_pb2.ExportTraceServiceRequest.FromString(export_request(added, "epp"))
    (resource_spans,) = request.resource_spans
    assert resource_spans.resource.attributes[0].value.string_value == "epp"
    assert [s.name for s in resource_spans.scope_spans[0].spans] == ["gateway.request"] * 3


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "counted"])
async def test_the_exporter_sends_each_requests_spans_to_a_collector_over_grpc(keep):
    """OTLPExporter's thread through real gRPC into harness.otlp's collector (which keeps them, or only counts them:
    `python -m harness.otlp`); closing sends what is pending."""
    port = free_ports(1)[0]
    collector = TraceCollector(f"127.0.0.1:{port}", keep=keep)
    await collector.start()
    try:
        exporter = OTLPExporter(f"http://127.0.0.1:{port}")
        traced = RequestTracing(exporter)
        for _ in range(3):
            traced.finished(traced.start({}, None), "200")
        await asyncio.to_thread(exporter.close)
        assert exporter.exported == 3 and exporter.dropped == 0 and collector.received == 3
        assert [(s.service, s.name) for s in collector.spans] == [("epp", "gateway.request")] * 3 * keep
    finally:
        await collector.stop()


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
