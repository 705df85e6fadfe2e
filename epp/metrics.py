"""The EPP's own Prometheus metrics, named like GIE's. Pool gauges are computed when Prometheus scrapes (no work
on the request path). Per-request series are plain numbers updated on the event loop and turned into samples only
when Prometheus scrapes (`_Series`): prometheus_client's own children take a lock and check observability on every
call, ~30 calls per request; the request path's own time went from 65-70 to 57-59 µs per request with this
(in-process: three messages parsed, handled and answered per request, 5,000 requests, three runs each)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.kv_events import LAG_BUCKETS, KVEventSubscriber
from epp.datalayer.load import queue_depth
from epp.flowcontrol import FlowController
from epp.handlers.budget import ByteBudget
from epp.predictor import LatencyPredictor
from epp.scheduling.framework import PrefixIndexStats
from epp.scheduling.types import TypedName
from epp.transport.h2 import ExtProcServer

DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
                    45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)  # fmt: skip
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072, 262144,
                 524288, 1048576)  # fmt: skip
OTHER_MODEL = "other"  # the label value of model names that are neither declared by the pool nor served yet
MAX_SERVED_MODEL_LABELS = 100
QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OTHER_FLOW = "other"  # the label value of fairness ids beyond MAX_FAIRNESS_ID_LABELS (clients choose them)
MAX_FAIRNESS_ID_LABELS = 100
# The metrics a pick read are as old as the time since its endpoint's latest scrape: at most about the refresh interval
# (50 ms) under traffic, up to the quiet interval (250 ms) for the first request after a quiet spell.
PICKED_METRICS_AGE = "inference_extension_scheduler_picked_metrics_age_seconds"
SCHEDULER_E2E = "inference_extension_scheduler_e2e_duration_seconds"
METRICS_AGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
SCHEDULER_BUCKETS = (0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class _Value:
    """A counter's or gauge's child."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class _Buckets:
    """A histogram's child: a count per bucket (the last one above every bound) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        bounds = self.bounds
        low, high = 0, len(bounds)
        while low < high:  # the first bucket whose upper bound is >= value: bisect_left, on C doubles when compiled
            middle = (low + high) // 2
            bound = bounds[middle]
            if value <= bound:
                high = middle
            else:  # (NaN too: it counts in the +Inf bucket, as in Prometheus's Go client)
                low = middle + 1
        self.counts[low] += 1
        self.sum += value


class _Series:
    """One labelled metric family of plain-number children, exported by `collect` when Prometheus scrapes (a scrape
    runs in a worker thread: it copies each child's numbers, which the GIL keeps whole)."""

    def __init__(self, kind: str, name: str, documentation: str, labelnames=(), buckets: tuple[float, ...] = ()):
        self.kind, self.name, self.documentation = kind, name, documentation
        self.labelnames, self.buckets = tuple(labelnames), tuple(float(b) for b in buckets)
        self.children: dict[tuple[str, ...], _Value | _Buckets] = {}

    def labels(self, *values: str) -> _Value | _Buckets:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = _Buckets(self.buckets) if self.kind == "histogram" else _Value()
        return child

    def collect(self):
        if self.kind == "counter":
            family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        elif self.kind == "gauge":
            family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        else:
            family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            if isinstance(child, _Buckets):
                counts, total, cumulative, buckets = list(child.counts), child.sum, 0, []
                for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                    cumulative += count
                    buckets.append((floatToGoString(bound), cumulative))
                family.add_metric(list(values), buckets, total)
            else:
                family.add_metric(list(values), child.value)
        return family


class _PoolCollector:
    def __init__(
        self,
        pool_name: str,
        endpoints: Callable[[], list[Endpoint]],
        prefix_index: Callable[[], PrefixIndexStats | None],
        latency_predictor: Callable[[], LatencyPredictor | None],
    ):
        self.pool_name = pool_name
        self.endpoints = endpoints
        self.prefix_index = prefix_index
        self.latency_predictor = latency_predictor

    def collect(self):
        endpoints = self.endpoints()
        ready = [e for e in endpoints if not e.stale and e.metrics is not None]
        kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization",
            "The average kv cache utilization for an inference server pool.",
            labels=["name"],
        )
        kv.add_metric([self.pool_name], sum(e.metrics.kv_usage for e in ready) / len(ready) if ready else 0.0)
        queue = GaugeMetricFamily(
            "inference_pool_average_queue_size",
            "The average number of requests pending in the model server queue.",
            labels=["name"],
        )
        queue.add_metric([self.pool_name], sum(queue_depth(e) for e in ready) / len(ready) if ready else 0.0)
        pods = GaugeMetricFamily(
            "inference_pool_ready_pods", "The number of ready pods in the inference server pool.", labels=["name"]
        )
        pods.add_metric([self.pool_name], len(ready))
        per_pod = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            "The total number of requests pending in the model server queue for each underlying pod.",
            labels=["name", "model_server_pod"],
        )
        for e in endpoints:
            per_pod.add_metric([self.pool_name, e.name], queue_depth(e))
        yield from (kv, queue, pods, per_pod)
        index = self.prefix_index()
        if index is not None:
            size = GaugeMetricFamily("inference_extension_prefix_indexer_size", "Size of the prefix indexer.")
            size.add_metric([], index.index_size)
            ratio = GaugeMetricFamily(
                "inference_extension_prefix_indexer_hit_ratio",
                "Fraction of prompt blocks found on the chosen endpoint, over all requests.",
            )
            ratio.add_metric([], index.hit_ratio)
            yield from (size, ratio)
        predictor = self.latency_predictor()
        if predictor is not None:
            error = GaugeMetricFamily(
                "inference_extension_latency_predictor_mape",
                "Mean absolute percentage error of the latency predictions over the recent window, by target.",
                labels=["target"],
            )
            for target, value in (("ttft", predictor.ttft_mape), ("tpot", predictor.tpot_mape)):
                if value is not None:
                    error.add_metric([target], value)
            observations = CounterMetricFamily(
                "inference_extension_latency_predictor_observations",
                "Completed requests the latency predictor learnt from.",
            )
            observations.add_metric([], predictor.observations)
            slowness = GaugeMetricFamily(
                "inference_extension_latency_predictor_endpoint_slowness",
                "An endpoint's measured prefill time per token over the mean of the measured endpoints' (above 1: "
                "slower); its TTFT predictions are scaled by it.",
                labels=["model_server_pod"],
            )
            for name, value in predictor.backlog.measured_slowness().items():
                slowness.add_metric([name], value)
            yield from (error, observations, slowness)


