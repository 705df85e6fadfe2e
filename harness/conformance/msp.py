"""The Model Server Protocol suite (Gateway API Inference Extension, docs/proposals/003-model-server-protocol):
OpenAI Completions and Chat, the metrics the EPP scrapes, LoRA serving, prefix caching, and vLLM's KV cache events
(what precise prefix routing subscribes to). Black-box: it talks HTTP to the server under test, and ZMQ to its KV
event publisher when told where, so it runs against ours, vLLM, SGLang or a simulator alike."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from harness.conformance.framework import CheckFailed, Level, Skip, Suite, expect
from protocol.kv_events import (
    DEFAULT_HASH_ALGO,
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    request_block_hashes,
)
from protocol.metrics import (
    LABEL_BLOCK_SIZE,
    LABEL_MAX_LORA,
    LABEL_NUM_GPU_BLOCKS,
    LABEL_RUNNING_LORA_ADAPTERS,
    LABEL_WAITING_LORA_ADAPTERS,
    EndpointMetrics,
    MetricsParseError,
    MetricSpec,
    engine_spec,
    parse_metrics,
    sample_filter_query,
)

suite = Suite("ModelServerProtocol")
MUST, SHOULD = Level.MUST, Level.SHOULD
LOAD_TOKENS = 256  # output tokens of the long requests that load the server


@dataclass
class KVEventsTarget:
    """How the suite reaches a server's KV event publisher (vLLM's `--kv-events-config`)."""

    endpoint: str  # the suite's SUB socket connects here (the server binds, `tcp://*:5557`) ...
    bind: bool = False  # ... or binds here and the server connects to it (llm-d points vLLM at its EPP)
    replay_endpoint: str | None = None  # the server's replay ROUTER
    topic: str = ""  # subscribe to topics starting with this
    hash_seed: str | None = None  # the server's PYTHONHASHSEED: with it, block hashes are checked exactly
    hash_algo: str = DEFAULT_HASH_ALGO  # the server's --prefix-caching-hash-algo


@dataclass
class Target:
    url: str
    model: str
    engine: str = "vllm"
    lora_adapters: list[str] = field(default_factory=list)
    load_requests: int = 32
    session: aiohttp.ClientSession | None = None
    kv: KVEventsTarget | None = None  # where the server's KV events are; None: the KV event checks are skipped

    async def post(self, path: str, body: dict | bytes) -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()

    async def json_post(self, path: str, body: dict) -> dict:
        status, payload = await self.post(path, body)
        expect(status == 200, f"POST {path} answered {status}: {payload[:300]!r}")
        return json.loads(payload)

    async def stream(self, path: str, body: dict) -> tuple[list[dict], list[str], float]:
        """SSE events as JSON, the raw `data:` payloads, and the time to the first byte of the stream. Checks the
        framing: every event is `data: ...` lines ended by a blank line (comment lines `:` allowed)."""
        started = time.monotonic()
        first = 0.0
        chunks = []
        async with self.session.post(self.url + path, json={**body, "stream": True}) as r:
            expect(r.status == 200, f"streaming POST {path} answered {r.status}")
            expect(r.headers.get("Content-Type", "").startswith("text/event-stream"), "stream is not text/event-stream")
            async for chunk in r.content.iter_any():
                first = first or time.monotonic() - started
                chunks.append(chunk)
        text = b"".join(chunks).decode().replace("\r\n", "\n")
        expect(text.endswith("\n\n"), f"the stream does not end with a blank line: {text[-80:]!r}")
        events, raw = [], []
        for block in text[:-2].split("\n\n"):
            lines = [line for line in block.split("\n") if not line.startswith(":")]
            expect(lines and all(line.startswith("data:") for line in lines), f"not an SSE data event: {block[:100]!r}")
            payload = "\n".join(line[5:].removeprefix(" ") for line in lines)
            raw.append(payload)
            if payload != "[DONE]":
                try:
                    events.append(json.loads(payload))
                except json.JSONDecodeError:
                    raise CheckFailed(f"an SSE event's data is not one JSON object: {payload[:120]!r}") from None
        return events, raw, first

    async def metrics_text(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            expect(r.status == 200, f"GET /metrics answered {r.status}")
            return await r.text()

    async def metrics(self) -> EndpointMetrics:
        return parse_metrics(await self.metrics_text(), self.engine)

    def long_request(self, model: str | None = None, prompt: str = "Tell a long story.") -> dict:
        return {
            "model": model or self.model,
            "prompt": prompt,
            "max_tokens": LOAD_TOKENS,
            "ignore_eos": True,
            "min_tokens": LOAD_TOKENS,
        }


def open_session() -> aiohttp.ClientSession:
    """The suite's HTTP session: no connection limit, since the load checks need hundreds of requests at once."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), connector=aiohttp.TCPConnector(limit=0))


class NotAModelServer(Exception):
    """What is at a URL is not an OpenAI-compatible model server: the message says what answered and the fix."""


