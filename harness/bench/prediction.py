"""How well the predictor learns real sim servers: `python -m harness.bench.prediction [--route predicted]`.

Starts a sim pool (one `modelserver --backend sim --replicas N` process), scrapes each server's /metrics every
50 ms into `Endpoint` objects as the EPP's data layer does, and drives a heterogeneous closed-loop workload
straight at the servers (no EPP, no Envoy): 20 % ~5,000-token prompts, the rest ~200 tokens, the number of
concurrent clients stepping through `--concurrency` (one phase each). Each request goes to a random server
(`--route random`, the default); or, once the predictor is ready, to the one with the lowest predicted TTFT
(`--route predicted`, what the predicted-latency scorer alone would do); or where the EPP's scheduler sends it,
with its default profile, whose predictor plugins read either a predictor of the scheduler's own, which learns
nothing here (`--route epp-default`: they abstain, the other scorers decide), or the one this driver trains
(`--route epp-predicted`; they abstain during its cold start). For every request it records the features at send
time (`LatencyPredictor.routed`, with this driver's own in-flight prompt tokens per server standing in for the
EPP's) and the prediction made then, then the TTFT and TPOT observed on the response stream, which the predictor
learns from (`observe`), as the director will.

Reported per phase, over the requests sent after the phase's first quarter (steady load) while the predictor was
ready: the mean absolute percentage error of the predictions made at send time, and the predictor's own windowed
MAPE; then the scheduler's decision time at 32 endpoints with the default profile reading the trained predictor.
Random routing is the harder test: it keeps sending short requests behind long prefills, whose progress no feature
sees exactly; routing by the prediction avoids most of those, and its error is the one that matters for the
decisions actually made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from epp.datalayer.endpoint import Endpoint, EndpointSpec
from epp.predictor.features import Features
from epp.predictor.predictor import LatencyPredictor
from epp.scheduling.predictions import CandidatePredictions
from harness.bench.ports import free_port_block
from harness.bench.workloads import _text
from harness.local import LocalStack, StackConfig
from protocol.metrics import MetricsParseError, parse_metrics

MODEL = "sim-llama-8b"
CHARS_PER_TOKEN = 4  # the EPP's prompt-token estimate (len(prompt) // 4) is what the director will record
MIX = ((0.8, 200, 96), (0.2, 5000, 128))  # (share, prompt tokens, output tokens)


@dataclass
class Sample:
    phase: int
    endpoint: str
    sent: float  # seconds since the phase began
    features: Features
    ttft: float
    tpot: float | None
    predicted_ttft: float | None  # at send time, None during cold start
    predicted_tpot: float | None


@dataclass
class PhaseReport:
    concurrency: int
    requests: int = 0
    scored: int = 0  # steady-load requests the predictor had a prediction for
    ttft_mape: float | None = None  # of predictions made at send time
    tpot_mape: float | None = None
    ttft_mean_ms: float = 0.0
    window_ttft_mape: float | None = None  # the predictor's own prequential error at the end of the phase
    window_tpot_mape: float | None = None


@dataclass
class Report:
    servers: int
    phases: list[PhaseReport] = field(default_factory=list)
    observations: int = 0
    decision_us_32: float = 0.0  # median schedule() + on_routed() at 32 endpoints, predictor plugins included


async def _scrape(session: aiohttp.ClientSession, endpoints: list[Endpoint], stop: asyncio.Event) -> None:
    async def one(e: Endpoint) -> None:
        try:
            async with session.get(f"http://{e.hostport}/metrics") as response:
                e.metrics = parse_metrics(await response.text(), scraped_at=time.monotonic())
                e.stale = False
        except (aiohttp.ClientError, TimeoutError, MetricsParseError):
            pass  # keep the last snapshot, as the EPP does until it is stale

    while not stop.is_set():
        await asyncio.gather(*(one(e) for e in endpoints))
        await asyncio.sleep(0.05)


async def _request(session: aiohttp.ClientSession, endpoint: Endpoint, prompt: str, max_tokens: int) -> tuple:
    """(ttft, tpot or None) from the response stream; tokens are counted by their stream events."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    started = time.monotonic()
    first = last = None
    tokens = 0
    async with session.post(f"http://{endpoint.hostport}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{endpoint.hostport} answered {response.status}: {(await response.read())[:200]!r}")
        async for line in response.content:
            if line.startswith(b"data: {") and b'"choices"' in line:
                last = time.monotonic()
                first = first or last
                tokens += 1
    if first is None:
        raise RuntimeError(f"{endpoint.hostport} returned no token")
    return first - started, (last - first) / (tokens - 1) if tokens > 1 else None


