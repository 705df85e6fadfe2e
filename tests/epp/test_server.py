"""The ext_proc state machine against hand-built ProcessingRequest messages (no Envoy)."""

import json
import time

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import EndpointSpec, ModelRewrite, PoolState
from epp.handlers.extproc import MESSAGE_ENVELOPE_BYTES
from epp.metrics import MAX_LABEL_VALUES, BoundedLabel, EPPMetrics
from epp.requestcontrol.director import Director
from epp.scheduling.scheduler import Scheduler
from protocol.limits import ByteBudget
from protocol.metrics import EndpointMetrics
from tests.epp.helpers import ParsedStream

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


class NoScraper:
    name = "no-scraper"

    def start(self, endpoint):
        endpoint.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=100)
        endpoint.stale = False

    def stop(self, endpoint):
        endpoint.stale = True

    def wake(self):
        pass

    async def close(self):
        return None


def make_picker(
    state: PoolState | None = None,
    config: str | None = None,
    emit_endpoint_scores: bool = False,
    allow_experimental_plugins: bool = False,
) -> Director:
    scheduler = Scheduler.from_config(config, allow_experimental_plugins=allow_experimental_plugins)
    datastore = Datastore([NoScraper()], scheduler.on_pool_changed)
    datastore.apply(
        state or PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000), EndpointSpec("b", "10.0.0.2", 8000)))
    )
    return Director(datastore, scheduler, EPPMetrics("pool"), emit_endpoint_scores=emit_endpoint_scores)


def new_stream(director: Director, budget: ByteBudget | None = None, **limits) -> ParsedStream:
    return ParsedStream(
        director, lambda answers: pytest.fail(f"unexpected deferred answer {answers}"), budget, **limits
    )


def headers_message(headers: dict, end_of_stream=False, mode=FULL_DUPLEX, subset=None) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
            ),
            end_of_stream=end_of_stream,
        ),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        if isinstance(subset, str):
            hint["x-gateway-destination-endpoint-subset"] = subset
        else:
            hint.get_or_create_list("x-gateway-destination-endpoint-subset").extend(subset)
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body_message(data: bytes, end=True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


BASE_HEADERS = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}


def set_headers(response) -> dict[str, str]:
    mutation = (response.request_headers or response.request_body).response.header_mutation
    if response.HasField("request_body"):
        mutation = response.request_body.response.header_mutation
    else:
        mutation = response.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_full_duplex_defers_headers_until_the_body_ends_and_streams_it_back_in_chunks():
    picker = make_picker()
    stream = new_stream(picker)
    assert stream.handle(headers_message({**BASE_HEADERS, "x-gateway-destination-endpoint": "6.6.6.6:1"})) == []
    body = json.dumps({"model": "m", "prompt": "x" * 150_000}).encode()
    assert stream.handle(body_message(body[:70_000], end=False)) == []
    responses = stream.handle(body_message(body[70_000:]))
    head, chunks = responses[0], responses[1:]
    assert head.HasField("request_headers")
    headers = set_headers(head)
    assert headers["x-gateway-destination-endpoint"] in ("10.0.0.1:8000", "10.0.0.2:8000")  # spoofed value replaced
    assert headers["content-length"] == str(len(body))
    assert "x-request-id" in headers
    assert head.request_headers.response.clear_route_cache
    destination = head.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert destination.string_value.split(",")[0] == headers["x-gateway-destination-endpoint"]  # then the fallback
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert all(len(s.body) <= 62_000 for s in streamed)
    assert b"".join(s.body for s in streamed) == body  # not re-serialized
    assert [s.end_of_stream for s in streamed] == [False, False, True]
    endpoint = stream.ctx.endpoint
    assert endpoint.in_flight_requests == 1
    stream.after_reply()
    stream.finish()
    assert endpoint.in_flight_requests == 0


