"""`epp-bench agent-cpu`: what the EPP's request path costs per agent request, in process.

The `agentic` workload's seeded plan (harness/bench/agentic.py: Chat sessions with the shared tools prompt,
subagents forked from their parent's context, Responses sessions sending only their new items), each request in
plan order through the director of a fresh EPP with the default profile over `handler_cpu.ENDPOINTS` endpoints that
publish KV events: the body parsed, routed (the approximate transcript, precise-prefix-cache-scorer's rendering,
tokenizing, block hashing and index walks, the scorers, the picker), its after-routing hooks and its completion.
After each request the endpoint it was sent to holds the prompt's blocks, as its KV events would tell (computed
outside the timed part), so that, as in a live pool, the tools prompt is held everywhere and a session's context
on its own endpoint. Responses follow-ups are sent without `previous_response_id` (nothing stored them here): they
are routed by their content.

What it leaves out, which `epp-bench compare`'s whole-process figure includes: the ext_proc transport (a body of
~15 KB in and out), the access log, the KV-event subscriber, scrapes, and the latency predictor's learning.
`profile` prints cProfile's heaviest functions (their times inflated by the profiler).
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import json
import os
import pstats
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

from epp.datalayer.kv_events import KVBlockIndex
from epp.requestcontrol.types import RoutingDecision
from epp.scheduling.prompt_tokens import PromptTokenizer
from harness.bench import agentic, handler_cpu
from harness.bench.workloads import _text, load_workload
from protocol.kv_events import request_block_hashes
from protocol.openai import CHAT_COMPLETIONS_PATH, RESPONSES_PATH, RequestKind, load_json_body

MODEL = handler_cpu.REQUEST["model"]
BLOCK_SIZE = 16


def requests(spec: dict, rate: float, duration: float, seed: int = 0) -> list[tuple[str, bytes, str]]:
    """The plan's requests as (path, body, the context it continues: its session, or a subagent's own), in plan
    order: each session's turns, a subagent's after the turn that forks it."""
    system = _text(random.Random(11), spec["system_prompt_tokens"])
    tools = agentic.tools(spec, 1.0)
    function_tools = [{"type": "function", **t["function"]} for t in tools]
    chat_body = {"model": MODEL, "tools": tools, "max_tokens": spec["output_tokens"], "stream": True}
    responses_body = {"model": MODEL, "instructions": system, "tools": function_tools, "stream": True}

    def chat(session: agentic.Session, context: list[dict] | None, key: str) -> Iterator[tuple[str, dict, str]]:
        messages = [*(context or [{"role": "system", "content": system}]), {"role": "user", "content": session.task}]
        for j, step in enumerate(session.steps):
            yield CHAT_COMPLETIONS_PATH, {**chat_body, "messages": messages}, key
            messages = [
                *messages,
                {"role": "assistant", "content": "", "tool_calls": [step.call]},
                {"role": "tool", "tool_call_id": step.call["id"], "content": step.result},
            ]
            if step.fork is not None:
                yield from chat(step.fork, messages, f"{key}/{j}")
        yield CHAT_COMPLETIONS_PATH, {**chat_body, "messages": messages}, key

    def responses(session: agentic.Session) -> Iterator[tuple[str, dict, str]]:
        items: list[dict] = [{"role": "user", "content": session.task}]
        for step in session.steps:
            yield RESPONSES_PATH, {**responses_body, "input": items}, session.id
            call = step.call
            items = [
                {"type": "function_call", "call_id": call["id"], **call["function"]},
                {"type": "function_call_output", "call_id": call["id"], "output": step.result},
            ]
        yield RESPONSES_PATH, {**responses_body, "input": items}, session.id

    out = []
    for session in agentic.sessions(spec, rate, duration, seed):
        turns = responses(session) if session.api == "responses" else chat(session, None, session.id)
        out += [(path, json.dumps(body).encode(), key) for path, body, key in turns]
    return out


@dataclass
class AgentCpuResult:
    requests: int
    body_bytes: float  # a request body's mean size
    ms_per_request: float  # CPU of the request path (under cProfile when `profile` is set)
    routed: int
    stayed: float  # the share of a context's later turns routed where its previous turn went
    profile: str = ""  # cProfile's heaviest functions by their own time

    def markdown(self) -> str:
        return (
            f"EPP request path, agentic plan ({self.requests} requests, bodies of {self.body_bytes:,.0f} bytes on "
            f"average): {self.ms_per_request:.3f} ms of CPU per request{' (under cProfile)' if self.profile else ''}"
            f"; {self.stayed:.0%} of a context's later turns routed where its previous turn went" + self.profile
        )


def measure(rate: float = 2.0, duration: float = 30.0, profile: int = 0) -> AgentCpuResult:
    """The request path over the plan at `rate` sessions a second for `duration` seconds (with `profile`, that many
    of cProfile's heaviest functions by their own time)."""
    os.environ.setdefault("PYTHONHASHSEED", "0")  # precise-prefix-cache-scorer's hashSeed, as the servers'
    seed = os.environ["PYTHONHASHSEED"]
    plan = requests(load_workload("agentic"), rate, duration)
    director = handler_cpu._director(kv_events=True)
    index: KVBlockIndex = director.scheduler.kv_index
    server = PromptTokenizer.from_directory(None)  # what the servers tokenize, for the blocks they then hold
    profiler = cProfile.Profile() if profile else None
    last: dict[str, str] = {}  # a context -> where its previous turn went
    stayed = later = 0

    async def run() -> float:
        nonlocal stayed, later
        spent = 0.0
        for n, (path, raw, key) in enumerate(plan):
            headers = {":path": path, ":method": "POST", agentic.SESSION_HEADER: "s", "x-request-id": f"request-{n}"}
            started = time.process_time()
            if profiler is not None:
                profiler.enable()
            ctx = director.new_request(headers, None)
            decision = director.route(ctx, load_json_body(raw), raw)
            if not isinstance(decision, RoutingDecision):  # a long prompt tokenized in a worker thread
                await decision
            director.after_routed(ctx)
            endpoint = ctx.endpoint
            director.on_complete(ctx)
            if profiler is not None:
                profiler.disable()
            spent += time.process_time() - started
            if key in last:
                later += 1
                stayed += last[key] == endpoint.hostport
            last[key] = endpoint.hostport
            prompt = server.prompt(json.loads(raw), RequestKind.RESPONSES if path == RESPONSES_PATH else None)
            tokens = [token for _, ids in server.pieces(prompt) for token in ids]
            index.store(endpoint.hostport, request_block_hashes(tokens, BLOCK_SIZE, hash_seed=seed))
        return spent

    spent = asyncio.run(run())
    text = io.StringIO()
    if profiler is not None:
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
    return AgentCpuResult(
        requests=len(plan),
        body_bytes=sum(len(raw) for _, raw, _ in plan) / len(plan),
        ms_per_request=1e3 * spent / len(plan),
        routed=sum(e.routed_total for e in director.datastore.endpoints),
        stayed=stayed / max(1, later),
        profile=text.getvalue(),
    )
