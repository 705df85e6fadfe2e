"""What the EPP costs: Envoy + EPP against a plain Envoy in front of the same zero-delay sim pool, in one run; what
flow control costs an unsaturated pool: the same build with `flowControl: {enabled: false}` beside it; and what
scheduling costs: the same build with max-score-picker alone (no filter, no scorer), and with any other
EndpointPickerConfig given (`--epp-config FILE`, one target per file).

* added latency, one request at a time (p50, p99), the targets interleaved request by request, each round in a new
  (seeded) random order;
* throughput at a fixed concurrency (default 32), each target run twice in alternating order;
* the CPU seconds each process used, so a reader can see when the 2-core machine itself is the limit: per request
  over the whole run, and per request over the target's own throughput phases (an EPP keeps scraping the shared pool
  while the other targets load it, which the whole run charges to its requests);
* the whole machine's CPU (/proc/stat) per request while each target's throughput is measured, and so the
  throughput ratio the machine's CPU allows each target, and a processor that costs nothing (the native floor less
  its processor's own CPU);
* with `pin`, the load (this client and the model servers) on one half of the CPUs and every target's processes
  (Envoys, processors, routers) on the other, the same for all targets: the client's and the servers' work then
  never takes a target's CPU. Unpinned (the default), every process may run on any CPU, as for all targets too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from epp.config.loader import DEFAULT_CONFIG
from epp.metrics import PICKED_METRICS_AGE, SCHEDULER_E2E
from harness.bench import build, floor, floor_native
from harness.bench.peers import peer_command, start_router
from harness.bench.ports import free_ports
from harness.envoy import EnvoyProcess, render_baseline, render_bootstrap, terminate
from harness.local import LocalStack, StackConfig

BODY = {"model": "sim-llama-8b", "prompt": "Say hello to the benchmark.", "max_tokens": 1}
PLAIN = "plain envoy"
EPP = "envoy+epp"
EPP_NO_FLOW_CONTROL = "envoy+epp (flowControl: {enabled: false})"
# Without the gateway's access log, the bootstrap has Envoy send the EPP each response's headers (the status and the
# endpoint that served come that way instead: `harness.envoy.render_bootstrap`): one more round trip on every response.
EPP_NO_ACCESS_LOG = "envoy+epp (no access log: response headers sent)"
EPP_PICKER_ONLY = "envoy+epp (max-score-picker alone)"
# the scheduling plugins' share: the default profile's filters and scorers gone, the rest of the EPP as it is
PICKER_ONLY_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: max-score-picker
"""
# The floor processors: the Python one (harness/bench/floor.py) and the C one (harness/bench/floor_native.c)
FLOOR, NATIVE_FLOOR = "floor", "native floor"
# what each floor target asks of Envoy: (mode, request body mode, response header mode); the last is the EPP's in
# our default bootstrap (the access log brings the status: harness.envoy.render_bootstrap)
FLOOR_MODES = (
    ("request headers only", "NONE", "SKIP"),
    ("headers only", "NONE", "SEND"),
    ("body streamed", "FULL_DUPLEX_STREAMED", "SKIP"),
)


def floor_target(processor: str, mode: str) -> str:
    """A floor target's name, e.g. "envoy+native floor (body streamed)"."""
    return f"envoy+{processor} ({mode})"


_CPUCLOCK_SCHED = 2  # the kernel's process CPU clock that sums the scheduler's run time (not tick samples)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's unit of CPU time


def cpu_seconds(pid: int) -> float:
    """The CPU time of a process, all its threads (ended ones too), to the nanosecond: Linux's CPU-time clock of the
    process (the clock id clock_getcpuclockid(3) makes). /proc's user + system time counts 10 ms ticks: a processor
    that spends 80 µs a request showed 0 or 10 ms over a hundred requests. Where that clock cannot be read, /proc."""
    try:
        return time.clock_gettime(((~pid) << 3) | _CPUCLOCK_SCHED)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, elapsed) CPU seconds of the whole machine since boot, every CPU summed, from /proc/stat's first line:
    busy is user, nice, system, irq and softirq time (every process and the kernel, the loopback network's work
    included); elapsed adds idle, iowait and steal (time the hypervisor gave to others). (0, 0) without /proc/stat:
    what is derived from it is then left out."""
    try:
        with open("/proc/stat") as stat:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    except OSError:
        return 0.0, 0.0
    busy = user + nice + system + irq + softirq
    return busy / _CLOCK_TICKS, (busy + idle + iowait + steal) / _CLOCK_TICKS


def split_cpus(cpus: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
    """The CPUs for `measure(pin=True)`: (the load's, the targets'), the first half and the rest of `cpus` in
    order. ValueError with fewer than two: nothing to keep apart."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        raise ValueError(f"pinning needs at least 2 CPUs, this process may use {len(ordered)}")
    half = len(ordered) // 2
    return frozenset(ordered[:half]), frozenset(ordered[half:])


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of process `pid` on `cpus` (threads it starts later inherit their creator's CPUs)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


def interleaved(targets: list[str], rounds: int, seed: int = 0) -> Iterator[str]:
    """The sequential phase's order: `rounds` rounds of one request to every target, each round in a new seeded
    random order. In one fixed order a target's request always followed the same one, whose processes left the
    caches warm for it or not (processes share code pages: the EPPs their compiled modules, the Envoys their
    binary): the EPP without flow control, right after the EPP, measured 0.05-0.12x of plain Envoy's p50 faster
    than it; -0.01 to +0.05x with the order shuffled (3 runs each)."""
    order, shuffle = list(targets), random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        yield from order


def histogram_buckets(page: str, name: str) -> dict[float, float]:
    """Histogram `name` on a Prometheus text page: each bucket's bound -> the observations at most that (cumulative)."""
    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(page)
        if family.name == name
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }


