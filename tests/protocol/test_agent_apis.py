"""The Responses and Messages request shapes: one conversation renders the same prompt through Chat, Responses and
Messages, tools and system blocks included, and the EPP's transcript is the chat template's text."""

import json

import pytest

from protocol.anthropic import parse_messages_request
from protocol.openai import OpenAIError, RequestKind, chat_transcript, parse_request, prompt_text
from protocol.responses import parse_responses_request
from protocol.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
DESCRIPTION = "Read a file <path> & return it's text."  # (characters the template's tojson escapes)
CHAT = {
    "model": "m",
    "tools": [{"type": "function", "function": {"name": "read", "description": DESCRIPTION, "parameters": SCHEMA}}],
    "messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Fix a.py"},
        {
            "role": "assistant",
            "content": "Reading.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "def add(a, b): return a - b"},
    ],
}
RESPONSES = {
    "model": "m",
    "instructions": "You are an agent.",
    "tools": [{"type": "function", "name": "read", "description": DESCRIPTION, "parameters": SCHEMA}],
    "input": [
        {"role": "user", "content": "Fix a.py"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Reading."}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"path": "a.py"}'},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "def add(a, b): return a - b"},
    ],
}
MESSAGES = {
    "model": "m",
    "max_tokens": 5,
    "system": [{"type": "text", "text": "You are an agent."}],
    "tools": [{"name": "read", "description": DESCRIPTION, "input_schema": SCHEMA}],
    "messages": [
        {"role": "user", "content": "Fix a.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "c1", "name": "read", "input": {"path": "a.py"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "def add(a, b): return a - b"}],
        },
    ],
}


def test_one_conversation_renders_one_prompt_through_the_three_apis():
    chat = parse_request(CHAT, RequestKind.CHAT)
    responses = parse_responses_request(RESPONSES, prior=[])
    messages = parse_messages_request(MESSAGES)
    text = chat_transcript(chat.messages, chat.tools)
    assert chat_transcript(responses.messages, responses.tools) == text
    assert chat_transcript(messages.messages, messages.tools) == text
    assert "<|tools|>" in text and "\\u003cpath\\u003e" in text and "<|tool_call|>read" in text
    # the EPP's text is the model server's chat template's, without the generation prompt
    rendered = load_tokenizer(None).apply_chat_template(chat.messages, tools=chat.tools)
    assert rendered == text + "<|assistant|>\n"
    assert prompt_text(CHAT) == prompt_text(RESPONSES, RequestKind.RESPONSES) == text
    assert prompt_text(MESSAGES, RequestKind.MESSAGES) == prompt_text(RESPONSES) == text


def test_a_follow_up_renders_after_its_stored_conversation():
    prior = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "answer"}]
    follow_up = parse_responses_request({**RESPONSES, "previous_response_id": "resp_1", "input": "next"}, prior)
    assert [m["content"] for m in follow_up.messages] == ["You are an agent.", "earlier", "answer", "next"]


@pytest.mark.parametrize(
    "body",
    [
        {"input": 5},
        {"input": [{"type": "computer_call"}]},
        {"input": [{"role": "tool", "content": "x"}]},
        {"input": [{"type": "function_call", "call_id": 1}]},
        {"input": "x", "tools": "all"},
        {"input": "x", "previous_response_id": 7},
    ],
)
def test_unreadable_responses_bodies_are_400_on_the_server_and_no_prompt_in_the_epp(body):
    with pytest.raises(OpenAIError) as error:
        parse_responses_request({"model": "m", **body}, prior=[])
    assert error.value.status == 400 and error.value.style == "openai"
    assert prompt_text({"model": "m", **body}, RequestKind.RESPONSES) == ""


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "n", "input": 5}]}]},
        {"messages": [{"role": "user", "content": "x"}], "system": 5},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
    ],
)
def test_unreadable_messages_bodies_are_anthropic_shaped_400s(body):
    with pytest.raises(OpenAIError) as error:
        parse_messages_request({"model": "m", "max_tokens": 4, **body})
    assert error.value.status == 400
    assert set(error.value.to_dict()) == {"type", "error"} and error.value.to_dict()["type"] == "error"
    text = prompt_text({"model": "m", **body}, RequestKind.MESSAGES)  # (the EPP reads no sampling parameters)
    readable = "max_tokens" in body
    assert (
        (text == "<|user|>\nx\n")
        if readable
        else text == json.dumps(body["messages"], sort_keys=True, separators=(",", ":"))
    )
