"""Routing quality, side by side on the same sim pool: our EPP (default profile and each scorer alone) through
Envoy, plain Envoy (round robin, least request, random), and the Rust routers from PyPI (sglang-router cache_aware
and round_robin, vllm-router cache_aware) when installed. Every target gets a freshly started pool, the same seeded
request stream, and the same measurements: TTFT / ITL / e2e percentiles, throughput, success and error codes, the
servers' own prefix-cache hit rate, the per-server request split, and the CPU of every process (a run where the
2-core machine itself is saturated is marked invalid: then the simulated GPUs are not the bottleneck)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import aiohttp

from epp.config.loader import DEFAULT_CONFIG, LLM_D_DEFAULT_CONFIG
from epp.scheduling.plugins.slo_headroom_filter import TPOT_HEADER, TTFT_HEADER
from harness.bench import agentic, charts, inference_perf
from harness.bench.decision import scorers_only_config
from harness.bench.overhead import cpu_seconds, percentile
from harness.bench.peers import peer_command, start_router
from harness.bench.workloads import load_workload, lora_names, requests
from harness.envoy import EnvoyProcess, gateway_timings, render_baseline
from harness.local import ALLOW_EXPERIMENTAL_PLUGINS, GATEWAY_TIMINGS, REPLICA_TURNS, LocalStack, StackConfig
from protocol.extproc import canonical_headers

MODEL = "sim-llama-8b"
LOAD_SAMPLE_SECONDS = 0.5  # how often a run samples each server's load (the load-per-server charts)
SINGLE_SCORER = """plugins:\n- type: {0}\nschedulingProfiles:\n- name: {0}\n  plugins:\n  - pluginRef: {0}\n"""
# The default profile before precise-prefix-cache-scorer: the approximate prefix index alone (no KV events)
APPROXIMATE_CONFIG = DEFAULT_CONFIG.replace("- type: precise-prefix-cache-scorer\n", "").replace(
    "  - pluginRef: precise-prefix-cache-scorer\n    weight: 3\n", ""
)
# epp-predicted learns from this share of the responses: its predictor's memory (~500 observations, decay 0.998)
# then spans ~2 minutes at 16 req/s, and streaming costs a quarter of what it costs for every response.
OBSERVED_RESPONSES_PERCENT = 25
# The default profile with session affinity (agent sessions send a session header): docs/agents.md measures it
SESSIONS_CONFIG = DEFAULT_CONFIG.replace(
    "- type: max-score-picker\n", "- type: session-affinity-scorer\n- type: max-score-picker\n"
).replace(
    "  - pluginRef: max-score-picker\n",
    "  - pluginRef: session-affinity-scorer\n    weight: 3\n  - pluginRef: max-score-picker\n",
)
# The default profile with the precise prefix score over the whole prompt (scoreBeyondShared off: the default until
# docs/2026-11-29-agentic-floor.md), where an agent's tools prompt, held everywhere, dilutes it
WHOLE_PROMPT_CONFIG = DEFAULT_CONFIG.replace(
    "- type: precise-prefix-cache-scorer\n",
    "- type: precise-prefix-cache-scorer\n  parameters: {scoreBeyondShared: false}\n",
)
# The default profile with replica-stripe-picker: active-active replicas take different endpoints among near-equal
# ones (docs/2026-11-30-replicas-notebook.md, "Bursts split between replicas"); alone it is the default profile
STRIPED_CONFIG = DEFAULT_CONFIG.replace("- type: max-score-picker\n", "- type: replica-stripe-picker\n").replace(
    "  - pluginRef: max-score-picker\n", "  - pluginRef: replica-stripe-picker\n"
)
EPP_TARGETS = {
    # the default profile: the latency predictor's filters, learning TTFT from the gateway's access log, then the
    # scorers (precise for endpoints that publish KV events: epp-local's servers do)
    "epp": None,
    "epp-no-predictor": scorers_only_config(),  # the default profile's scorers alone (and no access log)
    "epp-approximate": APPROXIMATE_CONFIG,
    "llm-d-default": LLM_D_DEFAULT_CONFIG,  # llm-d router v1.0's default profile, "sticky until saturated"
    "epp-sessions": SESSIONS_CONFIG,
    "epp-whole-prompt": WHOLE_PROMPT_CONFIG,
    "epp-striped": STRIPED_CONFIG,
    "epp-no-turns": None,  # the default profile; sharing replicas pick without turns (--no-replica-turns)
    "queue-only": SINGLE_SCORER.format("queue-scorer"),
    "kv-only": SINGLE_SCORER.format("kv-cache-utilization-scorer"),
    "prefix-only": SINGLE_SCORER.format("prefix-cache-scorer"),
    "lora-only": SINGLE_SCORER.format("lora-affinity-scorer"),
    # the default profile with the response bodies streamed through the EPP: what that costs, beside "epp"
    "epp-streamed": None,
    # the default profile learning from a sample of the response bodies too (TPOT, which the access log lacks)
    "epp-predicted": None,
}
# Targets whose Envoy sends the EPP no access log (the others: every request's, the gateway's default).
WITHOUT_ACCESS_LOG = {"epp-no-predictor"}
# Targets whose Envoy sends response bodies to the EPP, and the share of the requests it does it for
# (harness.envoy.render_bootstrap's observed_responses_percent): epp-streamed shows what streaming every one costs.
STREAMED_RESPONSES = {"epp-streamed": 100, "epp-predicted": OBSERVED_RESPONSES_PERCENT}
ENVOY_TARGETS = {"round-robin": "ROUND_ROBIN", "least-request": "LEAST_REQUEST", "random": "RANDOM"}
# The agentic workload's perfect-information reference (agentic.Oracle): the client routes, straight to the servers
ORACLE_TARGETS = {"oracle"}
PEER_TARGETS = {
    "sglang-cache-aware": ("sglang", "cache_aware"),
    "sglang-round-robin": ("sglang", "round_robin"),
    "vllm-cache-aware": ("vllm", "cache_aware"),
}
_TOKEN_EVENT, _USAGE_EVENT = re.compile(rb'"choices":\s*\[\{'), re.compile(rb'"usage":\s*\{')
_PREDICTOR = re.compile(
    r'^inference_extension_latency_predictor_(?:mape\{target="(ttft|tpot)"\}|(observations)_total) (\S+)$', re.M
)
_INDEX = re.compile(
    r"^inference_extension_(kv_events_index_entries|prefix_indexer_size|replica_datagrams_sent_total|"
    r"replica_bytes_sent_total) (\S+)$",
    re.M,
)
# the replica channel's CPU by part (epp/replicas.py CPU_PARTS), read from each EPP before and after the measured run
_CHANNEL_CPU = re.compile(r'^inference_extension_replica_cpu_seconds_total\{part="(\w+)"\} (\S+)$', re.M)
# the model servers' pages the replicas read for their peers and took from them, since they started
_PAGES = re.compile(r'^inference_extension_replica_pages_total\{direction="(\w+)"\} (\S+)$', re.M)
# how long the replicas' picks that waited for a turn waited
_TURN_WAIT = re.compile(r"^inference_extension_replica_turn_wait_seconds_(sum|count) (\S+)$", re.M)
_COUNTER = re.compile(
    r"^(vllm:(?:(?:prefix_cache_hits|prefix_cache_queries|request_success)_total|"
    r"(?:time_to_first_token|request_queue_time|request_prefill_time)_seconds_(?:sum|count)))"
    r"\{[^}]*\} (\S+)$",
    re.M,
)


@dataclass
class TargetResult:
    target: str
    rate: float  # open loop: Poisson/bursty arrivals per second; 0 in closed-loop runs
    concurrency: int = 0  # closed loop: this many clients, each sending its next request when one finishes
    requests: int = 0
    succeeded: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft_ms: dict[str, float] = field(default_factory=dict)
    cache_hit_requests: int = 0  # requests with at least half of the prompt served from the prefix cache
    ttft_hit_ms: dict[str, float] = field(default_factory=dict)
    ttft_miss_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    prefix_hit_rate: float = 0.0
    per_server: list[int] = field(default_factory=list)
    # the model servers' own mean TTFT (vllm:time_to_first_token_seconds: from arrival at the server to the first
    # token): the client's TTFT less this is the path (router, proxy) and its queueing, not where requests landed
    server_ttft_ms: float = 0.0
    # of it, the mean time waiting in the servers' queues and in prefill (vllm:request_queue_time_seconds,
    # vllm:request_prefill_time_seconds): placement onto busy servers shows in the first, on cold prefixes in the second
    server_queue_ms: float = 0.0
    server_prefill_ms: float = 0.0
    # the gateway's own timings (harness.envoy.TIMINGS_FORMAT), ms: before the request went to its server (routing:
    # the ext_proc calls, the EPP's pick and any wait for a turn; mean, p90) and from then to the first body byte
    gateway_ms: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    machine_busy: float = 0.0  # CPU seconds of this run's processes / (wall x cores)
    host_busy: float = 0.0  # the whole machine's busy fraction (/proc/stat), other users' processes included
    valid: bool = True
    load_over_time: list[list[int]] = field(default_factory=list)  # per sample: running + waiting per server
    slo_requests: int = 0  # requests that stated latency objectives (x-slo-ttft-ms / x-slo-tpot-ms)
    slo_met: int = 0  # of those, succeeded within their own objectives (TTFT, and ITL as the time per output token)
    goodput_per_s: float = 0.0  # slo_met / wall seconds
    predictor: dict[str, float] = field(default_factory=dict)  # the EPP's latency predictor at the end (its metrics)
    # per request class of the workload (TimedRequest.kind), when it has several: requests, succeeded, TTFT summary
    # (ttft_ms), and for requests with objectives slo_requests / slo_met
    by_kind: dict[str, dict] = field(default_factory=dict)
    # the EPPs' prefix indexes at the end: KV-event index entries, approximate index entries, resident memory (MB),
    # summed over the replicas
    epp_index: dict[str, float] = field(default_factory=dict)
    load_generator: str = "builtin"  # or "inference-perf"
    follow_ups: int = 0  # Responses turns with previous_response_id (the agentic workload)
    follow_ups_ok: int = 0  # of those, answered with their stored conversation
    ttft_samples_ms: list[float] = field(default_factory=list)  # every successful request's TTFT (the CDF charts)
    # with --profile: the first EPP's py-spy samples over the measured run, and of them the share (0-1) with a frame
    # in each file of PROFILED_FILES (the replica channel, the prefix index it feeds, the predictor it feeds)
    profile_samples: int = 0
    profile_shares: dict[str, float] = field(default_factory=dict)
    # of the EPPs' picks (their decision rings, pooled: each keeps its last 1,000 by default), the share that went to an endpoint another pick chose less
    # than REPEAT_SECONDS before: in bursts, a replica that picked before its peer's pick reached it (`repeat_picks`);
    # and of those, the share where that other pick was another replica's
    repeat_picks: float = 0.0
    repeat_picks_cross: float = 0.0
    # the replica channel's CPU seconds over the measured run, by part, summed over the replicas (sharing runs only)
    channel_cpu: dict[str, float] = field(default_factory=dict)
    # how the target ran (`target_label` names it from these): EPP replicas, whether they shared, whether only the
    # first routed; and which of --repeats rounds this run was (0: the only one)
    replicas: int = 1
    sharing: bool = True
    shadows: bool = False
    repeat: int = 0


def _host_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50": percentile(values, 0.5) * 1e3,
        "p90": percentile(values, 0.9) * 1e3,
        "p99": percentile(values, 0.99) * 1e3,
        "mean": statistics.fmean(values) * 1e3,
    }


async def _counters(session: aiohttp.ClientSession, urls: list[str]) -> list[dict[str, float]]:
    out = []
    for url in urls:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
        totals: dict[str, float] = {}
        for name, value in _COUNTER.findall(text):
            totals[name] = totals.get(name, 0.0) + float(value)
        out.append(totals)
    return out


async def _load(session: aiohttp.ClientSession, urls: list[str]) -> list[int]:
    from protocol.metrics import parse_metrics

    loads = []
    for url in urls:
        try:
            async with session.get(f"{url}/metrics") as r:
                m = parse_metrics(await r.text())
            loads.append(m.running + m.waiting)
        except Exception:
            loads.append(-1)
    return loads


class Outcome(NamedTuple):
    status: int  # HTTP status; 598: a 200 without any token, 599: connection error or timeout
    ttft: float = 0.0
    itl: float = 0.0  # mean gap between token chunks
    e2e: float = 0.0
    output_tokens: int = 0
    cached_share: float = 0.0  # usage.prompt_tokens_details.cached_tokens / prompt_tokens
    met_slo: bool | None = None  # None: the request stated no objective
    kind: str = ""  # the request's class in the workload (TimedRequest.kind)
    missed: str = ""  # which objectives it missed (missed_objectives), "" when met or none stated


def missed_objectives(headers: dict[str, str], outcome: Outcome) -> str | None:
    """Which objectives its headers state (milliseconds) a request missed: "" none, "error" (not a 200), else "ttft",
    "tpot" or "ttft+tpot" (the time per output token is the mean gap between token chunks the client saw); None
    when it states none."""
    headers = canonical_headers(dict(headers))  # a workload may state them by the older names
    ttft, tpot = headers.get(TTFT_HEADER), headers.get(TPOT_HEADER)
    if ttft is None and tpot is None:
        return None
    if outcome.status != 200:
        return "error"
    missed = []
    if ttft is not None and outcome.ttft * 1e3 > float(ttft):
        missed.append("ttft")
    if tpot is not None and outcome.output_tokens >= 2 and outcome.itl * 1e3 > float(tpot):
        missed.append("tpot")
    return "+".join(missed)


def judged(headers: dict[str, str], outcome: Outcome, kind: str = "") -> Outcome:
    """The outcome with its class and its verdict against the objectives its headers state: met_slo (None when it
    states none) and which it missed."""
    missed = missed_objectives(headers, outcome)
    return outcome._replace(met_slo=None if missed is None else not missed, kind=kind, missed=missed or "")


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str], kind: str = ""
) -> Outcome:
    return judged(headers, await _send(session, url, body, headers), kind)


async def _send(session: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]) -> Outcome:
    started = time.monotonic()
    first = last = None
    chunks = 0
    usage = {}
    try:
        async with session.post(url, json=body, headers=headers or None) as response:
            if response.status != 200:
                await response.read()
                return Outcome(response.status)
            async for line in response.content:
                # Only the final usage event is decoded; token events are recognised by their bytes.
                if not line.startswith(b"data: {"):
                    continue
                if _TOKEN_EVENT.search(line):
                    last = time.monotonic()
                    first = first or last
                    chunks += 1
                if _USAGE_EVENT.search(line):
                    usage = json.loads(line[6:])["usage"]
    except (TimeoutError, aiohttp.ClientError):
        return Outcome(599)
    if first is None:
        return Outcome(598)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Outcome(
        200,
        first - started,
        (last - first) / max(1, chunks - 1),
        time.monotonic() - started,
        usage.get("completion_tokens", 0),
        cached / max(1, usage.get("prompt_tokens", 0)),
    )


class Pool:
    """A fresh sim pool plus one kind of router in front of it."""

    def __init__(
        self,
        target: str,
        servers: int,
        workdir: Path,
        modelserver_args: list[str],
        epp_config: str | None = None,
        pool_extra: dict | None = None,
        router_args: list[str] = (),
        replicas: int = 1,
        sharing: bool = True,
        shadows: bool = False,
    ):
        self.target, self.servers, self.workdir = target, servers, workdir
        self.replicas, self.sharing, self.shadows = replicas, sharing, shadows
        self.modelserver_args = modelserver_args
        self.epp_config = epp_config if epp_config is not None else EPP_TARGETS.get(target)
        self.pool_extra = pool_extra or {}
        self.router_args = list(router_args)
        self.stack: LocalStack | None = None
        self.envoy: EnvoyProcess | None = None
        self.router: subprocess.Popen | None = None
        self.url = ""

    async def __aenter__(self) -> Pool:
        config = StackConfig.on_free_ports(
            self.servers,
            workdir=self.workdir,
            modelserver_args=self.modelserver_args,
            config_text=self.epp_config,
            pool_extra=self.pool_extra,
            response_body_mode="FULL_DUPLEX_STREAMED" if self.target in STREAMED_RESPONSES else "NONE",
            observed_responses_percent=STREAMED_RESPONSES.get(self.target, 100),
            access_log_percent=0 if self.target in WITHOUT_ACCESS_LOG else 100,
            epp_replicas=self.replicas,
            replica_sharing=self.sharing,
            replica_turns=self.target != "epp-no-turns",
            epp_shadows=self.shadows,
            gateway_timings=True,
            # the bench measures plugins of every stability level (epp-sessions: session-affinity-scorer is Alpha)
            epp_args=[ALLOW_EXPERIMENTAL_PLUGINS],
        )
        self.stack = LocalStack(config)
        hostports = [u.removeprefix("http://") for u in self.stack.model_server_urls]
        if self.target in EPP_TARGETS or self.target.startswith("epp"):
            await self.stack.start()
            self.url = self.stack.gateway_url
            return self
        self.stack.start_model_servers()
        await asyncio.gather(
            *(self.stack._wait_http("modelserver", f"{u}/health", 60) for u in self.stack.model_server_urls)
        )
        if self.target in ORACLE_TARGETS:
            return self
        if self.target in ENVOY_TARGETS:
            listener, admin = config.listener_port, config.admin_port  # the stack's, whose Envoy is not started
            baseline = render_baseline(
                endpoints=hostports, listener_port=listener, admin_port=admin, lb_policy=ENVOY_TARGETS[self.target]
            )
            self.envoy = await EnvoyProcess.launch(baseline, admin, self.workdir, "baseline-envoy")
            self.url = f"http://127.0.0.1:{listener}"
            return self
        kind, policy = PEER_TARGETS[self.target]
        self.router, self.url = await start_router(
            kind, policy, self.stack.model_server_urls, self.workdir, MODEL, extra_args=self.router_args
        )
        return self

    def pids(self) -> dict[str, int]:
        out = {name: p.pid for name, p in self.stack.processes.items()}
        for name, process in (
            ("envoy", self.stack.envoy and self.stack.envoy.process),
            ("envoy", self.envoy and self.envoy.process),
            ("router", self.router),
        ):
            if process is not None:
                out[name] = process.pid
        return out

    async def __aexit__(self, *exc) -> None:
        if self.router is not None:
            self.router.terminate()
            self.router.wait(10)
        if self.envoy is not None:
            self.envoy.stop()
        self.stack.stop()


async def run_target(
    target: str,
    spec: dict,
    rate: float,
    duration: float,
    servers: int,
    workdir: Path,
    scale: float = 1.0,
    seed: int = 0,
    concurrency: int = 0,
    load_generator: str = "builtin",
    warmup: float = 0.0,
    replicas: int = 1,
    sharing: bool = True,
    shadows: bool = False,
    profile: bool = False,
    repeat: int = 0,
) -> TargetResult:
    """One target under the workload for `duration` s; `warmup` s of the same workload (another draw, at `rate`)
    go first and count for nothing: what learns online (the latency predictor, the prefix caches) starts warm. An
    EPP target runs on `replicas` EPPs behind its Envoy, sharing their load (`sharing`) or not (`target_label`); with
    `shadows` Envoy routes to the first only and the others run beside it without requests (StackConfig.epp_shadows).
    `profile`: py-spy samples the first EPP over the measured run (`_profile`); `repeat`: which round of
    `compare`'s repeats this is (0: the only one), in its name."""
    if warmup and (concurrency or load_generator != "builtin"):
        raise ValueError("--warmup needs the builtin load generator at a fixed rate (--rates)")
    agent = spec["name"] == "agentic"
    if agent and (concurrency or load_generator != "builtin"):
        raise ValueError("the agentic workload runs sessions at a rate (--rates: sessions per second)")
    if target in ORACLE_TARGETS and not agent:
        raise ValueError(f"{target}: only the agentic workloads have a perfect-information reference")
    lora_args = []
    if spec["name"] == "multi-lora":
        names = lora_names(spec)
        lora_args = [
            "--enable-lora",
            "--max-loras",
            str(spec.get("max_loras", 4)),
            "--lora-modules",
            *(f"{n}={workdir}/{n}" for n in names),
        ]
    # A closed loop draws from a stream generated fast enough never to run dry.
    if agent:
        stream = agentic.sessions(spec, rate, duration, seed, scale)
    else:
        stream = requests(spec, MODEL, rate or concurrency * 50, duration, seed, scale)
    result = TargetResult(
        target_label(target, replicas, sharing, shadows, repeat),
        0.0 if concurrency else rate,
        concurrency,
        requests=len(stream),
        load_generator=load_generator,
        replicas=replicas,
        sharing=sharing,
        shadows=shadows,
        repeat=repeat,
    )
    server_args = ["--disable-log-stats", *lora_args, *map(str, spec.get("modelserver_args", []))]
    async with Pool(target, servers, workdir, server_args, replicas=replicas, sharing=sharing, shadows=shadows) as pool:
        urls = pool.stack.model_server_urls
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
        ) as session:
            oracle = agentic.Oracle(urls) if target in ORACLE_TARGETS else None
            if warmup and agent:
                runner = agentic.AgentRunner(session, pool.url, MODEL, spec, scale, _send, oracle)
                await runner.run(agentic.sessions(spec, rate, warmup, seed + 1, scale), time.monotonic())
            elif warmup:
                warm = []
                warm_started = time.monotonic()
                for request in requests(spec, MODEL, rate, warmup, seed + 1, scale):
                    await asyncio.sleep(max(0.0, warm_started + request.at - time.monotonic()))
                    warm.append(asyncio.create_task(_one(session, f"{pool.url}/v1/completions", *request[1:])))
                await asyncio.gather(*warm)
            before = await _counters(session, urls)
            channel_before = await _channel_cpu(session, pool.stack) if pool.stack.processes.get("epp") else {}
            pids = pool.pids()
            cpu_before = {k: cpu_seconds(p) for k, p in pids.items()}
            client_before = resource.getrusage(resource.RUSAGE_SELF)
            children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            host_before = _host_ticks()
            started, started_wall = time.monotonic(), time.time()
            spy = _profile(pids["epp"], duration, workdir / "epp.pyspy.txt") if profile and "epp" in pids else None

            async def sample_load() -> None:
                while True:
                    result.load_over_time.append(await _load(session, urls))
                    await asyncio.sleep(LOAD_SAMPLE_SECONDS)

            sampler = asyncio.create_task(sample_load())
            url = f"{pool.url}/v1/completions"
            outcomes = []
            if agent:
                runner = agentic.AgentRunner(session, pool.url, MODEL, spec, scale, _send, oracle)
                turns = await runner.run(stream, started)
                outcomes = [
                    Outcome(t.status, t.ttft, t.itl, t.e2e, t.output_tokens, t.cached_share, kind=t.kind) for t in turns
                ]
                follow_ups = [t.follow_up for t in turns if t.follow_up is not None]
                result.follow_ups, result.follow_ups_ok = len(follow_ups), sum(follow_ups)
            elif load_generator == "inference-perf":
                summary = await inference_perf.run(
                    spec, pool.url, MODEL, rate, concurrency, duration, scale, workdir, seed
                )
            elif concurrency:
                pending = iter(stream)

                async def client() -> None:
                    for request in pending:
                        if time.monotonic() - started >= duration:
                            return
                        outcomes.append(await _one(session, url, *request[1:]))

                await asyncio.gather(*(client() for _ in range(concurrency)))
            else:
                tasks = []
                for request in stream:
                    await asyncio.sleep(max(0.0, started + request.at - time.monotonic()))
                    tasks.append(asyncio.create_task(_one(session, url, *request[1:])))
                outcomes = await asyncio.gather(*tasks)
            elapsed = time.monotonic() - started
            sampler.cancel()
            # what the run cost, taken before the pages below are read: rendering its /metrics page twice cost the
            # EPP 85-195 ms (py-spy, agentic workload), 0.2-0.4 ms per request of a 30 s run at 15 requests a second
            cpu_after = {k: cpu_seconds(p) for k, p in pids.items()}
            if spy is not None:
                spy.wait(60)
                result.profile_samples, result.profile_shares = profile_shares(workdir / "epp.pyspy.txt")
            client_after = resource.getrusage(resource.RUSAGE_SELF)
            children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            host_after = _host_ticks()
            after = await _counters(session, urls)
            decisions: dict[str, list[dict]] = {}
            if pool.stack.processes.get("epp") is not None:
                for name, metrics_url in zip(pool.stack.epp_names, pool.stack.epp_metrics_urls, strict=True):
                    async with session.get(metrics_url) as r:
                        page = await r.text()
                    for key, value in _INDEX.findall(page):
                        result.epp_index[key] = result.epp_index.get(key, 0.0) + float(value)
                    for part, value in _CHANNEL_CPU.findall(page):
                        result.channel_cpu[part] = result.channel_cpu.get(part, 0.0) + float(value)
                    for key, value in [
                        *(("pages_" + d, v) for d, v in _PAGES.findall(page)),
                        *(("turns_" + o, v) for o, v in REPLICA_TURNS.findall(page)),
                        *(("turn_wait_" + o, v) for o, v in _TURN_WAIT.findall(page)),
                    ]:
                        result.epp_index[key] = result.epp_index.get(key, 0.0) + float(value)
                    async with session.get(metrics_url.removesuffix("metrics") + "status.json") as r:
                        decisions[name] = (await r.json())["decisions"]["entries"]
                    status = Path(f"/proc/{pool.stack.processes[name].pid}/status").read_text()
                    rss_kb = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))
                    result.epp_index["rss_mb"] = result.epp_index.get("rss_mb", 0.0) + rss_kb / 1024
                async with session.get(pool.stack.epp_metrics_url) as r:
                    result.predictor = {
                        f"{target}_mape" if target else "observations": float(value)
                        for target, _, value in _PREDICTOR.findall(await r.text())
                    }
        if decisions:
            (workdir / "decisions.json").write_text(json.dumps(decisions))
            picks = [(d["time"], d["pick_address"], name) for name, ds in decisions.items() for d in ds]
            result.repeat_picks, result.repeat_picks_cross = repeat_picks(picks, started_wall)
        result.channel_cpu = {k: v - channel_before.get(k, 0.0) for k, v in result.channel_cpu.items()}
        result.cpu_seconds = {k: cpu_after[k] - cpu_before[k] for k in pids}
        result.cpu_seconds["load generator"] = sum(
            after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            for before, after in ((client_before, client_after), (children_before, children_after))
        )
    if (workdir / GATEWAY_TIMINGS).exists():  # complete once the stack's Envoy has exited
        timings = gateway_timings(workdir / GATEWAY_TIMINGS, started_wall)
        if timings:
            routing = [t[0] for t in timings]
            result.gateway_ms = {
                "routing_mean": statistics.fmean(routing),
                "routing_p90": percentile(routing, 0.9),
                "upstream_mean": statistics.fmean(t[1] for t in timings),
            }
    if load_generator == "inference-perf":
        _from_inference_perf(result, summary)
    else:
        _from_outcomes(result, outcomes, elapsed)
    hits = sum(
        a.get("vllm:prefix_cache_hits_total", 0) - b.get("vllm:prefix_cache_hits_total", 0)
        for a, b in zip(after, before, strict=True)
    )
    queries = sum(
        a.get("vllm:prefix_cache_queries_total", 0) - b.get("vllm:prefix_cache_queries_total", 0)
        for a, b in zip(after, before, strict=True)
    )
    result.prefix_hit_rate = hits / queries if queries else 0.0
    result.per_server = [
        int(a.get("vllm:request_success_total", 0) - b.get("vllm:request_success_total", 0))
        for a, b in zip(after, before, strict=True)
    ]
    result.server_ttft_ms, result.server_queue_ms, result.server_prefill_ms = (
        _server_mean_ms(before, after, f"vllm:{name}_seconds")
        for name in ("time_to_first_token", "request_queue_time", "request_prefill_time")
    )
    if not result.requests:
        raise SystemExit(f"{target}: the workload produced no request in {duration:g} s; raise --duration or the rate")
    result.machine_busy = sum(result.cpu_seconds.values()) / (elapsed * (os.cpu_count() or 1))
    result.host_busy = (host_after[0] - host_before[0]) / max(1, host_after[1] - host_before[1])
    # Invalid when the machine (whoever used it), or one process (the sim pool shares one event loop), had no CPU to
    # spare: then the modelled GPU steps stretch and the comparison measures the host, not the routing.
    result.valid = max(result.machine_busy, result.host_busy) < 0.9 and max(result.cpu_seconds.values()) / elapsed < 0.9
    return result