@pytest.mark.parametrize("request_id, kept", [("client-id-1", True), ("x" * 256, True), ("x" * 257, False)])
def test_a_clients_request_id_is_kept_unless_it_is_too_long_to_key_on(request_id, kept):
    """The routed request carries the id the EPP keys its records on: the client's, unless it is longer than
    MAX_REQUEST_ID_CHARS (a header can be up to the proxy's limit), then the EPP's own."""
    stream = new_stream(make_picker())
    stream.handle(headers_message({**BASE_HEADERS, "x-request-id": request_id}))
    (head, *_) = stream.handle(body_message(b'{"model": "m", "prompt": "hello"}'))
    sent = set_headers(head)["x-request-id"]
    assert (sent == request_id) is kept and sent == stream.ctx.request.request_id and len(sent) <= 256
    stream.finish()


def test_buffered_mode_answers_headers_at_once_and_routes_in_the_body_response():
    stream = new_stream(make_picker())
    (first,) = stream.handle(headers_message(BASE_HEADERS, mode=BUFFERED))
    assert first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    (routed,) = stream.handle(body_message(b'{"model": "m", "prompt": "hello"}'))
    assert routed.HasField("request_body")
    assert set_headers(routed)["x-gateway-destination-endpoint"].startswith("10.0.0.")
    assert routed.request_body.response.clear_route_cache
    assert not routed.request_body.response.body_mutation.body  # unchanged body is not sent back


def test_header_only_request_is_routed_at_once():
    stream = new_stream(make_picker())
    (response,) = stream.handle(headers_message({":method": "GET", ":path": "/v1/models"}, end_of_stream=True))
    assert set_headers(response)["x-gateway-destination-endpoint"].startswith("10.0.0.")
    assert "content-length" not in set_headers(response)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b'{"prompt": "x"}', 400),
        (b'{"model": 5}', 400),
        (b"[1]", 400),
        (b'{"model": "m", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400),
        (b"[" * 100_000, 400),
    ],
)
def test_bad_bodies_get_openai_errors(body, status):
    stream = new_stream(make_picker())
    stream.handle(headers_message(BASE_HEADERS))
    (response,) = stream.handle(body_message(body))
    immediate = response.immediate_response
    assert immediate.status.code == status
    assert set(json.loads(immediate.body)["error"]) == {"message", "type", "param", "code"}
    headers = [(h.header.key, h.header.raw_value, h.append_action) for h in immediate.headers.set_headers]
    assert headers == [("content-type", b"application/json", base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]
    assert stream.ctx.endpoint is None


def test_unknown_model_is_404_when_the_pool_declares_its_models():
    state = PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000),), models=frozenset({"m"}))
    stream = new_stream(make_picker(state))
    stream.handle(headers_message(BASE_HEADERS))
    (response,) = stream.handle(body_message(b'{"model": "other", "prompt": "x"}'))
    assert response.immediate_response.status.code == 404


def test_empty_pool_is_503_and_sheddable_requests_are_429_when_saturated():
    stream = new_stream(make_picker(PoolState()))
    stream.handle(headers_message(BASE_HEADERS))
    (response,) = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    assert response.immediate_response.status.code == 503
    state = PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000),), objectives={"batch": -1})
    picker = make_picker(state)
    picker.datastore.endpoints[0].metrics.waiting = 10
    stream = new_stream(picker)
    stream.handle(headers_message({**BASE_HEADERS, "x-gateway-inference-objective": "batch"}))
    (response,) = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    assert response.immediate_response.status.code == 429


@pytest.mark.parametrize(
    ("subset", "expected"),
    [(["10.0.0.2:8000"], "10.0.0.2:8000"), ("10.0.0.1:8000, 9.9.9.9:1", "10.0.0.1:8000"), ([], None)],
)
def test_subset_hint(subset, expected):
    stream = new_stream(make_picker())
    stream.handle(headers_message(BASE_HEADERS, subset=subset))
    (response, *_) = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    if expected is None:
        assert response.immediate_response.status.code == 503
    else:
        assert set_headers(response)["x-gateway-destination-endpoint"] == expected