def base_url(url: str) -> str:
    """`url` without a trailing slash; NotAModelServer when it is not an http(s)://host[:port] URL."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        example = url if "://" in url else f"http://{url}"
        raise NotAModelServer(f"{url!r} is not an http:// URL of a model server (write it as {example})")
    try:
        _ = parsed.port  # a ValueError when it is not a number in 0..65535
    except ValueError:
        raise NotAModelServer(f"{url!r}: the port is not a number in 1..65535") from None
    return url.rstrip("/")


async def list_models(session: aiohttp.ClientSession, url: str, timeout: float = 10.0) -> list[dict]:
    """GET /v1/models's entries; NotAModelServer, naming what answered instead, when there are none to read."""
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            body = await r.read()
            kind = r.content_type
    except aiohttp.ClientConnectorError as exc:
        reason = exc.os_error.strerror if exc.os_error is not None and exc.os_error.strerror else str(exc)
        raise NotAModelServer(
            f"nothing answers at {url} ({reason}): start the model server, or fix the host and port"
        ) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise NotAModelServer(f"{url}: GET /v1/models failed ({type(exc).__name__}: {exc})") from None
    except TimeoutError:
        raise NotAModelServer(f"{url}: no answer to GET /v1/models within {timeout:g} s") from None
    if r.status != 200:
        raise NotAModelServer(
            f"{url}: GET /v1/models answered HTTP {r.status} ({kind}): not an OpenAI-compatible model server "
            "(vLLM, SGLang, `modelserver`)? Check the port"
        )
    try:
        data = json.loads(body)["data"]
        if not isinstance(data, list) or not data or not all(isinstance(m.get("id"), str) for m in data):
            raise ValueError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise NotAModelServer(
            f"{url}: GET /v1/models did not list models ({body[:80]!r}): not an OpenAI-compatible model server?"
        ) from None
    return data


