"""The Responses and Anthropic Messages APIs through real Envoy, the EPP and sim servers, with the real SDKs:
follow-ups reach the server that stored their conversation (three EPP replicas that share nothing), and a follow-up
whose server is gone gets a clear 404."""

import re
import signal

import aiohttp
import anthropic
import openai
import pytest

MODEL = "sim-llama-8b"
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.", "parameters": {"type": "object"}}]


async def lookups(stack) -> dict[str, float]:
    outcomes: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for url in stack.epp_metrics_urls:
            async with session.get(url) as r:
                page = await r.text()
            for outcome, value in re.findall(
                r'^llm_d_epp_stored_response_lookups_total\{outcome="(\w+)"\} (\S+)$', page, re.M
            ):
                outcomes[outcome] = outcomes.get(outcome, 0) + float(value)
    return outcomes


async def served_by(stack, response_id: str) -> list[int]:
    async with aiohttp.ClientSession() as session:
        found = []
        for i, url in enumerate(stack.model_server_urls):
            async with session.get(f"{url}/v1/responses/{response_id}") as r:
                if r.status == 200:
                    found.append(i)
        return found


async def conversation(client, turns: int, stream: bool) -> str:
    """An agent's turns: each a follow-up of the last, half of them tool results; returns the last response's id."""
    previous = None
    for turn in range(turns):
        items = [{"role": "user", "content": f"turn {turn}"}]
        if turn % 2:
            items = [
                {"type": "function_call", "call_id": f"c{turn}", "name": "read_file", "arguments": "{}"},
                {"type": "function_call_output", "call_id": f"c{turn}", "output": "text " * turn},
            ]
        args = {"model": MODEL, "instructions": "You are an agent.", "tools": TOOLS, "input": items}
        args |= {"max_output_tokens": 3, "previous_response_id": previous}
        if stream:
            async with client.responses.stream(**args) as events:
                response = await events.get_final_response()
        else:
            response = await client.responses.create(**args)
        assert response.previous_response_id == previous
        previous = response.id
    return previous


@pytest.mark.parametrize(("replicas", "body_mode"), [(3, "NONE"), (1, "FULL_DUPLEX_STREAMED")])
async def test_responses_follow_ups_reach_the_server_that_stored_them(make_stack, replicas, body_mode):
    """Three replicas that never see a response body (Envoy takes turns between them: a follow-up's replica never
    routed the turn before it) find each follow-up's server by asking the pool; one replica that sees the response
    bodies knows it from the response."""
    stack = await make_stack(
        servers=3, epp_replicas=replicas, separate_model_server_processes=True, response_body_mode=body_mode
    )
    client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0)
    last = [await conversation(client, 6, stream=False), await conversation(client, 6, stream=True)]
    outcomes = await lookups(stack)
    assert outcomes.get("not_found", 0) == 0
    assert outcomes["known"] + outcomes["asked"] == 10  # every follow-up found its server
    if replicas == 1:
        assert outcomes["known"] == 10
    (holder,) = await served_by(stack, last[0])
    assert (await client.responses.retrieve(last[0])).id == last[0]  # a GET goes there too

    stack.processes[f"modelserver-{holder}"].send_signal(signal.SIGKILL)
    stack.processes[f"modelserver-{holder}"].wait(10)
    with pytest.raises(openai.NotFoundError) as gone:
        for _ in range(
            50
        ):  # until every replica's scraper has dropped the dead server (then: 404, never another's answer)
            try:
                await client.responses.create(
                    model=MODEL, previous_response_id=last[0], input="more", max_output_tokens=2
                )
            except openai.InternalServerError:
                continue
    assert gone.value.body["param"] == "previous_response_id"


async def test_anthropic_messages_through_the_gateway(make_stack):
    stack = await make_stack(servers=2)
    client = anthropic.AsyncAnthropic(base_url=stack.gateway_url, api_key="none", max_retries=0)
    tools = [{"name": "read_file", "description": "Read a file.", "input_schema": {"type": "object"}}]
    messages = [
        {"role": "user", "content": "Fix a.py"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {"p": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "def f(): pass"}]},
    ]
    message = await client.messages.create(model=MODEL, max_tokens=4, system="Agent.", tools=tools, messages=messages)
    assert message.content[0].type == "text" and message.usage.output_tokens == 4
    async with client.messages.stream(model=MODEL, max_tokens=5, system="Agent.", tools=tools, messages=messages) as s:
        final = await s.get_final_message()
    assert final.usage.output_tokens == 5 and final.usage.cache_read_input_tokens > 0  # its prefix: the same server
    counted = await client.messages.count_tokens(model=MODEL, system="Agent.", tools=tools, messages=messages)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    with pytest.raises(anthropic.NotFoundError) as error:  # the pool's model list is the EPP's: the server's 404
        await client.messages.create(model="nope", max_tokens=2, messages=messages)
    assert error.value.body["type"] == "error"
    url = f"{stack.gateway_url}/v1/messages"
    async with aiohttp.ClientSession() as session, session.post(url, data=b"{not json") as r:  # the EPP's own 400
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