def test_model_rewrite_header_and_pool_rewrites_change_the_body():
    stream = new_stream(make_picker())
    stream.handle(headers_message({**BASE_HEADERS, "x-gateway-model-name-rewrite": "m-v2"}))
    responses = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    body = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in responses[1:])
    assert json.loads(body)["model"] == "m-v2"
    assert set_headers(responses[0])["content-length"] == str(len(body))
    state = PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000),), rewrites=(ModelRewrite("m", (("m-v3", 1),)),))
    stream = new_stream(make_picker(state))
    stream.handle(headers_message(BASE_HEADERS, mode=BUFFERED))
    (response,) = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    assert response.request_body.response.status == pb.CommonResponse.CONTINUE_AND_REPLACE
    assert json.loads(response.request_body.response.body_mutation.body)["model"] == "m-v3"


def test_fallback_endpoints_travel_in_metadata_and_headers():
    config = "plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 2}\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: max-score-picker\n"
    stream = new_stream(make_picker(config=config))
    stream.handle(headers_message(BASE_HEADERS))
    (head, *_) = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    listed = head.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
    assert sorted(listed.split(",")) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert set_headers(head)["x-gateway-destination-endpoint"] == listed.split(",")[0]
    # and for our Envoy bootstrap's retries, one fallback per header (the last one repeated when there are fewer)
    assert set_headers(head)["x-gateway-destination-endpoint-fallback-1"] == listed.split(",")[1]
    assert set_headers(head)["x-gateway-destination-endpoint-fallback-2"] == listed.split(",")[1]


ONE_PICK = (
    "plugins:\n- type: max-score-picker\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: max-score-picker\n"
)


@pytest.mark.parametrize("config", [None, ONE_PICK], ids=["default profile", "a picker of one endpoint"])
def test_two_fallbacks_for_the_gateways_retries(config):
    """A server that died since the last scrape refuses the connection: the gateway retries on the fallbacks (with
    none, the retry finds no destination and the request fails with 503). The scheduler completes a picker's
    shorter list with the best-scored other candidates, whatever the profile."""
    endpoints = tuple(EndpointSpec(name, f"10.0.0.{i}", 8000) for i, name in enumerate("abcd", start=1))
    stream = new_stream(make_picker(PoolState(endpoints=endpoints), config=config))
    stream.handle(headers_message(BASE_HEADERS))
    (head, *_) = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    headers = set_headers(head)
    listed = head.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
    chosen = [headers[f"x-gateway-destination-endpoint{suffix}"] for suffix in ("", "-fallback-1", "-fallback-2")]
    assert listed.split(",") == chosen and len(set(chosen)) == 3


QUEUE_SCORER = (
    "plugins:\n- type: queue-scorer\n  name: queue\nschedulingProfiles:\n- name: d\n  plugins:\n"
    "  - pluginRef: queue\n    weight: 2\n"
)


@pytest.mark.parametrize("emit", [True, False], ids=["--emit-endpoint-scores", "off by default"])
def test_endpoint_scores_go_beside_the_pick_in_the_metadata(emit):
    """llm-d's x-gateway-destination-endpoint-scores: a struct ip:port -> weighted total of every candidate the
    scheduler scored, beside the destination in the envoy.lb namespace, only when asked for."""
    director = make_picker(config=QUEUE_SCORER, emit_endpoint_scores=emit)
    director.datastore.endpoints[0].in_flight_requests = 3  # a's queue is longer: b wins
    stream = new_stream(director)
    stream.handle(headers_message(BASE_HEADERS))
    (head, *_) = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    namespace = head.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert namespace["x-gateway-destination-endpoint"].string_value.split(",")[0] == "10.0.0.2:8000"
    if not emit:
        assert "x-gateway-destination-endpoint-scores" not in namespace
        return
    scores = {
        k: v.number_value for k, v in namespace["x-gateway-destination-endpoint-scores"].struct_value.fields.items()
    }
    assert scores["10.0.0.2:8000"] == 2.0 and 0.0 <= scores["10.0.0.1:8000"] < 2.0  # weight 2 x the queue score


