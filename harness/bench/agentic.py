"""The `agentic` workload of `epp-bench compare`: coding-agent sessions, as Claude Code or Codex drive a model.

Sessions arrive as a Poisson stream (`--rates`: sessions per second). Each sends a long tools prompt that every
session shares (`tools_prompt_tokens`), its system prompt and a task, then runs tool-call turns: the model's answer
stands for a tool call (a stand-in text the client sends back, as the multi-turn workloads do), the client "runs the
tool" (`tool_seconds`) and sends its result (`tool_result_tokens`: lengths from a log-normal, from a grep's few lines
to a whole file) as the next turn's input. A share of the turns fork a subagent (`subagent_share`) that starts from
the parent's whole context plus its own task and runs its own turns beside the parent. Sessions carry Claude Code's
session header. A share of them (`responses_share`) speak the Responses API instead of Chat: each turn after the
first sends only its new items and `previous_response_id`, so only the server that stored the previous response can
answer it; such a follow-up counts as answered correctly when it succeeds and its prompt held the stored
conversation (its input tokens at least the previous turn's input and output).

The session plan is drawn from the seed alone (never from the answers), so every target gets the same sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import random
import re
import time
from dataclasses import dataclass, field

import aiohttp

from harness.bench.workloads import _text
from modelserver.engine.sim import SimTiming
from protocol.tokenizer import load_tokenizer

SESSION_HEADER = "x-claude-code-session-id"
_DELTA = re.compile(rb'"type":"response\.output_text\.delta"')
_CREATED_ID = re.compile(rb'"type":"response\.created".*?"id":"(resp_[^"]+)"')
_COMPLETED = re.compile(rb'"type":"response\.completed"')


@dataclass
class Step:
    call: dict  # the tool call the model's answer stands for (Chat's shape)
    result: str  # the tool's output, sent back as the next turn's input
    fork: Session | None = None  # a subagent started from the context up to this step's result


@dataclass
class Session:
    at: float  # arrival offset, seconds
    id: str
    api: str  # "chat" or "responses"
    task: str
    steps: list[Step] = field(default_factory=list)


@dataclass
class TurnOutcome:
    """What `compare.Outcome` needs, plus a Responses follow-up's verdict."""

    status: int
    ttft: float = 0.0
    itl: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    cached_share: float = 0.0
    kind: str = ""
    follow_up: bool | None = None  # a Responses follow-up: answered with its stored conversation (None: not one)


def tools(spec: dict, scale: float) -> list[dict]:
    """The shared tool definitions: `tools` functions whose descriptions add up to `tools_prompt_tokens`."""
    rng = random.Random(7)
    count = spec.get("tools", 12)
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": _text(rng, spec["tools_prompt_tokens"] * scale / count),
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for i in range(count)
    ]


def _steps(rng: random.Random, spec: dict, scale: float, turns: tuple[int, int], depth: int) -> list[Step]:
    median = spec["tool_result_tokens"]["median"]
    biggest = spec["tool_result_tokens"]["max"]
    steps = []
    for j in range(rng.randint(*turns) - 1):
        tokens = min(biggest, median * math.exp(rng.gauss(0, 1)))
        call = {
            "id": f"call_{j}",
            "type": "function",
            "function": {"name": f"tool_{rng.randrange(spec.get('tools', 12))}", "arguments": '{"path": "src/a.py"}'},
        }
        step = Step(call, _text(rng, tokens * scale))
        if depth == 0 and rng.random() < spec.get("subagent_share", 0.0):
            sub_turns = tuple(spec.get("subagent_turns", (2, 4)))
            step.fork = Session(0.0, "", "chat", _text(rng, spec["task_tokens"] * scale))
            step.fork.steps = _steps(rng, spec, scale, sub_turns, depth + 1)
        steps.append(step)
    return steps


def sessions(spec: dict, rate: float, duration: float, seed: int = 0, scale: float = 1.0) -> list[Session]:
    rng = random.Random(seed)
    out, t = [], 0.0
    burst = int(spec.get("arrival", {}).get("burst", 1))  # sessions that start at once
    while True:
        t += rng.expovariate(rate / burst)
        if t >= duration:
            return out
        for _ in range(burst):
            api = "responses" if rng.random() < spec.get("responses_share", 0.0) else "chat"
            session = Session(t, f"session-{seed}-{len(out)}", api, _text(rng, spec["task_tokens"] * scale))
            session.steps = _steps(rng, spec, scale, tuple(spec["turns"]), 0)
            out.append(session)


@dataclass
class Floor:
    """What the sim pool's timing model allows a plan's requests, each alone on an idle server (milliseconds)."""

    requests: int
    held: dict[str, float]  # TTFT when the server holds all of the request's earlier context
    shared_only: dict[str, float]  # TTFT when it holds only the prompt every session shares (tools, system)


