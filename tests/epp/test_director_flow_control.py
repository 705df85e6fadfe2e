"""The director with flow control: requests go straight on while the pool has room; at saturation the handler
tells the proxy to wait, answers through reply when the request's turn comes, and a stream that ends while queued
leaves its queue (no turn is lost or held)."""

import asyncio
import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.flowcontrol import DISPATCHED, EVICTED_CANCELLED, FlowControlConfig, FlowController
from epp.handlers.extproc import RequestStream
from tests.epp.test_server import BASE_HEADERS, body_message, headers_message, make_picker


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


def start(director, replies: list, tenant: str) -> tuple[RequestStream, list]:
    stream = RequestStream(director, replies.append)
    headers = {**BASE_HEADERS, "x-gateway-inference-fairness-id": tenant}
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
        assert wait.override_message_timeout.seconds == 32 and stream.awaiting_reply
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