def test_a_single_candidate_is_its_own_fallback():
    """Fallbacks come from the candidates the filters and the subset hint left: a pin stays a pin, and the gateway's
    retries (on a reset connection) go to it again rather than to no host."""
    stream = new_stream(make_picker())
    stream.handle(headers_message(BASE_HEADERS, subset=["10.0.0.2:8000"]))
    (head, *_) = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    headers = set_headers(head)
    assert headers["x-gateway-destination-endpoint"] == "10.0.0.2:8000"
    assert {value for name, value in headers.items() if "fallback" in name} == {"10.0.0.2:8000"}


def test_response_path_reads_served_endpoint_and_usage():
    picker = make_picker()
    stream = new_stream(picker)
    stream.handle(headers_message(BASE_HEADERS))
    stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    served = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
        )
    )
    served.metadata_context.filter_metadata["envoy.lb"].update(
        {"x-gateway-destination-endpoint-served": "10.0.0.1:8000"}
    )
    (response,) = stream.handle(served)
    assert response.HasField("response_headers")
    assert stream.ctx.served == "10.0.0.1:8000"
    (echo,) = stream.handle(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"usage": {"completion_tokens": 7}}', end_of_stream=True))
    )
    assert echo.HasField("response_body")
    stream.finish()
    assert (
        picker.metrics.registry.get_sample_value(
            "inference_objective_output_tokens_sum", {"model_name": "m", "target_model_name": "m"}
        )
        == 7
    )


def test_rewritten_model_is_rewritten_back_in_streamed_responses():
    state = PoolState(
        endpoints=(EndpointSpec("a", "10.0.0.1", 8000),), rewrites=(ModelRewrite("food", (("food-v2", 1),)),)
    )
    stream = new_stream(make_picker(state))
    headers = headers_message(BASE_HEADERS)
    headers.protocol_config.response_body_mode = FULL_DUPLEX
    stream.handle(headers)
    stream.handle(body_message(b'{"model": "food", "prompt": "x", "stream": true}'))
    (response,) = stream.handle(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    assert list(response.response_headers.response.header_mutation.remove_headers) == ["content-length"]
    chunk = b'data: {"id":"1","model":"food-v2","choices":[]}\n\n'
    (echo,) = stream.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=False)))
    assert echo.response_body.response.body_mutation.streamed_response.body == chunk.replace(b"food-v2", b"food")
    full = b'{"model": "food-v2", "text": "the model food-v2 said"}'
    (echo,) = stream.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=full, end_of_stream=True)))
    assert (
        echo.response_body.response.body_mutation.streamed_response.body
        == b'{"model": "food", "text": "the model food-v2 said"}'
    )


def test_bodies_over_the_limit_are_413_and_their_buffer_is_released():
    picker = make_picker()
    stream = new_stream(picker, max_body_bytes=1000)
    stream.handle(headers_message(BASE_HEADERS))
    assert stream.handle(body_message(b"x" * 600, end=False)) == []
    (response,) = stream.handle(body_message(b"x" * 600, end=False))
    assert response.immediate_response.status.code == 413
    assert "larger than 1000 bytes" in json.loads(response.immediate_response.body)["error"]["message"]
    assert stream.body_chunks == [] and stream.body_bytes == 0
    assert stream.handle(body_message(b"x" * 600, end=True)) == []  # the rest is dropped, not buffered


def test_a_message_that_can_only_hold_a_body_over_the_limit_is_refused_unread():
    picker = make_picker()
    stream = new_stream(picker, max_body_bytes=1000)
    assert stream.oversized(5 << 20) is None  # before the request headers: not a body chunk
    stream.handle(headers_message(BASE_HEADERS))
    assert stream.handle(body_message(b"x" * 600, end=False)) == []
    assert stream.oversized(400 + MESSAGE_ENVELOPE_BYTES) is None  # the body in it may still fit: parsed, then judged
    (response,) = stream.oversized(401 + MESSAGE_ENVELOPE_BYTES)
    assert response.immediate_response.status.code == 413
    assert "larger than 1000 bytes" in json.loads(response.immediate_response.body)["error"]["message"]
    assert stream.body_chunks == [] and stream.body_bytes == 0
    assert stream.oversized(5 << 20) is None  # answered: the rest of the body is dropped as usual
    assert stream.handle(body_message(b"x" * 600, end=True)) == []