def _server_mean_ms(before: list[dict[str, float]], after: list[dict[str, float]], histogram: str) -> float:
    """The mean of a servers' histogram over the run, all servers together, in ms (0 when nothing was observed)."""
    total, count = (
        sum(a.get(f"{histogram}_{k}", 0) - b.get(f"{histogram}_{k}", 0) for a, b in zip(after, before, strict=True))
        for k in ("sum", "count")
    )
    return 1e3 * total / count if count else 0.0


# Two picks of one endpoint less than this apart are a repeat (`repeat_picks`): a burst's requests reach the EPPs
# within a few milliseconds of each other; a peer's pick reaches a replica within about one.
REPEAT_SECONDS = 0.010


def repeat_picks(picks: list[tuple[float, str, str]], since: float) -> tuple[float, float]:
    """Of the picks (wall time, endpoint, EPP) made from `since` on, the share that chose an endpoint some pick chose
    less than REPEAT_SECONDS before, and of those the share where the last such pick came from another EPP."""
    picks = sorted(picks)
    last: dict[str, tuple[float, str]] = {}  # endpoint -> its last pick: when, by which EPP
    counted = repeats = cross = 0
    for at, endpoint, epp in picks:
        before = last.get(endpoint)
        last[endpoint] = (at, epp)
        if at < since:
            continue
        counted += 1
        if before is not None and at - before[0] < REPEAT_SECONDS:
            repeats += 1
            cross += before[1] != epp
    return (repeats / counted if counted else 0.0), (cross / repeats if repeats else 0.0)


