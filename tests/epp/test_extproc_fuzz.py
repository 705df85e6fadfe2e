"""The ext_proc handler and the director under generated message sequences: any order of request and response
messages (a body before its headers, headers twice, trailers, responses before any routing), bodies valid, cut
anywhere, or garbage, and any status. Each message gets answers, not an exception, and once every stream has
ended the pool's accounting is back where it started: no request left in flight on an endpoint, no prompt tokens,
no flow-control slot, no buffered body bytes."""

import asyncio
import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.handlers.extproc import RequestStream
from harness.bench.handler_cpu import _director
from protocol import extproc
from protocol.limits import ByteBudget

BODY = json.dumps({"model": "sim-llama-8b", "prompt": "Say hello. " * 8, "max_tokens": 4}).encode()
HEADERS = (
    (":path", "/v1/completions"),
    (":method", "POST"),
    ("content-type", "application/json"),
    (extproc.REQUEST_ID_HEADER, "r"),
    (extproc.MODEL_NAME_REWRITE_HEADER, "sim-llama-8b"),
    (extproc.OBJECTIVE_HEADER, "critical"),
    (extproc.FAIRNESS_ID_HEADER, "tenant"),
)


def _headers(pairs, end_of_stream: bool) -> pb.HttpHeaders:
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=end_of_stream,
    )


@st.composite
def messages(draw) -> pb.ProcessingRequest:
    kind = draw(st.sampled_from(("request_headers", "body", "body", "garbage", "request_trailers",
                                 "response_headers", "response_body", "response_trailers")))  # fmt: skip
    if kind == "request_headers":
        message = pb.ProcessingRequest(
            request_headers=_headers(draw(st.lists(st.sampled_from(HEADERS), max_size=5)), draw(st.booleans()))
        )
        if draw(st.booleans()):
            message.protocol_config.request_body_mode = draw(st.sampled_from((1, 4)))  # BUFFERED, FULL_DUPLEX
            message.protocol_config.response_body_mode = draw(st.sampled_from((0, 4)))
        return message
    if kind in ("body", "garbage"):
        data = BODY if kind == "body" else draw(st.binary(max_size=40))
        start = draw(st.integers(0, len(data)))
        chunk = data[start : draw(st.integers(start, len(data)))]
        return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=draw(st.booleans())))
    if kind == "request_trailers":
        return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    if kind == "response_headers":
        status = draw(st.sampled_from(("200", "503", "abc", "")))
        return pb.ProcessingRequest(response_headers=_headers([(":status", status)], draw(st.booleans())))
    if kind == "response_body":
        data = draw(st.sampled_from((b'data: {"model":"sim-llama-8b"}\n\n', b'"usage":{"completion_tokens":3}', b"")))
        return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=draw(st.booleans())))
    return pb.ProcessingRequest(response_trailers=pb.HttpTrailers())


# An access-log record: one of the requests' ids (x-request-id "r" in HEADERS) or another, its time and status.
records = st.tuples(
    st.sampled_from(("r", "other")),
    st.sampled_from((None, 0.002, 30.0)),
    st.sampled_from(("", "200", "503")),
    st.sampled_from((None, "127.0.0.1:8000", "10.9.9.9:1")),
)


@settings(max_examples=150)
@given(
    st.lists(
        st.tuples(st.lists(messages(), max_size=8), st.booleans(), st.lists(records, max_size=2)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from((None, 1, 2)),
)
def test_any_message_order_is_answered_and_leaves_no_accounting_behind(streams, room):
    """`room`: the requests the pool takes at once (None: always room); the others wait in flow control, and a
    stream that ends while its request waits takes it out of the queue. Access-log records come at any point,
    for these requests or others, before or after their request's end."""
    asyncio.run(_exchange(streams, room))


async def _exchange(streams, room: int | None) -> None:
    director = _director()
    if room is not None:
        director.flow_control.has_room = lambda in_flight: in_flight < room
    budget = ByteBudget(1 << 20)
    handlers = []
    for sequence, ends_at_once, logged in streams:
        handler = RequestStream(director, lambda answers: None, budget, max_body_bytes=200)
        handlers.append(handler)
        for message in sequence:
            answers = handler.handle(message)  # never raises
            assert all(pb.ProcessingResponse.FromString(a) is not None for a in answers)  # bytes of answers
            handler.after_reply()
        if ends_at_once:
            handler.finish()
        for record in logged:
            director.on_access_log(*record)
        await asyncio.sleep(0)  # a request that waited may be dispatched now
    for handler in handlers:
        handler.finish()
    for _ in range(3):
        await asyncio.sleep(0)
    endpoints = director.datastore.endpoints
    assert [e.in_flight_requests for e in endpoints] == [0] * len(endpoints)
    assert [e.in_flight_tokens for e in endpoints] == [0] * len(endpoints)
    assert director.flow_control.in_flight == 0 and director.flow_control.count == 0
    assert budget.held == 0