async def _age_buckets(
    session: aiohttp.ClientSession, metrics_url: str, decisions: float = 0.0
) -> tuple[float, dict[float, float]]:
    """The EPP's decisions so far (SCHEDULER_E2E's count) and its PICKED_METRICS_AGE histogram (bucket bound, in
    seconds -> picks at most that old). The EPP serves a rendered page again for a while (epp/metrics.py,
    RENDER_GAP_FACTOR): read until the page counts at least `decisions`, for at most a second."""
    deadline = time.monotonic() + 1.0
    while True:
        async with session.get(metrics_url) as response:
            page = await response.text()
        counted = histogram_buckets(page, SCHEDULER_E2E).get(math.inf, 0.0)
        if counted >= decisions or time.monotonic() > deadline:
            return counted, histogram_buckets(page, PICKED_METRICS_AGE)
        await asyncio.sleep(0.01)


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the bucket that holds quantile `q` of a cumulative histogram (bound -> count)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    return next(bound for bound in bounds if buckets[bound] >= q * total)


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
    streamed: bool = False  # the requests asked for streamed responses
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # target -> p50/p99/mean
    added_latency_ms: dict[str, float] = field(default_factory=dict)
    flow_control_added_ms: dict[str, float] = field(default_factory=dict)  # EPP - EPP without flow control
    scheduling_added_ms: dict[str, float] = field(default_factory=dict)  # EPP - EPP with max-score-picker alone
    # EPP without the access log (so with the response-header trip) - EPP
    response_headers_added_ms: dict[str, float] = field(default_factory=dict)
    throughput_rps: dict[str, float] = field(default_factory=dict)
    throughput_ratio: float = 0.0
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds over the whole run
    cpu_ms_per_request: dict[str, dict[str, float]] = field(default_factory=dict)  # target -> its process -> ms
    # the same over the target's own throughput phases only: what its processes spend while serving, without the
    # metrics scrapes an EPP keeps making while the other targets load the shared pool
    cpu_ms_per_request_loaded: dict[str, dict[str, float]] = field(default_factory=dict)
    # target -> its EPP's CPU ms per request in each of its throughput phases, in the order they ran (every target
    # runs once in each pass over the targets, the passes alternately forward and back): neighbours in time to
    # compare phase by phase where the machine's load drifts during a run
    epp_phase_cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    host_load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    epp_build: str = field(default_factory=build.summary)  # the EPP's request path: compiled or pure Python
    wall_seconds: float = 0.0
    pinning: str = "unpinned: every process may run on any CPU"  # measure(pin=True) says which CPUs ran what
    # target -> the share of the load's CPUs (pinned: its half; else all) the client and the model servers used
    # during the target's throughput runs: near 1, the load, not the target, bounded its throughput
    load_cpu_busy: dict[str, float] = field(default_factory=dict)
    # target -> the whole machine's busy CPU (every process and the kernel: machine_cpu_seconds) during the target's
    # throughput runs: "ms" per request, and "busy", the share of all its CPUs' time. On a machine that every process
    # shares, throughput follows the ms: plain Envoy's ms over a target's is the throughput ratio CPU allows
    machine_cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    # how old the picked endpoint's metrics were at the pick, over the EPP's throughput phases (the EPP's
    # PICKED_METRICS_AGE histogram): "picks", and "p50" and "p99" as the upper bounds of their buckets, in seconds
    picked_metrics_age: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # targets left out, and why

    def markdown(self) -> str:
        plain = self.latency_ms.get(PLAIN)
        lines = [
            f"| target | p50 ms | p99 ms | mean ms | p50 / plain | p99 / plain | req/s at concurrency {self.concurrency} "
            "| req/s / plain | CPU ms per request (its own processes) "
            f"| CPU ms per request at concurrency {self.concurrency} |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for target, lat in self.latency_ms.items():
            rps = self.throughput_rps.get(target, 0.0)
            cpu, loaded = (
                ", ".join(f"{k} {v:.3f}" for k, v in per_request.get(target, {}).items())
                for per_request in (self.cpu_ms_per_request, self.cpu_ms_per_request_loaded)
            )
            lines.append(
                f"| {target} | {lat['p50']:.2f} | {lat['p99']:.2f} | {lat['mean']:.2f} | "
                f"{lat['p50'] / plain['p50']:.2f} | {lat['p99'] / plain['p99']:.2f} | {rps:.0f} | "
                f"{rps / self.throughput_rps[PLAIN]:.2f} | {cpu} | {loaded} |"
            )
        lines.append("")
        if self.streamed:
            lines.append('requests: `"stream": true` (their access-log records teach the EPP\'s latency predictor)')
        lines.append(
            f"added latency of the EPP (ext_proc transport {self.transport}): p50 {self.added_latency_ms['p50']:+.2f} ms, "
            f"p99 {self.added_latency_ms['p99']:+.2f} ms; throughput ratio EPP/plain {self.throughput_ratio:.2f}"
        )
        for target in [t for t in self.cpu_ms_per_request_loaded if f"{t} unshared" in self.cpu_ms_per_request_loaded]:
            shared, unshared = (
                sum(v for k, v in self.cpu_ms_per_request_loaded[t].items() if k.startswith("epp"))
                for t in (target, f"{target} unshared")
            )
            lines.append(
                f"{target}: the replicas' CPU per request at concurrency {self.concurrency}, summed, sharing their load "
                f"{shared:.3f} ms, not sharing {unshared:.3f} ms: sharing adds {shared / unshared - 1:+.1%}"
            )
        if self.flow_control_added_ms:
            lines.append(
                f"added latency of flow control (unsaturated, the same build without it): p50 "
                f"{self.flow_control_added_ms['p50']:+.3f} ms, p99 {self.flow_control_added_ms['p99']:+.3f} ms"
            )
        if self.scheduling_added_ms:
            added = self.scheduling_added_ms
            lines.append(
                f"added by the default profile's filters and scorers (against max-score-picker alone): p50 "
                f"{added['p50']:+.3f} ms, p99 {added['p99']:+.3f} ms, EPP CPU per request at concurrency "
                f"{self.concurrency} {added['cpu']:+.3f} ms"
            )
        if self.response_headers_added_ms:
            added = self.response_headers_added_ms
            lines.append(
                f"added by the response-header trip (the gateway without its access log, against the default): p50 "
                f"{added['p50']:+.3f} ms, p99 {added['p99']:+.3f} ms, Envoy and EPP CPU per request back to back "
                f"{added['cpu']:+.3f} ms"
            )
        if self.picked_metrics_age.get("picks"):
            age = self.picked_metrics_age
            lines.append(
                f"the picked endpoint's metrics at the pick, over the EPP's runs at concurrency {self.concurrency} "
                f"({PICKED_METRICS_AGE}, its buckets' bounds): p50 <= {1e3 * age['p50']:g} ms, p99 <= "
                f"{1e3 * age['p99']:g} ms, of {age['picks']:.0f} picks"
            )
        lines += self._machine_lines()
        lines += self._phase_lines()
        lines.append("CPU seconds over the run: " + ", ".join(f"{k} {v:.1f}" for k, v in self.cpu_seconds.items()))
        lines.append("host load (1/5/15 min) at the end: " + " ".join(f"{v:.2f}" for v in self.host_load))
        lines.append(self.pinning)
        if self.load_cpu_busy:
            lines.append(
                "the load's CPUs (the client and the model servers) busy while each target's throughput was measured: "
                + ", ".join(f"{target} {busy:.0%}" for target, busy in self.load_cpu_busy.items())
            )
        lines.append(f"the EPP's request path: {self.epp_build}")
        lines += self.notes
        return "\n".join(lines)

    def _phase_lines(self) -> list[str]:
        """Each EPP variant's CPU per request against the default EPP's in the same pass, pass by pass."""
        base = self.epp_phase_cpu_ms.get(EPP)
        if not base or len(self.epp_phase_cpu_ms) < 2:
            return []
        lines = [
            f"the EPP's CPU ms per request at concurrency {self.concurrency}, each pass over the targets (forward and "
            "back in turn): "
            + "; ".join(f"{t} {' '.join(f'{v:.3f}' for v in ms)}" for t, ms in self.epp_phase_cpu_ms.items())
        ]
        for target, ms in self.epp_phase_cpu_ms.items():
            if target != EPP:
                ratios = sorted(m / b for m, b in zip(ms, base, strict=True))
                lines.append(
                    f"{target} / {EPP}, pass by pass: median {statistics.median(ratios):.3f}, "
                    f"{ratios[0]:.3f}-{ratios[-1]:.3f} over {len(ratios)} passes"
                )
        return lines

    def zero_cost_ceiling(self) -> float | None:
        """The throughput ratio (of plain Envoy's) that CPU allows a processor that costs nothing: the machine's CPU
        per request for plain Envoy over that for the native floor streaming the body (the EPP's processing mode)
        less its processor's own. Envoy's ext_proc work and the hops it adds stay; None without the native floor or
        /proc/stat."""
        target = floor_target(NATIVE_FLOOR, "body streamed")
        if target not in self.machine_cpu or PLAIN not in self.machine_cpu:
            return None
        envoy_alone = self.machine_cpu[target]["ms"] - self.cpu_ms_per_request_loaded[target]["processor"]
        return self.machine_cpu[PLAIN]["ms"] / envoy_alone if envoy_alone > 0 else None

    def _machine_lines(self) -> list[str]:
        if PLAIN not in self.machine_cpu:
            return []
        plain = self.machine_cpu[PLAIN]["ms"]
        lines = [
            "the whole machine while each target's throughput was measured (/proc/stat: every process and the "
            "kernel), CPU ms per request, its CPUs busy, and plain Envoy's CPU per request over the target's (the "
            "throughput ratio the machine's CPU allows): "
            + ", ".join(
                f"{target} {m['ms']:.3f} ({m['busy']:.0%}, {plain / m['ms'] if m['ms'] else math.inf:.2f})"
                for target, m in self.machine_cpu.items()
            )
        ]
        ceiling = self.zero_cost_ceiling()
        if ceiling is not None:
            lines.append(
                f"a processor that cost nothing, in Envoy's body-streamed mode (the native floor's machine CPU less its "
                f"processor's): at most {ceiling:.2f} of plain Envoy's throughput, where CPU bounds it"
            )
        return lines


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


async def _one(session: aiohttp.ClientSession, url: str, body: dict = BODY) -> float:
    started = time.perf_counter()
    async with session.post(url, json=body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")
    return time.perf_counter() - started


async def _throughput(
    session: aiohttp.ClientSession, url: str, total: int, concurrency: int, body: dict = BODY
) -> float:
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await _one(session, url, body)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - started)


async def _start_floor(
    stack: LocalStack,
    body_mode: str,
    response_header_mode: str,
    name: str,
    opened: list,
    processor: Callable[[int, list[str]], list[str]],
    endpoints: list[str],
) -> tuple[str, dict[str, int]]:
    """An Envoy with our gateway bootstrap in front of a floor processor, which routes to `endpoints` ("host:port")
    in turn; its URL and pids. `processor(port, endpoints)` is the processor's command line: `harness.bench.floor.command`
    or `harness.bench.floor_native.command` with its binary."""
    floor_port, listener, admin = free_ports(3)
    log = (stack.workdir / f"{name}.log").open("wb")
    process = subprocess.Popen(processor(floor_port, endpoints), stdout=subprocess.PIPE, stderr=log)
    log.close()
    opened.append(process)
    if process.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"the floor processor did not start; see {stack.workdir / f'{name}.log'}")
    bootstrap = render_bootstrap(
        epp_host="127.0.0.1",
        epp_port=floor_port,
        listener_port=listener,
        admin_port=admin,
        request_body_mode=body_mode,
        response_header_mode=response_header_mode,
        fallback_endpoints=[u.removeprefix("http://") for u in stack.model_server_urls],
    )
    envoy = await EnvoyProcess.launch(bootstrap, admin, stack.workdir, f"{name}-envoy")
    opened.append(envoy)
    return f"http://127.0.0.1:{listener}/v1/completions", {"envoy": envoy.process.pid, "processor": process.pid}