def test_the_bodies_of_one_connection_share_a_budget():
    picker = make_picker()
    budget = ByteBudget(1500)
    first, second = new_stream(picker, budget), new_stream(picker, budget)
    for stream in (first, second):
        stream.handle(headers_message(BASE_HEADERS))
    assert first.handle(body_message(b"x" * 1000, end=False)) == []
    (refused,) = second.handle(body_message(b"x" * 1000, end=False))
    assert refused.immediate_response.status.code == 413 and budget.held == 1000
    first.finish()  # the stream ended mid-body (reset): its bytes go back
    assert budget.held == 0
    third = new_stream(picker, budget)
    third.handle(headers_message(BASE_HEADERS))
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    responses = third.handle(body_message(body))
    assert not responses[0].HasField("immediate_response") and budget.held == 0


def finish_with_status(stream: ParsedStream, status: bytes) -> None:
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=status)])
    stream.handle(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers)))
    stream.finish()


def test_client_chosen_model_names_cannot_grow_the_metrics():
    picker = make_picker()  # the pool declares no models: any name is routed, and model servers answer 404
    assert MAX_LABEL_VALUES == 1000  # llm-d's cap
    picker.metrics.model_names = BoundedLabel(50)  # the same rule with fewer requests
    registry = picker.metrics.registry
    for i in range(100):
        stream = new_stream(picker)
        stream.handle(headers_message(BASE_HEADERS))
        stream.handle(body_message(json.dumps({"model": f"random-{i}", "prompt": "x"}).encode()))
        finish_with_status(stream, b"404")
    labels = {s.labels.get("model_name") for m in registry.collect() for s in m.samples if "model_name" in s.labels}
    # the first 50 names are labels of their own (as llm-d: first come), the rest share "other"
    assert labels == {f"random-{i}" for i in range(50)} | {"other"}
    labels = {"model_name": "other", "target_model_name": "other", "error_code": "404"}
    assert registry.get_sample_value("inference_objective_request_error_total", labels) == 50
    flow = {"fairness_id": "default-flow", "priority": "0"}  # (llm-d's series carry the request's flow too)
    assert registry.get_sample_value("llm_d_epp_request_error_total", {**labels, **flow}) == 50
    # a name the pool's rewrite rules give is pinned: its own label past the cap
    picker.datastore.state = PoolState(
        picker.datastore.state.endpoints, rewrites=(ModelRewrite("real", (("real-v2", 1),)),)
    )
    stream = new_stream(picker)
    stream.handle(headers_message(BASE_HEADERS))
    stream.handle(body_message(b'{"model": "real", "prompt": "x"}'))
    finish_with_status(stream, b"200")
    assert (
        registry.get_sample_value(
            "llm_d_epp_request_total", {"model_name": "real", "target_model_name": "real-v2", **flow}
        )
        == 1
    )
    # at most a series per admitted name, "other" and the pinned one in each family: none per name past the cap
    assert max(len(series.children) for series in picker.metrics.series) <= 52


def test_the_decisions_histograms_are_observed_once_the_answer_is_out_or_when_the_request_ends_first():
    director = make_picker()
    registry = director.metrics.registry

    def decisions() -> tuple[float | None, float | None, float | None]:
        return (
            registry.get_sample_value("inference_extension_scheduler_e2e_duration_seconds_count"),
            registry.get_sample_value(
                "inference_extension_plugin_duration_seconds_count",
                {"extension_point": "scheduler", "plugin_type": "max-score-picker", "plugin_name": "max-score-picker"},
            ),
            registry.get_sample_value(
                "inference_objective_input_tokens_count", {"model_name": "m", "target_model_name": "m"}
            ),
        )

    answered, reset = new_stream(director), new_stream(director)
    for stream in (answered, reset):
        stream.handle(headers_message(BASE_HEADERS))
        stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
    assert decisions() == (None, None, None)  # the proxy's answers did not wait for them
    answered.after_reply()
    assert decisions() == (1, 1, 1)
    answered.finish()
    reset.finish()  # its answer never went out (a reset stream)
    assert decisions() == (2, 2, 2)


