"""The EPP with the Responses and Messages APIs: their prompts, follow-ups routed to the endpoint that stored their
previous response (learnt from responses, else found by asking the pool), errors in each API's shape."""

import asyncio
import json

import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.datalayer.endpoint import EndpointSpec, PoolState
from tests.conftest import free_ports
from tests.epp.helpers import ParsedStream
from tests.epp.test_server import body_message, headers_message, make_picker, new_stream, set_headers

RESPONSES = {":method": "POST", ":path": "/v1/responses", "content-type": "application/json"}
MESSAGES = {":method": "POST", ":path": "/v1/messages", "content-type": "application/json"}
ASKED = [0]  # GET /v1/responses/{id} the pool_of_servers answered


def response_chunk(data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=False))


def routed_to(answers) -> list[str]:
    head = answers[0]
    fields = head.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return fields["x-gateway-destination-endpoint"].string_value.split(",")


def immediate(answers) -> tuple[int, dict]:
    (answer,) = answers
    return answer.immediate_response.status.code, json.loads(answer.immediate_response.body)


def test_the_prompts_of_responses_and_messages_bodies_feed_the_scorers():
    director = make_picker()
    for headers, body in (
        (RESPONSES, {"model": "m", "instructions": "sys", "input": "hi", "tools": [{"type": "function", "name": "t"}]}),
        (MESSAGES, {"model": "m", "max_tokens": 2, "system": "sys", "messages": [{"role": "user", "content": "hi"}]}),
    ):
        stream = new_stream(director)
        stream.handle(headers_message(headers))
        stream.handle(body_message(json.dumps(body).encode()))
        assert stream.ctx.request.prompt.startswith(("<|tools|>\n", "<|system|>\nsys\n"))
        assert "<|user|>\nhi\n" in stream.ctx.request.prompt
        stream.finish()


