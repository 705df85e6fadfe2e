"""`epp-bench failover`: what a replica or a model server dying costs, under load through Envoy.

One local stack: `servers` sim model servers (one process each), `replicas` EPPs behind one Envoy (round robin, each
with its gRPC health checked every second: harness/envoy.py), FailOpen or FailClose. `clients` streaming clients
send completions back to back the whole run. In turn, each for `seconds`:

1. one EPP replica SIGKILLed (then restarted, and back in the balancing before the next phase): the one that
   grants the others' turns to pick (`--replica-turns`), whose death the others wait out;
2. one EPP replica sent SIGTERM: it drains (`epp --drain-timeout`): not ready, GOAWAY, the streams in flight finish;
3. one model server SIGKILLed.

Each request of a phase is counted once: `ok` (a whole answer), `failed` (an error status or a refused connection:
a request lost), `cut` (a stream that began and broke: in flight on the server that died, expected). Beside them,
from Envoy's own counters over the phase: requests that went upstream without the EPP's pick (FailOpen's pool
fallback: not lost, but unrouted) and ext_proc streams Envoy started again on another replica (retries). The goal
(issue 53): no failed request in any phase with FailOpen, nor any after a drain or a model server's death with either
failure mode.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from harness.bench.chaos import FAST_SIM, MODEL
from harness.local import REPLICA_TURNS, LocalStack, StackConfig

# Envoy's counters read before and after each phase (admin /stats); the ext_proc filter's are under the listener's
# stat prefix (gateway).
UNROUTED = "http.gateway.ext_proc.failure_mode_allowed"
STREAM_RETRIES = "cluster.epp.upstream_rq_retry"
COUNTERS = (UNROUTED, STREAM_RETRIES)
KILLED_REPLICA = "EPP replica killed"  # the phase whose streams in flight fail by design under FailClose


@dataclass
class Phase:
    name: str
    outcomes: dict[str, int] = field(default_factory=dict)  # ok, failed, cut
    counters: dict[str, int] = field(default_factory=dict)  # Envoy's, over the phase
    notes: list[str] = field(default_factory=list)  # the first failures, each in a line
    exit_seconds: float | None = None  # a drained replica: from SIGTERM to its exit

    @property
    def failed(self) -> int:
        return self.outcomes.get("failed", 0)


@dataclass
class FailoverReport:
    servers: int
    replicas: int
    clients: int
    fail_open: bool
    drain_timeout: float
    phases: list[Phase]


class Load:
    """`clients` streaming completions back to back; each outcome counted in the phase current when it ended."""

    def __init__(self, url: str, clients: int, max_tokens: int):
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.phase = Phase("warm-up")
        self.stop = asyncio.Event()

    def count(self, outcome: str, note: str = "") -> None:
        phase = self.phase
        phase.outcomes[outcome] = phase.outcomes.get(outcome, 0) + 1
        if note and len(phase.notes) < 3:
            phase.notes.append(note)

    async def one(self, session: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "prompt": "stream me a while", "max_tokens": self.max_tokens, "stream": True}
        try:
            async with session.post(self.url, json=body) as r:
                if r.status != 200:
                    self.count("failed", f"HTTP {r.status}: {(await r.read())[:120]!r}")
                    return
                try:
                    raw = await r.read()
                except aiohttp.ClientPayloadError:
                    raw = b""
                self.count("ok" if raw.rstrip().endswith(b"[DONE]") else "cut")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.count("failed", f"{type(exc).__name__}: {exc}"[:120])

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def client() -> None:
                while not self.stop.is_set():
                    await self.one(session)

            await asyncio.gather(*(client() for _ in range(self.clients)))


async def envoy_counters(session: aiohttp.ClientSession, admin: str) -> dict[str, int]:
    async with session.get(f"{admin}/stats", params={"filter": "ext_proc|cluster.epp."}) as r:
        text = await r.text()
    values = {}
    for name in COUNTERS:
        match = re.search(rf"^{re.escape(name)}: (\d+)$", text, re.M)
        values[name] = int(match.group(1)) if match else 0
    return values


async def wait_serving(session: aiohttp.ClientSession, admin: str, replicas: int, timeout: float = 60.0) -> None:
    """Until Envoy sees `replicas` EPPs healthy (its active health checks passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with session.get(f"{admin}/clusters") as r:
            text = await r.text()
        healthy = re.findall(r"^epp::[^:]+:\d+::health_flags::healthy$", text, re.M)
        if len(healthy) == replicas:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"Envoy did not see {replicas} healthy EPP replicas within {timeout:.0f} s")