class _FlowControlCollector:
    """The flow control's queues (per band and flow), the pool's saturation and the autoscaler signal, read when
    Prometheus scrapes."""

    def __init__(
        self, metrics: EPPMetrics, flow_control: Callable[[], FlowController | None], saturation: Callable[[], float]
    ):
        self.metrics = metrics
        self.flow_control = flow_control
        self.saturation = saturation

    def collect(self):
        pool = self.metrics.pool_name
        labels = ["fairness_id", "priority", "inference_pool"]
        size = GaugeMetricFamily(
            "inference_extension_flow_control_queue_size",
            "Current count of requests in the flow control buffer.",
            labels=labels,
        )
        size_bytes = GaugeMetricFamily(
            "inference_extension_flow_control_queue_bytes",
            "Current size in bytes of all buffered requests.",
            labels=labels,
        )
        saturation = GaugeMetricFamily(
            "inference_extension_flow_control_pool_saturation",
            "Share of the pool's endpoints that are saturated.",
            labels=["inference_pool"],
        )
        saturation.add_metric([pool], self.saturation())
        per_endpoint = GaugeMetricFamily(
            "inference_extension_flow_control_queued_requests_per_ready_endpoint",
            "Requests waiting in flow control per ready endpoint (an autoscaling signal).",
            labels=["inference_pool"],
        )
        controller = self.flow_control()
        totals: dict[tuple[str, str], list[int]] = {}
        for priority, flow, count, size_of in controller.queued() if controller is not None else ():
            key = (self.metrics.fairness_label(flow), str(priority))
            total = totals.setdefault(key, [0, 0])
            total[0] += count
            total[1] += size_of
        for (flow, priority), (count, size_of) in totals.items():
            size.add_metric([flow, priority, pool], count)
            size_bytes.add_metric([flow, priority, pool], size_of)
        ready = sum(1 for e in self.metrics.endpoints() if not e.stale and e.metrics is not None)
        queued = controller.count if controller is not None else 0
        per_endpoint.add_metric([pool], queued / ready if ready else float(queued))
        yield from (size, size_bytes, saturation, per_endpoint)