async def _start_epp_variant(
    stack: LocalStack,
    transport: str,
    opened: list,
    name: str,
    config_text: str | None,
    access_log_percent: int,
    env: dict[str, str],
    flags: tuple[str, ...] = (),
    replicas: int = 1,
    sharing: bool = True,
) -> LocalStack:
    """The stack's EPP build and Envoy bootstrap again, on ports of their own and over the stack's model servers,
    with one difference: the EPP's config (`flowControl: {enabled: false}`: flow control's cost is the difference to
    the stack's own EPP), the share of requests whose access-log record Envoy sends the EPP (`access_log_percent`:
    the stack's gateway sends every one), the EPP's build (`env`: another checkout's PYTHONPATH), more of its
    command-line flags (`flags`), or several EPP replicas behind the Envoy, sharing their load or not."""
    c = stack.config
    variant = LocalStack(
        StackConfig.on_free_ports(
            model_servers=c.model_servers,
            base_port=c.base_port,
            workdir=stack.workdir / name,
            config_text=config_text,
            access_log_percent=access_log_percent,
            epp_args=["--ext-proc-transport", transport, *flags],
            epp_env=env,
            epp_replicas=replicas,
            replica_sharing=sharing,
        )
    )
    variant.workdir.mkdir(exist_ok=True)
    opened.append(variant)
    variant.start_epp()
    variant.start_envoy()
    await asyncio.gather(
        *(variant._wait_http(n, u, 60) for n, u in zip(variant.epp_names, variant.epp_metrics_urls, strict=True)),
        variant.envoy.wait_ready(60),
    )
    return variant


