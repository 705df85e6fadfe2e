"""The Responses and Anthropic Messages APIs of the model server, through the real `openai` and `anthropic` SDKs."""

import aiohttp
import anthropic
import openai
import pytest

from modelserver.api.responses import ResponseStore
from tests.modelserver.conftest import MODEL

TOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file of the repository and return its text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
]


@pytest.fixture
def oai(model_server):
    return openai.AsyncOpenAI(base_url=f"{model_server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture
def claude(model_server):
    return anthropic.AsyncAnthropic(base_url=model_server.url, api_key="none", max_retries=0)


async def test_responses_follow_ups_continue_the_stored_conversation(oai):
    first = await oai.responses.create(
        model=MODEL, instructions="You are a coding agent.", tools=TOOLS, input="Fix the bug.", max_output_tokens=8
    )
    assert first.id.startswith("resp_") and first.status == "incomplete"  # (8 tokens: max_output_tokens)
    assert first.output[0].type == "message" and first.output_text == first.output[0].content[0].text
    assert first.usage.output_tokens == 8
    assert (await oai.responses.retrieve(first.id)).output_text == first.output_text

    follow_up = await oai.responses.create(
        model=MODEL,
        instructions="You are a coding agent.",
        tools=TOOLS,
        previous_response_id=first.id,
        input=[
            {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "a.py"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "def add(a, b): return a - b"},
            {"role": "user", "content": [{"type": "input_text", "text": "Now fix it."}]},
        ],
        max_output_tokens=4,
    )
    assert follow_up.previous_response_id == first.id
    # the stored conversation comes first: the prompt holds it, and its prefix is in the server's cache
    assert follow_up.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow_up.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16

    deleted = await oai.responses.delete(first.id)
    assert deleted is None  # (the SDK returns nothing for a 200)
    with pytest.raises(openai.NotFoundError) as missing:
        await oai.responses.create(model=MODEL, previous_response_id=first.id, input="again", max_output_tokens=2)
    assert missing.value.body["param"] == "previous_response_id"
    assert f"'{first.id}' not found" in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(first.id)


async def test_responses_stream_with_its_event_types(oai):
    stream = await oai.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6, stream=True)
    kinds, deltas, final = [], [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert "".join(deltas) == final.output_text and final.usage.output_tokens == 6
    assert (await oai.responses.retrieve(final.id)).id == final.id  # streamed responses are stored too


async def test_responses_store_false_and_bad_input(oai, model_server):
    unstored = await oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(unstored.id)
    for bad, param in (
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "previous_response_id": "chatcmpl-1"}, "previous_response_id"),
        ({"input": []}, "input"),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            await oai.responses.create(model=MODEL, **bad)
        assert error.value.body["param"] == param
    async with aiohttp.ClientSession() as session, session.get(f"{model_server.url}/v1/responses/not-an-id") as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "response_id"


def test_the_response_store_drops_the_oldest_past_its_count_and_bytes():
    store = ResponseStore(max_count=3, max_bytes=9_000)
    conversation = [{"role": "user", "content": "x" * 1000}]
    for i in range(5):
        store.put({"id": f"resp_{i}"}, conversation, conversation)
    assert list(store.entries) == ["resp_2", "resp_3", "resp_4"] and store.evicted == 2
    big = [{"role": "user", "content": "y" * 4000}]
    store.put({"id": "resp_big"}, big, big)  # 2 x ~1.3 KB + ~4.3 KB fit
    store.put({"id": "resp_big2"}, big, big)  # the count drops one small one, the bytes the other
    assert list(store.entries) == ["resp_big", "resp_big2"] and store.bytes <= 9_000
    store.put({"id": "resp_huge"}, [{"role": "user", "content": "z" * 20_000}], [])  # (added: nothing new)
    assert "resp_huge" in store.entries
    store.put({"id": "resp_over"}, [], [{"role": "user", "content": "z" * 20_000}])  # over the whole limit
    assert "resp_over" not in store.entries
    assert store.delete("resp_huge") and not store.delete("resp_huge")


async def test_the_store_metrics(oai, model_server):
    await oai.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    async with aiohttp.ClientSession() as session, session.get(f"{model_server.url}/metrics") as r:
        page = await r.text()
    assert 'modelserver:stored_responses{engine="0",model_name="sim-model"} 1.0' in page
    assert "modelserver:stored_responses_evicted_total" in page


async def test_anthropic_messages_with_tools_and_tool_results(claude):
    tools = [{"name": "read_file", "description": "Read a file.", "input_schema": {"type": "object"}}]
    messages = [
        {"role": "user", "content": "Fix the bug in a.py."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "def add(a, b): return a - b"}],
        },
    ]
    system = [{"type": "text", "text": "You are a coding agent."}]
    message = await claude.messages.create(model=MODEL, max_tokens=5, system=system, tools=tools, messages=messages)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.stop_reason == "max_tokens"
    assert message.content[0].type == "text" and message.usage.output_tokens == 5
    counted = await claude.messages.count_tokens(model=MODEL, system=system, tools=tools, messages=messages)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens

    async with claude.messages.stream(model=MODEL, max_tokens=6, system=system, tools=tools, messages=messages) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == 6 and final.stop_reason == "max_tokens"
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: its prefix was cached


async def test_anthropic_errors_are_anthropic_shaped(claude, model_server):
    with pytest.raises(anthropic.BadRequestError) as error:
        await claude.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert error.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": error.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.NotFoundError) as error:
        await claude.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["error"]["type"] == "not_found_error"
    async with aiohttp.ClientSession() as session:
        for body in (b"{not json", b'{"model": "sim-model", "messages": []}'):
            async with session.post(f"{model_server.url}/v1/messages", data=body) as r:
                assert r.status == 400 and (await r.json())["type"] == "error"
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        payload = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [image]}]}
        async with session.post(f"{model_server.url}/v1/messages", json=payload) as r:
            assert r.status == 400 and "image" in (await r.json())["error"]["message"]