# The files whose share of the profiled EPP's samples a run reports (a sample counts for each file it has a frame in):
# the replica channel (what it sends, receives and applies, its callees included), and what a peer's datagram feeds
PROFILED_FILES = ("epp/replicas.py", "epp/predictor/", "epp/scheduling/plugins/prefix_cache_scorer.py")
PROFILE_RATE = 200  # py-spy samples a second


async def _channel_cpu(session: aiohttp.ClientSession, stack: LocalStack) -> dict[str, float]:
    """The replica channel's CPU seconds by part, summed over the stack's EPPs (none without sharing)."""
    seconds: dict[str, float] = {}
    for metrics_url in stack.epp_metrics_urls:
        async with session.get(metrics_url) as r:
            for part, value in _CHANNEL_CPU.findall(await r.text()):
                seconds[part] = seconds.get(part, 0.0) + float(value)
    return seconds


def _profile(pid: int, duration: float, out: Path) -> subprocess.Popen:
    """py-spy sampling `pid` for `duration` s into `out` (collapsed stacks), without stopping it for each sample."""
    # the environment's own py-spy when it is not on PATH (epp-bench run by its path)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    command = [spy, "record", "--nonblocking", "--format", "raw", "--rate", str(PROFILE_RATE)]
    command += ["--duration", str(max(1, round(duration))), "--pid", str(pid), "--output", str(out)]
    try:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SystemExit("--profile needs py-spy (pip install -e '.[bench]')") from None