def test_errors_are_in_the_apis_shape_and_unreadable_bodies_go_through():
    director = make_picker()
    stream = new_stream(director)
    stream.handle(headers_message(MESSAGES))
    status, body = immediate(stream.handle(body_message(b"{not json")))
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    stream = new_stream(director)
    stream.handle(headers_message(MESSAGES))
    status, body = immediate(stream.handle(body_message(b'{"messages": []}')))
    assert status == 400 and body["type"] == "error"
    # a body the EPP cannot read for its prompt still goes to a server, which answers it in its own words
    for headers, body in (
        (RESPONSES, {"model": "m", "input": [{"type": "computer_call"}]}),
        (MESSAGES, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
    ):
        stream = new_stream(director)
        stream.handle(headers_message(headers))
        answers = stream.handle(body_message(json.dumps(body).encode()))
        assert answers[0].HasField("request_headers") and routed_to(answers)
        stream.finish()


def test_a_follow_up_goes_to_the_endpoint_that_stored_its_response_learnt_from_the_response():
    director = make_picker()
    stream = new_stream(director)
    stream.handle(headers_message(RESPONSES))
    first = routed_to(stream.handle(body_message(b'{"model": "m", "input": "hi"}')))[0]
    stream.after_reply()
    stream.handle(response_chunk(b'{"id":"resp_abc","object":"response"'))
    stream.finish()
    assert director.responses.known("resp_abc") == first
    stored = next(e for e in director.datastore.endpoints if e.hostport == first)
    stored.in_flight_requests += 100  # far busier than the other: load does not move a follow-up
    for _ in range(5):
        follow_up = new_stream(director)
        follow_up.handle(headers_message(RESPONSES))
        answers = follow_up.handle(body_message(b'{"model": "m", "previous_response_id": "resp_abc", "input": "x"}'))
        assert routed_to(answers) == [first]  # no fallbacks: no other server could answer it
        assert set_headers(answers[0])["x-gateway-destination-endpoint"] == first
        follow_up.after_reply()
    # a stored response's GET and DELETE go there too
    get = new_stream(director)
    answers = get.handle(headers_message({":method": "GET", ":path": "/v1/responses/resp_abc"}, end_of_stream=True))
    assert routed_to(answers) == [first]


def test_a_streamed_response_teaches_its_id_from_its_created_event():
    director = make_picker()
    stream = new_stream(director)
    stream.handle(headers_message(RESPONSES))
    first = routed_to(stream.handle(body_message(b'{"model": "m", "input": "hi", "stream": true}')))[0]
    stream.handle(response_chunk(b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'))
    stream.handle(response_chunk(b'"response":{"id":"resp_s1","object":"response"}}\n\n'))
    assert director.responses.known("resp_s1") == first
    unstored = new_stream(director)
    unstored.handle(headers_message(RESPONSES))
    unstored.handle(body_message(b'{"model": "m", "input": "hi", "store": false}'))
    unstored.handle(response_chunk(b'{"id":"resp_u1","object":"response"}'))
    assert director.responses.known("resp_u1") is None  # never stored: nothing to route back to


@pytest.fixture
async def pool_of_servers():
    """Three HTTP servers answering GET /v1/responses/{id}: the second stores resp_there, server i resp_on_{i};
    ASKED counts the GETs."""
    runners, specs = [], []
    ports = free_ports(3)
    for i, port in enumerate(ports):

        async def get(request, stores=(i == 1), mine=f"resp_on_{i}"):
            ASKED[0] += 1
            found = request.match_info["id"] == mine or (stores and request.match_info["id"] == "resp_there")
            return web.json_response({}, status=200 if found else 404)

        app = web.Application()
        app.router.add_get("/v1/responses/{id}", get)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        specs.append(EndpointSpec(f"s{i}", "127.0.0.1", port))
    try:
        yield specs
    finally:
        for runner in runners:
            await runner.cleanup()


async def follow_up(director, previous: str, headers: dict | None = None) -> list:
    deferred = asyncio.get_running_loop().create_future()
    stream = ParsedStream(director, deferred.set_result)
    stream.handle(headers_message({**RESPONSES, **(headers or {})}))
    body = json.dumps({"model": "m", "previous_response_id": previous, "input": "x"}).encode()
    answers = stream.handle(body_message(body))
    assert answers[0].HasField("override_message_timeout")  # the proxy waits while the EPP asks the pool
    return await asyncio.wait_for(deferred, 5)


async def test_a_follow_up_another_replica_routed_is_found_by_asking_the_pool(pool_of_servers):
    director = make_picker(PoolState(endpoints=tuple(pool_of_servers)))
    try:
        answers = await follow_up(director, "resp_there")
        assert routed_to(answers) == [pool_of_servers[1].hostport]
        assert director.responses.known("resp_there") == pool_of_servers[1].hostport
        status, body = immediate(await follow_up(director, "resp_nowhere"))
        assert status == 404 and body["error"]["param"] == "previous_response_id"
        assert (
            body["error"]["code"] == "previous_response_not_found"
            and "no endpoint stores it" in body["error"]["message"]
        )
        # its endpoint left the pool: a clear 404, never another server's answer without the conversation
        director.responses.learn("resp_gone", "127.0.0.1:1")
        status, body = immediate(await follow_up(director, "resp_gone"))
        assert status == 404 and "127.0.0.1:1" in body["error"]["message"]
    finally:
        await director.responses.close()


async def test_an_agent_s_follow_up_asks_the_endpoint_of_its_session_s_last_stored_answer_first(pool_of_servers):
    director = make_picker(PoolState(endpoints=tuple(pool_of_servers)))
    session = {"x-claude-code-session-id": "agent-1"}
    try:
        stream = new_stream(director)
        stream.handle(headers_message({**RESPONSES, **session}))
        first = routed_to(stream.handle(body_message(b'{"model": "m", "input": "hi"}')))[0]
        stream.after_reply()  # (the access log brings the rest: no response body comes through)
        stored = next(i for i, spec in enumerate(pool_of_servers) if spec.hostport == first)
        ASKED[0] = 0
        assert routed_to(await follow_up(director, f"resp_on_{stored}", session)) == [first]
        assert ASKED[0] == 1  # that endpoint alone, not the pool
        # the hint wrong (another session's answer): the rest of the pool is asked
        other = (stored + 1) % len(pool_of_servers)
        ASKED[0] = 0
        assert routed_to(await follow_up(director, f"resp_on_{other}", session)) == [pool_of_servers[other].hostport]
        assert ASKED[0] == len(pool_of_servers)
    finally:
        await director.responses.close()


async def test_a_follow_up_that_waited_for_its_turn_still_goes_to_its_full_endpoint():
    """After a wait in flow control a request goes where there is room, except a follow-up: only its endpoint has
    its conversation."""
    from epp.flowcontrol import FlowControlConfig, FlowController

    director = make_picker()
    full = director.datastore.endpoints[0]  # (the other has room)
    full.metrics.waiting = 10  # (queueDepthThreshold 5: no room there)
    director.responses.learn("resp_full", full.hostport)
    slots = [0]
    director.flow_control = FlowController(
        FlowControlConfig(), lambda in_flight: in_flight < slots[0], poll_interval=0.01
    )
    replies: list = []
    stream = ParsedStream(director, replies.append)
    stream.handle(headers_message(RESPONSES))
    (wait,) = stream.handle(body_message(b'{"model": "m", "previous_response_id": "resp_full", "input": "x"}'))
    assert wait.HasField("override_message_timeout")
    slots[0] = 1
    for _ in range(100):
        if replies:
            break
        await asyncio.sleep(0.01)
    assert routed_to(replies[0]) == [full.hostport]
    stream.finish()
