"""Multi-tenant flood (issue 14): a sim pool driven past its capacity by tenants of different priority, one of
them noisy, through each target: our EPP with flow control (the default, with its request TTL set below the TTFT
SLO: a request that waited that long is answered 429 instead of late), our EPP without it, Envoy round robin, and
the Rust routers with their own admission limits as SGLang's gateway docs size them (vllm-router is a fork with the
same flags): max concurrent requests = workers x requests per worker (the pool's batch slots), queue size = that x
1 (the "interactive" factor), token refill = the sustainable request rate x 1.2 (without it the bucket refills at
max-concurrent-requests per second), queue timeout = our TTL in whole seconds.

Traffic (shares of the offered rate): three equal-priority tenants (fairness ids), `noisy` sending 10x what
`quiet-1` and `quiet-2` send; `critical` (objective priority 1) and `sheddable` (objective priority -1). The
pool's capacity is measured first (closed loop at the pool's batch slots, straight to the servers) and the offered
rate is a multiple of it. Per class: goodput (requests whose TTFT met the SLO, per second), TTFT p50/p99, statuses;
the Jain index of the equal-priority tenants' served tokens relative to min(demand, max-min fair share); the pool's
goodput against its capacity. For our EPP with flow control, every request is accounted for: the EPP's outcome
counts (dispatched / rejected / expired / cancelled, from its metrics) per tenant add up to what was sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from epp.config.loader import DEFAULT_CONFIG
from harness.bench import charts
from harness.bench.compare import ENVOY_TARGETS, LOAD_SAMPLE_SECONDS, MODEL, PEER_TARGETS, Outcome, Pool, _load, _one
from harness.bench.overhead import percentile
from harness.bench.peers import peer_command

SLO_TTFT = 2.0  # seconds: what "served in time" means here (the unloaded TTFT is ~0.1 s)
MAX_NUM_SEQS = 4  # batch slots per sim server: the pool's capacity is servers x this / request time
OUTPUT_TOKENS = 32
PROMPT_WORDS = 60
SIM_ARGS = ["--max-num-seqs", str(MAX_NUM_SEQS), "--sim-decode-base", "0.02", "--disable-log-stats"]
CLASSES = {  # name: (share of the offered rate, headers)
    "noisy": (10.0, {"x-gateway-inference-fairness-id": "noisy"}),
    "quiet-1": (1.0, {"x-gateway-inference-fairness-id": "quiet-1"}),
    "quiet-2": (1.0, {"x-gateway-inference-fairness-id": "quiet-2"}),
    "critical": (0.6, {"x-gateway-inference-objective": "critical", "x-gateway-inference-fairness-id": "critical"}),
    "sheddable": (2.0, {"x-gateway-inference-objective": "batch", "x-gateway-inference-fairness-id": "batch"}),
}
EQUAL_PRIORITY = ("noisy", "quiet-1", "quiet-2")
QUIET = ("quiet-1", "quiet-2")
OBJECTIVES = {"objectives": [{"name": "critical", "priority": 1}, {"name": "batch", "priority": -1}]}
WARMUP = 2.0  # seconds of the flood before completions count towards goodput and sharing
TTL = 1.5  # seconds a request may wait in flow control: the SLO less the time a dispatched request takes to start
TARGETS = {
    "epp": DEFAULT_CONFIG + f"flowControl: {{defaultRequestTTL: {TTL}s}}\n",  # flow control on (the default)
    "epp-no-flow-control": DEFAULT_CONFIG + "flowControl: {enabled: false}\n",
    "round-robin": None,
    "sglang-round-robin": None,
    "vllm-cache-aware": None,
}


@dataclass
class ClassResult:
    sent: int = 0
    ok: int = 0
    in_slo: int = 0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    served_tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)  # the EPP's flow-control outcomes for this tenant


@dataclass
class FloodResult:
    target: str
    overload: float
    offered_rate: float
    capacity: float
    duration: float
    classes: dict[str, ClassResult] = field(default_factory=dict)
    jain: float = 0.0
    pool_goodput_ratio: float = 0.0  # requests served within the SLO while the flood lasted, per second / capacity
    pool_throughput_ratio: float = 0.0  # requests completed while the flood lasted, per second / capacity
    server_errors: int = 0
    accounted: bool | None = None  # the EPP's outcomes per tenant == requests sent (None: no flow control)
    ttft_samples_ms: dict[str, list[float]] = field(default_factory=dict)  # per class, its served requests' TTFTs
    completed_per_s: list[int] = field(default_factory=list)  # requests completed in each second from the start
    load_over_time: list[list[int]] = field(
        default_factory=list
    )  # every LOAD_SAMPLE_SECONDS: running + waiting per server


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(("cache", "queue", "token", "route", "batch", "prefix")) for _ in range(PROMPT_WORDS))


async def measure_capacity(servers: int, workdir: Path, seconds: float = 8.0) -> float:
    """Requests per second the pool completes with every batch slot busy (closed loop, straight to the servers)."""
    workdir.mkdir(parents=True, exist_ok=True)
    async with Pool("round-robin", servers, workdir, SIM_ARGS) as pool:
        urls = pool.stack.model_server_urls
        done = 0
        rng = random.Random(1)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            started = time.monotonic()

            async def client(url: str) -> None:
                nonlocal done
                while time.monotonic() - started < seconds:
                    body = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
                    async with session.post(f"{url}/v1/completions", json=body) as r:
                        await r.read()
                        done += r.status == 200

            await asyncio.gather(*(client(url) for url in urls for _ in range(MAX_NUM_SEQS)))
            return done / (time.monotonic() - started)


def _max_min_fair(demands: list[float], total: float) -> list[float]:
    """Water-filling: each tenant gets min(its demand, an equal share of what the smaller demands leave)."""
    shares = [0.0] * len(demands)
    left, order = total, sorted(range(len(demands)), key=demands.__getitem__)
    for i, index in enumerate(order):
        shares[index] = min(demands[index], left / (len(order) - i))
        left -= shares[index]
    return shares


def jain_index(served: list[float], demands: list[float]) -> float:
    fair = _max_min_fair(demands, sum(served))
    x = [s / f for s, f in zip(served, fair, strict=True) if f > 0]
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if x and any(x) else 0.0


async def run_target(
    target: str, overload: float, capacity: float, duration: float, servers: int, workdir: Path, seed: int = 0
) -> FloodResult:
    workdir.mkdir(parents=True, exist_ok=True)
    rate = capacity * overload
    total_share = sum(share for share, _ in CLASSES.values())
    rng = random.Random(seed)
    stream: list[tuple[float, str]] = []
    for name, (share, _) in CLASSES.items():
        t = 0.0
        while (t := t + rng.expovariate(rate * share / total_share)) < duration:
            stream.append((t, name))
    stream.sort()
    router_args = [
        "--max-concurrent-requests",
        str(servers * MAX_NUM_SEQS),
        "--queue-size",
        str(servers * MAX_NUM_SEQS),
        "--rate-limit-tokens-per-second",
        str(math.ceil(capacity * 1.2)),
        "--queue-timeout-secs",
        str(max(1, int(TTL))),
    ]
    result = FloodResult(target, overload, rate, capacity, duration)
    async with Pool(
        target,
        servers,
        workdir,
        SIM_ARGS,
        epp_config=TARGETS.get(target),
        pool_extra=OBJECTIVES,
        router_args=router_args,
    ) as pool:
        url = f"{pool.url}/v1/completions"
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=TTL + 60)
        ) as session:
            started = time.monotonic()

            async def sample_load() -> None:
                while True:
                    result.load_over_time.append(await _load(session, pool.stack.model_server_urls))
                    await asyncio.sleep(LOAD_SAMPLE_SECONDS)

            sampler = asyncio.create_task(sample_load())
            tasks: list[tuple[str, float, asyncio.Task[Outcome]]] = []
            for offset, name in stream:
                await asyncio.sleep(max(0.0, started + offset - time.monotonic()))
                body = {
                    "model": MODEL,
                    "prompt": _prompt(rng),
                    "max_tokens": OUTPUT_TOKENS,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "ignore_eos": True,
                }
                tasks.append((name, offset, asyncio.create_task(_one(session, url, body, CLASSES[name][1]))))
            outcomes = [(name, offset, await task) for name, offset, task in tasks]
            sampler.cancel()
            flow_outcomes = await _flow_control_outcomes(session, pool) if target == "epp" else None
    # While the flood lasts: what was completed before the arrivals stopped (after that the queues drain and every
    # tenant's backlog gets served, which says nothing about sharing under overload), after the first WARMUP seconds
    # (an empty pool completes nothing until its first requests have run their course).
    in_window = [(name, o) for name, offset, o in outcomes if o.status == 200 and WARMUP <= offset + o.e2e <= duration]
    done = [int(offset + o.e2e) for _, offset, o in outcomes if o.status == 200]
    result.completed_per_s = [0] * (max(done) + 1 if done else 0)
    for second in done:
        result.completed_per_s[second] += 1
    outcomes = [(name, o) for name, _, o in outcomes]
    for name in CLASSES:
        mine = [o for n, o in outcomes if n == name]
        ok = [o for o in mine if o.status == 200]
        ttfts = sorted(o.ttft for o in ok)
        result.ttft_samples_ms[name] = [1e3 * t for t in ttfts]
        statuses: dict[str, int] = {}
        for o in mine:
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        result.classes[name] = ClassResult(
            sent=len(mine),
            ok=len(ok),
            in_slo=sum(1 for o in ok if o.ttft <= SLO_TTFT),
            ttft_p50=percentile(ttfts, 0.5) if ttfts else 0.0,
            ttft_p99=percentile(ttfts, 0.99) if ttfts else 0.0,
            served_tokens=sum(o.output_tokens for o in ok),
            statuses=statuses,
            outcomes=(flow_outcomes or {}).get(CLASSES[name][1]["x-gateway-inference-fairness-id"], {}),
        )
    if flow_outcomes is not None:
        result.accounted = all(sum(c.outcomes.values()) == c.sent for c in result.classes.values())
    served = [sum(o.output_tokens for n, o in in_window if n == name) for name in EQUAL_PRIORITY]
    demands = [result.classes[n].sent * OUTPUT_TOKENS for n in EQUAL_PRIORITY]
    result.jain = jain_index(served, demands)
    result.pool_goodput_ratio = sum(1 for _, o in in_window if o.ttft <= SLO_TTFT) / (duration - WARMUP) / capacity
    result.pool_throughput_ratio = len(in_window) / (duration - WARMUP) / capacity
    result.server_errors = sum(1 for _, o in outcomes if 500 <= o.status < 600)
    return result


async def _flow_control_outcomes(session: aiohttp.ClientSession, pool: Pool) -> dict[str, dict[str, int]]:
    """fairness id -> outcome -> requests, from the EPP's queue-duration histogram (one observation per request)."""
    async with session.get(pool.stack.epp_metrics_url) as response:
        page = await response.text()
    out: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(page):
        if family.name != "inference_extension_flow_control_request_queue_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                by_outcome = out.setdefault(sample.labels["fairness_id"], {})
                by_outcome[sample.labels["outcome"]] = int(sample.value)
    return out