async def measure(
    servers: int = 4,
    sequential: int = 2000,
    concurrency: int = 32,
    concurrent_requests: int = 2000,
    workdir: Path | None = None,
    with_peers: bool = True,
    transport: str = "h2",
    with_floor: bool = True,
    with_flow_control_off: bool = True,
    without_access_log: bool = True,
    streamed: bool = False,
    with_picker_only: bool = True,
    epp_configs: dict[str, str] | None = None,
    epp_env: dict[str, str] | None = None,
    epp_builds: dict[str, dict[str, str]] | None = None,
    pin: bool = False,
    epp_flags: list[list[str]] | None = None,
    epp_replicas: int = 1,
    rounds: int = 1,
) -> OverheadResult:
    """Every target in one run over one pool: sequential latency interleaved request by request, then throughput
    in alternating order. Each target has processes of its own (its Envoy, its processor or router), so their CPU
    divided by the target's requests is its cost per request; the model servers are shared. `streamed`: every
    request asks for a streamed response (`"stream": true`, as chat clients do), whose access-log records teach the
    EPP's latency predictor, which then predicts for every request: what a live EPP pays per streamed request.
    `epp_configs`: name -> EndpointPickerConfig text, a target "envoy+epp (name)" each. `epp_env`: more environment
    for the stack's EPP; `epp_builds`: name -> the environment of another build of the EPP (another checkout's
    PYTHONPATH), a target "envoy+epp (name)" each, with its own default config (`compare_builds`). `pin`: the
    client and the model servers on half the CPUs, every target's processes on the other half (`split_cpus`);
    ValueError with fewer than two CPUs. `epp_flags`: more command-line flags for the EPP, a target
    "envoy+epp (flags)" each (e.g. the status page's ring off, or tracing on: what a flag costs, side by side).
    `epp_replicas` > 1: two more targets, that many EPP replicas behind one Envoy sharing their load
    ("envoy+epp xN") and not ("envoy+epp xN unshared"): what sharing costs, the replicas' CPU summed.
    `rounds`: pairs of passes over the targets for throughput (each pass one phase a target, forward then back)."""
    body = {**BODY, "stream": True} if streamed else BODY
    cpus = split_cpus(os.sched_getaffinity(0)) if pin else None
    plain_listener, plain_admin = free_ports(2)
    stack = LocalStack(
        StackConfig.on_free_ports(
            servers,
            workdir=workdir,
            modelserver_args=["--sim-zero-delay", "--disable-log-stats"],
            epp_args=["--ext-proc-transport", transport],
            epp_env=epp_env or {},
        )
    )
    result = OverheadResult(transport, servers, sequential, concurrency, concurrent_requests, streamed)
    started_at = time.monotonic()
    await stack.start()
    opened: list = []
    try:
        baseline = render_baseline(
            endpoints=[u.removeprefix("http://") for u in stack.model_server_urls],
            listener_port=plain_listener,
            admin_port=plain_admin,
        )
        plain = await EnvoyProcess.launch(baseline, plain_admin, stack.workdir, "plain-envoy")
        opened.append(plain)
        targets = {PLAIN: f"http://127.0.0.1:{plain_listener}/v1/completions"}
        pids: dict[str, dict[str, int]] = {PLAIN: {"envoy": plain.process.pid}}
        if with_floor:
            processors = {FLOOR: floor.command}
            native = floor_native.build(stack.workdir)
            if native is None:
                result.notes.append("no C compiler on PATH (cc or gcc): the native floor is left out")
            else:
                processors[NATIVE_FLOOR] = functools.partial(floor_native.command, native)
            pool = [u.removeprefix("http://") for u in stack.model_server_urls]
            for label, processor in processors.items():
                for index, (mode, body_mode, response_mode) in enumerate(FLOOR_MODES):
                    name = floor_target(label, mode)
                    targets[name], pids[name] = await _start_floor(
                        stack, body_mode, response_mode, f"{label.replace(' ', '-')}-{index}", opened, processor, pool
                    )
        targets[EPP] = f"{stack.gateway_url}/v1/completions"
        pids[EPP] = {"envoy": stack.envoy.process.pid, "epp": stack.processes["epp"].pid}
        # a second EPP and Envoy over the same servers, one thing changed: (target, workdir, EPP config, access log %,
        # the EPP's environment)
        variants = []
        if with_flow_control_off:
            variants.append(
                (EPP_NO_FLOW_CONTROL, "flow-control-off", DEFAULT_CONFIG + "flowControl: {enabled: false}\n", 100, {})
            )
        if without_access_log:
            # the access-log records the gateway sends by default (the EPP learns nothing from them here: the
            # responses are not streamed) against the response-header trip that replaces them without one
            variants.append((EPP_NO_ACCESS_LOG, "no-access-log", None, 0, {}))
        if with_picker_only:
            variants.append((EPP_PICKER_ONLY, "picker-only", PICKER_ONLY_CONFIG, 100, {}))
        for index, (name, config_text) in enumerate((epp_configs or {}).items()):
            variants.append((f"{EPP} ({name})", f"config-{index}", config_text, 100, {}))
        for index, (name, env) in enumerate((epp_builds or {}).items()):
            variants.append((f"{EPP} ({name})", f"build-{index}", None, 100, env))
        for index, flags in enumerate(epp_flags or ()):
            variants.append((f"{EPP} ({' '.join(flags)})", f"flags-{index}", None, 100, {}, tuple(flags)))
        variants += [
            (
                f"{EPP} x{epp_replicas}" + ("" if sharing else " unshared"),
                f"replicas-{sharing}",
                None,
                100,
                {},
                (),
                epp_replicas,
                sharing,
            )
            for sharing in ((True, False) if epp_replicas > 1 else ())
        ]
        for target, *variant in variants:
            other = await _start_epp_variant(stack, transport, opened, *variant)
            targets[target] = f"{other.gateway_url}/v1/completions"
            pids[target] = {"envoy": other.envoy.process.pid, **{n: other.processes[n].pid for n in other.epp_names}}
        for kind in ("sglang", "vllm") if with_peers else ():  # the Rust routers, when the [bench] extra installed them
            if peer_command(kind) is not None:
                process, url = await start_router(
                    kind, "round_robin", stack.model_server_urls, stack.workdir, BODY["model"]
                )
                opened.append(process)
                targets[f"{kind}-router"] = f"{url}/v1/completions"
                pids[f"{kind}-router"] = {"router": process.pid}
        pids["(shared)"] = {"model servers": stack.processes["modelserver"].pid}
        if cpus is not None:
            load_cpus, target_cpus = cpus
            for target, processes in pids.items():
                for pid in processes.values():
                    pin_process(pid, load_cpus if target == "(shared)" else target_cpus)
            pin_process(os.getpid(), load_cpus)
            result.pinning = (
                f"pinned: the client and the model servers on CPUs {_cpu_list(load_cpus)}, every target's "
                f"processes on CPUs {_cpu_list(target_cpus)}"
            )
        cpu_before = {(t, k): cpu_seconds(p) for t, procs in pids.items() for k, p in procs.items()}
        requests = dict.fromkeys(targets, 0)
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            for url in targets.values():  # warm up connections and caches
                for _ in range(50):
                    await _one(session, url, body)
            latencies: dict[str, list[float]] = {name: [] for name in targets}
            for name in interleaved(list(targets), sequential):
                latencies[name].append(await _one(session, targets[name], body))
            for name, values in latencies.items():
                result.latency_ms[name] = {
                    "p50": percentile(values, 0.5) * 1e3,
                    "p99": percentile(values, 0.99) * 1e3,
                    "mean": statistics.fmean(values) * 1e3,
                }
                requests[name] += len(values)
            rates: dict[str, list[float]] = {name: [] for name in targets}
            # each target's throughput runs: in turn, then back, `rounds` times
            orders = [list(targets), list(reversed(targets))] * rounds
            loaded_requests = len(orders) * concurrent_requests
            loaded_cpu = {(t, k): 0.0 for t in targets for k in pids[t]}
            # the load (this client and the model servers): how busy its CPUs were while each target was loaded
            load_pids = (os.getpid(), pids["(shared)"]["model servers"])
            load_cpu_count = len(cpus[0]) if cpus is not None else len(os.sched_getaffinity(0))
            load_used = dict.fromkeys(targets, 0.0)
            load_wall = dict.fromkeys(targets, 0.0)
            machine_busy = dict.fromkeys(targets, 0.0)
            machine_elapsed = dict.fromkeys(targets, 0.0)
            ages: dict[float, float] = {}  # the picks' metrics ages over the EPP's throughput phases (cumulative)
            for order in orders:
                for name in order:
                    decided, ages_before = (
                        await _age_buckets(session, stack.epp_metrics_url) if name == EPP else (0, {})
                    )
                    phase_start = {k: cpu_seconds(p) for k, p in pids[name].items()}
                    load_start, wall_start = sum(map(cpu_seconds, load_pids)), time.monotonic()
                    machine_start = machine_cpu_seconds()
                    rates[name].append(
                        await _throughput(session, targets[name], concurrent_requests, concurrency, body)
                    )
                    requests[name] += concurrent_requests
                    for k, p in pids[name].items():
                        loaded_cpu[name, k] += cpu_seconds(p) - phase_start[k]
                        if k == "epp":
                            phase_ms = 1e3 * (cpu_seconds(p) - phase_start[k]) / concurrent_requests
                            result.epp_phase_cpu_ms.setdefault(name, []).append(phase_ms)
                    load_used[name] += sum(map(cpu_seconds, load_pids)) - load_start
                    load_wall[name] += time.monotonic() - wall_start
                    (busy, elapsed), (busy_start, elapsed_start) = machine_cpu_seconds(), machine_start
                    machine_busy[name] += busy - busy_start
                    machine_elapsed[name] += elapsed - elapsed_start
                    if name == EPP:
                        _, ages_after = await _age_buckets(
                            session, stack.epp_metrics_url, decided + concurrent_requests
                        )
                        for bound, count in ages_after.items():
                            ages[bound] = ages.get(bound, 0.0) + count - ages_before.get(bound, 0.0)
            if ages and ages[math.inf]:
                result.picked_metrics_age = {
                    "picks": ages[math.inf],
                    "p50": bucket_quantile(ages, 0.5),
                    "p99": bucket_quantile(ages, 0.99),
                }
            result.throughput_rps = {name: statistics.fmean(v) for name, v in rates.items()}
            result.load_cpu_busy = {name: load_used[name] / (load_wall[name] * load_cpu_count) for name in targets}
            if all(machine_elapsed.values()):
                result.machine_cpu = {
                    name: {
                        "ms": 1e3 * machine_busy[name] / loaded_requests,
                        # sums of clock ticks over phases, in floating point: a machine busy throughout (pytest
                        # workers beside it) came out 1.0000000000014
                        "busy": min(1.0, machine_busy[name] / machine_elapsed[name]),
                    }
                    for name in targets
                }
        used = {key: cpu_seconds(pids[key[0]][key[1]]) - before for key, before in cpu_before.items()}
        result.cpu_seconds = {f"{k} ({t})" if t != "(shared)" else k: v for (t, k), v in used.items()}
        for (target, process), seconds in used.items():
            if target in requests:
                result.cpu_ms_per_request.setdefault(target, {})[process] = 1e3 * seconds / requests[target]
        for (target, process), seconds in loaded_cpu.items():
            result.cpu_ms_per_request_loaded.setdefault(target, {})[process] = 1e3 * seconds / loaded_requests
        epp, base_lat = result.latency_ms[EPP], result.latency_ms[PLAIN]
        result.added_latency_ms = {"p50": epp["p50"] - base_lat["p50"], "p99": epp["p99"] - base_lat["p99"]}
        result.throughput_ratio = result.throughput_rps[EPP] / result.throughput_rps[PLAIN]
        if EPP_NO_FLOW_CONTROL in result.latency_ms:
            off_lat = result.latency_ms[EPP_NO_FLOW_CONTROL]
            result.flow_control_added_ms = {"p50": epp["p50"] - off_lat["p50"], "p99": epp["p99"] - off_lat["p99"]}
        if EPP_NO_ACCESS_LOG in result.latency_ms:
            trip = result.latency_ms[EPP_NO_ACCESS_LOG]
            result.response_headers_added_ms = {
                "p50": trip["p50"] - epp["p50"],
                "p99": trip["p99"] - epp["p99"],
                "cpu": sum(result.cpu_ms_per_request[EPP_NO_ACCESS_LOG].values())
                - sum(result.cpu_ms_per_request[EPP].values()),
            }
        if EPP_PICKER_ONLY in result.latency_ms:
            bare = result.latency_ms[EPP_PICKER_ONLY]
            result.scheduling_added_ms = {
                "p50": epp["p50"] - bare["p50"],
                "p99": epp["p99"] - bare["p99"],
                "cpu": result.cpu_ms_per_request_loaded[EPP]["epp"]
                - result.cpu_ms_per_request_loaded[EPP_PICKER_ONLY]["epp"],
            }
    finally:
        if cpus is not None:  # this process is the caller's again: every CPU it had
            pin_process(os.getpid(), cpus[0] | cpus[1])
        for item in reversed(opened):
            if isinstance(item, (EnvoyProcess, LocalStack)):
                item.stop()
            else:
                terminate(item)
        stack.stop()
    result.host_load = os.getloadavg()
    result.wall_seconds = time.monotonic() - started_at
    return result