ROUTES = ("random", "predicted", "epp-default", "epp-predicted")


def _router(route: str, predictor: LatencyPredictor, endpoints: list[Endpoint], rng: random.Random):
    """(request id, prompt, prompt tokens, max tokens) -> (the endpoint it goes to, its recorded features), for one
    of ROUTES: the features `predictor.routed` recorded at the pick (the predicted-latency scorer's, when the
    scheduler's profile has it; once per request, so that its prefill joins the backlog once)."""

    def routed(endpoint: Endpoint, tokens: int) -> tuple[Endpoint, Features]:
        return endpoint, predictor.routed(endpoint, tokens, 0, None)

    if route == "random":
        return lambda request_id, prompt, tokens, output: routed(rng.choice(endpoints), tokens)
    if route == "predicted":
        return lambda request_id, prompt, tokens, output: routed(_pick(rng, endpoints, predictor, tokens), tokens)
    from epp.scheduling.plugins.predicted_latency_scorer import ROUTED_FEATURES
    from epp.scheduling.scheduler import Scheduler
    from epp.scheduling.types import SchedulingRequest

    # the default profile, its latency predictor its own (epp-default) or `predictor` (epp-predicted)
    scheduler = Scheduler.from_config(None, None if route == "epp-default" else CandidatePredictions(predictor))

    def route_by_scheduler(request_id: str, prompt: str, tokens: int, output: int) -> tuple[Endpoint, Features]:
        request = SchedulingRequest(request_id, MODEL, prompt, tokens, max_tokens=output, streamed=True)  # timed
        result = scheduler.schedule(request, endpoints)
        scheduler.on_picked(request, result)
        scheduler.on_routed(request, result)
        features = result.cycle_state.read(ROUTED_FEATURES)
        return (result.primary, features) if features is not None else routed(result.primary, tokens)

    return route_by_scheduler


async def drive(
    urls: list[str],
    predictor: LatencyPredictor,
    concurrency: list[int],
    phase_seconds: float,
    seed: int = 0,
    route: str = "random",
) -> list[Sample]:
    """Run the phases against already started servers; every completed request is observed by `predictor`.
    `route`: "random"; "predicted" (the lowest predicted TTFT once the predictor is ready, random before);
    "epp-default" (the EPP's default profile, with a latency predictor of its own); "epp-predicted" (that profile
    with its predictor plugins reading `predictor`)."""
    rng = random.Random(seed)
    hostports = [u.removeprefix("http://").rpartition(":") for u in urls]
    endpoints = [Endpoint(EndpointSpec(f"ms-{i}", host, int(port))) for i, (host, _, port) in enumerate(hostports)]
    pick = _router(route, predictor, endpoints, rng)
    sent_total = 0
    prompts = {tokens: [_text(rng, tokens) for _ in range(16)] for _, tokens, _ in MIX}
    samples: list[Sample] = []
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        scraper = asyncio.create_task(_scrape(session, endpoints, stop))
        try:
            while any(e.metrics is None for e in endpoints):  # the scheduler picks no endpoint it never read
                await asyncio.sleep(0.02)
            for phase, clients in enumerate(concurrency):
                began = time.monotonic()
                deadline = began + phase_seconds

                async def client(phase=phase, began=began, deadline=deadline) -> None:
                    nonlocal sent_total
                    while time.monotonic() < deadline:
                        _, tokens, output = rng.choices(MIX, [m[0] for m in MIX])[0]
                        # a unique head per request: no prefix-cache hits, so cached_tokens = 0 is the truth
                        prompt = f"{rng.random()} " + rng.choice(prompts[tokens])
                        estimate = len(prompt) // CHARS_PER_TOKEN
                        sent_total += 1
                        endpoint, features = pick(f"r{sent_total}", prompt, estimate, output)
                        predicted = predictor.predict_ttft(features), predictor.predict_tpot(features)
                        sent = time.monotonic() - began
                        endpoint.in_flight_tokens += estimate
                        endpoint.in_flight_requests += 1
                        try:
                            ttft, tpot = await _request(session, endpoint, prompt, output)
                        finally:
                            endpoint.in_flight_tokens -= estimate
                            endpoint.in_flight_requests -= 1
                        predictor.observe(features, ttft, tpot)
                        samples.append(Sample(phase, endpoint.name, sent, features, ttft, tpot, *predicted))

                await asyncio.gather(*(client() for _ in range(clients)))
        finally:
            stop.set()
            await scraper
    return samples