async def default_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first base model (not a LoRA adapter) of GET /v1/models; NotAModelServer when it lists none."""
    data = await list_models(session, url)
    base = [m["id"] for m in data if not m.get("parent")]
    return (base or [data[0]["id"]])[0]


async def served_adapters(session: aiohttp.ClientSession, url: str, model: str) -> list[str]:
    """The LoRA adapters GET /v1/models lists on top of `model` (vLLM: entries whose `parent` is the base model),
    so the LoRA checks run without naming adapters by hand."""
    return [m["id"] for m in await list_models(session, url) if m.get("parent") == model]


def _usage_adds_up(usage: dict) -> None:
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        expect(isinstance(usage.get(key), int), f"usage.{key} is missing or not an integer: {usage}")
    expect(
        usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"usage does not add up: {usage}"
    )


def _envelope(body: dict, t: Target, model: str | None = None) -> None:
    expect(isinstance(body.get("id"), str) and body["id"], f"no string id: {str(body)[:200]}")
    expect(isinstance(body.get("created"), int), f"created is not an integer: {body.get('created')!r}")
    expect(body.get("model") == (model or t.model), f"model is {body.get('model')!r}, not {model or t.model!r}")


def _error_shape(payload: bytes) -> None:
    body = json.loads(payload)
    error = body.get("error") if isinstance(body, dict) else None
    expect(isinstance(error, dict) and isinstance(error.get("message"), str), f"not an OpenAI error body: {body}")
    expect("type" in error, f"error has no `type`: {body}")


@suite.check("completions", MUST, "POST /v1/completions answers a well-formed text_completion with usage")
async def completions(t: Target) -> None:
    body = await t.json_post("/v1/completions", {"model": t.model, "prompt": "Say hello.", "max_tokens": 8})
    expect(body.get("object") == "text_completion", f"object is {body.get('object')!r}")
    _envelope(body, t)
    choice = body["choices"][0]
    expect(isinstance(choice.get("text"), str), "choices[0].text is not a string")
    expect(choice.get("finish_reason") in ("stop", "length"), f"finish_reason {choice.get('finish_reason')!r}")
    _usage_adds_up(body["usage"])
    expect(body["usage"]["completion_tokens"] <= 8, "more tokens than max_tokens")


@suite.check("completions-streaming", MUST, "streamed completions are SSE chunks ending with data: [DONE]")
async def completions_streaming(t: Target) -> None:
    events, raw, _ = await t.stream("/v1/completions", {"model": t.model, "prompt": "Count to five.", "max_tokens": 8})
    expect(raw and raw[-1] == "[DONE]", "the stream does not end with data: [DONE]")
    expect(events and all(e.get("object") == "text_completion" for e in events), "chunks are not text_completion")
    expect(any(c.get("finish_reason") for e in events for c in e.get("choices", [])), "no chunk has a finish_reason")
    expect(len({e.get("id") for e in events}) == 1, "the chunks of one stream carry different ids")


@suite.check("chat-completions", MUST, "POST /v1/chat/completions answers a well-formed chat.completion")
async def chat(t: Target) -> None:
    body = await t.json_post(
        "/v1/chat/completions",
        {"model": t.model, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]},
    )
    expect(body.get("object") == "chat.completion", f"object is {body.get('object')!r}")
    _envelope(body, t)
    message = body["choices"][0]["message"]
    expect(message.get("role") == "assistant" and isinstance(message.get("content"), str), f"bad message {message}")
    _usage_adds_up(body["usage"])


@suite.check("chat-completions-streaming", MUST, "streamed chat: chunks, the first delta carries the role, [DONE]")
async def chat_streaming(t: Target) -> None:
    events, raw, _ = await t.stream(
        "/v1/chat/completions", {"model": t.model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    )
    expect(raw and raw[-1] == "[DONE]", "the stream does not end with data: [DONE]")
    expect(all(e.get("object") == "chat.completion.chunk" for e in events), "chunks are not chat.completion.chunk")
    expect(events[0]["choices"][0]["delta"].get("role") == "assistant", "the first delta does not carry the role")


@suite.check("streaming-usage", SHOULD, "stream_options.include_usage adds a final chunk with usage")
async def streaming_usage(t: Target) -> None:
    events, _, _ = await t.stream(
        "/v1/completions",
        {"model": t.model, "prompt": "Hi", "max_tokens": 4, "stream_options": {"include_usage": True}},
    )
    expect(events and events[-1].get("usage"), "no usage chunk at the end")
    expect(events[-1].get("choices") == [], "the usage chunk has choices")
    _usage_adds_up(events[-1]["usage"])


@suite.check("error-shape", MUST, "invalid input answers 400 with an OpenAI error body")
async def error_shape(t: Target) -> None:
    status, payload = await t.post("/v1/completions", {"model": t.model, "prompt": "x", "max_tokens": "many"})
    expect(status == 400, f"wrong type for max_tokens answered {status}")
    _error_shape(payload)
    status, payload = await t.post("/v1/completions", b"{not json")
    expect(status == 400, f"malformed JSON answered {status}")


@suite.check("unknown-model", MUST, "a model the server does not serve answers 404 with an OpenAI error body")
async def unknown_model(t: Target) -> None:
    status, payload = await t.post("/v1/completions", {"model": "no-such-model-xyz", "prompt": "x", "max_tokens": 2})
    expect(status == 404, f"unknown model answered {status}")
    _error_shape(payload)


@suite.check(
    "responses-stored",
    SHOULD,
    "POST /v1/responses answers a response, GET /v1/responses/{id} returns it, and a follow-up naming it as "
    "previous_response_id holds its conversation (vLLM's Responses API)",
)
async def responses_stored(t: Target) -> None:
    first = await t.json_post("/v1/responses", {"model": t.model, "input": "Say hello.", "max_output_tokens": 4})
    expect(first.get("object") == "response" and str(first.get("id")).startswith("resp_"), f"not a response: {first}")
    async with t.session.get(f"{t.url}/v1/responses/{first['id']}") as r:
        expect(
            r.status == 200 and (await r.json()).get("id") == first["id"], f"GET of the response answered {r.status}"
        )
    body = {"model": t.model, "previous_response_id": first["id"], "input": "Again.", "max_output_tokens": 2}
    follow_up = await t.json_post("/v1/responses", body)
    seen = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    expect(follow_up["usage"]["input_tokens"] > seen, "the follow-up's prompt does not hold the stored conversation")
    status, payload = await t.post("/v1/responses", {**body, "previous_response_id": "resp_no_such_response"})
    expect(status == 404, f"an unknown previous_response_id answered {status}")
    _error_shape(payload)


@suite.check("anthropic-messages", SHOULD, "POST /v1/messages answers an Anthropic message, errors in its shape")
async def anthropic_messages(t: Target) -> None:
    message = await t.json_post(
        "/v1/messages", {"model": t.model, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]}
    )
    expect(message.get("type") == "message" and message.get("role") == "assistant", f"not a message: {message}")
    expect(message["content"][0].get("type") == "text" and message["usage"]["output_tokens"] <= 4, str(message))
    status, payload = await t.post("/v1/messages", {"model": t.model, "messages": [{"role": "user", "content": "x"}]})
    error = json.loads(payload)
    expect(status == 400 and error.get("type") == "error" and "message" in error.get("error", {}), f"{status} {error}")


@suite.check(
    "openai-sdk",
    MUST,
    "the official OpenAI Python SDK reads completions and chat, streamed and not, "
    "and maps errors to its exception types",
)
async def openai_sdk(t: Target) -> None:
    import openai  # here only: the SDK is most of the import time of epp-local, which imports this module

    async with openai.AsyncOpenAI(base_url=t.url + "/v1", api_key="conformance", max_retries=0) as client:
        completion = await client.completions.create(model=t.model, prompt="Say hello.", max_tokens=4)
        expect(isinstance(completion.choices[0].text, str), "SDK: completion text is not a string")
        expect(completion.usage and completion.usage.total_tokens > 0, "SDK: completion usage missing")
        stream = await client.completions.create(model=t.model, prompt="Hi", max_tokens=4, stream=True)
        chunks = [chunk async for chunk in stream]
        expect(chunks and any(c.choices and c.choices[0].finish_reason for c in chunks), "SDK: no finish_reason")
        messages = [{"role": "user", "content": "Say hello."}]
        chat = await client.chat.completions.create(model=t.model, messages=messages, max_tokens=4)
        expect(chat.choices[0].message.role == "assistant", "SDK: chat message role is not assistant")
        stream = await client.chat.completions.create(model=t.model, messages=messages, max_tokens=4, stream=True)
        deltas = [c.choices[0].delta for c in [chunk async for chunk in stream] if c.choices]
        expect(deltas and deltas[0].role == "assistant", "SDK: the first chat delta has no assistant role")
        try:
            await client.completions.create(model="no-such-model-xyz", prompt="x", max_tokens=2)
            raise CheckFailed("SDK: an unknown model raised no error")
        except openai.NotFoundError:
            pass
        try:
            await client.completions.create(model=t.model, prompt="x", max_tokens=-1)
            raise CheckFailed("SDK: max_tokens=-1 raised no error")
        except openai.BadRequestError:
            pass


def _families(text: str) -> dict[str, str]:
    """Metric family name -> TYPE, from the Prometheus text parser (which also proves the page well-formed)."""
    try:
        return {f.name: f.type for f in text_string_to_metric_families(text)}
    except ValueError as exc:
        raise CheckFailed(f"the metrics page is not valid Prometheus text: {exc}") from None


def _samples(text: str, spec: MetricSpec) -> list[tuple[dict, float]]:
    """Raw (labels, value) of one metric, unclamped (parse_metrics clamps KV usage, which would hide a bad one)."""
    out = []
    for line in text.splitlines():
        if line.startswith(spec.name) and (match := _SAMPLE.match(line)) and match.group(1) == spec.name:
            labels = dict(_LABEL.findall(match.group(2) or ""))
            if spec.matches(labels):
                out.append((labels, float(match.group(3))))
    return out


_SAMPLE = re.compile(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@suite.check("metrics-gauges", MUST, "/metrics parses; the three MUST gauges (queued, running, KV usage) are gauges")
async def metrics_gauges(t: Target) -> None:
    text = await t.metrics_text()
    families = _families(text)
    try:
        parse_metrics(text, t.engine)
    except MetricsParseError as exc:
        raise CheckFailed(f"protocol.metrics cannot read the page for engine {t.engine}: {exc}") from None
    spec = engine_spec(t.engine)
    for alternatives in (spec.waiting, spec.running, spec.kv_usage):
        present = [a for a in alternatives if _samples(text, a)]
        kind = families.get(present[0].name)
        expect(kind == "gauge", f"{present[0].name} has TYPE {kind}, not gauge")
    kv = [v for _, v in _samples(text, present[0])]
    expect(all(0.0 <= v <= 1.0 for v in kv), f"KV usage {kv} is not a fraction in [0, 1]")


@suite.check(
    "metrics-sample-filter",
    SHOULD,
    "/metrics?name[]=... serves only the samples named (prometheus_client's exposition does): what the EPP asks for",
)
async def metrics_sample_filter(t: Target) -> None:
    names = engine_spec(t.engine).sample_names()
    async with t.session.get(f"{t.url}/metrics?{sample_filter_query(names)}") as r:
        status, text = r.status, await r.text()
    expect(status == 200, f"/metrics with name[] parameters answered {status}: the EPP falls back to whole pages")
    try:
        parse_metrics(text, t.engine)
    except MetricsParseError as exc:
        raise CheckFailed(f"the filtered page does not read ({exc}): the EPP falls back to whole pages") from None
    try:
        served = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    except ValueError as exc:
        raise CheckFailed(f"the filtered page is not valid Prometheus text: {exc}") from None
    extra = sorted(served - set(names))
    expect(
        not extra,
        f"{len(extra)} samples not asked for (e.g. {extra[0] if extra else ''}): name[] is ignored, so every scrape"
        f" carries the whole page ({len(text)} bytes)",
    )


@suite.check(
    "metrics-under-load",
    MUST,
    "waiting and running rise under concurrent long requests and fall back after; KV usage stays in [0, 1] and rises",
)
async def metrics_under_load(t: Target) -> None:
    idle = await t.metrics()
    peak = await _escalate(t, lambda i: t.model, lambda p: p.running > 0 and p.waiting > 0 and p.kv_max > idle.kv_usage)
    expect(peak.running > 0, "num running never rose above 0 under load")
    expect(peak.waiting > 0, f"num waiting never rose with up to {peak.requests} concurrent requests")
    expect(peak.kv_min >= 0.0 and peak.kv_max <= 1.0, f"KV usage left [0, 1]: {peak.kv_min}..{peak.kv_max}")
    expect(peak.kv_max > idle.kv_usage, f"KV usage did not rise under load (idle {idle.kv_usage}, peak {peak.kv_max})")
    await _back_to_idle(t, idle)


@dataclass
class Peak:
    """The extremes the metrics reached while a load ran."""

    requests: int = 0
    running: int = 0
    waiting: int = 0
    kv_max: float = 0.0
    kv_min: float = 1.0
    running_adapters: set[str] = field(default_factory=set)
    waiting_adapters: set[str] = field(default_factory=set)


async def _load(t: Target, models: list[str], goal: Callable[[Peak], bool]) -> Peak:
    """Send one long request per entry of `models` at once and sample /metrics until `goal` holds (then the load
    is cancelled: the server sees client disconnects) or every request finished."""
    peak = Peak(requests=len(models))
    kv_specs = engine_spec(t.engine).kv_usage
    load = [asyncio.create_task(t.post("/v1/completions", t.long_request(m))) for m in models]
    try:
        deadline = time.monotonic() + 60
        while not all(task.done() for task in load) and time.monotonic() < deadline:
            text = await t.metrics_text()
            m = parse_metrics(text, t.engine)
            kv = [v for spec in kv_specs for _, v in _samples(text, spec)]
            peak.running = max(peak.running, m.running)
            peak.waiting = max(peak.waiting, m.waiting)
            peak.kv_max = max([peak.kv_max, *kv])
            peak.kv_min = min([peak.kv_min, *kv])
            peak.running_adapters |= m.running_adapters
            peak.waiting_adapters |= m.waiting_adapters
            if goal(peak):
                return peak
            await asyncio.sleep(0.02)
        failed = [task.result()[0] for task in load if task.done() and task.result()[0] != 200]
        expect(not failed, f"load requests failed: {sorted(set(failed))}")
    finally:
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    return peak


async def _escalate(t: Target, model_of: Callable[[int], str], goal: Callable[[Peak], bool]) -> Peak:
    """Load the server with --load-requests concurrent long requests, then 4x as many, up to 64x, until `goal`
    holds: enough to pass any batch limit (max_num_seqs) so requests must queue."""
    count = t.load_requests
    while True:
        peak = await _load(t, [model_of(i) for i in range(count)], goal)
        if goal(peak) or count >= t.load_requests * 64:
            return peak
        count *= 4


async def _back_to_idle(t: Target, idle: EndpointMetrics, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        m = await t.metrics()
        if m.running <= idle.running and m.waiting <= idle.waiting:
            return
        expect(
            time.monotonic() < deadline,
            f"{seconds:.0f}s after the load ended: running {m.running}, "
            f"waiting {m.waiting} (idle: {idle.running}, {idle.waiting})",
        )
        await asyncio.sleep(0.05)


def _cache_info(text: str, engine: str) -> dict[str, str]:
    spec = engine_spec(engine)
    if spec.cache_info is None:
        return {}
    match = re.search(rf"^{re.escape(spec.cache_info.name)}\{{([^}}]*)\}}", text, re.MULTILINE)
    return dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) if match else {}


@suite.check("cache-config-info", SHOULD, "cache_config_info publishes integer block_size and num_gpu_blocks")
async def cache_config(t: Target) -> None:
    spec = engine_spec(t.engine)
    if spec.cache_info is None:
        raise Skip(f"engine {t.engine} defines no cache info metric")
    labels = _cache_info(await t.metrics_text(), t.engine)
    if not labels:
        raise Skip(f"{spec.cache_info.name} is not published (optional)")
    for key in (LABEL_BLOCK_SIZE, LABEL_NUM_GPU_BLOCKS):
        expect(labels.get(key, "").isdigit(), f"{key}={labels.get(key)!r} is not an integer")


def _need_lora(t: Target) -> MetricSpec:
    if not t.lora_adapters:
        raise Skip("the server lists no LoRA adapter in /v1/models and none was given (--lora-adapter)")
    spec = engine_spec(t.engine).lora_info
    if spec is None:
        raise Skip(f"engine {t.engine} defines no LoRA info metric")
    return spec


@suite.check("lora-served", MUST, "a request naming a LoRA adapter in `model` is served")
async def lora_served(t: Target) -> None:
    _need_lora(t)
    for adapter in t.lora_adapters:
        body = await t.json_post("/v1/completions", {"model": adapter, "prompt": "Hi", "max_tokens": 4})
        _usage_adds_up(body["usage"])


@suite.check("lora-info-metric", MUST, "lora_requests_info is a gauge valued with a recent timestamp; integer max_lora")
async def lora_info(t: Target) -> None:
    spec = _need_lora(t)
    await t.post("/v1/completions", {"model": t.lora_adapters[0], "prompt": "Hi", "max_tokens": 2})
    text = await t.metrics_text()
    kind = _families(text).get(spec.name)
    expect(kind == "gauge", f"{spec.name} has TYPE {kind}, not gauge")
    series = _samples(text, spec)
    expect(series, f"{spec.name} has no series")
    labels, newest = max(series, key=lambda s: s[1])
    expect(abs(newest - time.time()) < 600, f"{spec.name} value {newest} is not a recent Unix timestamp")
    expect(labels.get(LABEL_MAX_LORA, "").isdigit(), f"max_lora={labels.get(LABEL_MAX_LORA)!r} is not an integer")


@suite.check("lora-running-adapters", MUST, "an adapter is listed in running_lora_adapters while its requests run")
async def lora_running(t: Target) -> None:
    _need_lora(t)
    adapter = t.lora_adapters[0]
    peak = await _load(t, [adapter] * 4, lambda p: adapter in p.running_adapters)
    expect(adapter in peak.running_adapters, f"{adapter} never appeared in running_lora_adapters")


@suite.check("lora-waiting-adapters", MUST, "an adapter whose requests cannot run yet shows in waiting_lora_adapters")
async def lora_waiting(t: Target) -> None:
    # Two ways to make adapter requests wait, used together: requests for all the given adapters at once (more
    # adapters than max_lora cannot share a batch), and more concurrent requests than the batch holds.
    _need_lora(t)
    adapters = t.lora_adapters
    peak = await _escalate(t, lambda i: adapters[i % len(adapters)], lambda p: p.waiting_adapters & set(adapters))
    expect(
        peak.waiting_adapters & set(adapters),
        f"no adapter appeared in waiting_lora_adapters with up to {peak.requests} concurrent requests",
    )


@suite.check("lora-names-clean", MUST, "adapter lists are comma-separated names, none empty or with inner spaces")
async def lora_names(t: Target) -> None:
    spec = _need_lora(t)
    seen: list[dict] = []  # raw labels: the parsed snapshot already strips what this check looks at
    load = asyncio.create_task(t.post("/v1/completions", t.long_request(t.lora_adapters[0])))
    try:
        while not load.done() and not any(labels.get(LABEL_RUNNING_LORA_ADAPTERS) for labels in seen):
            seen += [labels for labels, _ in _samples(await t.metrics_text(), spec)]
            await asyncio.sleep(0.02)
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    expect(any(labels.get(LABEL_RUNNING_LORA_ADAPTERS) for labels in seen), "running_lora_adapters stayed empty")
    for labels in seen:
        for key in (LABEL_RUNNING_LORA_ADAPTERS, LABEL_WAITING_LORA_ADAPTERS):
            value = labels.get(key, "")
            # the protocol's own example is "adapter1, adapter2": a space after the comma is a separator
            names = [n.strip() for n in value.split(",")] if value else []
            expect(all(n and not any(c.isspace() for c in n) for n in names), f"{key}={value!r}: bad adapter names")
            expect(value == value.strip(), f"{key}={value!r} has leading or trailing spaces")


@suite.check("prefix-cache", SHOULD, "a repeated long prompt raises prefix-cache hits and lowers TTFT")
async def prefix_cache(t: Target) -> None:
    prompt = f"Conformance run {time.time()}: " + "You are a careful assistant who answers precisely. " * 60
    body = {"model": t.model, "prompt": prompt, "max_tokens": 2}
    hits_before = _counter(await t.metrics_text(), "vllm:prefix_cache_hits_total")
    _, _, cold = await t.stream("/v1/completions", body)
    warm = min([(await t.stream("/v1/completions", body))[2] for _ in range(3)])
    hits_after = _counter(await t.metrics_text(), "vllm:prefix_cache_hits_total")
    if hits_before is not None:
        expect(hits_after > hits_before, "vllm:prefix_cache_hits_total did not rise")
    expect(
        warm < cold, f"TTFT with a cached prefix ({warm * 1e3:.1f} ms) is not below the cold one ({cold * 1e3:.1f} ms)"
    )


def _counter(text: str, name: str) -> float | None:
    values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values) if values else None


# -- KV cache events (vLLM's ZMQ publisher; wire format in protocol/kv_events.py) ------------------------------------

KV_JOIN_SECONDS = 0.5  # a SUB socket receives only after its subscription reached the publisher
KV_EVENT_TIMEOUT = 10.0
KV_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class KVEventListener:
    """Subscribes to the server's KV events for the length of one check and keeps every message received."""

    def __init__(self, kv: KVEventsTarget):
        self.kv = kv
        self.frames: list[tuple[bytes, int, bytes]] = []  # (topic, seq, payload) in arrival order
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, kv.topic.encode())
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> KVEventListener:
        (self._sock.bind if self.kv.bind else self._sock.connect)(self.kv.endpoint)
        self._task = asyncio.create_task(self._read())
        await asyncio.sleep(KV_JOIN_SECONDS)
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            expect(len(frames) == 3 and len(frames[1]) == 8, "a KV event message is not [topic, seq, payload]")
            self.frames.append((frames[0], int.from_bytes(frames[1], "big"), frames[2]))

    def events(self) -> list:
        events = []
        for topic, seq, payload in self.frames:
            try:
                events += KV_DECODER.decode(payload).events
            except msgspec.DecodeError as exc:
                raise CheckFailed(f"batch {seq} of {topic!r} is not vLLM's msgpack KVEventBatch: {exc}") from None
        return events

    async def wait_for(self, condition: Callable[[], object], seconds: float = KV_EVENT_TIMEOUT):
        """condition()'s first truthy value while events arrive, or its last (falsy) one after `seconds`."""
        deadline = time.monotonic() + seconds
        while not (result := condition()) and time.monotonic() < deadline:
            if self._task.done():
                self._task.result()  # a malformed message fails the check
            await asyncio.sleep(0.02)
        return result


