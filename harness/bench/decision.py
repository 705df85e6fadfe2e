"""Decision time per request against pool size and prompt length, with a warm prefix index (every endpoint has
served 200 earlier prompts): the scheduler alone (default profile: filters, scorers, picker, and recording the
pick), the scheduler with its latency predictor trained (the same default profile, every request carrying a TTFT
objective so that the SLO filter does its work too), and the whole request path of the director
(`epp.requestcontrol.director`: model, objective, admission, scheduling, accounting and metrics; recording the pick;
completion)."""

from __future__ import annotations

import functools
import random
import time
from collections import deque

import yaml

from epp.config.loader import DEFAULT_CONFIG
from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import Endpoint, EndpointSpec, PoolState
from epp.flowcontrol import FlowControlConfig, FlowController
from epp.metrics import EPPMetrics
from epp.predictor import LatencyPredictor, endpoint_features
from epp.requestcontrol.director import Director
from epp.scheduling import plugins  # noqa: F401  (registers the built-in plugins, which scorers_only_config reads)
from epp.scheduling.framework import LatencyPredictionReader
from epp.scheduling.plugins import PLUGIN_TYPES
from epp.scheduling.predictions import CandidatePredictions
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import ResponseInfo, SchedulingRequest, SchedulingResult
from protocol.metrics import EndpointMetrics


def _pool(size: int, rng: random.Random) -> list[Endpoint]:
    return [
        Endpoint(
            EndpointSpec(f"e{i}", f"10.0.{i // 250}.{i % 250}", 8000),
            EndpointMetrics(
                waiting=rng.randrange(5),
                running=rng.randrange(20),
                kv_usage=rng.random(),
                block_size=16,
                num_gpu_blocks=8192,
                max_lora=4,
                running_adapters=frozenset({f"lora-{rng.randrange(8)}"}),
            ),
            stale=False,
        )
        for i in range(size)
    ]


class _DrawnMetrics:
    """Stands in for the scraper: every endpoint keeps the metrics drawn for it."""

    name = "drawn-metrics"

    def __init__(self, endpoints: list[Endpoint]):
        self.metrics = {e.spec.name: e.metrics for e in endpoints}

    def start(self, endpoint: Endpoint) -> None:
        endpoint.metrics, endpoint.stale = self.metrics[endpoint.spec.name], False

    def stop(self, endpoint: Endpoint) -> None:
        pass

    def wake(self) -> None:
        pass

    async def close(self) -> None:
        pass


