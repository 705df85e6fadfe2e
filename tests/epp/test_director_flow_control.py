"""The director with flow control: requests go straight on while the pool has room; at saturation the handler
tells the proxy to wait, answers through reply when the request's turn comes, and a stream that ends while queued
leaves its queue (no turn is lost or held)."""

import asyncio
import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.datalayer.endpoint import PoolState
from epp.flowcontrol import DISPATCHED, EVICTED_CANCELLED, FlowControlCollector, FlowControlConfig, FlowController
from epp.metrics import OVERFLOW_LABEL, BoundedLabel, EPPMetrics
from protocol.metrics import EndpointMetrics
from tests.epp.helpers import ParsedStream, until
from tests.epp.test_server import BASE_HEADERS, body_message, headers_message, make_picker


def dropped_reason(answer: pb.ProcessingResponse) -> bytes | None:
    """llm-d's x-llm-d-request-dropped-reason on an ImmediateResponse, None without one."""
    headers = {h.header.key: h.header.raw_value for h in answer.immediate_response.headers.set_headers}
    return headers.get("x-llm-d-request-dropped-reason")


class Room:
    def __init__(self, slots: int):
        self.slots = slots

    def __call__(self, in_flight: int) -> bool:
        return in_flight < self.slots


def setup(slots: int):
    director = make_picker()
    outcomes = []
    room = Room(slots)
    director.flow_control = FlowController(
        FlowControlConfig(), room, observer=lambda p, f, o, s: outcomes.append((f, o)), poll_interval=0.01
    )
    return director, room, outcomes


def start(director, replies: list, tenant: str, objective: str | None = None) -> tuple[ParsedStream, list]:
    stream = ParsedStream(director, replies.append)
    headers = {**BASE_HEADERS, "x-gateway-inference-fairness-id": tenant}
    if objective:
        headers["x-gateway-inference-objective"] = objective
    assert stream.handle(headers_message(headers)) == []
    return stream, stream.handle(body_message(json.dumps({"model": "m", "prompt": "hello"}).encode()))


async def test_saturation_queues_and_completion_dispatches_the_next_in_fair_order():
    director, _, outcomes = setup(slots=1)
    replies: list = []
    first, answers = start(director, replies, "a")
    assert answers[0].HasField("request_headers")  # straight through: routed in the same call
    queued = [start(director, replies, tenant) for tenant in ("a", "a", "b")]
    for stream, answers in queued:
        (wait,) = answers  # the proxy is told to wait: flow control's longest TTL and a margin
        assert wait.override_message_timeout.seconds == 62 and stream.awaiting_reply  # 60 s: llm-d's TTL
    await asyncio.sleep(0)  # the waits start (in arrival order)
    assert director.flow_control.count == 3
    first.after_reply()
    first.finish()  # the first request is over: its turn goes to the next in line
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(replies) == 1 and replies[0][0].HasField("request_headers")
    assert not queued[0][0].awaiting_reply and queued[1][0].awaiting_reply
    queued[0][0].finish()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert queued[2][0].ctx.endpoint is not None  # tenant b goes before tenant a's second request
    assert queued[1][0].awaiting_reply
    queued[1][0].finish()  # its client went away while queued
    await asyncio.sleep(0)
    queued[2][0].finish()
    assert [o for _, o in outcomes] == [DISPATCHED, DISPATCHED, DISPATCHED, EVICTED_CANCELLED]
    assert [f for f, _ in outcomes] == ["a", "a", "b", "a"]
    assert director.flow_control.in_flight == 0 and director.flow_control.count == 0
    assert all(e.in_flight_requests == 0 for e in director.datastore.endpoints)


async def test_a_scrape_that_shows_room_dispatches_without_a_completion():
    director, room, _ = setup(slots=0)
    replies: list = []
    stream, (wait,) = start(director, replies, "a")
    assert wait.HasField("override_message_timeout")
    room.slots = 1  # the next poll (at the scrape interval) finds room
    await asyncio.sleep(0.05)
    assert replies and replies[0][0].HasField("request_headers")
    stream.finish()
    assert director.flow_control.in_flight == 0


async def test_answers_to_messages_that_arrive_while_queued_follow_the_deferred_answer():
    director, room, _ = setup(slots=0)
    replies: list = []
    stream, _ = start(director, replies, "a")
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    assert stream.handle(trailers) == []  # held: its answer may not overtake the routing answer
    room.slots = 1
    await asyncio.sleep(0.05)
    (answers,) = replies
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "request_trailers"]  # routing, the body, then the trailers
    stream.finish()


async def test_a_completion_frees_its_endpoint_before_the_next_dispatch_which_goes_there():
    director = make_picker()
    detector, endpoints = director.scheduler.detector, director.datastore.endpoints
    director.flow_control = FlowController(FlowControlConfig(), lambda n: detector.has_room(endpoints, n))
    for e in endpoints:  # each seen full at one running request; idle at the last scrape
        e.metrics, e.stale, e.batch_slots = EndpointMetrics(), False, 1
    replies: list = []
    first, _ = start(director, replies, "a")
    second, _ = start(director, replies, "a")
    assert {first.ctx.endpoint, second.ctx.endpoint} == set(endpoints)  # each to the endpoint with a free slot
    third, (wait,) = start(director, replies, "b")
    assert wait.HasField("override_message_timeout")
    await asyncio.sleep(0)
    freed = first.ctx.endpoint
    first.finish()  # its endpoint's slot is free at once (no scrape needed) and the queued request goes there
    for _ in range(3):  # (the wait resumes, then its answer goes out)
        await asyncio.sleep(0)
    assert replies and third.ctx.endpoint is freed
    second.finish()
    third.finish()
    assert director.flow_control.in_flight == 0 and all(e.in_flight_requests == 0 for e in endpoints)