THIS_BUILD, OTHER_BUILD = "this build", "other build"


def build_environment(checkout: Path) -> dict[str, str]:
    """The environment that makes `python -m epp` run `checkout`'s EPP: its directory first on the path, and not the
    working directory, which `-m` would otherwise put before it (run from this checkout, it would run this build).
    ValueError when `epp` still resolves elsewhere."""
    env = {"PYTHONPATH": str(checkout), "PYTHONSAFEPATH": "1"}
    found = Path(_in_build(env, "import epp; print(epp.__file__)")).resolve()
    if found.parent != (checkout / "epp").resolve():
        raise ValueError(
            f"not a checkout of this repository: `epp` resolves to {found}, not to that checkout's package"
        )
    return env


def _build_summary(env: dict[str, str]) -> str:
    return _in_build(env, "from harness.bench import build; print(build.summary())")


def _in_build(env: dict[str, str], code: str) -> str:
    command = [sys.executable, "-c", code]
    return subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout.strip()


@dataclass
class BuildComparison:
    """`compare_builds`' runs: each pair is two runs of one pool with the two builds as the stack's EPP and a second
    EPP target, in one slot each and then swapped. Ratios are to plain Envoy's figure in the same run."""

    other: str  # the other checkout
    other_build: str  # its request path: compiled or pure Python (build.summary())
    runs: list[OverheadResult] = field(default_factory=list)  # pair i: runs[2i] this build first, runs[2i+1] swapped

    @staticmethod
    def _targets(run: OverheadResult) -> tuple[str, str]:
        """(this build's target, the other's) in one run: the stack's EPP is the first slot."""
        second = next(target for target in run.latency_ms if target not in (PLAIN, EPP))
        return (EPP, second) if second == f"{EPP} ({OTHER_BUILD})" else (second, EPP)

    def _ratios(self, run: OverheadResult, quantile: str) -> tuple[float, float, float]:
        """(this build's ratio, the other's, the second slot's ratio less the first's) in one run."""
        plain = run.latency_ms[PLAIN][quantile]
        this_target, other_target = self._targets(run)
        this, other = run.latency_ms[this_target][quantile] / plain, run.latency_ms[other_target][quantile] / plain
        return this, other, (other - this if this_target == EPP else this - other)

    def differences(self, quantile: str = "p50") -> tuple[list[float], list[float]]:
        """Per pair, this build's ratio less the other's, and the second slot's less the first's (the slots' own
        difference, which the swap cancels out of the first)."""
        builds, slots = [], []
        for first, swapped in zip(self.runs[::2], self.runs[1::2], strict=True):
            (a_this, a_other, a_slot), (b_this, b_other, b_slot) = (
                self._ratios(first, quantile),
                self._ratios(swapped, quantile),
            )
            builds.append(((a_this - a_other) + (b_this - b_other)) / 2)
            slots.append((a_slot + b_slot) / 2)
        return builds, slots

    def markdown(self) -> str:
        lines = [
            "| run | this build in | p50 / plain: this, other | p99 / plain: this, other | EPP CPU ms per request at "
            "concurrency: this, other |",
            "| --- | --- | --- | --- | --- |",
        ]
        for index, run in enumerate(self.runs):
            this_target, other_target = self._targets(run)
            p50, p99 = self._ratios(run, "p50"), self._ratios(run, "p99")
            cpu = run.cpu_ms_per_request_loaded
            slot = "the first slot" if this_target == EPP else "the second slot"
            lines.append(
                f"| {index + 1} | {slot} | {p50[0]:.3f}, {p50[1]:.3f} "
                f"| {p99[0]:.3f}, {p99[1]:.3f} | {cpu[this_target]['epp']:.3f}, {cpu[other_target]['epp']:.3f} |"
            )
        lines.append("")
        for quantile in ("p50", "p99"):
            builds, slots = self.differences(quantile)
            spread = f", sd {statistics.stdev(builds):.4f}" if len(builds) > 1 else ""
            lines.append(
                f"this build less the other ({self.other}), {quantile} / plain Envoy's: mean "
                f"{statistics.fmean(builds):+.4f}{spread} over {len(builds)} pairs (the second slot less the first, "
                f"either build: {statistics.fmean(slots):+.4f})"
            )
        loads = [run.host_load[0] for run in self.runs]
        lines.append(f"host load (1 min) at the end of each run: {min(loads):.2f}-{max(loads):.2f}")
        lines.append(self.runs[0].pinning)
        lines.append(f"this build's request path: {self.runs[0].epp_build}; the other's: {self.other_build}")
        return "\n".join(lines)