class _SeriesCollector:
    def __init__(self, series: tuple[_Series, ...]):
        self.series = series

    def collect(self):
        for one in self.series:
            yield one.collect()


class _KVEventsCollector:
    """The KV-event subscriber and its index (epp/datalayer/kv_events.py), read when Prometheus scrapes."""

    def __init__(self, subscriber: Callable[[], KVEventSubscriber | None]):
        self.subscriber = subscriber

    def collect(self):
        sub = self.subscriber()
        if sub is None:
            return
        index = sub.index
        gauges = (
            (
                "inference_extension_kv_events_index_entries",
                "(block hash, endpoint) pairs in the KV-event index.",
                index.size,
            ),
            (
                "inference_extension_kv_events_index_max_entries",
                "The KV-event index's cap on entries.",
                index.max_entries,
            ),
        )
        yield from _unlabelled(GaugeMetricFamily, gauges)
        counters = (
            (
                "inference_extension_kv_events_index_dropped_entries",
                "Entries the index's cap dropped.",
                index.dropped_entries,
            ),
            ("inference_extension_kv_events_batches", "KV event batches applied to the index.", sub.batches),
            ("inference_extension_kv_events_events", "KV events applied to the index.", sub.events_applied),
            ("inference_extension_kv_events_gaps", "Sequence gaps that dropped an endpoint's entries.", sub.gaps),
            ("inference_extension_kv_events_replays", "Sequence gaps closed by a replay from the server.", sub.replays),
            ("inference_extension_kv_events_restarts", "Servers whose sequence started over.", sub.restarts),
            ("inference_extension_kv_events_bad_messages", "Malformed KV event messages ignored.", sub.bad_messages),
            (
                "inference_extension_kv_events_outside_pool_messages",
                "KV event messages from servers not in the pool, ignored.",
                sub.outside_pool,
            ),
        )
        yield from _unlabelled(CounterMetricFamily, counters)
        lag = HistogramMetricFamily(
            "inference_extension_kv_events_lag_seconds",
            "Seconds from a KV event batch's engine step (its ts) to its application in the index.",
        )
        cumulative, buckets = 0, []
        for bound, count in zip((*LAG_BUCKETS, float("inf")), sub.lag_buckets, strict=True):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        lag.add_metric([], buckets, sub.lag_sum)
        yield lag


class _ExtProcCollector:
    """The ext_proc transport's shared bounds (epp/transport/h2.py, epp/handlers), read when Prometheus scrapes."""

    def __init__(self, server: Callable[[], ExtProcServer | None], body_budget: Callable[[], ByteBudget | None]):
        self.server = server
        self.body_budget = body_budget

    def collect(self):
        budget = self.body_budget()
        if budget is not None:
            yield from _unlabelled(
                GaugeMetricFamily,
                [
                    (
                        "inference_extension_ext_proc_buffered_body_bytes",
                        "Request body bytes all ext_proc streams buffer now (--max-buffered-body-bytes bounds them).",
                        budget.held,
                    )
                ],
            )
        server = self.server()
        if server is None:  # (the grpcio transport)
            return
        gauges = (
            (
                "inference_extension_ext_proc_connections",
                "Open connections to the ext_proc port (h2 transport).",
                len(server.connections),
            ),
            (
                "inference_extension_ext_proc_partial_message_bytes",
                "Bytes of gRPC messages not yet complete that all connections hold now.",
                server.partial.held,
            ),
            (
                "inference_extension_ext_proc_unread_answer_bytes",
                "Bytes of answers the ext_proc peers have not read yet (in the sockets' buffers or waiting for flow-control "
                "window), all connections together.",
                server.outbound.held,
            ),
        )
        yield from _unlabelled(GaugeMetricFamily, gauges)
        counters = (
            (
                "inference_extension_ext_proc_refused_connections",
                "Connections refused over --max-ext-proc-connections.",
                server.refused.count,
            ),
            (
                "inference_extension_ext_proc_refused_messages",
                "gRPC messages refused over their method's size limit (RESOURCE_EXHAUSTED), unread.",
                server.oversized.count,
            ),
            (
                "inference_extension_ext_proc_aborted_connections",
                "Connections aborted because all connections' unread answers went over the EPP-wide budget (the "
                "largest backlogs go first).",
                server.shed.count,
            ),
        )
        yield from _unlabelled(CounterMetricFamily, counters)


