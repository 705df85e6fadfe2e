"""OpenAI Responses request shape (`POST /v1/responses`): validation with OpenAI-shaped errors, and the chat messages
and tools it renders. Shared by the model server (which answers it) and the EPP (which hashes its prompt).

A request's conversation is its `instructions` (a system message, not carried to follow-ups, as OpenAI's API
documents), then the stored conversation of its `previous_response_id` (the model server's; the EPP has none and
routes the follow-up to the server that stored it), then its `input`: text, or items (messages with text parts,
`function_call`, `function_call_output`; `reasoning` items are kept by clients but render nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocol.openai import (
    CompletionRequest,
    OpenAIError,
    RequestKind,
    _expect,
    _float_in,
    _int_in,
    function_tool,
    valid_text,
)

RESPONSE_ID_PREFIX = "resp_"
INPUT_ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def response_not_found(response_id: str) -> OpenAIError:
    """vLLM's answer to an id no stored response has (GET, DELETE, or a follow-up's previous_response_id)."""
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, param="response_id")


def check_response_id(response_id: Any, param: str = "response_id") -> str:
    if not isinstance(response_id, str) or not response_id.startswith(RESPONSE_ID_PREFIX):
        raise OpenAIError(
            f"Invalid '{param}': '{response_id}'. Expected an ID that begins with '{RESPONSE_ID_PREFIX}'.", param=param
        )
    return response_id


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return valid_text(content, "input")
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"`{where}`: content part {kind!r} is not supported (text parts only)", param="input")
            parts.append(valid_text(part["text"], "input"))
        return "".join(parts)
    raise OpenAIError(f"`{where}` content must be a string or a list of text parts", param="input")


def _string(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise OpenAIError(f"`{where}.{name}` must be a string", param="input")
    return valid_text(value, "input")


def input_messages(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`: a text is one user message; items become messages, a function call
    an assistant message's tool call (calls that follow an assistant message join it: one turn's output), its output
    a tool message."""
    value = payload.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": valid_text(value, "input")}]
    if not isinstance(value, list) or not value:
        raise OpenAIError("`input` must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"`{where}` must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise OpenAIError(f"`{where}.role` must be one of {sorted(INPUT_ROLES)}", param="input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(output, f"{where}.output"),
                }
            )
        elif kind != "reasoning":
            raise OpenAIError(f"`{where}`: input item type {kind!r} is not supported", param="input")
    return messages


def responses_tools(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Function tools (`{"type": "function", "name", "description", "parameters"}`) in Chat's shape; built-in tools
    (web search, file search, code interpreter) need a tool server this model server does not have: 400."""
    tools = payload.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise OpenAIError("`tools` must be a list", param="tools")
    out = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise OpenAIError(f"tool type {kind!r} is not supported (function tools only)", param="tools")
        out.append(function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), "tools"))
    return out


def parse_responses_request(body: Mapping[str, Any], prior: list[dict[str, Any]]) -> CompletionRequest:
    """Validate a Responses body; `prior` is the stored conversation its previous_response_id names ([] for none,
    or for the EPP, which has none). The messages are instructions + prior + input; `raw` keeps the body."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("`model` is required and must be a non-empty string", param="model")
    previous = body.get("previous_response_id")
    if previous is not None:
        check_response_id(previous, "previous_response_id")
    instructions = _expect(body, "instructions", str, "a string")
    system = [{"role": "system", "content": valid_text(instructions, "instructions")}] if instructions else []
    request = CompletionRequest(
        kind=RequestKind.RESPONSES,
        model=model,
        messages=[*system, *prior, *input_messages(body)],
        tools=responses_tools(body),
        raw=dict(body),
    )
    request.stream = bool(_expect(body, "stream", bool, "a boolean"))
    _expect(body, "store", bool, "a boolean")
    request.max_tokens = _int_in(body, "max_output_tokens", 1)
    request.temperature = _float_in(body, "temperature", 0.0, 2.0)
    request.top_p = _float_in(body, "top_p", 0.0, 1.0, low_open=True)
    request.user = _expect(body, "user", str, "a string")
    return request