def _pick(rng: random.Random, endpoints: list[Endpoint], predictor: LatencyPredictor, tokens: int) -> Endpoint:
    predicted = predictor.predict_endpoints(endpoints, tokens, [0] * len(endpoints), None)
    if predicted is None:
        return rng.choice(endpoints)
    best = min(ttft for ttft, _ in predicted)
    return rng.choice([e for e, (ttft, _) in zip(endpoints, predicted, strict=True) if ttft == best])


def _mape(pairs: list[tuple[float, float]]) -> float | None:
    return statistics.fmean(abs(p - y) / y for p, y in pairs) if pairs else None


def phase_report(samples: list[Sample], phase: int, concurrency: int, phase_seconds: float) -> PhaseReport:
    """Errors over the steady part of one phase (after its first quarter)."""
    mine = [s for s in samples if s.phase == phase]
    steady = [s for s in mine if s.sent >= phase_seconds / 4]
    ttft = [(s.predicted_ttft, s.ttft) for s in steady if s.predicted_ttft is not None]
    tpot = [(s.predicted_tpot, s.tpot) for s in steady if s.predicted_tpot is not None and s.tpot is not None]
    return PhaseReport(
        concurrency,
        len(mine),
        len(ttft),
        _mape(ttft),
        _mape(tpot),
        statistics.fmean(s.ttft for s in steady) * 1e3 if steady else 0.0,
    )


def decision_time(predictor: LatencyPredictor, size: int = 32, repeats: int = 300) -> float:
    """Median microseconds of schedule() + on_routed() at `size` endpoints with the default profile's predictor
    plugins reading `predictor`, with the prefix scorer's match wired in as the director does (every request carries
    a TTFT objective, so the filter does its work too)."""
    from harness.bench import decision

    return decision.measure(
        size,
        4000,
        repeats,
        headers={"x-llm-d-slo-ttft-ms": "500"},
        predictor=predictor,
    )


async def evaluate(
    servers: int,
    concurrency: list[int],
    phase_seconds: float,
    trace: Path | None = None,
    seed: int = 0,
    predictor: LatencyPredictor | None = None,
    route: str = "random",
) -> Report:
    predictor = predictor or LatencyPredictor()
    with tempfile.TemporaryDirectory(prefix="predictor-eval-") as workdir:
        stack = LocalStack(
            StackConfig(
                model_servers=servers,
                base_port=free_port_block(servers),
                workdir=Path(workdir),
                modelserver_args=["--disable-log-stats"],
            )
        )
        stack.start_model_servers()
        try:
            await asyncio.gather(*(stack._wait_http("modelserver", f"{u}/health", 60) for u in stack.model_server_urls))
            samples = await drive(stack.model_server_urls, predictor, concurrency, phase_seconds, seed, route)
        finally:
            stack.stop()
    report = Report(servers, observations=predictor.observations)
    for phase, clients in enumerate(concurrency):
        report.phases.append(phase_report(samples, phase, clients, phase_seconds))
    report.phases[-1].window_ttft_mape, report.phases[-1].window_tpot_mape = predictor.ttft_mape, predictor.tpot_mape
    if trace is not None:
        with trace.open("w") as out:
            for s in samples:
                out.write(json.dumps({**asdict(s), "features": asdict(s.features)}) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m harness.bench.prediction", description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=4)
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(c) for c in s.split(",")],
        default=[4, 12, 24],
        help="clients per phase, comma separated (default 4,12,24)",
    )
    p.add_argument("--phase", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--route",
        choices=ROUTES,
        default="random",
        help="how each request picks its server (see the module's docstring)",
    )
    p.add_argument("--trace", type=Path, help="write every sample (features, observed, predicted) as JSON lines")
    args = p.parse_args(argv)
    predictor = LatencyPredictor()
    report = asyncio.run(
        evaluate(args.servers, args.concurrency, args.phase, args.trace, args.seed, predictor, args.route)
    )
    if predictor.ttft_ready:
        report.decision_us_32 = decision_time(predictor)
    print(f"{report.servers} sim servers, {report.observations} requests observed")
    print("| clients | requests | predicted | TTFT MAPE | TPOT MAPE | mean TTFT (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    fmt = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    for r in report.phases:
        print(
            f"| {r.concurrency} | {r.requests} | {r.scored} | {fmt(r.ttft_mape)} | {fmt(r.tpot_mape)} | "
            f"{r.ttft_mean_ms:.0f} |"
        )
    last = report.phases[-1]
    fmt = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    print(f"windowed MAPE at the end: TTFT {fmt(last.window_ttft_mape)}, TPOT {fmt(last.window_tpot_mape)}")
    if report.decision_us_32:
        print(f"decision time at 32 endpoints with the predictor plugins: {report.decision_us_32:.0f} us (median)")
    else:
        print("the predictor never became ready: no decision time measured with it")


if __name__ == "__main__":
    main()