async def test_a_request_queued_when_the_pool_empties_gets_503_at_its_ttl():
    director = make_picker()
    director.flow_control = FlowController(FlowControlConfig(default_request_ttl=0.02), Room(0))
    replies: list = []
    stream, _ = start(director, replies, "a")
    director.datastore.apply(PoolState())  # every endpoint left the pool
    await asyncio.sleep(0.05)
    (answers,) = replies
    assert answers[0].immediate_response.status.code == 503
    assert dropped_reason(answers[0]) == b"rejected-no-endpoints"
    stream.finish()
    assert director.flow_control.in_flight == 0 and director.flow_control.count == 0


async def test_a_request_waits_for_its_objectives_ttl_and_gets_429_with_retry_after():
    director = make_picker()
    config = FlowControlConfig.from_config({"defaultRequestTTL": "10s", "objectiveRequestTTL": {"interactive": "20ms"}})
    director.flow_control = FlowController(config, Room(0))
    replies: list = []
    stream, (wait,) = start(director, replies, "a", objective="interactive")
    assert wait.override_message_timeout.seconds == 12  # the longest TTL (10 s) and a margin
    await until(lambda: replies, timeout=5.0)  # expired at its 20 ms, not the default 10 s
    (answers,) = replies
    status = answers[0].immediate_response
    assert status.status.code == 429
    headers = {h.header.key: h.header.raw_value for h in status.headers.set_headers}
    assert headers["content-type"] == b"application/json" and int(headers["retry-after"]) >= 0
    assert headers["x-llm-d-request-dropped-reason"] == b"rejected-ttl-expired"
    stream.finish()


async def test_the_response_trailers_end_a_request_not_its_first_byte_and_only_once():
    director, _, _ = setup(slots=1)
    replies: list = []
    first, _ = start(director, replies, "a")
    second, _ = start(director, replies, "b")
    await asyncio.sleep(0)
    first.after_reply()
    first.handle(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    await asyncio.sleep(0)
    assert not replies  # the response has begun, the request still runs: no slot for the queued one
    first.handle(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))  # the response is over
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert replies and second.ctx.endpoint is not None
    first.finish()  # the stream's end after the trailers completes nothing twice
    assert director.flow_control.in_flight == 1
    second.finish()
    assert director.flow_control.in_flight == 0 and all(e.in_flight_requests == 0 for e in director.datastore.endpoints)


LABELS = 40


async def test_flow_control_metrics_by_band_and_flow_with_bounded_fairness_labels():
    director, _, _ = setup(slots=0)
    metrics = director.metrics = EPPMetrics("pool")
    metrics.fairness_label = BoundedLabel(LABELS)  # the cap's rule, with fewer flows than its default 1,000
    detector = director.scheduler.detector
    metrics.register(FlowControlCollector(metrics, director.flow_control, director.datastore, detector.saturation))
    director.flow_control.observer = metrics.flow_control_outcome
    for e in director.datastore.endpoints:
        e.metrics, e.stale = EndpointMetrics(), False
    replies: list = []
    streams = [start(director, replies, f"tenant-{i}")[0] for i in range(LABELS + 5)]
    await asyncio.sleep(0)
    streams[0].finish()  # one client gave up while queued
    await asyncio.sleep(0)
    page = generate_latest(metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(page)}
    sizes = families["inference_extension_flow_control_queue_size"].samples
    # the first LABELS fairness ids are labels of their own (tenant-0 left its queue), the rest share "other"
    assert {s.labels["fairness_id"] for s in sizes} == {f"tenant-{i}" for i in range(1, LABELS)} | {OVERFLOW_LABEL}
    assert sum(s.value for s in sizes) == LABELS + 4
    assert next(s for s in sizes if s.labels["fairness_id"] == OVERFLOW_LABEL).value == 5
    (per_endpoint,) = families["inference_extension_flow_control_queued_requests_per_ready_endpoint"].samples
    assert per_endpoint.value == (LABELS + 4) / 2  # two ready endpoints
    waits = families["inference_extension_flow_control_request_queue_duration_seconds"].samples
    cancelled = [s for s in waits if s.name.endswith("_count") and s.labels["outcome"] == EVICTED_CANCELLED]
    assert [(s.labels["fairness_id"], s.labels["priority"], s.value) for s in cancelled] == [("tenant-0", "0", 1)]
    for stream in streams[1:]:
        stream.finish()
    await asyncio.sleep(0)
    assert director.flow_control.count == 0


async def test_a_bug_routing_a_request_that_waited_answers_500_and_frees_its_turn():
    """The answer of a request that waited comes from a callback: a bug there must still answer the proxy (a 500),
    which would otherwise wait for it until its message timeout."""
    director, room, _ = setup(slots=0)
    replies: list = []
    stream, (wait,) = start(director, replies, "a")
    assert wait.HasField("override_message_timeout")
    await asyncio.sleep(0)

    class BrokenScheduler:
        """The director's scheduler with a bug in preparing a cycle."""

        def __init__(self, scheduler):
            self.scheduler = scheduler

        def prepare(self, request):
            raise RuntimeError("a bug")

        def __getattr__(self, name):
            return getattr(self.scheduler, name)

    director.scheduler = BrokenScheduler(director.scheduler)
    room.slots = 1
    director.flow_control.pump()
    for _ in range(3):
        await asyncio.sleep(0)
    ((answer,),) = replies
    assert answer.immediate_response.status.code == 500 and not stream.awaiting_reply
    stream.finish()
    assert director.flow_control.in_flight == 0 and director.flow_control.count == 0