def test_the_age_of_the_metrics_a_pick_read_is_observed_once_with_the_decision():
    director = make_picker(PoolState(endpoints=(EndpointSpec("a", "10.0.0.1", 8000),)))
    registry = director.metrics.registry
    name = "inference_extension_scheduler_picked_metrics_age_seconds"
    payload = {"model": "m", "prompt": "x"}
    ctx = director.new_request({":path": "/v1/completions"}, None)
    director.route(ctx, payload, json.dumps(payload).encode())
    director.after_routed(ctx)
    director.on_complete(ctx)
    assert registry.get_sample_value(f"{name}_count") is None  # its metrics came from no scrape: no age to tell
    (endpoint,) = director.datastore.endpoints
    endpoint.metrics = EndpointMetrics(scraped_at=time.monotonic() - 0.03)
    ctx = director.new_request({":path": "/v1/completions"}, None)
    director.route(ctx, payload, json.dumps(payload).encode())
    endpoint.metrics = EndpointMetrics(scraped_at=time.monotonic())  # a scrape after the pick changes nothing
    director.after_routed(ctx)
    director.on_complete(ctx)
    assert registry.get_sample_value(f"{name}_count") == 1
    assert 0.03 <= registry.get_sample_value(f"{name}_sum") < 1.0
    assert registry.get_sample_value(f"{name}_bucket", {"le": "0.025"}) == 0
    assert registry.get_sample_value(f"{name}_bucket", {"le": "1.0"}) == 1


def test_a_rewrite_header_cannot_widen_the_pools_model_allowlist():
    state = PoolState(
        endpoints=(EndpointSpec("a", "10.0.0.1", 8000),),
        models=frozenset({"m", "m-v2"}),
        rewrites=(ModelRewrite("alias", (("backend-name", 1),)),),
    )
    for target, allowed in (("secret-model", False), ("m-v2", True), ("backend-name", True)):
        stream = new_stream(make_picker(state))
        stream.handle(headers_message({**BASE_HEADERS, "x-gateway-model-name-rewrite": target}))
        responses = stream.handle(body_message(b'{"model": "m", "prompt": "x"}'))
        if allowed:
            body = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in responses[1:])
            assert json.loads(body)["model"] == target
        else:
            assert responses[0].immediate_response.status.code == 404


def test_prompt_tokens_count_as_in_flight_until_the_endpoint_answers_and_the_request_until_it_ends():
    director = make_picker()
    ctx = director.new_request({":path": "/v1/completions"}, None)
    payload = {"model": "m", "prompt": "hello " * 50, "max_tokens": 5, "stream": True}
    director.route(ctx, payload, json.dumps(payload).encode())
    picked = ctx.endpoint
    assert picked.in_flight_requests == 1 and picked.in_flight_tokens == ctx.request.prompt_tokens_estimate > 0
    director.on_response_headers(ctx, "200", None)  # its prefill is under way: no longer work waiting there
    assert picked.in_flight_tokens == 0 and picked.in_flight_requests == 1
    director.on_complete(ctx)
    assert picked.in_flight_tokens == 0 and picked.in_flight_requests == 0
    # a request that ends without response headers (reset, EPP-side failure) releases both at its end
    ctx = director.new_request({":path": "/v1/completions"}, None)
    director.route(ctx, payload, json.dumps(payload).encode())
    picked = ctx.endpoint
    director.on_complete(ctx)
    assert picked.in_flight_tokens == 0 and picked.in_flight_requests == 0
