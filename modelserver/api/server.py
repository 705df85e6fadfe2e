"""OpenAI Completions and Chat, model listing, tokenization, LoRA admin, health and metrics, like vLLM's server; the
Responses and Anthropic Messages APIs (`modelserver.api.responses`, `modelserver.api.messages`) on the same engine.

Requests are validated by `protocol.openai` (and `protocol.responses`, `protocol.anthropic`); everything that goes
wrong answers in its API's error shape (OpenAI's; Anthropic's under /v1/messages) with vLLM's status codes, and an
unexpected exception in one handler never affects another request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from modelserver.api.detokenizer import IncrementalDetokenizer
from modelserver.api.messages import MessagesAPI
from modelserver.api.responses import ResponsesAPI, ResponseStore
from modelserver.engine.engine import AsyncEngine, EngineDeadError
from modelserver.engine.lora import LoRAError
from modelserver.engine.request import FinishReason, SamplingParams
from modelserver.lora_files import resolve_adapter_path
from modelserver.metrics import prometheus_logger
from protocol.http_listener import HttpListener
from protocol.limits import ByteBudget, RepeatedWarning
from protocol.openai import (
    CompletionRequest,
    OpenAIError,
    RequestKind,
    error_style,
    load_json_body,
    model_not_found,
    parse_request,
    valid_text,
)
from protocol.tokenizer import Tokenizer
from protocol.tracing import TRACEPARENT_HEADER, TRACESTATE_HEADER

log = logging.getLogger("modelserver.api")
VERSION = "0.1.0"
# A request body must arrive whole within this of its handler's start (nginx gives 60 s between two reads; Envoy,
# the usual client, forwards a body as fast as it gets it): a slower one is answered 408 and its bytes let go.
BODY_SECONDS = 60.0
TOKENIZE_IN_THREAD_CHARS = 4096  # ~1 µs of tokenizing per character: longer texts go to a worker thread
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str
    max_model_len: int
    backend: str = "sim"
    lora_roots: list[str] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    max_request_body_bytes: int = 32 * 1024 * 1024
    max_buffered_body_bytes: int = 256 * 1024 * 1024  # request bodies being received, all connections together
    # open on the server's port at once. Envoy opens a connection for each request in flight to a server (HTTP/1.1),
    # from each worker thread of each gateway pod: a few gateways at a server's --max-num-seqs and its waiting
    # requests stay well under it
    max_connections: int = 4096
    max_stored_responses: int = 4096  # stored Responses (previous_response_id), oldest dropped first
    max_stored_response_bytes: int = 256 * 1024 * 1024
    extra_info: dict = field(default_factory=dict)


def runtime_lora_updating_from_env() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes")


def _error_response(error: OpenAIError, path: str = "") -> web.Response:
    """The error in the shape of the API its path belongs to (error_style)."""
    error.style = error_style(path)
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return web.Response(status=error.status, body=error.to_json(), content_type="application/json", headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except OpenAIError as error:
        return _error_response(error, request.path)
    except EngineDeadError as error:
        return _error_response(OpenAIError(str(error), 503), request.path)
    except web.HTTPException as http:
        if http.status < 400:
            raise
        return _error_response(OpenAIError(http.reason or "error", http.status), request.path)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return _error_response(OpenAIError(f"internal error: {type(exc).__name__}", 500), request.path)


class _Choice:
    """One generated sequence: its engine stream, detokenized text so far, and stop-string handling."""

    __slots__ = (
        "closed",
        "finish_reason",
        "index",
        "logprobs",
        "logprobs_sent",
        "num_cached",
        "num_prompt",
        "request_id",
        "sent",
        "stop_reason",
        "text",
        "token_ids",
    )

    def __init__(self, index: int, request_id: str):
        self.index = index
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []  # per generated token, when asked
        self.logprobs_sent = 0  # how many of them went out in stream chunks
        self.text = ""
        self.sent = 0  # characters already streamed
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None  # the stop string that ended it
        self.closed = False  # the final chunk (with finish_reason) was streamed
        self.num_prompt = 0
        self.num_cached = 0


class ModelServer:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.created = int(time.time())
        self.bodies = ByteBudget(settings.max_buffered_body_bytes)
        self.bodies_refused = RepeatedWarning(
            "modelserver.http",
            "answered 503: request bodies being received hold %d of --max-buffered-body-bytes %d; %d so far",
        )
        self.bodies_late = RepeatedWarning("modelserver.http", "answered 408: a request body took over %g s; %d so far")
        self.listener = HttpListener("the model server's port", "modelserver.http", settings.max_connections)
        self.app = web.Application(middlewares=[self.listener.middleware, openai_errors])
        # aiohttp's keep-alive (3,630 s) outlasts Envoy's upstream idle timeout (1 h): Envoy closes an idle connection
        # first, so it never sends a request on one the server is closing
        self.runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/version", self.version)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/detokenize", self.detokenize)
        self.app.router.add_get("/metrics", self.metrics)
        for path in ("/server_info", "/get_server_info"):
            self.app.router.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            self.app.router.add_get(path, self.model_info)
        self.app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        self.app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        self.app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        store = ResponseStore(
            settings.max_stored_responses, settings.max_stored_response_bytes, prometheus_logger(engine.stat_loggers)
        )
        ResponsesAPI(self, store).add_routes(self.app.router)
        MessagesAPI(self).add_routes(self.app.router)

    async def start(self, host: str, port: int) -> None:
        """Serve on host:port, within the listener's limits (protocol/http_listener.py)."""
        await self.runner.setup()
        await self.listener.start(self.runner.server, host, port, backlog=1024)

    async def stop(self) -> None:
        self.listener.close()
        await self.runner.cleanup()

    async def read_body(self, request: web.Request) -> bytes:
        """The request's body, read within the server's limits: at most max_request_body_bytes (413), arriving whole
        within BODY_SECONDS (408), its bytes counted while it arrives against max_buffered_body_bytes, shared by all
        connections (503 to the request that would go over it). Counted as received, not as declared: a client that
        declares a large body and sends nothing holds no budget. Without these, 375 connections each sending 8 MiB
        of a body and never the rest took the server from 55 MB to 5.5 GB."""
        limit = self.settings.max_request_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise OpenAIError("request body too large", 413)
        chunks: list[bytes] = []
        size = 0
        # a body that came whole with its head (a small one) has nothing to wait for: no timer (10 µs a request)
        arriving = contextlib.nullcontext() if request.content.is_eof() else asyncio.timeout(BODY_SECONDS)
        try:
            async with arriving:
                while chunk := await request.content.readany():
                    if size + len(chunk) > limit:
                        raise OpenAIError("request body too large", 413)
                    if not self.bodies.reserve(len(chunk)):
                        self.bodies_refused.note(self.bodies.held, self.bodies.limit)
                        raise OpenAIError(
                            "the server is receiving too many request bodies at once; retry", 503, retry_after=1
                        )
                    chunks.append(chunk)
                    size += len(chunk)
        except TimeoutError:
            self.bodies_late.note(BODY_SECONDS)
            raise OpenAIError(f"request body not received within {BODY_SECONDS:g} s", 408) from None
        finally:
            self.bodies.release(size)
        return b"".join(chunks)  # a body of one chunk (most) is that chunk, not a copy

    # -- info endpoints ----------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.engine.is_dead:
            return _error_response(OpenAIError("engine is dead", 503))
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def metrics(self, request: web.Request) -> web.Response:
        names = request.query.getall("name[]", None)  # only these samples, as vLLM's prometheus_client app serves
        body = prometheus_logger(self.engine.stat_loggers).render(frozenset(names) if names is not None else None)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        s = self.settings
        base = {
            "id": s.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "modelserver",
            "root": s.model_path,
            "parent": None,
            "max_model_len": s.max_model_len,
        }
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "modelserver",
                "root": path,
                "parent": s.served_model_name,
            }
            for name, path in self.engine.lora_adapters.items()
        ]
        return web.json_response({"object": "list", "data": [base, *adapters]})

    async def server_info(self, request: web.Request) -> web.Response:
        config = self.engine.config
        return web.json_response(
            {
                "model_path": self.settings.model_path,
                "served_model_name": self.settings.served_model_name,
                "backend": self.settings.backend,
                "version": VERSION,
                "max_model_len": config.max_model_len,
                "block_size": config.block_size,
                "num_gpu_blocks": config.num_gpu_blocks,
                "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "enable_prefix_caching": config.enable_prefix_caching,
                "prefix_caching_hash_algo": config.prefix_caching_hash_algo,
                "enable_lora": config.enable_lora,
                "max_loras": config.max_loras,
                **self.settings.extra_info,
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's development endpoint: 200 whether or not the engine could reset (it refuses while requests hold
        blocks, and logs why), as vLLM answers without checking."""
        self.engine.reset_prefix_cache()
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.settings.model_path,
                "tokenizer_path": self.settings.model_path,
                "is_generation": True,
                "served_model_name": self.settings.served_model_name,
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        payload = load_json_body(await self.read_body(request))
        if "messages" in payload:
            chat = parse_request({"model": self.settings.served_model_name, **payload}, RequestKind.CHAT)
            text = self.tokenizer.apply_chat_template(
                chat.messages, payload.get("add_generation_prompt", True) is True, chat.tools
            )
        elif isinstance(payload.get("prompt"), str):
            text = valid_text(payload["prompt"], "prompt")
        else:
            raise OpenAIError("`prompt` (a string) or `messages` is required", param="prompt")
        tokens = await self._encode(text)
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.settings.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        tokens = load_json_body(await self.read_body(request)).get("tokens")
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < self.tokenizer.vocab_size for t in tokens
        ):
            raise OpenAIError("`tokens` must be a list of token ids in the vocabulary", param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    # -- LoRA admin --------------------------------------------------------------------------------------------
    def _check_lora_admin(self) -> None:
        if not self.engine.config.enable_lora:
            raise OpenAIError("LoRA is not enabled on this server (--enable-lora)", 400)
        if not self.settings.allow_runtime_lora_updating:
            raise OpenAIError(
                "runtime LoRA updating is disabled (--allow-runtime-lora-updating or "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                400,
            )

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        self._check_lora_admin()
        payload = load_json_body(await self.read_body(request))
        name = payload.get("lora_name")
        if not isinstance(name, str) or not name or "," in name or name != name.strip():
            raise OpenAIError("`lora_name` must be a non-empty name without commas or spaces", param="lora_name")
        if name == self.settings.served_model_name:
            raise OpenAIError("`lora_name` must differ from the base model's name", param="lora_name")
        path = resolve_adapter_path(payload.get("lora_path"), self.settings.lora_roots)
        try:
            self.engine.add_lora(name, str(path))
        except LoRAError as error:
            raise OpenAIError(str(error), 400, param="lora_name") from None
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        self._check_lora_admin()
        name = load_json_body(await self.read_body(request)).get("lora_name")
        if not isinstance(name, str) or not name:
            raise OpenAIError("`lora_name` is required", param="lora_name")
        try:
            self.engine.remove_lora(name)
        except KeyError:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name") from None
        except LoRAError as error:
            raise OpenAIError(str(error), 400, param="lora_name") from None
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # -- generation --------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, RequestKind.COMPLETION)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, RequestKind.CHAT)

    def _resolve_model(self, model: str) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model; 404 otherwise."""
        if model in (self.settings.served_model_name, self.settings.model_path):
            return None
        if model in self.engine.lora_adapters:
            return model
        raise model_not_found(model)

    async def _encode(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of a prompt: over max_model_len by its length alone -> 400 without tokenizing; long texts are
        tokenized in a worker thread so /metrics and other requests never wait behind them."""
        limit = self.settings.max_model_len
        at_least = -(-len(text) // self.tokenizer.max_chars_per_token)
        if at_least >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has at least "
                f"{at_least} tokens ({len(text)} characters). Please reduce the length of the prompt.",
                param=param,
            )
        if len(text) < TOKENIZE_IN_THREAD_CHARS:
            return self.tokenizer.encode(text)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    async def _prompt_ids(self, parsed: CompletionRequest) -> list[list[int]]:
        if parsed.kind is not RequestKind.COMPLETION:  # Chat, Responses, Messages: the chat template's text
            text = self.tokenizer.apply_chat_template(parsed.messages, tools=parsed.tools)
            return [await self._encode(text, "messages")]
        vocab = self.tokenizer.vocab_size
        prompts = []
        for prompt in parsed.prompts:
            if isinstance(prompt, str):
                prompts.append(await self._encode(prompt))
            elif any(t >= vocab for t in prompt):
                raise OpenAIError(f"token ids must be below the vocabulary size {vocab}", param="prompt")
            else:
                prompts.append(prompt)
        return prompts

    def _sampling_params(self, parsed: CompletionRequest, num_prompt_tokens: int) -> SamplingParams:
        limit = self.settings.max_model_len
        if num_prompt_tokens == 0:
            raise OpenAIError("the prompt is empty", param="prompt")
        if num_prompt_tokens >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens. Please reduce the length of the prompt.",
                param="prompt",
            )
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=parsed.min_tokens,
            temperature=1.0 if parsed.temperature is None else parsed.temperature,
            top_p=1.0 if parsed.top_p is None else parsed.top_p,
            top_k=parsed.top_k,
            seed=parsed.seed,
            ignore_eos=parsed.ignore_eos,
            logprobs=parsed.logprobs,
            n=parsed.n,
        )

    async def _generate(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        if self.engine.is_dead:
            raise OpenAIError("engine is dead", 503)
        parsed = parse_request(await self.read_body(request), kind)
        lora = self._resolve_model(parsed.model)
        sequences = (1 if kind is RequestKind.CHAT else len(parsed.prompts)) * parsed.n
        if sequences > self.engine.config.max_num_seqs:
            raise OpenAIError(
                f"the request asks for {sequences} sequences (prompts x n); this server runs at most "
                f"{self.engine.config.max_num_seqs} at once (--max-num-seqs)",
                param="n",
            )
        prompt_ids = await self._prompt_ids(parsed)
        params = [self._sampling_params(parsed, len(ids)) for ids in prompt_ids]
        trace = None  # the trace context the engine's spans continue, when it traces
        if self.engine.tracer is not None:
            trace = {n: request.headers[n] for n in (TRACEPARENT_HEADER, TRACESTATE_HEADER) if n in request.headers}
        base_id = ("chatcmpl-" if kind is RequestKind.CHAT else "cmpl-") + uuid.uuid4().hex
        choices, streams = [], []
        for p, ids in enumerate(prompt_ids):
            for j in range(parsed.n):
                choice = _Choice(p * parsed.n + j, f"{base_id}-{p}-{j}")
                choices.append(choice)
                streams.append(self._run_choice(choice, ids, params[p], lora, parsed.stop, trace))
        if parsed.stream:
            return await self._stream(request, parsed, base_id, choices, streams)
        try:
            await asyncio.gather(*(self._drain(s) for s in streams))
        except (ValueError, KeyError) as error:
            raise OpenAIError(str(error)) from None
        return web.json_response(self._full_response(parsed, base_id, choices))

    async def start_chat(self, parsed: CompletionRequest, request_id: str) -> tuple[_Choice, AsyncIterator[str]]:
        """One sequence of a Responses or Messages request: its choice and its text deltas. The first step runs
        before this returns, so that bad input is an error with a status, not a broken stream."""
        if self.engine.is_dead:
            raise OpenAIError("engine is dead", 503)
        lora = self._resolve_model(parsed.model)
        (prompt_ids,) = await self._prompt_ids(parsed)
        params = self._sampling_params(parsed, len(prompt_ids))
        choice = _Choice(0, request_id)
        steps = self._run_choice(choice, prompt_ids, params, lora, parsed.stop)
        try:
            await anext(steps)
        except StopAsyncIteration:
            pass
        except (ValueError, KeyError) as error:
            await steps.aclose()
            raise OpenAIError(str(error)) from None
        return choice, self._deltas(choice, steps)

    @staticmethod
    async def _deltas(choice: _Choice, steps: AsyncIterator[None]) -> AsyncIterator[str]:
        """The choice's new text after each step (an incomplete UTF-8 character waits for the next token); the engine
        request is aborted when the consumer stops early (the client went away)."""
        try:
            while True:
                text = choice.text[choice.sent :]
                if choice.finish_reason is None and text.endswith("\ufffd"):
                    text = text[:-1]
                if text:
                    choice.sent += len(text)
                    yield text
                try:
                    await anext(steps)
                except StopAsyncIteration:
                    break
        finally:
            await steps.aclose()
            if choice.finish_reason is None:
                choice.finish_reason = FinishReason.ABORT

    def usage(self, choice: _Choice) -> dict:
        return self._usage([choice])

    @staticmethod
    async def _drain(stream: AsyncIterator[None]) -> None:
        async for _ in stream:
            pass

    async def _run_choice(
        self,
        choice: _Choice,
        prompt_ids: list[int],
        params: SamplingParams,
        lora: str | None,
        stop: list[str],
        trace: dict[str, str] | None = None,
    ) -> AsyncIterator[None]:
        """Drive one engine request, keeping `choice.text` current; yields after each step's new text."""
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode, stop, choice.token_ids)
        engine = self.engine
        async for output in engine.generate(choice.request_id, prompt_ids, params, lora, trace):
            choice.num_prompt, choice.num_cached = output.num_prompt_tokens, output.num_cached_tokens
            if output.new_logprobs:
                choice.logprobs += output.new_logprobs
            stopped = detokenizer.append(output.new_token_ids, final=output.finished)
            choice.text = detokenizer.text
            if stopped:
                choice.finish_reason = FinishReason.STOP
                choice.stop_reason = detokenizer.stop_reason
                engine.abort(choice.request_id, FinishReason.STOP)
                yield None
                return
            if output.finished:
                choice.finish_reason = output.finish_reason
            yield None

    def _logprobs(self, chat: bool, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict | None:
        """OpenAI's logprobs object for these tokens: chat `{"content": [...]}`, completions parallel lists."""
        if not logprobs:
            return None
        decode = self.tokenizer.decode
        pairs = list(zip(token_ids, logprobs, strict=False))
        if chat:

            def entry(token: int, logprob: float) -> dict:
                text = decode([token])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {
                "content": [
                    {**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in lp.items() if k != t]}
                    for t, lp in pairs
                ]
            }
        texts = [decode([t]) for t, _ in pairs]
        offsets = [sum(len(s) for s in texts[:i]) for i in range(len(texts))]
        return {
            "tokens": texts,
            "token_logprobs": [lp[t] for t, lp in pairs],
            "top_logprobs": [{decode([k]): v for k, v in lp.items()} for _, lp in pairs],
            "text_offset": offsets,
        }

    def _usage(self, choices: list[_Choice]) -> dict:
        seen: dict[str, tuple[int, int]] = {}
        for c in choices:  # prompts are counted once per distinct prompt, like OpenAI with n > 1
            seen.setdefault(c.request_id.rsplit("-", 1)[0], (c.num_prompt, c.num_cached))
        prompt_tokens = sum(p for p, _ in seen.values())
        cached = sum(c for _, c in seen.values())
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _full_response(self, parsed: CompletionRequest, base_id: str, choices: list[_Choice]) -> dict:
        if parsed.kind is RequestKind.CHAT:
            items = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(True, c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ]
            obj = "chat.completion"
        else:
            items = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._logprobs(False, c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ]
            obj = "text_completion"
        return {
            "id": base_id,
            "object": obj,
            "created": int(time.time()),
            "model": parsed.model,
            "choices": items,
            "usage": self._usage(choices),
        }

    async def _stream(
        self,
        request: web.Request,
        parsed: CompletionRequest,
        base_id: str,
        choices: list[_Choice],
        streams: list[AsyncIterator[None]],
    ) -> web.StreamResponse:
        chat = parsed.kind is RequestKind.CHAT
        created = int(time.time())
        head = {
            "id": base_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": parsed.model,
        }
        updates: asyncio.Queue[tuple[_Choice, BaseException | None]] = asyncio.Queue()

        async def pump(choice: _Choice, stream: AsyncIterator[None]) -> None:
            try:
                async for _ in stream:
                    updates.put_nowait((choice, None))
                updates.put_nowait((choice, StopAsyncIteration()))
            except Exception as exc:
                updates.put_nowait((choice, exc))

        # Start the first engine request before the headers so that input errors still get a proper status.
        first_update = None
        tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(choices, streams, strict=True)]
        response = None
        try:
            first_update = await updates.get()
            if isinstance(first_update[1], (ValueError, KeyError)):
                raise OpenAIError(str(first_update[1]))
            if isinstance(first_update[1], EngineDeadError):
                raise first_update[1]
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            if chat:
                for c in choices:
                    delta = {"role": "assistant", "content": ""}
                    await self._send(
                        response,
                        {
                            **head,
                            "choices": [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}],
                        },
                    )
            remaining = len(choices)
            update = first_update
            while True:
                choice, event = update
                if event is not None:  # the choice's stream ended, normally or by an error
                    remaining -= 1
                    if not isinstance(event, StopAsyncIteration):
                        choice.finish_reason = choice.finish_reason or FinishReason.ABORT
                if not choice.closed:
                    text = choice.text[choice.sent :]
                    finish = choice.finish_reason
                    if finish is None and text.endswith("\ufffd"):  # incomplete UTF-8: wait for the next token
                        text = text[:-1]
                    if text or finish:
                        choice.sent += len(text)
                        choice.closed = finish is not None
                        new = slice(choice.logprobs_sent, len(choice.logprobs))
                        choice.logprobs_sent = new.stop
                        logprobs = self._logprobs(chat, choice.token_ids[new], choice.logprobs[new])
                        item = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish}
                        if finish is not None:
                            item["stop_reason"] = choice.stop_reason
                        if chat:
                            item["delta"] = {"content": text} if text else {}
                        else:
                            item["text"] = text
                        await self._send(response, {**head, "choices": [item]})
                if remaining == 0:
                    break
                update = await updates.get()
            if parsed.include_usage:
                await self._send(response, {**head, "choices": [], "usage": self._usage(choices)})
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()

    @staticmethod
    async def _send(response: web.StreamResponse, payload: dict) -> None:
        await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