def _need_kv(t: Target, replay: bool = False, seed: bool = False) -> KVEventsTarget:
    if t.kv is None:
        raise Skip("no KV event endpoint given (--kv-events-endpoint or --kv-events-bind)")
    if replay and not t.kv.replay_endpoint:
        raise Skip("no KV event replay endpoint given (--kv-replay-endpoint)")
    if seed and t.kv.hash_seed is None:
        raise Skip("the server's PYTHONHASHSEED was not given (--kv-hash-seed): its block hashes cannot be reproduced")
    return t.kv


def _unique_prompt(words: int = 200) -> str:
    """A prompt no earlier request shares a block with: it starts with a fresh nonce."""
    return f"{uuid.uuid4().hex} " + " ".join(f"w{i}" for i in range(words))


async def _tokens(t: Target, prompt: str) -> list[int]:
    body = await t.json_post("/tokenize", {"model": t.model, "prompt": prompt})
    tokens = body.get("tokens")
    expect(isinstance(tokens, list) and tokens, f"/tokenize answered no tokens: {str(body)[:200]}")
    return tokens


@dataclass
class StoredChain:
    """A prompt's blocks as BlockStored events announced them."""

    block_size: int
    hashes: list[int]
    lora_ids: set


def _find_chain(events: list, tokens: list[int]) -> StoredChain | str:
    """The chain of stored blocks that holds `tokens` from its first token: each block's token ids are the prompt's
    and its parent is the block before it (None for the first). A string says what is missing or wrong."""
    blocks = {}  # hash -> (parent, token ids, block size, lora_id)
    for event in events:
        if isinstance(event, BlockStored):
            size, parent = event.block_size, event.parent_block_hash
            expect(size > 0, f"BlockStored with block_size {size}")
            expect(
                len(event.token_ids) == size * len(event.block_hashes),
                f"BlockStored carries {len(event.token_ids)} token ids for {len(event.block_hashes)} blocks of {size}",
            )
            for i, block_hash in enumerate(event.block_hashes):
                blocks[block_hash] = (parent, event.token_ids[i * size : (i + 1) * size], size, event.lora_id)
                parent = block_hash
    if not blocks:
        return "no BlockStored event arrived"
    size = next(iter(blocks.values()))[2]
    by_tokens: dict[tuple, list[int]] = {}
    for block_hash, (_, block_tokens, _, _) in blocks.items():
        by_tokens.setdefault(tuple(block_tokens), []).append(block_hash)
    chain: list[int] = []
    lora_ids = set()
    for k in range(len(tokens) // size):
        candidates = by_tokens.get(tuple(tokens[k * size : (k + 1) * size]), [])
        parent = chain[-1] if chain else None
        linked = [h for h in candidates if blocks[h][0] == parent]
        if not linked:
            if candidates:
                return f"block {k} of the prompt was stored with parent {blocks[candidates[0]][0]}, not {parent}"
            return f"block {k} of the prompt (of {len(tokens) // size}) was not announced as stored"
        chain.append(linked[0])
        lora_ids.add(blocks[linked[0]][3])
    return StoredChain(size, chain, lora_ids)


async def _store_prompt(
    t: Target, listener: KVEventListener, model: str | None = None
) -> tuple[list[int], StoredChain]:
    """Send a fresh prompt (one output token) and wait for its full blocks to be announced."""
    prompt = _unique_prompt()
    tokens = await _tokens(t, prompt)
    await t.json_post("/v1/completions", {"model": model or t.model, "prompt": prompt, "max_tokens": 1})

    def stored() -> StoredChain | None:
        chain = _find_chain(listener.events(), tokens)
        return chain if isinstance(chain, StoredChain) else None

    found = await listener.wait_for(stored)
    if not found:
        raise CheckFailed(str(_find_chain(listener.events(), tokens)))
    expect(found.hashes, f"a {len(tokens)}-token prompt filled no block of {found.block_size} tokens")
    return tokens, found


@suite.check(
    "kv-events-stored",
    SHOULD,
    "a request's full blocks are announced as BlockStored with the prompt's token ids (/tokenize), each block's "
    "parent the block before it",
)
async def kv_events_stored(t: Target) -> None:
    _need_kv(t)
    async with KVEventListener(t.kv) as listener:
        _, chain = await _store_prompt(t, listener)
    expect(chain.lora_ids == {None}, f"a base-model request's blocks carry lora_id {chain.lora_ids}")
    cache_info = _cache_info(await t.metrics_text(), t.engine)
    if cache_info.get(LABEL_BLOCK_SIZE, "").isdigit():
        size = int(cache_info[LABEL_BLOCK_SIZE])
        expect(chain.block_size == size, f"events say block_size {chain.block_size}, cache_config_info {size}")


@suite.check(
    "kv-events-block-hashes",
    SHOULD,
    "stored block hashes are vLLM's for the prompt's tokens, the server's PYTHONHASHSEED and hash algorithm "
    "(LoRA adapters: the adapter name in the hash, a lora_id)",
)
async def kv_events_block_hashes(t: Target) -> None:
    kv = _need_kv(t, seed=True)
    async with KVEventListener(kv) as listener:
        for adapter in [None, *t.lora_adapters[:1]]:
            tokens, chain = await _store_prompt(t, listener, adapter)
            expected = request_block_hashes(
                tokens[: len(chain.hashes) * chain.block_size],
                chain.block_size,
                lora_name=adapter,
                hash_seed=kv.hash_seed,
                algo=kv.hash_algo,
            )
            expect(
                chain.hashes == expected,
                f"{adapter or 'base model'}: block hashes {chain.hashes[:3]}... are not vLLM's {expected[:3]}... "
                f"(PYTHONHASHSEED={kv.hash_seed!r}, {kv.hash_algo})",
            )
            if adapter is not None:
                expect(
                    len(chain.lora_ids) == 1 and isinstance(next(iter(chain.lora_ids)), int),
                    f"{adapter}: blocks carry lora_id {chain.lora_ids}, not the adapter's integer id",
                )


async def _max_model_len(t: Target) -> int | None:
    async with t.session.get(t.url + "/v1/models") as r:
        data = (await r.json())["data"] if r.status == 200 else []
    lengths = [m.get("max_model_len") for m in data if m.get("id") == t.model]
    return lengths[0] if lengths and isinstance(lengths[0], int) else None


KV_EVICTION_BUDGET_TOKENS = 1_000_000  # a bigger KV cache is not filled with traffic (use kv-events-cleared)


@suite.check(
    "kv-events-removed",
    SHOULD,
    "blocks the server evicts (distinct prompts through its whole KV cache) are announced as BlockRemoved",
)
async def kv_events_removed(t: Target) -> None:
    _need_kv(t)
    info = _cache_info(await t.metrics_text(), t.engine)
    if not info.get(LABEL_NUM_GPU_BLOCKS, "").isdigit() or not info.get(LABEL_BLOCK_SIZE, "").isdigit():
        raise Skip("cache_config_info does not say num_gpu_blocks and block_size: how much traffic evicts is unknown")
    capacity = int(info[LABEL_NUM_GPU_BLOCKS]) * int(info[LABEL_BLOCK_SIZE])
    if 2 * capacity > KV_EVICTION_BUDGET_TOKENS:
        raise Skip(f"a KV cache of {capacity} tokens is too large to evict with traffic here")
    prompt_tokens = min((await _max_model_len(t) or 4096) // 2, 2048)
    words = max(16, prompt_tokens * 200 // len(await _tokens(t, _unique_prompt())))
    async with KVEventListener(t.kv) as listener:
        _, chain = await _store_prompt(t, listener)

        def removed() -> bool:
            return set(chain.hashes) <= {
                h for e in listener.events() if isinstance(e, BlockRemoved) for h in e.block_hashes
            }

        sent = 0
        while not removed() and sent < 2 * capacity:
            bodies = [{"model": t.model, "prompt": _unique_prompt(words), "max_tokens": 1} for _ in range(4)]
            answers = await asyncio.gather(*(t.json_post("/v1/completions", body) for body in bodies))
            sent += sum(a["usage"]["prompt_tokens"] for a in answers)
        expect(
            await listener.wait_for(removed, 2.0),
            f"after {sent} prompt tokens through a {capacity}-token KV cache, the first prompt's "
            f"{len(chain.hashes)} blocks were not all announced as BlockRemoved",
        )


@suite.check(
    "kv-events-cleared", SHOULD, "POST /reset_prefix_cache (vLLM's dev endpoint) is announced as AllBlocksCleared"
)
async def kv_events_cleared(t: Target) -> None:
    _need_kv(t)
    async with KVEventListener(t.kv) as listener:
        status, _ = await t.post("/reset_prefix_cache", b"")
        if status in (404, 405):
            raise Skip(f"POST /reset_prefix_cache answered {status} (vLLM serves it with VLLM_SERVER_DEV_MODE=1)")
        expect(status == 200, f"POST /reset_prefix_cache answered {status}")
        # vLLM publishes what its block pool recorded after the next engine step: give it one
        await t.json_post("/v1/completions", {"model": t.model, "prompt": _unique_prompt(8), "max_tokens": 1})
        cleared = await listener.wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in listener.events()))
        expect(cleared, "no AllBlocksCleared after POST /reset_prefix_cache on an idle server")


async def _traffic(t: Target, listener: KVEventListener, batches: int = 4) -> None:
    """Distinct prompts, one at a time, until the listener holds `batches` batches."""
    for _ in range(4 * batches):
        if len(listener.frames) >= batches:
            return
        await t.json_post("/v1/completions", {"model": t.model, "prompt": _unique_prompt(), "max_tokens": 1})
        await listener.wait_for(lambda: False, 0.05)
    expect(len(listener.frames) >= batches, f"{4 * batches} requests produced {len(listener.frames)} event batches")


def _gaps(frames: list[tuple[bytes, int, bytes]]) -> list[str]:
    last: dict[bytes, int] = {}
    problems = []
    for topic, seq, _ in frames:
        if topic in last and seq != last[topic] + 1:
            problems.append(f"{topic.decode(errors='replace')}: {last[topic]} then {seq}")
        last[topic] = seq
    return problems


@suite.check("kv-events-gapless", SHOULD, "each topic's batches are numbered one after another, no gap or repeat")
async def kv_events_gapless(t: Target) -> None:
    _need_kv(t)
    async with KVEventListener(t.kv) as listener:
        await _traffic(t, listener, batches=6)
        listener.events()  # every payload decodes
        problems = _gaps(listener.frames)
    expect(not problems, f"sequence numbers jump: {'; '.join(problems[:5])}")


@suite.check(
    "kv-events-replay",
    SHOULD,
    "the replay socket answers [start seq] with every buffered batch from it, as published, then seq -1",
)
async def kv_events_replay(t: Target) -> None:
    kv = _need_kv(t, replay=True)
    async with KVEventListener(kv) as listener:
        await _traffic(t, listener, batches=4)
        topic = listener.frames[0][0]
        received = [(seq, payload) for top, seq, payload in listener.frames if top == topic]
    start = received[1][0]  # as a subscriber that missed everything after its first batch asks
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    replayed = []
    try:
        dealer.connect(kv.replay_endpoint)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), KV_EVENT_TIMEOUT)
            expect(len(frames) == 3 and frames[0] == b"", f"a replay answer is not [b'', seq, payload]: {len(frames)}")
            if frames[1] == END_SEQ:
                break
            replayed.append((int.from_bytes(frames[1], "big"), frames[2]))
    except TimeoutError:
        raise CheckFailed(f"the replay socket sent {len(replayed)} batches and no end marker (seq -1)") from None
    finally:
        dealer.close(linger=0)
        ctx.term()
    expect(replayed, f"replay from seq {start} answered no batch")
    expect(replayed[0][0] == start, f"replay from seq {start} began at {replayed[0][0]}")
    expect(
        replayed[: len(received) - 1] == received[1:],
        "replayed batches differ from the ones published (sequence numbers or payloads)",
    )