def markdown(results: list[FloodResult], unloaded_ttft_p99: float) -> str:
    lines = [
        f"TTFT SLO {SLO_TTFT:g} s; critical TTFT p99 on the unloaded pool {unloaded_ttft_p99 * 1000:.0f} ms",
        "",
        "| target | overload | class | sent | 200 | in SLO | TTFT p50 ms | TTFT p99 ms | other statuses | EPP outcomes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for name, c in r.classes.items():
            others = ", ".join(f"{k}: {v}" for k, v in sorted(c.statuses.items()) if k != "200") or "-"
            outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(c.outcomes.items())) or "-"
            lines.append(
                f"| {r.target} | {r.overload:g}x | {name} | {c.sent} | {c.ok} | {c.in_slo} | "
                f"{c.ttft_p50 * 1000:.0f} | {c.ttft_p99 * 1000:.0f} | {others} | {outcomes} |"
            )
    lines += [
        "",
        "| target | overload | offered req/s | capacity req/s | completed during the flood / capacity | "
        "in-SLO goodput / capacity | Jain (equal priority, during the flood) | critical p99 / unloaded | "
        "quiet p99 / unloaded | 5xx | all accounted for |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        critical = r.classes["critical"].ttft_p99 / unloaded_ttft_p99 if unloaded_ttft_p99 else 0.0
        quiet = max(r.classes[n].ttft_p99 for n in QUIET) / unloaded_ttft_p99 if unloaded_ttft_p99 else 0.0
        accounted = "-" if r.accounted is None else ("yes" if r.accounted else "NO")
        lines.append(
            f"| {r.target} | {r.overload:g}x | {r.offered_rate:.1f} | {r.capacity:.1f} | "
            f"{r.pool_throughput_ratio:.2f} | {r.pool_goodput_ratio:.2f} | {r.jain:.3f} | {critical:.2f} | "
            f"{quiet:.2f} | {r.server_errors} | {accounted} |"
        )
    return "\n".join(lines)


async def unloaded_ttft_p99(servers: int, workdir: Path, requests: int = 30) -> float:
    """Critical requests one at a time through our EPP: the TTFT the critical band should keep under overload."""
    workdir.mkdir(parents=True, exist_ok=True)
    async with Pool("epp", servers, workdir, SIM_ARGS, epp_config=DEFAULT_CONFIG, pool_extra=OBJECTIVES) as pool:
        rng = random.Random(2)
        async with aiohttp.ClientSession() as session:
            ttfts = []
            for _ in range(requests):
                body = {
                    "model": MODEL,
                    "prompt": _prompt(rng),
                    "max_tokens": OUTPUT_TOKENS,
                    "stream": True,
                    "ignore_eos": True,
                }
                outcome = await _one(session, f"{pool.url}/v1/completions", body, CLASSES["critical"][1])
                ttfts.append(outcome.ttft)
    return percentile(ttfts, 0.99)


def plots(results: list[FloodResult], out: Path) -> list[Path]:
    """PNG charts beside flood.md: each overload's TTFT distribution per target and class, the requests each target
    completed per second (its throughput over the flood and the drain after it), and each run's load per server."""
    if charts.pyplot() is None:
        print("epp-bench: matplotlib is not installed (pip install '.[harness]'); no plots written")
        return []
    paths = []
    for overload in dict.fromkeys(r.overload for r in results):
        runs = [r for r in results if r.overload == overload]
        series = {f"{r.target} {name}": samples for r in runs for name, samples in r.ttft_samples_ms.items()}
        title = f"TTFT at {overload:g}x capacity"
        paths.append(charts.cdf(series, out / f"flood_ttft_cdf_{overload:g}x.png", title))
        completed = {r.target: r.completed_per_s for r in runs}
        title = f"Requests completed per second at {overload:g}x capacity"
        paths.append(charts.over_time(completed, 1.0, out / f"flood_throughput_{overload:g}x.png", title, "requests/s"))
        for r in runs:
            if r.load_over_time:
                servers = range(len(r.load_over_time[0]))
                per_server = {f"server {i}": [sample[i] for sample in r.load_over_time] for i in servers}
                path = out / f"flood_load_{r.target}_{overload:g}x.png"
                title = f"{r.target} at {overload:g}x capacity: load per server"
                paths.append(charts.over_time(per_server, LOAD_SAMPLE_SECONDS, path, title, "running + waiting"))
    return paths


async def flood(
    targets: list[str], overloads: list[float], duration: float, servers: int, out: Path | None
) -> list[FloodResult]:
    workdir = Path(out or ".") / "flood-work"
    workdir.mkdir(parents=True, exist_ok=True)
    capacity = await measure_capacity(servers, workdir / "capacity")
    baseline = await unloaded_ttft_p99(servers, workdir / "unloaded")
    print(f"pool capacity {capacity:.1f} req/s; unloaded critical TTFT p99 {baseline * 1000:.0f} ms", flush=True)
    results = []
    for overload in overloads:
        for target in targets:
            if target in PEER_TARGETS and peer_command(PEER_TARGETS[target][0]) is None:
                print(f"{target}: not installed (pip install -e '.[bench]'), skipped", flush=True)
                continue
            if target not in TARGETS and target not in ENVOY_TARGETS:
                raise SystemExit(f"unknown flood target {target!r}; known: {', '.join(TARGETS)}")
            result = await run_target(target, overload, capacity, duration, servers, workdir / f"{target}-{overload:g}")
            results.append(result)
            print(markdown([result], baseline), flush=True)
    report = markdown(results, baseline)
    if out is not None:
        (out / "flood.md").write_text(report + "\n")
        (out / "flood.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
        plots(results, out)
    print("\n" + report)
    return results