# After a render that took d seconds the next one starts d x this later at the soonest: rendering takes at most a
# tenth of the time, whoever asks and how often (~1.7 ms for a pool of 4; a new render within ~15 ms).
RENDER_GAP_FACTOR = 9.0


class MetricsPage:
    """The /metrics page, rendered in a worker thread. A render holds the GIL, and with it the event loop that
    answers Envoy, for up to the interpreter's switch interval (5 ms) at a time: scrapers in a loop (four of them
    asked ~350 times a second) tripled the gateway's sequential p50. So requests that come while a render runs share
    it, and after a render the page is served as it is for RENDER_GAP_FACTOR times as long as it took: Prometheus
    (every few seconds) always gets a new page, a flood gets the same one."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.page = b""
        self.fresh_until = 0.0  # (monotonic) until then `page` is served without a render
        self.rendering: asyncio.Future[bytes] | None = None
        self.renders = 0

    async def get(self) -> bytes:
        if self.rendering is None:
            if time.monotonic() < self.fresh_until:
                return self.page
            self.rendering = asyncio.ensure_future(self._render())
        # shielded: a client that goes away does not cancel the render the others wait for
        return await asyncio.shield(self.rendering)

    async def _render(self) -> bytes:
        started = time.monotonic()
        try:
            page = await asyncio.to_thread(generate_latest, self.registry)
        finally:
            self.rendering = None
        ended = time.monotonic()
        self.page, self.fresh_until = page, ended + RENDER_GAP_FACTOR * (ended - started)
        self.renders += 1
        return page


def _unlabelled(family_type: type, rows) -> Iterator:
    """A family without labels for each (name, documentation, value) row."""
    for name, doc, value in rows:
        family = family_type(name, doc)
        family.add_metric([], value)
        yield family


class EPPMetrics:
    def __init__(
        self,
        pool_name: str,
        endpoints: Callable[[], list[Endpoint]],
        prefix_index: Callable[[], PrefixIndexStats | None],
        flow_control: Callable[[], FlowController | None] = lambda: None,
        saturation: Callable[[], float] = lambda: 0.0,
        latency_predictor: Callable[[], LatencyPredictor | None] = lambda: None,
        kv_events: Callable[[], KVEventSubscriber | None] = lambda: None,
        ext_proc_server: Callable[[], ExtProcServer | None] = lambda: None,
        body_budget: Callable[[], ByteBudget | None] = lambda: None,
    ):
        self.pool_name = pool_name
        self.endpoints = endpoints
        self.registry = reg = CollectorRegistry()
        model_labels = ["model_name", "target_model_name"]
        self.requests = _Series(
            "counter",
            "inference_objective_request_total",
            "Counter of inference objective requests broken out for each model and target model.",
            model_labels,
        )
        self.errors = _Series(
            "counter",
            "inference_objective_request_error_total",
            "Counter of inference objective requests errors broken out for each model and target model.",
            [*model_labels, "error_code"],
        )
        self.duration = _Series(
            "histogram",
            "inference_objective_request_duration_seconds",
            "Inference objective response latency distribution in seconds for each model and target model.",
            model_labels,
            DURATION_BUCKETS,
        )
        self.input_tokens = _Series(
            "histogram",
            "inference_objective_input_tokens",
            "Inference objective input token count distribution for requests in each model.",
            model_labels,
            TOKEN_BUCKETS,
        )
        self.output_tokens = _Series(
            "histogram",
            "inference_objective_output_tokens",
            "Inference objective output token count distribution for requests in each model.",
            model_labels,
            TOKEN_BUCKETS,
        )
        self.running = _Series(
            "gauge",
            "inference_objective_running_requests",
            "Inference objective number of running requests in each model.",
            ["model_name"],
        )
        self.scheduler_e2e = _Series(
            "histogram",
            SCHEDULER_E2E,
            "Scheduling latency distribution in seconds.",
            (),
            SCHEDULER_BUCKETS,
        )
        self.picked_metrics_age = _Series(
            "histogram",
            PICKED_METRICS_AGE,
            "Age in seconds of the picked endpoint's metrics (its latest successful scrape) when it was picked.",
            (),
            METRICS_AGE_BUCKETS,
        )
        self.plugin_duration = _Series(
            "histogram",
            "inference_extension_plugin_duration_seconds",
            "Plugin latency distribution in seconds for each extension point, plugin type and plugin name.",
            ["extension_point", "plugin_type", "plugin_name"],
            SCHEDULER_BUCKETS,
        )
        self.plugin_durations: dict[TypedName, _Buckets] = {}  # plugin_duration's series by plugin, looked up once
        self.served = _Series(
            "counter",
            "inference_extension_served_endpoint_reports",
            "Responses for which the gateway reported the endpoint that served them, by whether it was the EPP's pick.",
            ["result"],
        )
        self.queue_duration = _Series(
            "histogram",
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Distribution of the total time requests spend in flow control, from arrival to their outcome.",
            ["fairness_id", "priority", "outcome", "inference_pool"],
            QUEUE_BUCKETS,
        )
        self.series = series = (
            self.requests,
            self.errors,
            self.duration,
            self.input_tokens,
            self.output_tokens,
            self.running,
            self.scheduler_e2e,
            self.picked_metrics_age,
            self.plugin_duration,
            self.served,
            self.queue_duration,
        )
        reg.register(_SeriesCollector(series))
        reg.register(_PoolCollector(pool_name, endpoints, prefix_index, latency_predictor))
        reg.register(_FlowControlCollector(self, flow_control, saturation))
        reg.register(_KVEventsCollector(kv_events))
        reg.register(_ExtProcCollector(ext_proc_server, body_budget))
        self._served_models: set[str] = set()
        self._fairness_ids: set[str] = set()

    def fairness_label(self, flow_id: str) -> str:
        """Fairness ids are the clients' choice: the first MAX_FAIRNESS_ID_LABELS get series, the rest share one."""
        if flow_id in self._fairness_ids:
            return flow_id
        if len(self._fairness_ids) < MAX_FAIRNESS_ID_LABELS:
            self._fairness_ids.add(flow_id)
            return flow_id
        return OTHER_FLOW

    def flow_control_outcome(self, priority: int, flow_id: str, outcome: str, seconds: float) -> None:
        """FlowController's observer: every request's outcome and its time in flow control."""
        self.queue_duration.labels(self.fairness_label(flow_id), str(priority), outcome, self.pool_name).observe(
            seconds
        )

    def model_label(self, name: str, declared: frozenset[str] | None) -> str:
        """Clients choose model names, so label values are bounded: a name is its own label once the pool declares
        it or a model server answered a request for it with success (at most MAX_SERVED_MODEL_LABELS of those);
        every other name is OTHER_MODEL."""
        if name in self._served_models or (declared is not None and name in declared) or not name:
            return name
        return OTHER_MODEL

    def model_served(self, name: str) -> None:
        if name not in self._served_models and len(self._served_models) < MAX_SERVED_MODEL_LABELS:
            self._served_models.add(name)
