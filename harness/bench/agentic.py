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
import json
import math
import random
import re
import time
from dataclasses import dataclass, field

import aiohttp

from harness.bench.workloads import _text

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


class AgentRunner:
    """Runs sessions against one target's URL and collects one outcome per request."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, spec: dict, scale: float, send):
        """`send(http, url, body, headers)` streams one Chat request and measures it (compare's `_send`)."""
        self.http, self.url, self.model, self.spec, self.send = http, url, model, spec, send
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

    async def session(self, session: Session, context: list[dict] | None = None, kind: str = "") -> None:
        if session.api == "responses":
            await self._responses_session(session)
            return
        messages = [
            *(context or [{"role": "system", "content": self.system}]),
            {"role": "user", "content": session.task},
        ]
        kind = kind or "chat turns"
        for step in [*session.steps, None]:
            outcome = await self._chat(messages, session.id, kind)
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
                self.forks.append(asyncio.create_task(self.session(fork, messages, "subagent turns")))

    async def _chat(self, messages: list[dict], session: str, kind: str) -> TurnOutcome:
        body = {
            "model": self.model,
            "messages": messages,
            "tools": self.tools,
            "max_tokens": self.spec["output_tokens"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        o = await self.send(self.http, f"{self.url}/v1/chat/completions", body, {SESSION_HEADER: session})
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
            outcome, response_id, prompt_tokens = await self._responses(body, {SESSION_HEADER: session.id})
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

    async def _responses(self, body: dict, headers: dict) -> tuple[TurnOutcome, str | None, int]:
        started = time.monotonic()
        first = last = None
        chunks, response_id, usage = 0, None, {}
        kind = "responses turns"
        try:
            async with self.http.post(f"{self.url}/v1/responses", json=body, headers=headers) as response:
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
