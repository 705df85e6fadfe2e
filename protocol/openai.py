"""OpenAI Completions and Chat request shapes: parsing, validation with OpenAI-shaped errors, and the prompt text
used for prefix hashing. Shared by the model server (which validates fully) and the EPP (which needs the model name
and the prompt, and must not reject extensions that some model server accepts). The Responses and Anthropic Messages
APIs (`protocol.responses`, `protocol.anthropic`) turn their bodies into the same chat messages and tools."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from http import HTTPStatus
from typing import Any

import msgspec

from protocol.json_text import tojson

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_N = 128
MAX_LOGPROBS = 20


class RequestKind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"
    RESPONSES = "responses"  # OpenAI Responses (protocol.responses)
    MESSAGES = "messages"  # Anthropic Messages (protocol.anthropic)


# Python 3.11 looks an Enum's members up through its class's __getattr__ hook (0.2 µs an access as Python, about
# 850 instructions compiled): the request path compares kinds with these module names instead.
COMPLETION, CHAT, RESPONSES, MESSAGES = RequestKind

_KIND_OF_PATH = {
    COMPLETIONS_PATH: COMPLETION,
    CHAT_COMPLETIONS_PATH: CHAT,
    RESPONSES_PATH: RESPONSES,
    MESSAGES_PATH: MESSAGES,
}

_MESSAGES_PREFIX = MESSAGES_PATH + "/"


def request_kind(path: str) -> RequestKind | None:
    """The kind of generation request a URL path names (query string ignored), or None for any other path."""
    kind = _KIND_OF_PATH.get(path)  # (a client's path is usually the API's own, as is)
    return kind if kind is not None else _KIND_OF_PATH.get(path.partition("?")[0].rstrip("/"))


def error_style(path: str) -> str:
    """The error body shape of the API a path belongs to: "anthropic" under /v1/messages, else "openai"."""
    if not path.startswith(MESSAGES_PATH):
        return "openai"
    path = path.partition("?")[0]
    return "anthropic" if path == MESSAGES_PATH or path.startswith(_MESSAGES_PREFIX) else "openai"


_ANTHROPIC_ERROR_TYPES = {  # Anthropic's error types by status (its API's errors page)
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "api_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "internal_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable",
}


class OpenAIError(Exception):
    """An error with an HTTP status and OpenAI's body shape {"error": {"message", "type", "param", "code"}}, or with
    `style` "anthropic" Anthropic's {"type": "error", "error": {"type", "message"}} (a /v1/messages request's)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        dropped_reason: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, for a retry-after header (429, 503)
        # why a gateway dropped the request (429, 503): extproc.DROPPED_REASON_HEADER, its status's default when None
        self.dropped_reason = dropped_reason
        self.style = "openai"  # the body's shape: "openai", or "anthropic" for the Messages API (error_style)

    @property
    def type(self) -> str:
        if self.style == "anthropic":
            return _ANTHROPIC_ERROR_TYPES.get(
                self.status, "api_error" if self.status >= 500 else "invalid_request_error"
            )
        return _ERROR_TYPES.get(self.status, "invalid_request_error")

    def to_dict(self) -> dict[str, Any]:
        if self.style == "anthropic":
            return {"type": "error", "error": {"type": self.type, "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")


@dataclass(slots=True)
class CompletionRequest:
    """A validated Completions or Chat request. `prompts` holds the completion prompt(s): text or token ids."""

    kind: RequestKind
    model: str
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # Chat's function tools, as the chat template reads them
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # completions: top-k count; chat: top_logprobs when logprobs is true
    echo: bool = False
    user: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


def _expect(payload: Mapping[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = payload.get(name)
    if value is None:
        return None
    # bool is an int subclass; a JSON true is never a valid number here.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise OpenAIError(f"`{name}` must be {what}, got a boolean", param=name)
    if not isinstance(value, types):
        raise OpenAIError(f"`{name}` must be {what}, got {type(value).__name__}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise OpenAIError(f"`{name}` must be a finite number", param=name)
    return value


def _int_in(payload: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = _expect(payload, name, int, "an integer")
    if value is not None and (value < low or (high is not None and value > high)):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise OpenAIError(f"`{name}` must be {bound}, got {value}", param=name)
    return value


def _float_in(payload: Mapping[str, Any], name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = _expect(payload, name, (int, float), "a number")
    if value is not None and not ((low < value if low_open else low <= value) and value <= high):
        raise OpenAIError(f"`{name}` must be in {'(' if low_open else '['}{low}, {high}], got {value}", param=name)
    return None if value is None else float(value)


def valid_text(value: str, param: str) -> str:
    """A string that is valid Unicode text (JSON can carry lone surrogates, which no tokenizer accepts)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(f"`{param}` contains invalid Unicode (a lone surrogate)", param=param) from None
    return value


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _prompts(payload: Mapping[str, Any]) -> list[str | list[int]]:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return [valid_text(prompt, "prompt")]
    if _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return [valid_text(p, "prompt") if isinstance(p, str) else p for p in prompt]
    if prompt is None:
        raise OpenAIError("`prompt` is required", param="prompt")
    raise OpenAIError("`prompt` must be a string, a list of strings, or a list of token ids", param="prompt")


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return valid_text(content, "messages")
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(
                    f"`messages[{index}].content` parts must be {{'type': 'text', 'text': str}}", param="messages"
                )
            parts.append(valid_text(part["text"], "messages"))
        return "".join(parts)
    raise OpenAIError(f"`messages[{index}].content` must be a string or a list of parts", param="messages")


def _tool_calls(message: Mapping[str, Any], index: int) -> list[dict[str, Any]] | None:
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str)
        for c in calls
    ):
        return calls
    raise OpenAIError(
        f"`messages[{index}].tool_calls` must be a list of {{'function': {{'name': str, 'arguments': str}}}}",
        param="messages",
    )


def chat_messages(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The validated `messages` of a Chat request, each content as text: what the chat template renders (the model
    server's and the EPP's)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("`messages` must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise OpenAIError(f"`messages[{i}]` must be an object", param="messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise OpenAIError(f"`messages[{i}].role` must be one of {sorted(CHAT_ROLES)}", param="messages")
        entry = {**message, "content": _message_text(message.get("content"), i)}
        if _tool_calls(message, i) is None:
            entry.pop("tool_calls", None)  # (a template may test for the key)
        out.append(entry)
    return out


def function_tool(name: Any, description: Any, parameters: Any, param: str) -> dict[str, Any]:
    """One function tool in Chat's shape, from any API's fields: the one form the chat template renders."""
    if not isinstance(name, str) or not name:
        raise OpenAIError(f"`{param}` needs a function name (a non-empty string)", param=param)
    function: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise OpenAIError(f"`{param}` description must be a string", param=param)
        function["description"] = valid_text(description, param)
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise OpenAIError(f"`{param}` parameters must be a JSON schema object", param=param)
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def chat_tools(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The `tools` of a Chat request: function tools, `{"type": "function", "function": {"name", ...}}`."""
    tools = payload.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise OpenAIError("`tools` must be a list", param="tools")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise OpenAIError("`tools` entries must be {'type': 'function', 'function': {...}}", param="tools")
        out.append(
            function_tool(function.get("name"), function.get("description"), function.get("parameters"), "tools")
        )
    return out


def _stop(payload: Mapping[str, Any]) -> list[str]:
    stop = payload.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [valid_text(stop, "stop")] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [valid_text(s, "stop") for s in stop if s]
    raise OpenAIError("`stop` must be a string or a list of strings", param="stop")


_JSON = msgspec.json.Decoder()


def load_json_body(body: bytes | str) -> dict[str, Any]:
    """Decode a request body that must be a JSON object; OpenAIError(400) for anything else.

    msgspec decodes it (~10x faster than the json module for a small body, 2x for a large one); whatever msgspec
    refuses goes to the json module, which decides: it also takes what msgspec does not (NaN, a byte-order mark,
    UTF-16, lone surrogates), so what is accepted, and each error's message, are the json module's."""
    try:
        payload = _JSON.decode(body)
    except Exception:  # msgspec's own errors, UnicodeDecodeError, RecursionError: the json module decides
        payload = _json_module_decode(body)
    if not isinstance(payload, dict):
        raise OpenAIError("request body must be a JSON object")
    return payload


def _json_module_decode(body: bytes | str) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise OpenAIError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # the decoder's depth limit (the interpreter's recursion limit, ~1000 levels)
        raise OpenAIError("request body is nested too deeply") from None


def parse_request(body: bytes | str | Mapping[str, Any], kind: RequestKind) -> CompletionRequest:
    """Validate a Completions or Chat request body. Raises OpenAIError(400) with the offending `param`."""
    payload = dict(body) if isinstance(body, Mapping) else load_json_body(body)
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("`model` is required and must be a non-empty string", param="model")
    request = CompletionRequest(kind=kind, model=model, raw=payload)
    if kind is RequestKind.CHAT:
        request.messages = chat_messages(payload)
        request.tools = chat_tools(payload)
        max_tokens = _int_in(payload, "max_completion_tokens", 1)
        request.max_tokens = max_tokens if max_tokens is not None else _int_in(payload, "max_tokens", 1)
        if _expect(payload, "logprobs", bool, "a boolean"):
            request.logprobs = _int_in(payload, "top_logprobs", 0, MAX_LOGPROBS) or 0
    else:
        request.prompts = _prompts(payload)
        request.max_tokens = _int_in(payload, "max_tokens", 1)
        request.logprobs = _int_in(payload, "logprobs", 0, MAX_LOGPROBS)
        request.echo = bool(_expect(payload, "echo", bool, "a boolean"))
    request.stream = bool(_expect(payload, "stream", bool, "a boolean"))
    options = _expect(payload, "stream_options", dict, "an object")
    if options is not None:
        if not request.stream:
            raise OpenAIError("`stream_options` is only allowed when `stream` is true", param="stream_options")
        request.include_usage = bool(_expect(options, "include_usage", bool, "a boolean"))
    request.min_tokens = _int_in(payload, "min_tokens", 0) or 0
    if request.max_tokens is not None and request.min_tokens > request.max_tokens:
        raise OpenAIError("`min_tokens` must not exceed `max_tokens`", param="min_tokens")
    request.n = _int_in(payload, "n", 1, MAX_N) or 1
    request.temperature = _float_in(payload, "temperature", 0.0, 2.0)
    request.top_p = _float_in(payload, "top_p", 0.0, 1.0, low_open=True)
    top_k = _int_in(payload, "top_k", -1)
    request.top_k = None if top_k in (None, -1, 0) else top_k
    request.seed = _int_in(payload, "seed", -(2**63), 2**64 - 1)
    request.stop = _stop(payload)
    request.ignore_eos = bool(_expect(payload, "ignore_eos", bool, "a boolean"))
    request.user = _expect(payload, "user", str, "a string")
    return request


def chat_transcript(messages: list[Mapping[str, Any]], tools: list[Mapping[str, Any]] | None = None) -> str:
    """A stable, prefix-preserving text of chat messages and tools: what the default chat template renders
    (protocol.tokenizer), without the generation prompt. A conversation that grows by turns keeps its prefix, and
    agents' long tool lists lead it."""
    parts = []
    if tools:
        parts.append("<|tools|>\n")
        parts += [tojson(tool.get("function")) + "\n" for tool in tools]
    for i, m in enumerate(messages):
        parts.append(f"<|{m.get('role')}|>\n{_message_text(m.get('content'), i)}\n")
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping):
                parts.append(f"<|tool_call|>{function.get('name')} {function.get('arguments')}\n")
    return "".join(parts)


def rendered_chat(payload: Mapping[str, Any], kind: RequestKind | None) -> tuple[list[dict], list[dict]]:
    """The chat messages and tools a Chat, Responses or Messages body renders (validated: OpenAIError otherwise),
    as the chat template reads them. (protocol.responses and protocol.anthropic import this module: they are
    imported when first used.)"""
    if kind is RequestKind.RESPONSES:
        from protocol.responses import parse_responses_request

        chat = parse_responses_request(payload, prior=[])
    elif kind is RequestKind.MESSAGES:
        from protocol.anthropic import parse_messages_request

        chat = parse_messages_request(payload, counting=True)
    else:
        return chat_messages(payload), chat_tools(payload)
    return chat.messages, chat.tools


def _agent_api_transcript(payload: Mapping[str, Any], kind: RequestKind) -> str:
    return chat_transcript(*rendered_chat(payload, kind))


def prompt_text(request: CompletionRequest | Mapping[str, Any], kind: RequestKind | None = None) -> str:
    """The text the EPP hashes for prefix affinity: the prompt, or the chat transcript (with the tools and system
    blocks of a Responses or Messages body, as the chat template renders them).

    Accepts a validated request or a raw payload (the EPP does not validate what the model server will) and the
    request's kind (its path; None: told apart by its fields). A body it cannot read gives its JSON text (Chat, a
    Messages body) or "" (a Responses body): the server answers it, and there is no prompt to match.
    Token-id prompts become their decimal ids joined by commas, which is stable and prefix-preserving.
    """
    if isinstance(request, CompletionRequest):
        if request.kind is not COMPLETION:
            return chat_transcript(request.messages, request.tools)
        prompt: Any = request.prompts[0] if len(request.prompts) == 1 else request.prompts
    else:
        if kind is RESPONSES or (kind is None and "messages" not in request and "input" in request):
            try:
                return _agent_api_transcript(request, RESPONSES)
            except OpenAIError:
                return ""
        messages = request.get("messages")
        if isinstance(messages, list):
            try:
                if kind is MESSAGES:
                    return _agent_api_transcript(request, kind)
                try:
                    tools = chat_tools(request)
                except OpenAIError:
                    tools = None
                return chat_transcript([m for m in messages if isinstance(m, Mapping)], tools)
            except OpenAIError:
                return json.dumps(messages, sort_keys=True, separators=(",", ":"))
        prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt):
        return ",".join(map(str, prompt))
    if isinstance(prompt, list):
        return "\n".join(
            p if isinstance(p, str) else ",".join(map(str, p)) for p in prompt if isinstance(p, str | list)
        )
    return ""