def measure_director(
    size: int, prompt_bytes: int, repeats: int = 300, seed: int = 0, flow_control: bool = False
) -> float:
    """Median microseconds per director.route() + after_routed() + on_complete(); with `flow_control`, through
    its fast path (the pool has room: the saturation check, no queue)."""
    rng = random.Random(seed)
    pool = _pool(size, rng)
    scheduler = Scheduler.from_config(None)
    datastore = Datastore([_DrawnMetrics(pool)], scheduler.on_pool_changed)
    datastore.apply(PoolState(endpoints=tuple(e.spec for e in pool)))
    director = Director(datastore, scheduler, EPPMetrics("bench"))
    if flow_control:
        detector = scheduler.detector
        director.flow_control = FlowController(
            FlowControlConfig(), lambda in_flight: detector.has_room(datastore.endpoints, in_flight)
        )
    system = "".join(rng.choice("abcdefghij ") for _ in range(prompt_bytes))
    headers = {":path": "/v1/completions", "content-type": "application/json"}

    def one(prompt: str) -> None:
        ctx = director.new_request(dict(headers), None)
        payload = {"model": "m", "prompt": prompt, "max_tokens": 16}
        director.route(ctx, payload, b"")
        director.after_routed(ctx)
        ctx.status = "200"
        director.on_complete(ctx)

    for i in range(200):
        one(system[: prompt_bytes // 2] + str(i))
    samples = []
    for i in range(repeats):
        started = time.perf_counter()
        one(system + str(i))
        samples.append(time.perf_counter() - started)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


IN_FLIGHT_PER_ENDPOINT = 8


def scorers_only_config() -> str:
    """The default profile without the latency predictor's plugins (LatencyPredictionReader): what it was before
    them."""
    readers = {name for name, cls in PLUGIN_TYPES.items() if issubclass(cls, LatencyPredictionReader)}
    config = yaml.safe_load(DEFAULT_CONFIG)
    config["plugins"] = [p for p in config["plugins"] if p["type"] not in readers]
    for profile in config["schedulingProfiles"]:
        profile["plugins"] = [p for p in profile["plugins"] if p["pluginRef"] not in readers]
    return yaml.safe_dump(config, sort_keys=False)


def trained_predictor(endpoints: list[Endpoint], seed: int = 0) -> LatencyPredictor:
    """A predictor that is ready (past its cold start) with a prefill rate for every endpoint, trained on latencies
    drawn from a linear model of the features: what matters here is the cost of predicting, not the figures."""
    rng = random.Random(seed)
    predictor = LatencyPredictor()
    while not (predictor.ttft_ready and predictor.tpot_ready and len(predictor.backlog.rates) == len(endpoints)):
        f = endpoint_features(rng.choice(endpoints), rng.randrange(50, 6000), 0, None)
        ttft = 0.02 + 1e-4 * f.prompt_tokens + 0.01 * f.waiting + 0.002 * f.running
        predictor.observe(f, ttft, 0.012 + 5e-5 * f.running)
    return predictor


def measure(
    size: int,
    prompt_bytes: int,
    repeats: int = 300,
    seed: int = 0,
    config: str | None = None,
    headers: dict[str, str] | None = None,
    predictor: LatencyPredictor | None = None,
    max_tokens: int | None = None,
    streamed: bool = False,
) -> float:
    """Median microseconds per schedule() + on_picked() + on_routed() with the profile `config` (None: the
    default); `headers`, `max_tokens` and `streamed` go with every request; `predictor` (when given) is the latency
    predictor the profile's plugins read. The requests stay in flight until IN_FLIGHT_PER_ENDPOINT per endpoint are
    (then the oldest completes, outside the timed decision), as in a busy pool: what plugins keep per in-flight
    request is then its usual size."""
    rng = random.Random(seed)
    endpoints = _pool(size, rng)
    given = CandidatePredictions(predictor) if predictor is not None else None
    scheduler = Scheduler.from_config(config, given)
    system = "".join(rng.choice("abcdefghij ") for _ in range(prompt_bytes))
    for i in range(200):  # warm the prefix index
        request = SchedulingRequest(f"w{i}", "m", system[: prompt_bytes // 2] + str(i))
        result = scheduler.schedule(request, endpoints)
        scheduler.on_picked(request, result)
        scheduler.on_routed(request, result)
    samples = []
    in_flight: deque[tuple[SchedulingRequest, SchedulingResult]] = deque()
    for i in range(repeats):
        prompt = system + str(i)
        request = SchedulingRequest(
            f"r{i}", "m", prompt, len(prompt) // 4, headers=headers or {}, max_tokens=max_tokens, streamed=streamed
        )
        started = time.perf_counter()
        result = scheduler.schedule(request, endpoints)
        scheduler.on_picked(request, result)
        scheduler.on_routed(request, result)
        samples.append(time.perf_counter() - started)
        in_flight.append((request, result))
        if len(in_flight) > IN_FLIGHT_PER_ENDPOINT * size:
            request, result = in_flight.popleft()
            scheduler.on_finished(request, result, result.primary, ResponseInfo("200"))
        del request, result  # the last reference to a completed one's cycle state (up to 256 prefix hashes)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def measure_predicted(size: int, prompt_bytes: int, repeats: int = 300, seed: int = 0) -> float:
    """`measure` with the default profile's latency predictor trained, and TTFT and TPOT objectives on every
    request (slo-interference-filter keeps each one in flight until it completes), each streamed (its features are
    kept for the predictor to learn from)."""
    return measure(
        size,
        prompt_bytes,
        repeats,
        seed,
        headers={"x-llm-d-slo-ttft-ms": "500", "x-llm-d-slo-tpot-ms": "50"},
        predictor=trained_predictor(_pool(size, random.Random(seed))),
        max_tokens=64,
        streamed=True,
    )


def main(sizes=(8, 32, 128), prompts=(1_000, 16_000, 220_000)) -> None:
    with_flow_control = functools.partial(measure_director, flow_control=True)
    for title, function in (
        ("scheduler", measure),
        ("scheduler with the latency predictor trained (its filters and scorer predict)", measure_predicted),
        ("director (whole request path)", measure_director),
        ("director with flow control (its fast path: the pool has room)", with_flow_control),
    ):
        print(f"\n{title}\n")
        print("| endpoints | " + " | ".join(f"{p // 1000} KB prompt (us)" for p in prompts) + " |")
        print("| --- |" + " --- |" * len(prompts))
        for size in sizes:
            print(f"| {size} | " + " | ".join(f"{function(size, p):.0f}" for p in prompts) + " |", flush=True)