def floor(spec: dict, plan: list[Session], scale: float = 1.0, timing: SimTiming | None = None) -> Floor:
    """The routing floor of a plan, from the sim's timing model: every request's TTFT on an idle server (one
    prefill step: its overhead plus its uncached tokens' time; the first token comes with it), when that server
    holds all of the request's earlier context (its session's previous prompt, or its parent's at a fork: what
    perfect affinity leaves to prefill is the new turn) and when it holds only what every session shares (a
    server new to the session). No router does better than the first at any load; the gap between the two is all
    that prefix affinity can win. Prompts are rendered as the sim's chat template renders a Chat request (a
    Responses session's as if it were one: its follow-ups render the same conversation), in whole blocks of 16."""
    timing = timing or SimTiming()
    tokenizer = load_tokenizer(None)
    system = [{"role": "system", "content": _text(random.Random(11), spec["system_prompt_tokens"] * scale)}]
    shared_tools = tools(spec, scale)

    def encode(messages: list[dict], generation: bool = True) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, generation, shared_tools))

    shared = encode(system, generation=False)
    held, shared_only = [], []

    def run(session: Session, context: list[dict], earlier: list[int]) -> None:
        messages = [*context, {"role": "user", "content": session.task}]
        for step in [*session.steps, None]:
            ids = encode(messages)
            held.append(len(ids) - _common_blocks(earlier, ids))
            shared_only.append(len(ids) - _common_blocks(shared, ids))
            if step is None:
                return
            messages = [
                *messages,
                {"role": "assistant", "content": "", "tool_calls": [step.call]},
                {"role": "tool", "tool_call_id": step.call["id"], "content": step.result},
            ]
            if step.fork is not None:
                run(step.fork, messages, ids)
            earlier = ids

    for session in plan:
        run(session, system, shared)

    def ttft(uncached: list[int]) -> dict[str, float]:
        ms = sorted(1e3 * (timing.prefill_overhead + u * timing.prefill_time_per_token) for u in uncached)
        return {"mean": sum(ms) / len(ms), "p90": ms[int(0.9 * (len(ms) - 1))]}

    return Floor(len(held), ttft(held), ttft(shared_only))


