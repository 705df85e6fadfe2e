"""OpenAI's Responses API on the model server's engine, as vLLM serves it: `POST /v1/responses` (streamed with the
Responses event types, or not), `GET` and `DELETE /v1/responses/{id}`.

A response with `store` (the default) keeps its conversation (its input after the instructions, then its output) in
this process, as vLLM does: a follow-up naming it as `previous_response_id` continues from there, here and nowhere
else (the gateway routes it back: docs/agents.md). Unlike vLLM's, the store is bounded: at most
`max_stored_responses` entries and `max_stored_response_bytes` (each entry counted as its response's JSON and the
text its turn added; a conversation shares the earlier turns' strings), the oldest dropped first, counted in
`modelserver:stored_responses_evicted_total`. The model's text is the output message; this server parses no tool
calls out of it (vLLM does so only with a tool parser configured).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from modelserver.engine.request import FinishReason
from protocol.openai import CompletionRequest, load_json_body
from protocol.responses import RESPONSE_ID_PREFIX, check_response_id, parse_responses_request, response_not_found

if TYPE_CHECKING:
    from modelserver.api.server import ModelServer
    from modelserver.metrics import PrometheusStatLogger

log = logging.getLogger("modelserver.api")
ENTRY_OVERHEAD_BYTES = 256  # an entry's objects besides its text: the dicts, the list of the conversation's messages


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages: the earlier turns, this one's input and its output
    size: int


class ResponseStore:
    """Stored responses by id, bounded by count and bytes, the oldest dropped first."""

    def __init__(self, max_count: int, max_bytes: int, metrics: PrometheusStatLogger | None = None):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.metrics = metrics
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], added: list[dict[str, Any]]) -> None:
        """Keep `response` and its conversation; `added` holds the messages this turn brought (what it costs)."""
        size = len(json.dumps(response)) + ENTRY_OVERHEAD_BYTES + 8 * len(conversation) + sum(map(_text_bytes, added))
        if size > self.max_bytes or self.max_count <= 0:
            log.warning("response %s (%d bytes) is over the store's limit; not stored", response["id"], size)
            return
        self.entries[response["id"]] = StoredResponse(response, conversation, size)
        self.bytes += size
        while len(self.entries) > self.max_count or self.bytes > self.max_bytes:
            _, oldest = self.entries.popitem(last=False)
            self.bytes -= oldest.size
            self.evicted += 1
            if self.metrics is not None:
                self.metrics.stored_responses_evicted.inc()
        self._publish()

    def get(self, response_id: str) -> StoredResponse | None:
        return self.entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        self._publish()
        return True

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.stored_responses.set(len(self.entries))
            self.metrics.stored_response_bytes.set(self.bytes)


def _text_bytes(message: dict[str, Any]) -> int:
    calls = message.get("tool_calls")
    return len(message["content"]) + (len(json.dumps(calls)) if calls else 0)


class ResponsesAPI:
    def __init__(self, server: ModelServer, store: ResponseStore):
        self.server = server
        self.store = store

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{response_id}", self.retrieve)
        router.add_delete("/v1/responses/{response_id}", self.delete)

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = check_response_id(request.match_info["response_id"])
        entry = self.store.get(response_id)
        if entry is None:
            raise response_not_found(response_id)
        return web.json_response(entry.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = check_response_id(request.match_info["response_id"])
        if not self.store.delete(response_id):
            raise response_not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = load_json_body(await self.server.read_body(request))
        previous = body.get("previous_response_id")
        prior: list[dict[str, Any]] = []
        if previous is not None:
            entry = self.store.get(check_response_id(previous, "previous_response_id"))
            if entry is None:
                error = response_not_found(previous)
                error.param = "previous_response_id"
                raise error
            prior = entry.conversation
        parsed = parse_responses_request(body, prior)
        turn = Turn(parsed, len(prior) + (1 if body.get("instructions") else 0))
        turn.choice, deltas = await self.server.start_chat(parsed, turn.id)
        if parsed.stream:
            return await self._stream(request, turn, deltas)
        async for _ in deltas:
            pass
        return web.json_response(self._finish(turn))

    def _finish(self, turn: Turn) -> dict[str, Any]:
        """The completed response, stored when the request asks (`store`, true by default)."""
        response = turn.response("completed", [turn.message("completed")], self.server.usage(turn.choice))
        if turn.choice.finish_reason == FinishReason.LENGTH:
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if turn.parsed.raw.get("store", True) is not False:
            added = [*turn.parsed.messages[turn.input_start :], {"role": "assistant", "content": turn.choice.text}]
            conversation = [*turn.parsed.messages[turn.prior_start : turn.input_start], *added]
            self.store.put(response, conversation, added)
        return response

    async def _stream(self, request: web.Request, turn: Turn, deltas) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sequence = 0

        async def send(kind: str, **fields: Any) -> None:
            nonlocal sequence
            payload = json.dumps({"type": kind, "sequence_number": sequence, **fields}, separators=(",", ":"))
            sequence += 1
            await response.write(f"event: {kind}\ndata: {payload}\n\n".encode())

        started = turn.response("in_progress", [], None)
        await send("response.created", response=started)
        await send("response.in_progress", response=started)
        where = {"item_id": turn.message_id, "output_index": 0}
        await send("response.output_item.added", output_index=0, item=turn.message("in_progress", with_text=False))
        await send("response.content_part.added", **where, content_index=0, part=_text_part(""))
        async for text in deltas:
            await send("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
        final = self._finish(turn)
        await send("response.output_text.done", **where, content_index=0, text=turn.choice.text, logprobs=[])
        await send("response.content_part.done", **where, content_index=0, part=_text_part(turn.choice.text))
        await send("response.output_item.done", output_index=0, item=final["output"][0])
        await send("response.completed", response=final)  # (as vLLM ends it, also for an incomplete response)
        await response.write_eof()
        return response


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class Turn:
    """One Responses request being answered: its ids, its parsed request and where its input starts."""

    def __init__(self, parsed: CompletionRequest, input_start: int):
        self.parsed = parsed
        self.id = RESPONSE_ID_PREFIX + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.input_start = input_start  # messages[:input_start]: the instructions, then the stored conversation
        self.prior_start = 1 if parsed.raw.get("instructions") else 0
        self.choice = None

    def message(self, status: str, with_text: bool = True) -> dict[str, Any]:
        content = [_text_part(self.choice.text)] if with_text else []
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        raw = self.parsed.raw
        if usage is not None:
            usage = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.parsed.model,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": raw.get("instructions"),
            "max_output_tokens": raw.get("max_output_tokens"),
            "metadata": raw.get("metadata") or {},
            "output": output,
            "parallel_tool_calls": raw.get("parallel_tool_calls", True),
            "previous_response_id": raw.get("previous_response_id"),
            "reasoning": None,
            "store": raw.get("store", True),
            "temperature": raw.get("temperature", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": raw.get("tool_choice", "auto"),
            "tools": raw.get("tools") or [],
            "top_p": raw.get("top_p", 1.0),
            "truncation": raw.get("truncation", "disabled"),
            "usage": usage,
            "user": raw.get("user"),
        }