async def sequencer(session: aiohttp.ClientSession, stack: LocalStack) -> str | None:
    """The replica that grants the others' turns to pick: the one that has given turns (None when none has)."""
    given = {}
    for name, url in zip(stack.epp_names, stack.epp_metrics_urls, strict=True):
        async with session.get(url) as r:
            given[name] = float(dict(REPLICA_TURNS.findall(await r.text())).get("given", 0.0))
    name = max(given, key=given.get)
    return name if given[name] > 0 else None


async def run(
    servers: int = 8,
    replicas: int = 3,
    clients: int = 32,
    seconds: float = 6.0,
    fail_open: bool = True,
    drain_timeout: float = 10.0,
    max_tokens: int = 40,
    workdir: Path | None = None,
    progress=print,
) -> FailoverReport:
    stack = LocalStack(
        StackConfig.on_free_ports(
            servers,
            workdir=workdir,
            fail_open=fail_open,
            epp_replicas=replicas,
            separate_model_server_processes=True,
            modelserver_args=[*FAST_SIM, "--disable-log-stats"],
            epp_args=["--drain-timeout", f"{drain_timeout:g}s"],
        )
    )
    await stack.start()
    admin = f"http://{stack.config.host}:{stack.config.admin_port}"
    load = Load(f"{stack.gateway_url}/v1/completions", clients, max_tokens)
    phases: list[Phase] = []
    try:
        async with aiohttp.ClientSession() as session:
            await wait_serving(session, admin, replicas)
            running = asyncio.create_task(load.run())

            async def phase(name: str, fault) -> Phase:
                before = await envoy_counters(session, admin)
                load.phase = current = Phase(name)
                await fault(current)
                await asyncio.sleep(seconds)
                after = await envoy_counters(session, admin)
                current.counters = {k: after[k] - before[k] for k in COUNTERS}
                phases.append(current)
                progress(f"{name}: {current.outcomes}, Envoy {current.counters}, notes {current.notes}")
                return current

            await asyncio.sleep(1.0)  # the load reaches its steady state
            victim = await sequencer(session, stack) or stack.epp_names[1]
            progress(f"the replica killed and drained: {victim}")

            async def kill_replica(current: Phase) -> None:
                stack.processes[victim].send_signal(signal.SIGKILL)

            await phase(f"{KILLED_REPLICA} (SIGKILL, 1 of {replicas})", kill_replica)
            load.phase = Phase("restart")
            stack.processes[victim].wait(10)
            stack.restart(victim)
            await wait_serving(session, admin, replicas)

            async def drain_replica(current: Phase) -> None:
                process = stack.processes[victim]
                began = time.monotonic()
                process.send_signal(signal.SIGTERM)
                await asyncio.to_thread(process.wait, drain_timeout + 10)
                current.exit_seconds = time.monotonic() - began

            await phase(f"EPP replica drained (SIGTERM, 1 of {replicas})", drain_replica)
            server = f"modelserver-{servers - 1}"

            async def kill_server(current: Phase) -> None:
                stack.processes[server].send_signal(signal.SIGKILL)

            await phase(f"model server killed (SIGKILL, 1 of {servers})", kill_server)
            load.stop.set()
            await running
    finally:
        stack.stop()
    return FailoverReport(servers, replicas, clients, fail_open, drain_timeout, phases)


def missed_goals(report: FailoverReport) -> list[str]:
    """The phases that failed a request they should not have: any, with FailOpen; with FailClose the killed replica's
    streams in flight fail by design (Envoy answers them 500), so only the other phases count."""
    return [p.name for p in report.phases if p.failed and (report.fail_open or not p.name.startswith(KILLED_REPLICA))]


def markdown(report: FailoverReport) -> str:
    mode = "FailOpen" if report.fail_open else "FailClose"
    lines = [
        f"{report.servers} sim servers, {report.replicas} EPP replicas, {mode}, {report.clients} streaming clients, "
        f"--drain-timeout {report.drain_timeout:g}s",
        "",
        "| fault | ok | failed | cut in flight | unrouted (pool fallback) | ext_proc streams retried | replica's exit |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in report.phases:
        exit_time = f"{p.exit_seconds:.2f} s" if p.exit_seconds is not None else ""
        lines.append(
            f"| {p.name} | {p.outcomes.get('ok', 0)} | {p.failed} | {p.outcomes.get('cut', 0)} | "
            f"{p.counters.get(UNROUTED, 0)} | {p.counters.get(STREAM_RETRIES, 0)} | {exit_time} |"
        )
    notes = [f"- {p.name}: {note}" for p in report.phases for note in p.notes]
    return "\n".join(lines + (["", *notes] if notes else []))
