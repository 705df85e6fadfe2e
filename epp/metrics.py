"""The EPP's own Prometheus metrics: a leaf that imports nothing of the EPP.

Names: llm-d router v1's `llm_d_epp_*` (docs/metrics.md there), each beside its older twin (`inference_objective_*`,
`inference_pool_*`, `inference_extension_*`: GIE's names), as llm-d emits both while dashboards migrate. The parts
write only the older name; the registry adds the twin to every family it exports (`DualEmission`, one table of
renames, CURRENT_NAMES), so no part writes a name twice. The director's per-request series (`_Series`) keep llm-d's
labels, the request's fairness id and priority among them, and write their older twins summed over the labels those
lack. Its parts register
their collectors here (`EPPMetrics.register`), read when Prometheus scrapes (no work on the request path). Per-request
series are plain numbers updated on the event loop and turned into samples only
when Prometheus scrapes (`_Series`): prometheus_client's own children take a lock and check observability on every
call, ~30 calls per request; the request path's own time went from 65-70 to 57-59 µs per request with this
(in-process: three messages parsed, handled and answered per request, 5,000 requests, three runs each)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Mapping

import cython
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.exposition import bucket_bounds, cumulative_buckets

DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
                    45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)  # fmt: skip
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072, 262144,
                 524288, 1048576)  # fmt: skip
QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Label values clients choose (model names from the body, fairness ids from a header) are capped as llm-d caps them
# (pkg/epp/metrics/cardinality.go): the first MAX_LABEL_VALUES distinct values of each get series, the rest share
# OVERFLOW_LABEL; model names the pool declares or its rewrite rules name are pinned (always their own label, not
# counted).
MAX_LABEL_VALUES = 1000
OVERFLOW_LABEL = "other"
# The labels of the per-request series (the director's RequestContext.labels), as llm-d's llm_d_epp_request_* carry
# them: the fairness id (bounded as above; llm-d's "default-flow" when the request names none) and the priority band.
REQUEST_LABELS = ("model_name", "target_model_name", "fairness_id", "priority")

# The llm_d_epp_* name of each older family (as prometheus_client names it: a counter without `_total`), with the
# labels llm-d renamed; a family not listed here takes llm_d_epp_ in place of its older prefix (PREFIXES).
CURRENT_PREFIX = "llm_d_epp_"
LEGACY_PREFIXES = ("inference_objective_", "inference_pool_", "inference_extension_")
CURRENT_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    "inference_objective_input_tokens": ("llm_d_epp_request_input_tokens", {}),
    "inference_objective_output_tokens": ("llm_d_epp_request_output_tokens", {}),
    "inference_objective_running_requests": ("llm_d_epp_request_running", {}),
    "inference_pool_ready_pods": ("llm_d_epp_ready_endpoints", {}),
    "inference_pool_per_pod_queue_size": (
        "llm_d_epp_per_endpoint_queue_size",
        {"model_server_pod": "model_server_endpoint"},
    ),
}


def current_name(legacy: str) -> tuple[str, dict[str, str]] | None:
    """The llm_d_epp_* name (and label renames) of an older family name; None for a name without a twin."""
    renamed = CURRENT_NAMES.get(legacy)
    if renamed is not None:
        return renamed
    for prefix in LEGACY_PREFIXES:
        if legacy.startswith(prefix):
            return CURRENT_PREFIX + legacy[len(prefix) :], {}
    return None


def twin(family: Metric) -> Metric | None:
    """`family` under its llm_d_epp_* name, the same samples (their labels renamed as llm-d did); None without one."""
    renamed = current_name(family.name)
    if renamed is None:
        return None
    name, labels = renamed
    copy = Metric(name, family.documentation, family.type, family.unit)
    start = len(family.name)
    copy.samples = [
        sample._replace(
            name=name + sample.name[start:],
            labels={labels.get(k, k): v for k, v in sample.labels.items()} if labels else sample.labels,
        )
        for sample in family.samples
    ]
    return copy


class DualEmission:
    """A collector's families, each followed by its llm_d_epp_* twin (`twin`)."""

    def __init__(self, collector: Collector):
        self.collector = collector

    def collect(self):
        for family in self.collector.collect():
            yield family
            current = twin(family)
            if current is not None:
                yield current


@cython.annotation_typing(True)
@cython.final
@cython.cclass
class BoundedLabel:
    """A free-form label's values: pinned ones and the first `limit` others are themselves, the rest OVERFLOW_LABEL.
    A value once admitted stays admitted (an increment and its decrement land on the same series); "" passes."""

    limit = cython.declare(cython.Py_ssize_t, visibility="public")
    seen = cython.declare(set, visibility="public")
    pinned = cython.declare(frozenset, visibility="public")

    def __init__(self, limit: int = MAX_LABEL_VALUES):
        self.limit = limit
        self.seen: set[str] = set()
        self.pinned: frozenset[str] = frozenset()

    def __call__(self, value: str) -> str:
        if not value or value in self.seen or value in self.pinned:
            return value
        if len(self.seen) < self.limit:
            self.seen.add(value)
            return value
        return OVERFLOW_LABEL


