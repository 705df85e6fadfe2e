"""What the EPP costs: Envoy + EPP against a plain Envoy in front of the same zero-delay sim pool, in one run.

* added latency, one request at a time (p50, p99), the two targets interleaved request by request;
* throughput at a fixed concurrency (default 32), each target run twice in alternating order;
* the CPU seconds each process used, so a reader can see when the 2-core machine itself is the limit.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from epp.bench.peers import peer_command, start_router
from epp.bench.ports import free_port_block, free_ports
from epp.envoy import EnvoyProcess, render_baseline, terminate
from epp.local import LocalStack, StackConfig

BODY = {"model": "sim-llama-8b", "prompt": "Say hello to the benchmark.", "max_tokens": 1}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class OverheadResult:
    transport: str
    servers: int
    sequential_requests: int
    concurrency: int
    concurrent_requests: int
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # target -> p50/p99/mean
    added_latency_ms: dict[str, float] = field(default_factory=dict)
    throughput_rps: dict[str, float] = field(default_factory=dict)
    throughput_ratio: float = 0.0
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0

    def markdown(self) -> str:
        lines = [f"| target | p50 ms | p99 ms | mean ms | req/s at concurrency {self.concurrency} |",
                 "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for target, lat in self.latency_ms.items():
            lines.append(f"| {target} | {lat['p50']:.2f} | {lat['p99']:.2f} | {lat['mean']:.2f} | "
                         f"{self.throughput_rps.get(target, 0):.0f} |")  # fmt: skip
        lines.append("")
        lines.append(f"added latency of the EPP (ext_proc transport {self.transport}): p50 {self.added_latency_ms['p50']:+.2f} ms, "
                     f"p99 {self.added_latency_ms['p99']:+.2f} ms; throughput ratio EPP/plain "
                     f"{self.throughput_ratio:.2f}")  # fmt: skip
        lines.append("CPU seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.cpu_seconds.items()))
        return "\n".join(lines)


async def _one(session: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with session.post(url, json=BODY) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")
    return time.perf_counter() - started


async def _throughput(session: aiohttp.ClientSession, url: str, total: int, concurrency: int) -> float:
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await _one(session, url)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - started)


async def measure(
    servers: int = 4, sequential: int = 400, concurrency: int = 32, concurrent_requests: int = 2000,
    workdir: Path | None = None, with_peers: bool = True, transport: str = "h2",
) -> OverheadResult:  # fmt: skip
    base = free_port_block(servers)
    grpc, health, metrics, listener, admin, plain_listener, plain_admin = free_ports(7)
    stack = LocalStack(StackConfig(
        model_servers=servers, base_port=base, grpc_port=grpc, grpc_health_port=health, metrics_port=metrics,
        listener_port=listener, admin_port=admin, workdir=workdir,
        modelserver_args=["--sim-zero-delay", "--disable-log-stats"], epp_args=["--ext-proc-transport", transport],
    ))  # fmt: skip
    result = OverheadResult(transport, servers, sequential, concurrency, concurrent_requests)
    started_at = time.monotonic()
    await stack.start()
    plain = None
    routers = []
    try:
        config = stack.workdir / "plain-envoy.yaml"
        config.write_text(render_baseline(endpoints=[u.removeprefix("http://") for u in stack.model_server_urls],
                                          listener_port=plain_listener, admin_port=plain_admin))  # fmt: skip
        plain = EnvoyProcess(config, plain_admin, stack.workdir / "plain-envoy.log")
        plain.start()
        await plain.wait_ready()
        targets = {"envoy+epp": f"{stack.gateway_url}/v1/completions",
                   "plain envoy": f"http://127.0.0.1:{plain_listener}/v1/completions"}  # fmt: skip
        pids = {"epp": stack.processes["epp"].pid, "envoy (epp)": stack.envoy.process.pid,
                "envoy (plain)": plain.process.pid, "model servers": stack.processes["modelserver"].pid}  # fmt: skip
        for kind in ("sglang", "vllm") if with_peers else ():  # the Rust routers, when the [bench] extra installed them
            if peer_command(kind) is not None:
                process, url = await start_router(kind, "round_robin", stack.model_server_urls, stack.workdir,
                                                  BODY["model"])  # fmt: skip
                routers.append(process)
                targets[f"{kind}-router"] = f"{url}/v1/completions"
                pids[f"{kind}-router"] = process.pid
        cpu_before = {k: cpu_seconds(p) for k, p in pids.items()}
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            for url in targets.values():  # warm up connections and caches
                for _ in range(50):
                    await _one(session, url)
            latencies: dict[str, list[float]] = {name: [] for name in targets}
            for _ in range(sequential):
                for name, url in targets.items():
                    latencies[name].append(await _one(session, url))
            for name, values in latencies.items():
                result.latency_ms[name] = {"p50": percentile(values, 0.5) * 1e3, "p99": percentile(values, 0.99) * 1e3,
                                           "mean": statistics.fmean(values) * 1e3}  # fmt: skip
            rates: dict[str, list[float]] = {name: [] for name in targets}
            for order in (list(targets), list(reversed(targets))):
                for name in order:
                    rates[name].append(await _throughput(session, targets[name], concurrent_requests, concurrency))
            result.throughput_rps = {name: statistics.fmean(v) for name, v in rates.items()}
        result.cpu_seconds = {k: cpu_seconds(p) - cpu_before[k] for k, p in pids.items()}
        epp, base_lat = result.latency_ms["envoy+epp"], result.latency_ms["plain envoy"]
        result.added_latency_ms = {"p50": epp["p50"] - base_lat["p50"], "p99": epp["p99"] - base_lat["p99"]}
        result.throughput_ratio = result.throughput_rps["envoy+epp"] / result.throughput_rps["plain envoy"]
    finally:
        for process in routers:
            terminate(process)
        if plain is not None:
            plain.stop()
        stack.stop()
    result.wall_seconds = time.monotonic() - started_at
    return result


def as_dict(result: OverheadResult) -> dict:
    return asdict(result)