def profile_shares(path: Path) -> tuple[int, dict[str, float]]:
    """A py-spy collapsed-stack file: its samples, and the share of them with a frame in each of PROFILED_FILES and
    in each function of the replica channel ("epp/replicas.py:datagram_received"), callees included."""
    counts: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines() if path.exists() else ():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        keys = {f for f in PROFILED_FILES if f in stack}
        keys |= {f"epp/replicas.py:{frame.split(' (')[0]}" for frame in stack.split(";") if "epp/replicas.py" in frame}
        for key in keys:
            counts[key] = counts.get(key, 0) + int(n)
    return total, {k: v / total for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def target_label(target: str, replicas: int, sharing: bool, shadows: bool = False, repeat: int = 0) -> str:
    """A run's name in the report: the target, and for several EPP replicas how many, whether they share their
    load and whether only the first routes ("epp x3", "epp x3 unshared", "epp 1+2 shadows"); with repeats, which
    round ("epp x3 #2")."""
    label = target
    if replicas > 1:
        label += (f" 1+{replicas - 1} shadows" if shadows else f" x{replicas}") + ("" if sharing else " unshared")
    return label + (f" #{repeat}" if repeat else "")


def bare_target(r: TargetResult) -> str:
    """The target a run measured, without its replicas and round ("epp x3 #2" -> "epp")."""
    return r.target.split(" ", 1)[0]


def replica_variants(
    target: str, replicas: list[int], sharing: list[bool], shadows: list[bool] = (False,)
) -> list[tuple[int, bool, bool]]:
    """The (replicas, sharing, shadows) runs of one target: each combination for an EPP target (one replica shares
    with nobody and has no shadows), one replica for the others."""
    if target not in EPP_TARGETS:
        return [(1, True, False)]
    return list(
        dict.fromkeys(
            (n, share if n > 1 else True, shadow and n > 1) for n in replicas for shadow in shadows for share in sharing
        )
    )


def _from_outcomes(result: TargetResult, outcomes: list[Outcome], elapsed: float) -> None:
    result.requests = len(outcomes)
    ok = [o for o in outcomes if o.status == 200]
    result.succeeded = len(ok)
    for o in outcomes:
        if o.status != 200:
            result.errors[str(o.status)] = result.errors.get(str(o.status), 0) + 1
    result.ttft_ms = _summary([o.ttft for o in ok])
    result.ttft_samples_ms = [1e3 * o.ttft for o in ok]
    result.itl_ms = _summary([o.itl for o in ok])
    result.e2e_ms = _summary([o.e2e for o in ok])
    # TTFT split by whether the server had most of the prompt cached: routing quality (how many hits) apart from
    # the cost of the path and of queueing (how fast a hit is served).
    hit = [o.ttft for o in ok if o.cached_share >= 0.5]
    miss = [o.ttft for o in ok if o.cached_share < 0.5]
    result.cache_hit_requests = len(hit)
    result.ttft_hit_ms, result.ttft_miss_ms = _summary(hit), _summary(miss)
    result.requests_per_s = len(ok) / elapsed
    result.output_tokens_per_s = sum(o.output_tokens for o in ok) / elapsed
    judged = [o.met_slo for o in outcomes if o.met_slo is not None]
    result.slo_requests, result.slo_met = len(judged), sum(judged)
    result.goodput_per_s = result.slo_met / elapsed
    by_kind: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, []).append(o)
    if len(by_kind) > 1:
        for kind, group in sorted(by_kind.items()):
            judged = [o.met_slo for o in group if o.met_slo is not None]
            result.by_kind[kind] = {
                "requests": len(group),
                "succeeded": sum(o.status == 200 for o in group),
                "ttft_ms": _summary([o.ttft for o in group if o.status == 200]),
                "slo_requests": len(judged),
                "slo_met": sum(judged),
                # of those that missed: by TTFT, by time per output token (a request missing both counts in both)
                "missed_ttft": sum("ttft" in o.missed for o in group),
                "missed_tpot": sum("tpot" in o.missed for o in group),
            }


