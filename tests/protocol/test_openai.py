"""OpenAI request parsing, validation errors in OpenAI's shape, and the prompt text used for prefix hashing."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.openai import (
    OpenAIError,
    RequestKind,
    load_json_body,
    model_not_found,
    parse_request,
    prompt_text,
    request_kind,
)

CHAT = RequestKind.CHAT
COMPLETION = RequestKind.COMPLETION


def test_completion_request_fields():
    request = parse_request(
        json.dumps(
            {
                "model": "m",
                "prompt": "hello",
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": 7,
                "n": 2,
                "temperature": 0.5,
                "top_p": 0.9,
                "seed": 3,
                "stop": "\n",
                "logprobs": 2,
                "user": "u",
            }
        ).encode(),
        COMPLETION,
    )
    assert request.model == "m"
    assert request.prompts == ["hello"]
    assert request.stream and request.include_usage
    assert (request.max_tokens, request.n, request.temperature, request.top_p, request.seed) == (7, 2, 0.5, 0.9, 3)
    assert request.stop == ["\n"]
    assert request.logprobs == 2
    assert request.user == "u"


def test_chat_request_fields_and_max_completion_tokens_wins():
    request = parse_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            ],
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": ["a", "b"],
        },
        CHAT,
    )
    assert request.max_tokens == 9
    assert request.messages[1]["content"] == "hi there"
    assert request.logprobs == 3
    assert request.stop == ["a", "b"]


@pytest.mark.parametrize(
    "prompt",
    ["text", ["one", "two"], [1, 2, 3], [[1, 2], [3]]],
)
def test_completion_prompt_shapes(prompt):
    request = parse_request({"model": "m", "prompt": prompt}, COMPLETION)
    assert len(request.prompts) >= 1


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (COMPLETION, {"prompt": "x"}, "model"),
        (COMPLETION, {"model": "", "prompt": "x"}, "model"),
        (COMPLETION, {"model": 3, "prompt": "x"}, "model"),
        (COMPLETION, {"model": "m"}, "prompt"),
        (COMPLETION, {"model": "m", "prompt": 5}, "prompt"),
        (COMPLETION, {"model": "m", "prompt": [1, -2]}, "prompt"),
        (COMPLETION, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETION, {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        (COMPLETION, {"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        (COMPLETION, {"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        (COMPLETION, {"model": "m", "prompt": "x", "n": 0}, "n"),
        (COMPLETION, {"model": "m", "prompt": "x", "n": 10**30}, "n"),
        (COMPLETION, {"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        (COMPLETION, {"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETION, {"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        (COMPLETION, {"model": "m", "prompt": "x", "seed": 2**70}, "seed"),
        (COMPLETION, {"model": "m", "prompt": "x", "stop": [1]}, "stop"),
        (COMPLETION, {"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        (COMPLETION, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETION, {"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPLETION, {"model": "m", "prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        (CHAT, {"model": "m"}, "messages"),
        (CHAT, {"model": "m", "messages": []}, "messages"),
        (CHAT, {"model": "m", "messages": ["hi"]}, "messages"),
        (CHAT, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages"),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2, "logprobs": 1},
            "logprobs",
        ),
    ],
)
def test_validation_errors_name_the_param(kind, body, param):
    with pytest.raises(OpenAIError) as info:
        parse_request(body, kind)
    error = info.value
    assert error.status == 400
    assert error.param == param
    assert set(error.to_dict()["error"]) == {"message", "type", "param", "code"}
    assert error.to_dict()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [b"", b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b"null", b"NaN"])
def test_body_must_be_a_json_object(body):
    with pytest.raises(OpenAIError) as info:
        parse_request(body, COMPLETION)
    assert info.value.status == 400


def _json_module(body: bytes):
    """What the json module makes of a body: the object, or the message of the 400 the EPP answers."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"request body is not valid JSON: {exc}"
    except RecursionError:
        return "request body is nested too deeply"
    return payload if isinstance(payload, dict) else "request body must be a JSON object"


def _decoded(body: bytes):
    try:
        return load_json_body(body)
    except OpenAIError as error:
        assert error.status == 400
        return error.message


EDGES = [
    b'{"a": NaN, "b": -Infinity}',  # the json module takes these, msgspec does not
    b'{"a": 1e400}',
    b'\xef\xbb\xbf{"a": 1}',  # a byte-order mark
    '{"a": 1}'.encode("utf-16"),
    b'{"a": "\\ud800"}',  # a lone surrogate
    b'{"a": 1, "a": 2}',
    b'{"a": 123456789012345678901234567890}',
    b'{"a": "x\ny"}',  # a raw control character
    b'{"model": "\xff"}',  # invalid UTF-8 in a string (msgspec raises UnicodeDecodeError, not its own error)
    b'{"a": 1} x',
    b"[" * 2000 + b"]" * 2000,
    b'{"a":' * 2000 + b"1" + b"}" * 2000,
]


@pytest.mark.parametrize("body", EDGES)
def test_bodies_decode_as_the_json_module_decodes_them(body):
    assert repr(_decoded(body)) == repr(_json_module(body))  # (repr: NaN != NaN)


def test_error_shapes():
    error = model_not_found("nope")
    assert error.status == 404
    body = json.loads(error.to_json())
    assert body["error"]["code"] == "model_not_found"
    assert "nope" in body["error"]["message"]
    assert OpenAIError("busy", 429).type == "rate_limit_error"
    assert OpenAIError("down", 503).type == "service_unavailable"


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/completions", COMPLETION),
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions?x=1", CHAT),
        ("/v1/chat/completions/", CHAT),
        ("/v1/models", None),
        ("/", None),
    ],
)
def test_request_kind(path, kind):
    assert request_kind(path) is kind


def test_prompt_text_of_completion_and_token_ids():
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": [5, 6]}) == "5,6"
    assert prompt_text(parse_request({"model": "m", "prompt": "abc"}, COMPLETION)) == "abc"
    assert prompt_text({}) == ""


def test_chat_prompt_text_is_prefix_preserving_across_turns():
    turn1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    text1, text2 = prompt_text({"messages": turn1}), prompt_text({"messages": turn2})
    assert text2.startswith(text1)
    assert text1 != text2
    # validated and raw payloads hash the same text
    assert prompt_text(parse_request({"model": "m", "messages": turn2}, CHAT)) == text2


def test_chat_prompt_text_of_odd_messages_never_raises():
    assert prompt_text({"messages": [{"role": "user", "content": 5}]})
    assert prompt_text({"messages": ["not a dict"]}) == ""


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300)
@given(
    kind=st.sampled_from([COMPLETION, CHAT]),
    body=st.dictionaries(
        st.sampled_from(["model", "prompt", "messages", "max_tokens", "n", "stream", "stop", "temperature", "seed"]),
        json_values,
    ),
)
def test_arbitrary_bodies_raise_only_openai_errors(kind, body):
    try:
        parse_request(body, kind)
    except OpenAIError as error:
        assert error.status == 400
    prompt_text(body)


@settings(max_examples=300)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.binary(max_size=16).map(lambda b: b'{"model": "' + b + b'"}'),
        json_values.map(lambda v: json.dumps(v).encode()),
    )
)
def test_arbitrary_bodies_decode_as_the_json_module_decodes_them(body):
    assert repr(_decoded(body)) == repr(_json_module(body))
