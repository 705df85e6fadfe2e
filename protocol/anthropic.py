"""Anthropic Messages request shape (`POST /v1/messages`, `/v1/messages/count_tokens`): validation with errors in
Anthropic's shape (`OpenAIError` with style "anthropic"), and the chat messages and tools it renders, as vLLM's
Anthropic endpoint turns it into a chat request. Shared by the model server and the EPP.

`system` (text or text blocks) is a system message; a user turn's `tool_result` blocks are tool messages (before its
text, where Anthropic's API puts them), an assistant turn's `tool_use` blocks its tool calls (their `input` as JSON
text); `thinking` blocks render nothing; images and documents are not supported (400).
"""

from __future__ import annotations

import json
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

ROLES = frozenset({"user", "assistant"})
SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def anthropic_error(message: str, status: int = 400) -> OpenAIError:
    error = OpenAIError(message, status)
    error.style = "anthropic"
    return error


def _block_text(blocks: Any, where: str) -> str:
    """The text of a string or of a list of text blocks (a system prompt, a tool result)."""
    if isinstance(blocks, str):
        return valid_text(blocks, "messages")
    if blocks is None:
        return ""
    if isinstance(blocks, list):
        texts = []
        for block in blocks:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise anthropic_error(f"{where}: only text blocks are supported here")
            texts.append(valid_text(block["text"], "messages"))
        return "".join(texts)
    raise anthropic_error(f"{where}: must be a string or a list of text blocks")


def _turn(message: Any, index: int) -> list[dict[str, Any]]:
    where = f"messages.{index}"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise anthropic_error(f"{where}: must be an object with role 'user' or 'assistant'")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": valid_text(content, "messages")}]
    if not isinstance(content, list):
        raise anthropic_error(f"{where}.content: must be a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(valid_text(block["text"], "messages"))
        elif kind == "tool_use" and role == "assistant":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(block.get("id"), str) or not isinstance(name, str) or not isinstance(arguments, dict):
                raise anthropic_error(f"{at}: tool_use needs an id and a name (strings) and an input (object)")
            function = {"name": name, "arguments": json.dumps(arguments)}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise anthropic_error(f"{at}: tool_result needs a tool_use_id (string)")
            results.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _block_text(block.get("content"), at)}
            )
        elif kind not in SKIPPED_BLOCKS:
            raise anthropic_error(f"{at}: content block type {kind!r} is not supported here")
    turn = results
    if texts or calls or not results:
        message_out: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message_out["tool_calls"] = calls
        turn = [*results, message_out]
    return turn


def messages_tools(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Client tools (`{"name", "description", "input_schema"}`) in Chat's shape; server tools (web search, code
    execution: a versioned `type`) need Anthropic's servers: 400."""
    tools = payload.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise anthropic_error("tools: must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise anthropic_error(f"tools.{i}: tool type {kind!r} is not supported (client tools only)")
        try:
            out.append(function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), "tools"))
        except OpenAIError as error:
            raise anthropic_error(f"tools.{i}: {error.message}") from None
    return out


def parse_messages_request(body: Mapping[str, Any], counting: bool = False) -> CompletionRequest:
    """Validate a Messages body (`counting`: a count_tokens body, which has no max_tokens). Errors are Anthropic's."""
    try:
        return _parse(body, counting)
    except OpenAIError as error:
        if error.style != "anthropic":  # (the shared validators' errors)
            raise anthropic_error(error.message, error.status) from None
        raise


def _parse(body: Mapping[str, Any], counting: bool) -> CompletionRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise anthropic_error("model: Field required (a non-empty string)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise anthropic_error("messages: must be a non-empty list")
    system = _block_text(body.get("system"), "system")
    chat = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(messages):
        chat += _turn(message, i)
    request = CompletionRequest(
        kind=RequestKind.MESSAGES, model=model, messages=chat, tools=messages_tools(body), raw=dict(body)
    )
    if counting:
        return request
    max_tokens = _int_in(body, "max_tokens", 1)
    if max_tokens is None:
        raise anthropic_error("max_tokens: Field required")
    request.max_tokens = max_tokens
    request.stream = bool(_expect(body, "stream", bool, "a boolean"))
    request.temperature = _float_in(body, "temperature", 0.0, 1.0)
    request.top_p = _float_in(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = _int_in(body, "top_k", 0)
    request.top_k = top_k or None
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise anthropic_error("stop_sequences: must be a list of strings")
    request.stop = [valid_text(s, "stop_sequences") for s in stops or () if s]
    return request