def _from_inference_perf(result: TargetResult, summary: dict) -> None:
    successes, failures = summary["successes"], summary["failures"]
    result.succeeded, result.requests = successes["count"], successes["count"] + failures["count"]
    if failures["count"]:
        result.errors["failed (inference-perf)"] = failures["count"]
    latency = successes.get("latency") or {}
    result.ttft_ms = inference_perf.ms(latency.get("time_to_first_token"))
    result.itl_ms = inference_perf.ms(latency.get("inter_token_latency"))
    result.e2e_ms = inference_perf.ms(latency.get("request_latency"))
    throughput = successes.get("throughput") or {}
    result.requests_per_s = throughput.get("requests_per_sec", 0.0)
    result.output_tokens_per_s = throughput.get("output_tokens_per_sec", 0.0)


def markdown(results: list[TargetResult], floors: dict[float, agentic.Floor] | None = None) -> str:
    """The report; `floors`: the agentic plan's idle-server floor per rate (agentic.floor)."""
    lines = []
    for rate, concurrency in sorted({(r.rate, r.concurrency) for r in results}):
        rows = [r for r in results if (r.rate, r.concurrency) == (rate, concurrency)]
        base = next((r for r in rows if bare_target(r) == "round-robin"), None)
        peers = [r for r in rows if bare_target(r) in PEER_TARGETS and r.ttft_ms]
        # The goal is set against the peers' cache-aware policies; their round robin only when nothing else ran.
        peers = [r for r in peers if PEER_TARGETS[bare_target(r)][1] == "cache_aware"] or peers
        best_peer = min(peers, key=lambda r: r.ttft_ms["mean"]) if peers else None
        title = f"closed loop, {concurrency} concurrent clients" if concurrency else f"{rate:g} requests/s"
        if rows and rows[0].load_generator != "builtin":
            title += f" (load generator: {rows[0].load_generator})"
        lines += [
            f"### {title}",
            "",
            "| target | TTFT mean | TTFT p90 | ITL mean | e2e p90 | req/s | out tok/s | success | prefix hits | "
            "cached requests (TTFT cached / not) | per server | TTFT vs RR (mean / p90) | TTFT vs best peer (mean / p90) | "
            "valid |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            t = r.ttft_ms or {"mean": float("nan"), "p90": float("nan")}
            vs_rr = (
                f"{t['mean'] / base.ttft_ms['mean']:.2f} / {t['p90'] / base.ttft_ms['p90']:.2f}"
                if base and base.ttft_ms
                else "-"
            )
            vs_peer = (
                f"{t['mean'] / best_peer.ttft_ms['mean']:.2f} / {t['p90'] / best_peer.ttft_ms['p90']:.2f} "
                f"({best_peer.target})"
                if best_peer
                else "-"
            )
            cached = (  # inference-perf does not report the usage's cached_tokens per request
                f"{r.cache_hit_requests} ({r.ttft_hit_ms.get('mean', 0):.0f} / {r.ttft_miss_ms.get('mean', 0):.0f})"
                if r.load_generator == "builtin"
                else "-"
            )
            lines.append(
                f"| {r.target} | {t['mean']:.0f} | {t['p90']:.0f} | {r.itl_ms.get('mean', 0):.1f} | {r.e2e_ms.get('p90', 0):.0f} | "
                f"{r.requests_per_s:.1f} | {r.output_tokens_per_s:.0f} | {r.succeeded}/{r.requests} | "
                f"{r.prefix_hit_rate:.0%} | {cached} | {'/'.join(map(str, r.per_server))} | {vs_rr} | {vs_peer} | "
                f"{'yes' if r.valid else f'no (CPU: ours {r.machine_busy:.0%}, host {r.host_busy:.0%})'} |"
            )
        lines.append("")
        lines += _replicas_table(rows)
        lines += _spread_table(rows)
        floor = (floors or {}).get(rate)
        if floor is not None:
            vs_rr = (
                f"; round robin's client TTFT is {base.ttft_ms['mean'] / floor.held['mean']:.1f}x / "
                f"{base.ttft_ms['p90'] / floor.held['p90']:.1f}x the first"
                if base and base.ttft_ms
                else ""
            )
            lines += [
                f"the plan's floor ({floor.requests} requests, each alone on an idle server, the sim's timing model): "
                f"TTFT mean / p90 {floor.held['mean']:.0f} / {floor.held['p90']:.0f} ms where the server holds all "
                f"its earlier context, {floor.shared_only['mean']:.0f} / {floor.shared_only['p90']:.0f} ms where it "
                f"holds only the shared prompt{vs_rr}",
                "",
            ]
        lines += [
            "mean TTFT at the model servers [of it queued / in prefill] (client's): "
            + ", ".join(
                f"{r.target} {r.server_ttft_ms:.0f} [{r.server_queue_ms:.1f} / {r.server_prefill_ms:.1f}] "
                f"({r.ttft_ms.get('mean', 0):.0f})"
                for r in rows
                if r.server_ttft_ms
            ),
            "",
        ]
        if any(r.gateway_ms for r in rows):
            lines += [
                "at the gateway, ms: before the request left for its server (the EPP's part) mean / p90, and from "
                "then to its first response byte mean: "
                + ", ".join(
                    f"{r.target} {g['routing_mean']:.2f} / {g['routing_p90']:.2f}, {g['upstream_mean']:.1f}"
                    for r in rows
                    if (g := r.gateway_ms)
                ),
                "",
            ]
        for r in rows:
            epp_cpu = sum(v for k, v in r.cpu_seconds.items() if k.startswith("epp"))
            if r.epp_index and r.succeeded:
                i = r.epp_index
                lines += [
                    f"{r.target}: EPP CPU {1e3 * epp_cpu / r.succeeded:.2f} ms per request; at the end, KV-event index "
                    f"{i.get('kv_events_index_entries', 0):.0f} entries, approximate index "
                    f"{i.get('prefix_indexer_size', 0):.0f} entries, EPP resident memory {i['rss_mb']:.0f} MB",
                    "",
                ]
                if i.get("replica_datagrams_sent_total"):
                    lines += [
                        f"{r.target}: replica datagrams sent since the EPPs started, per request (all replicas, "
                        f"each peer counted): {i['replica_datagrams_sent_total'] / r.succeeded:.2f}, "
                        f"{i.get('replica_bytes_sent_total', 0) / r.succeeded:.0f} bytes; model servers' pages read "
                        f"for the peers {i.get('pages_sent', 0):.0f}, taken from them {i.get('pages_received', 0):.0f}",
                        "",
                    ]
                turns = {k.removeprefix("turns_"): v for k, v in i.items() if k.startswith("turns_") and v}
                if turns:
                    lines += [
                        f"{r.target}: the replicas' turns to pick since they started (all replicas): "
                        + ", ".join(f"{k} {v:.0f}" for k, v in turns.items())
                        + (
                            f"; {i['turn_wait_count']:.0f} picks waited for a turn, "
                            f"{1e3 * i['turn_wait_sum'] / i['turn_wait_count']:.2f} ms on average"
                            if i.get("turn_wait_count")
                            else ""
                        ),
                        "",
                    ]
                if r.channel_cpu:
                    parts = ", ".join(f"{k} {1e3 * v / r.succeeded:.3f}" for k, v in r.channel_cpu.items())
                    lines += [
                        f"{r.target}: the replica channel's CPU over the run, ms per request (all replicas): {parts}; "
                        f"{1e3 * sum(r.channel_cpu.values()) / r.succeeded:.3f} in all",
                        "",
                    ]
            if r.repeat_picks:
                lines += [
                    f"{r.target}: {r.repeat_picks:.1%} of the picks chose an endpoint picked less than "
                    f"{1e3 * REPEAT_SECONDS:g} ms before ({r.repeat_picks_cross:.0%} of those by another replica)",
                    "",
                ]
            if r.profile_samples:
                shares = ", ".join(f"{k} {v:.1%}" for k, v in r.profile_shares.items())
                lines += [f"{r.target}: the first EPP's profile, {r.profile_samples} samples: {shares}", ""]
        follow_ups = [r for r in rows if r.follow_ups]
        if follow_ups:
            lines += [
                "Responses follow-ups (previous_response_id) answered with their stored conversation: "
                + ", ".join(f"{r.target} {r.follow_ups_ok}/{r.follow_ups}" for r in follow_ups),
                "",
            ]
        lines += _by_kind_table(rows, base)
        lines += _goodput_table(rows)
        for r in rows:
            if r.predictor:
                p = r.predictor
                lines += [
                    f"{r.target}: the latency predictor at the end had learnt from {p.get('observations', 0):.0f} "
                    f"requests; windowed MAPE TTFT {p.get('ttft_mape', float('nan')):.1%}, "
                    f"TPOT {p.get('tpot_mape', float('nan')):.1%}",
                    "",
                ]
    return "\n".join(lines) + "times in ms; TTFT ratios below 1 mean faster than the reference.\n"


def _ttft_ratio(a: TargetResult | None, b: TargetResult | None) -> tuple[float, float] | None:
    """a's TTFT over b's, (mean, p90); None when either did not run or served nothing."""
    if a is None or b is None or not a.ttft_ms or not b.ttft_ms:
        return None
    return a.ttft_ms["mean"] / b.ttft_ms["mean"], a.ttft_ms["p90"] / b.ttft_ms["p90"]


def _replicas_table(rows: list[TargetResult]) -> list[str]:
    """N replicas against one EPP of the same target and round, in its two causes: the floor (one routing replica
    and N-1 shadows against one EPP: what the replicas cost the machine while routing is not split) and the routing
    (N routing replicas against the floor: what splitting the requests between them costs); with repeats, each
    ratio's mean and range over the rounds."""
    groups: dict[tuple[str, int, bool, int], dict[str, TargetResult]] = {}
    for r in rows:
        if r.replicas > 1:
            groups.setdefault((bare_target(r), r.replicas, r.sharing, r.repeat), {})[
                "floor" if r.shadows else "split"
            ] = r
    if not groups:
        return []
    lines = [
        "N replicas against one EPP (TTFT mean / p90 ratios): floor = 1 routing + N-1 shadows / 1 EPP (the replicas' "
        "cost to the machine), routing = N routing / the floor (splitting the requests), in all = N routing / 1 EPP",
        "",
        "| run | floor | routing | in all | servers' own TTFT ms, of it queued (1 / floor / N) | "
        "prefix hits (1 / floor / N) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rounds: dict[tuple[str, int, bool], list[tuple]] = {}
    for (target, replicas, sharing, repeat), runs in groups.items():
        one = next((r for r in rows if bare_target(r) == target and r.replicas == 1 and r.repeat == repeat), None)
        floor, split = runs.get("floor"), runs.get("split")
        ratios = (_ttft_ratio(floor, one), _ttft_ratio(split, floor), _ttft_ratio(split, one))
        rounds.setdefault((target, replicas, sharing), []).append(ratios)
        named = target_label(target, replicas, sharing, repeat=repeat)
        cells = [f"{ratio[0]:.2f} / {ratio[1]:.2f}" if ratio else "-" for ratio in ratios]
        own = " / ".join(f"{r.server_ttft_ms:.0f} ({r.server_queue_ms:.1f})" if r else "-" for r in (one, floor, split))
        hits = " / ".join(f"{r.prefix_hit_rate:.0%}" if r else "-" for r in (one, floor, split))
        lines.append(f"| {named} | {' | '.join(cells)} | {own} | {hits} |")
    for (target, replicas, sharing), measured in rounds.items():
        if len(measured) < 2:
            continue
        cells = []
        for column in zip(*measured, strict=True):
            present = [ratio for ratio in column if ratio]
            if not present:
                cells.append("-")
                continue
            means, p90s = [m for m, _ in present], [p for _, p in present]
            cells.append(
                f"{statistics.fmean(means):.2f} ({min(means):.2f}-{max(means):.2f}) / "
                f"{statistics.fmean(p90s):.2f} ({min(p90s):.2f}-{max(p90s):.2f})"
            )
        named = target_label(target, replicas, sharing)
        lines.append(f"| **{named}, {len(measured)} rounds: mean (range)** | {' | '.join(cells)} | | |")
    return [*lines, ""]


def _spread_table(rows: list[TargetResult]) -> list[str]:
    """With repeats: each configuration's TTFT over its rounds, and the spread (max / min - 1), the noise a ratio
    between two single runs carries."""
    rounds: dict[str, list[TargetResult]] = {}
    for r in rows:
        if r.repeat and r.ttft_ms:
            rounds.setdefault(target_label(bare_target(r), r.replicas, r.sharing, r.shadows), []).append(r)
    if not any(len(runs) > 1 for runs in rounds.values()):
        return []
    lines = [
        "| configuration | rounds | TTFT mean per round | spread | TTFT p90 per round | spread | servers' own TTFT |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in rounds.items():
        means, p90s = [r.ttft_ms["mean"] for r in runs], [r.ttft_ms["p90"] for r in runs]
        lines.append(
            f"| {name} | {len(runs)} | {' / '.join(f'{v:.0f}' for v in means)} | {max(means) / min(means) - 1:.1%} | "
            f"{' / '.join(f'{v:.0f}' for v in p90s)} | {max(p90s) / min(p90s) - 1:.1%} | "
            f"{' / '.join(f'{r.server_ttft_ms:.0f}' for r in runs)} |"
        )
    return [*lines, ""]


def _by_kind_table(rows: list[TargetResult], base: TargetResult | None) -> list[str]:
    """TTFT per request class of the workload (a mix entry, a traffic tier): where each target gains or loses."""
    split = [r for r in rows if r.by_kind]
    if not split:
        return []
    lines = [
        "| target | class | succeeded | TTFT mean | TTFT p90 | TTFT vs RR (mean / p90) | met their SLO | missed TTFT / TPOT |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in split:
        for kind, k in r.by_kind.items():
            t = k["ttft_ms"] or {"mean": float("nan"), "p90": float("nan")}
            reference = (base.by_kind.get(kind) or {}).get("ttft_ms") if base else None
            vs_rr = f"{t['mean'] / reference['mean']:.2f} / {t['p90'] / reference['p90']:.2f}" if reference else "-"
            met = f"{k['slo_met']}/{k['slo_requests']}" if k["slo_requests"] else "-"
            missed = f"{k.get('missed_ttft', 0)} / {k.get('missed_tpot', 0)}" if k["slo_requests"] else "-"
            lines.append(
                f"| {r.target} | {kind} | {k['succeeded']}/{k['requests']} | {t['mean']:.0f} | {t['p90']:.0f} | "
                f"{vs_rr} | {met} | {missed} |"
            )
    return [*lines, ""]


def _goodput_table(rows: list[TargetResult]) -> list[str]:
    """Requests that met their own objectives, per target, against the best of the other targets."""
    judged = [r for r in rows if r.slo_requests]
    if not judged:
        return []
    lines = [
        "| target | met their SLO | goodput req/s | goodput vs best other |",
        "| --- | --- | --- | --- |",
    ]
    for r in judged:
        others = [o.goodput_per_s for o in judged if o is not r]
        best = max(others, default=0.0)
        ratio = f"{r.goodput_per_s / best:.2f}" if best else "-"
        lines.append(
            f"| {r.target} | {r.slo_met}/{r.slo_requests} ({r.slo_met / r.slo_requests:.0%}) | "
            f"{r.goodput_per_s:.1f} | {ratio} |"
        )
    return [*lines, ""]


def plots(results: list[TargetResult], out: Path) -> list[Path]:
    """PNG charts beside the tables: TTFT p90 against the load, the TTFT distribution of each target at each load,
    each target's throughput, and each run's load per server over time."""
    plt = charts.pyplot()
    if plt is None:
        print("epp-bench: matplotlib is not installed (pip install '.[harness]'); no plots written")
        return []
    paths = []
    for closed, xlabel, name in ((False, "requests/s", "rate"), (True, "concurrent clients", "concurrency")):
        runs = [r for r in results if bool(r.concurrency) == closed]
        if not runs:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for target in dict.fromkeys(r.target for r in runs):
            points = sorted(
                (r.concurrency if closed else r.rate, r.ttft_ms.get("p90", float("nan")))
                for r in runs
                if r.target == target
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=target)
        ax.set(xlabel=xlabel, ylabel="TTFT p90 (ms)", title=f"TTFT vs {xlabel}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / f"ttft_vs_{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    loads = {_load_label(r): [q for q in results if _load_label(q) == _load_label(r)] for r in results}
    for label, runs in loads.items():
        series = {r.target: r.ttft_samples_ms for r in runs}
        if any(series.values()):
            tag = label.replace(" ", "").replace("/", "per")
            paths.append(charts.cdf(series, out / f"ttft_cdf_{tag}.png", f"TTFT distribution at {label}"))
    throughput = {label: {r.target: r.requests_per_s for r in runs} for label, runs in loads.items()}
    paths.append(charts.bars(throughput, out / "throughput.png", "Throughput (successful requests)", "requests/s"))
    for r in results:
        if not r.load_over_time:
            continue
        per_server = {f"server {i}": [s[i] for s in r.load_over_time] for i in range(len(r.load_over_time[0]))}
        path = out / f"load_{r.target}_{f'c{r.concurrency}' if r.concurrency else f'{r.rate:g}'}.png"
        title = f"{r.target} at {_load_label(r)}: load per server"
        paths.append(charts.over_time(per_server, LOAD_SAMPLE_SECONDS, path, title, "running + waiting"))
    return paths


def _load_label(r: TargetResult) -> str:
    return f"{r.concurrency} clients" if r.concurrency else f"{r.rate:g} req/s"


async def compare(
    workload: str,
    targets: list[str],
    rates: list[float],
    duration: float,
    servers: int,
    out: Path,
    scale: float = 1.0,
    progress=print,
    concurrencies: list[int] = (),
    load_generator: str = "builtin",
    warmup: float = 0.0,
    replicas: list[int] = (1,),
    sharing: list[bool] = (True,),
    burst: int = 0,
    shadows: list[bool] = (False,),
    profile: bool = False,
    repeats: int = 1,
) -> list[TargetResult]:
    """Each target at each load; an EPP target once per replica count, sharing and routing choice
    (`replica_variants`). `repeats` > 1: at each load every run that many times, in rounds (each round runs every
    target and variant once, so that a slow drift of the host lands on all of them alike).
    `burst` > 0: arrivals (requests, or agent sessions) come in bursts of that many at once, at the same rate.
    `profile`: py-spy samples each run's first EPP (`run_target`)."""
    known = {**EPP_TARGETS, **ENVOY_TARGETS, **PEER_TARGETS, **dict.fromkeys(ORACLE_TARGETS)}
    unknown = [t for t in targets if t not in known]
    if unknown:  # before anything starts
        raise ValueError(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(known)}")
    spec = load_workload(workload)
    if burst:
        spec["arrival"] = {**spec.get("arrival", {}), "burst": burst}
    out.mkdir(parents=True, exist_ok=True)
    results = []
    loads = [(0.0, c) for c in concurrencies] or [(rate, 0) for rate in rates]
    skipped = set()
    for rate, concurrency in loads:
        for repeat in range(1, repeats + 1) if repeats > 1 else (0,):
            for target in targets:
                if target in PEER_TARGETS and peer_command(PEER_TARGETS[target][0]) is None:
                    if target not in skipped:
                        progress(f"skip {target}: not installed (pip install '.[bench]')")
                    skipped.add(target)
                    continue
                for n, share, shadow in replica_variants(target, list(replicas), list(sharing), list(shadows)):
                    label = target_label(target, n, share, shadow, repeat)
                    load = f"{concurrency} concurrent clients" if concurrency else f"{rate:g} req/s"
                    progress(f"{workload}: {label} at {load} for {duration:g} s on {servers} servers ...")
                    run = label.replace(" ", "-").replace("#", "r")
                    workdir = out / "runs" / f"{run}-{f'c{concurrency}' if concurrency else f'{rate:g}'}"
                    workdir.mkdir(parents=True, exist_ok=True)
                    results.append(
                        await run_target(
                            target,
                            spec,
                            rate,
                            duration,
                            servers,
                            workdir,
                            scale,
                            concurrency=concurrency,
                            load_generator=load_generator,
                            warmup=warmup,
                            replicas=n,
                            sharing=share,
                            shadows=shadow,
                            profile=profile,
                            repeat=repeat,
                        )
                    )
    (out / f"{workload}.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    floors = {}
    if spec["name"] == "agentic" and not concurrencies:
        floors = {rate: agentic.floor(spec, agentic.sessions(spec, rate, duration, 0, scale), scale) for rate in rates}
    (out / f"{workload}.md").write_text(markdown(results, floors))
    plots(results, out)
    return results
