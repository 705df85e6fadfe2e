"""Anthropic's Messages API on the model server's engine, as vLLM's Anthropic endpoint serves it: `POST /v1/messages`
(streamed with Anthropic's events, or not) and `POST /v1/messages/count_tokens`. Errors are in Anthropic's shape
(the server's error middleware, by path). The model's text is one text block; no tool calls are parsed out of it.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from modelserver.engine.request import FinishReason
from protocol.anthropic import parse_messages_request
from protocol.openai import load_json_body

if TYPE_CHECKING:
    from modelserver.api.server import ModelServer


class MessagesAPI:
    def __init__(self, server: ModelServer):
        self.server = server

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/messages", self.create)
        router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def count_tokens(self, request: web.Request) -> web.Response:
        parsed = parse_messages_request(load_json_body(await self.server.read_body(request)), counting=True)
        (ids,) = await self.server._prompt_ids(parsed)
        return web.json_response({"input_tokens": len(ids)})

    async def create(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_messages_request(load_json_body(await self.server.read_body(request)))
        message_id = "msg_" + uuid.uuid4().hex
        choice, deltas = await self.server.start_chat(parsed, message_id)
        head = {"id": message_id, "type": "message", "role": "assistant", "model": parsed.model}
        if not parsed.stream:
            async for _ in deltas:
                pass
            return web.json_response(
                {
                    **head,
                    "content": [{"type": "text", "text": choice.text}],
                    **_stop(choice),
                    "usage": self._usage(choice),
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(kind: str, **fields: Any) -> None:
            payload = json.dumps({"type": kind, **fields}, separators=(",", ":"))
            await response.write(f"event: {kind}\ndata: {payload}\n\n".encode())

        started = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": self._usage(choice)}
        await send("message_start", message=started)
        await send("content_block_start", index=0, content_block={"type": "text", "text": ""})
        await send("ping")
        async for text in deltas:
            await send("content_block_delta", index=0, delta={"type": "text_delta", "text": text})
        await send("content_block_stop", index=0)
        await send("message_delta", delta=_stop(choice), usage={"output_tokens": len(choice.token_ids)})
        await send("message_stop")
        await response.write_eof()
        return response

    def _usage(self, choice) -> dict[str, int]:
        """Anthropic counts the prompt's cached tokens apart: input_tokens are the ones computed."""
        usage = self.server.usage(choice)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": usage["prompt_tokens"] - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": usage["completion_tokens"],
        }


def _stop(choice) -> dict[str, Any]:
    if choice.stop_reason is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": choice.stop_reason}
    reason = "max_tokens" if choice.finish_reason == FinishReason.LENGTH else "end_turn"
    return {"stop_reason": reason, "stop_sequence": None}