# The metrics a pick read are as old as the time since its endpoint's latest scrape: at most about the refresh interval
# (50 ms) under traffic, up to the quiet interval (250 ms) for the first request after a quiet spell.
PICKED_METRICS_AGE = "inference_extension_scheduler_picked_metrics_age_seconds"
SCHEDULER_E2E = "inference_extension_scheduler_e2e_duration_seconds"
METRICS_AGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
# a pick's wait for its turn (--replica-turns): a round trip to the sequencer, and any turn ahead of it
TURN_WAIT_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02)
SCHEDULER_BUCKETS = (0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


@cython.annotation_typing(True)
@cython.final
@cython.cclass
class _Value:
    """A counter's or gauge's child."""

    value = cython.declare(cython.double, visibility="public")

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


@cython.annotation_typing(True)
@cython.final
@cython.cclass
class _Buckets:
    """A histogram's child: a count per bucket (the last one above every bound) and the sum."""

    bounds = cython.declare(tuple, visibility="public")
    counts = cython.declare(list, visibility="public")
    sum = cython.declare(cython.double, visibility="public")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # The first bucket whose upper bound is >= value, looked for from the lowest: most observations (the
        # decision's time, each plugin's, the time in flow control) are below a millisecond and land in the first
        # bucket or two. A NaN is <= no bound: it counts in the last bucket (+Inf), as in Prometheus's Go client.
        bucket: cython.Py_ssize_t = 0
        bound: float
        for bound in self.bounds:
            if value <= bound:
                break
            bucket += 1
        self.counts[bucket] += 1
        self.sum += value


@cython.final
@cython.cclass
class _Series:
    """One labelled metric family of plain-number children, exported by `collect` when Prometheus scrapes (a scrape
    runs in a worker thread: it copies each child's numbers, which the GIL keeps whole) under both its names: its
    older `name` with `older_labels` (the children summed over the labels the older family lacks; None: all) and its
    llm_d_epp_* twin with every label, as llm-d's request series carry fairness_id and priority and their older twins
    do not."""

    kind = cython.declare(str, visibility="public")
    name = cython.declare(str, visibility="public")
    documentation = cython.declare(str, visibility="public")
    labelnames = cython.declare(tuple, visibility="public")
    older_labels = cython.declare(tuple, visibility="public")
    buckets = cython.declare(tuple, visibility="public")
    les = cython.declare(object, visibility="public")
    children = cython.declare(dict, visibility="public")

    def __init__(
        self,
        kind: str,
        name: str,
        documentation: str,
        labelnames=(),
        buckets: tuple[float, ...] = (),
        older_labels: tuple[str, ...] | None = None,
    ):
        self.kind, self.name, self.documentation = kind, name, documentation
        self.labelnames, self.buckets = tuple(labelnames), tuple(float(b) for b in buckets)
        self.older_labels = self.labelnames if older_labels is None else tuple(older_labels)
        unknown = set(self.older_labels) - set(self.labelnames)
        if unknown:
            raise ValueError(f"{name}: older labels {sorted(unknown)} are not among its labels")
        self.les = bucket_bounds(self.buckets)
        self.children: dict[tuple[str, ...], _Value | _Buckets] = {}

    def labels(self, *values: str) -> _Value | _Buckets:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = _Buckets(self.buckets) if self.kind == "histogram" else _Value()
        return child

    def collect(self) -> list:
        """The older family, then its llm_d_epp_* twin."""
        rows = [(values, _numbers(child)) for values, child in list(self.children.items())]
        full = self._family(self.labelnames, rows)
        if self.older_labels == self.labelnames:
            older = full
        else:
            kept = [self.labelnames.index(label) for label in self.older_labels]
            summed: dict[tuple[str, ...], tuple] = {}
            for values, numbers in rows:
                key = tuple([values[i] for i in kept])
                seen = summed.get(key)
                summed[key] = numbers if seen is None else _added(seen, numbers)
            older = self._family(self.older_labels, summed.items())
        current = twin(full)
        return [older] if current is None else [older, current]

    def _family(self, labelnames: tuple, rows: Iterable) -> Metric:
        if self.kind == "counter":
            family = CounterMetricFamily(self.name, self.documentation, labels=labelnames)
        elif self.kind == "gauge":
            family = GaugeMetricFamily(self.name, self.documentation, labels=labelnames)
        else:
            family = HistogramMetricFamily(self.name, self.documentation, labels=labelnames)
        for values, numbers in rows:
            if self.kind == "histogram":
                counts, total = numbers
                family.add_metric(list(values), cumulative_buckets(self.les, counts), total)
            else:
                family.add_metric(list(values), numbers[0])
        return family


def _numbers(child: _Value | _Buckets) -> tuple:
    """A child's numbers, copied: (value,) or (bucket counts, sum)."""
    if isinstance(child, _Buckets):
        return list(child.counts), child.sum
    return (child.value,)


def _added(a: tuple, b: tuple) -> tuple:
    if len(a) == 1:
        return (a[0] + b[0],)
    return [x + y for x, y in zip(a[0], b[0], strict=True)], a[1] + b[1]


class _SeriesCollector:
    def __init__(self, series: tuple[_Series, ...]):
        self.series = series

    def collect(self):
        for one in self.series:
            yield from one.collect()


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


def unlabelled(family_type: type, rows: Iterable[tuple[str, str, float]]) -> Iterator:
    """A family without labels for each (name, documentation, value) row (for the components' collectors)."""
    for name, doc, value in rows:
        family = family_type(name, doc)
        family.add_metric([], value)
        yield family


def one_label(family_type: type, name: str, doc: str, label: str, values: Mapping[str, float]):
    """A family with one label, a series for each (label value, value) of `values` (for the components' collectors)."""
    family = family_type(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class EPPMetrics:
    """The EPP's registry. It owns the per-request series (updated by the director) and the bounds on their
    free-form label values; each component registers its own collector (`register`), read when Prometheus scrapes:
    the pool's gauges (`epp.datalayer.datastore.PoolCollector`), the scheduler's prefix index and latency predictor
    (`epp.scheduling.scheduler.Scheduler`), flow control's queues (`epp.flowcontrol.FlowControlCollector`), the
    KV-event subscriber (`epp.datalayer.kv_events.KVEventSubscriber`) and the ext_proc transport's bounds
    (`epp.handlers.extproc.BufferedBodyCollector`, `epp.transport.h2.ExtProcServer`)."""

    def __init__(self, pool_name: str):
        self.pool_name = pool_name
        self.registry = CollectorRegistry()
        # llm-d's request series (pkg/epp/metrics/llm_d_router_metrics.go there) carry the request's fairness id and
        # priority band beside its model names; their older twins do not (request_total keeps the priority)
        model_labels = ("model_name", "target_model_name")
        labels = REQUEST_LABELS
        self.requests = _Series(
            "counter",
            "inference_objective_request_total",
            "Counter of inference objective requests broken out for each model and target model.",
            labels,
            older_labels=(*model_labels, "priority"),
        )
        self.errors = _Series(
            "counter",
            "inference_objective_request_error_total",
            "Counter of inference objective requests errors broken out for each model and target model.",
            (*labels, "error_code"),
            older_labels=(*model_labels, "error_code"),
        )
        self.duration = _Series(
            "histogram",
            "inference_objective_request_duration_seconds",
            "Inference objective response latency distribution in seconds for each model and target model.",
            labels,
            DURATION_BUCKETS,
            older_labels=model_labels,
        )
        self.input_tokens = _Series(
            "histogram",
            "inference_objective_input_tokens",
            "Inference objective input token count distribution for requests in each model.",
            labels,
            TOKEN_BUCKETS,
            older_labels=model_labels,
        )
        self.output_tokens = _Series(
            "histogram",
            "inference_objective_output_tokens",
            "Inference objective output token count distribution for requests in each model.",
            labels,
            TOKEN_BUCKETS,
            older_labels=model_labels,
        )
        self.running = _Series(
            "gauge",
            "inference_objective_running_requests",
            "Inference objective number of running requests in each model.",
            labels,
            older_labels=("model_name",),
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
        self.turn_wait = _Series(
            "histogram",
            "inference_extension_replica_turn_wait_seconds",
            "How long picks that waited for their turn to pick (--replica-turns) waited, in seconds.",
            (),
            TURN_WAIT_BUCKETS,
        )
        self.plugin_duration = _Series(
            "histogram",
            "inference_extension_plugin_duration_seconds",
            "Plugin latency distribution in seconds for each extension point, plugin type and plugin name.",
            ["extension_point", "plugin_type", "plugin_name"],
            SCHEDULER_BUCKETS,
        )
        # plugin_duration's series by plugin (its TypedName: type, name), looked up once
        self.plugin_durations: dict[tuple[str, str], _Buckets] = {}
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
            self.turn_wait,
            self.plugin_duration,
            self.served,
            self.queue_duration,
        )
        self.registry.register(_SeriesCollector(series))  # (each series writes its llm_d_epp_* twin itself)
        self.model_names = BoundedLabel()
        self.fairness_label = BoundedLabel()

    def register(self, collector: Collector) -> None:
        """Export what `collector.collect()` yields (metric families) on every scrape, after what is registered, each
        family with its llm_d_epp_* twin (DualEmission)."""
        self.registry.register(DualEmission(collector))

    def flow_control_outcome(self, priority: int, flow_id: str, outcome: str, seconds: float) -> None:
        """FlowController's observer: every request's outcome and its time in flow control."""
        self.queue_duration.labels(self.fairness_label(flow_id), str(priority), outcome, self.pool_name).observe(
            seconds
        )