async def compare_builds(
    other: Path,
    pairs: int = 4,
    servers: int = 4,
    sequential: int = 2000,
    concurrency: int = 32,
    concurrent_requests: int = 2000,
    transport: str = "h2",
    streamed: bool = False,
    pin: bool = False,
) -> BuildComparison:
    """This checkout's EPP against another checkout's (`other`, a directory with the `epp` package, built as its
    README says or run as Python) in the same runs, over the same pool, each with its own default config: what a
    change to the request path is worth, to a few thousandths of plain Envoy's p50. Runs of one build alternated
    with runs of the other spread by several hundredths (the machine's load moves between them); within one run,
    two EPP targets of one build differ by about a hundredth, the second slot being the faster (`differences`),
    so each pair swaps the builds between the slots and the slots' difference cancels."""
    this_env, other_env = {}, build_environment(other)
    comparison = BuildComparison(str(other), _build_summary(other_env))
    for _ in range(pairs):
        for first, (second_name, second_env) in (
            (this_env, (OTHER_BUILD, other_env)),
            (other_env, (THIS_BUILD, this_env)),
        ):
            comparison.runs.append(
                await measure(
                    servers,
                    sequential,
                    concurrency,
                    concurrent_requests,
                    transport=transport,
                    with_peers=False,
                    with_floor=False,
                    streamed=streamed,
                    with_flow_control_off=False,
                    without_access_log=False,
                    with_picker_only=False,
                    epp_env=first,
                    epp_builds={second_name: second_env},
                    pin=pin,
                )
            )
    return comparison


def as_dict(result: OverheadResult) -> dict:
    return asdict(result)