def _common_blocks(a: list[int], b: list[int], block: int = 16) -> int:
    """The tokens of the whole blocks that `a` and `b` begin with alike."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // block * block


class Oracle:
    """The perfect-information reference (`epp-bench compare --targets oracle`): the client routes each request
    straight to a server, with no proxy, knowing what a router can only estimate: where each context was last
    prefilled (a session's previous turn; a subagent's first turn, its parent's server at the fork) and every
    server's exact number of requests in flight (the client is the only one). A turn goes to its context's server
    unless that server has `handoff` or more requests in flight beyond the least loaded one (then to the least
    loaded: a context re-prefilled costs less than a queue); a new session, whose tools and system prompts every
    warm server holds, goes to the least loaded; a Responses follow-up always goes where its response is stored.
    What it reaches is the floor for routing on this workload at this load: a router sees no more than this."""

    def __init__(self, urls: list[str], handoff: int = 4):
        self.in_flight = dict.fromkeys(urls, 0)
        self.contexts = dict.fromkeys(urls, 0)  # live contexts held per server: ties in flight go to the fewest
        self.handoff = handoff
        self.home: dict[str, str] = {}  # live context key -> the server that prefilled it last

    def pick(self, key: str, parent: str = "", pinned: bool = False) -> str:
        home = self.home.get(key) or self.home.get(parent)
        least = min(self.in_flight, key=lambda u: (self.in_flight[u], self.contexts[u]))
        if home is None or (not pinned and self.in_flight[home] - self.in_flight[least] >= self.handoff):
            home = least
        self._move(key, home)
        self.in_flight[home] += 1
        return home

    def done(self, url: str) -> None:
        self.in_flight[url] -= 1

    def forget(self, key: str) -> None:
        """The context's session ended."""
        self._move(key, None)

    def _move(self, key: str, url: str | None) -> None:
        before = self.home.pop(key, None)
        if before is not None:
            self.contexts[before] -= 1
        if url is not None:
            self.home[key] = url
            self.contexts[url] += 1


class AgentRunner:
    """Runs sessions against one target's URL (or, for the oracle, the servers it picks) and collects one outcome
    per request."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, spec: dict, scale: float, send, oracle=None):
        """`send(http, url, body, headers)` streams one Chat request and measures it (compare's `_send`)."""
        self.http, self.url, self.model, self.spec, self.send = http, url, model, spec, send
        self.oracle: Oracle | None = oracle
        self.system = _text(random.Random(11), spec["system_prompt_tokens"] * scale)
        self.tools = tools(spec, scale)
        self.outcomes: list[TurnOutcome] = []
        self.forks: list[asyncio.Task] = []

    async def run(self, plan: list[Session], started: float) -> list[TurnOutcome]:
        tasks = []
        for session in plan:
            await asyncio.sleep(max(0.0, started + session.at - time.monotonic()))
            tasks.append(asyncio.create_task(self.session(session)))
        await asyncio.gather(*tasks)
        while self.forks:  # subagents started by sessions that have ended
            forks, self.forks = self.forks, []
            await asyncio.gather(*forks)
        return self.outcomes

    async def _post(self, path: str, key: str, parent: str, pinned: bool, request):
        """`request(url)` against the gateway, or against the server the oracle picks for this context."""
        if self.oracle is None:
            return await request(f"{self.url}{path}")
        url = self.oracle.pick(key, parent, pinned)
        try:
            return await request(f"{url}{path}")
        finally:
            self.oracle.done(url)

    async def session(
        self, session: Session, context: list[dict] | None = None, kind: str = "", key: str = "", parent: str = ""
    ) -> None:
        """Runs one session (`key` names its context for the oracle: a subagent's is its own, its `parent`'s at
        first)."""
        key = key or session.id
        try:
            if session.api == "responses":
                await self._responses_session(session)
            else:
                await self._chat_session(session, context, kind, key, parent)
        finally:
            if self.oracle is not None:
                self.oracle.forget(key)

    async def _chat_session(self, session: Session, context: list[dict] | None, kind: str, key: str, parent: str):
        messages = [
            *(context or [{"role": "system", "content": self.system}]),
            {"role": "user", "content": session.task},
        ]
        kind = kind or "chat turns"
        for j, step in enumerate([*session.steps, None]):
            outcome = await self._chat(messages, session.id, kind, key, parent if j == 0 else "")
            self.outcomes.append(outcome)
            if step is None or outcome.status != 200:
                return
            await asyncio.sleep(self.spec.get("tool_seconds", 0.0))
            messages = [
                *messages,
                {"role": "assistant", "content": "", "tool_calls": [step.call]},
                {"role": "tool", "tool_call_id": step.call["id"], "content": step.result},
            ]
            if step.fork is not None:  # the subagent carries its parent's session header
                fork = dataclasses.replace(step.fork, id=session.id)
                fork_task = self.session(fork, messages, "subagent turns", f"{key}/{j}", key)
                self.forks.append(asyncio.create_task(fork_task))

    async def _chat(self, messages: list[dict], session: str, kind: str, key: str, parent: str) -> TurnOutcome:
        body = {
            "model": self.model,
            "messages": messages,
            "tools": self.tools,
            "max_tokens": self.spec["output_tokens"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        headers = {SESSION_HEADER: session}
        o = await self._post(
            "/v1/chat/completions", key, parent, False, lambda u: self.send(self.http, u, body, headers)
        )
        return TurnOutcome(o.status, o.ttft, o.itl, o.e2e, o.output_tokens, o.cached_share, kind)

    async def _responses_session(self, session: Session) -> None:
        tools = [{"type": "function", **t["function"]} for t in self.tools]
        previous: tuple[str, int] | None = None  # the last response's id and its input + output tokens
        items: list[dict] = [{"role": "user", "content": session.task}]
        for step in [*session.steps, None]:
            body = {
                "model": self.model,
                "instructions": self.system,
                "tools": tools,
                "input": items,
                "max_output_tokens": self.spec["output_tokens"],
                "stream": True,
            }
            if previous is not None:
                body["previous_response_id"] = previous[0]
            headers = {SESSION_HEADER: session.id}
            pinned = previous is not None
            outcome, response_id, prompt_tokens = await self._post(
                "/v1/responses", session.id, "", pinned, functools.partial(self._responses, body=body, headers=headers)
            )
            if previous is not None:
                outcome.follow_up = outcome.status == 200 and prompt_tokens >= previous[1]
            self.outcomes.append(outcome)
            if step is None or outcome.status != 200 or response_id is None:
                return
            previous = (response_id, prompt_tokens + outcome.output_tokens)
            await asyncio.sleep(self.spec.get("tool_seconds", 0.0))
            call = step.call["function"]
            items = [
                {
                    "type": "function_call",
                    "call_id": step.call["id"],
                    "name": call["name"],
                    "arguments": call["arguments"],
                },
                {"type": "function_call_output", "call_id": step.call["id"], "output": step.result},
            ]

    async def _responses(self, url: str, body: dict, headers: dict) -> tuple[TurnOutcome, str | None, int]:
        started = time.monotonic()
        first = last = None
        chunks, response_id, usage = 0, None, {}
        kind = "responses turns"
        try:
            async with self.http.post(url, json=body, headers=headers) as response:
                if response.status != 200:
                    await response.read()
                    return TurnOutcome(response.status, kind=kind), None, 0
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if _DELTA.search(line):
                        last = time.monotonic()
                        first = first or last
                        chunks += 1
                    elif response_id is None and (match := _CREATED_ID.search(line)):
                        response_id = match.group(1).decode()
                    elif _COMPLETED.search(line):
                        usage = json.loads(line[6:])["response"]["usage"] or {}
        except (TimeoutError, aiohttp.ClientError):
            return TurnOutcome(599, kind=kind), None, 0
        if first is None:
            return TurnOutcome(598, kind=kind), None, 0
        prompt = usage.get("input_tokens", 0)
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        outcome = TurnOutcome(
            200,
            first - started,
            (last - first) / max(1, chunks - 1),
            time.monotonic() - started,
            usage.get("output_tokens", 0),
            cached / max(1, prompt),
            kind,
        )
        return outcome, response_id, prompt
