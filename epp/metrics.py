"""The EPP's own Prometheus metrics, named like GIE's. Pool gauges are computed when Prometheus scrapes (no work
on the request path); per-request series bind their label children once per model."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.load import queue_depth

DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
                    45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)  # fmt: skip
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072, 262144,
                 524288, 1048576)  # fmt: skip
OTHER_MODEL = "other"  # the label value of model names that are neither declared by the pool nor served yet
MAX_SERVED_MODEL_LABELS = 100
SCHEDULER_BUCKETS = (0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class _PoolCollector:
    def __init__(self, pool_name: str, endpoints: Callable[[], list[Endpoint]], prefix_index: Callable[[], object]):
        self.pool_name = pool_name
        self.endpoints = endpoints
        self.prefix_index = prefix_index

    def collect(self):
        endpoints = self.endpoints()
        ready = [e for e in endpoints if not e.stale and e.metrics is not None]
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization",
                               "The average kv cache utilization for an inference server pool.", labels=["name"])  # fmt: skip
        kv.add_metric([self.pool_name], sum(e.metrics.kv_usage for e in ready) / len(ready) if ready else 0.0)
        queue = GaugeMetricFamily("inference_pool_average_queue_size",
                                  "The average number of requests pending in the model server queue.", labels=["name"])  # fmt: skip
        queue.add_metric([self.pool_name], sum(queue_depth(e) for e in ready) / len(ready) if ready else 0.0)
        pods = GaugeMetricFamily("inference_pool_ready_pods", "The number of ready pods in the inference server pool.",
                                 labels=["name"])  # fmt: skip
        pods.add_metric([self.pool_name], len(ready))
        per_pod = GaugeMetricFamily("inference_pool_per_pod_queue_size", "The total number of requests pending in the "
                                    "model server queue for each underlying pod.", labels=["name", "model_server_pod"])  # fmt: skip
        for e in endpoints:
            per_pod.add_metric([self.pool_name, e.name], queue_depth(e))
        yield from (kv, queue, pods, per_pod)
        index = self.prefix_index()
        if index is not None:
            size = GaugeMetricFamily("inference_extension_prefix_indexer_size", "Size of the prefix indexer.")
            size.add_metric([], index.index_size)
            ratio = GaugeMetricFamily("inference_extension_prefix_indexer_hit_ratio",
                                      "Fraction of prompt blocks found on the chosen endpoint, over all requests.")  # fmt: skip
            ratio.add_metric([], index.hit_ratio)
            yield from (size, ratio)


class EPPMetrics:
    def __init__(self, pool_name: str, endpoints: Callable[[], list[Endpoint]], prefix_index: Callable[[], object]):
        self.registry = reg = CollectorRegistry()
        model_labels = ["model_name", "target_model_name"]
        self.requests = Counter("inference_objective_request_total",
                                "Counter of inference objective requests broken out for each model and target model.",
                                model_labels, registry=reg)  # fmt: skip
        self.errors = Counter("inference_objective_request_error_total",
                              "Counter of inference objective requests errors broken out for each model and target "
                              "model.", [*model_labels, "error_code"], registry=reg)  # fmt: skip
        self.duration = Histogram("inference_objective_request_duration_seconds",
                                  "Inference objective response latency distribution in seconds for each model and "
                                  "target model.", model_labels, buckets=DURATION_BUCKETS, registry=reg)  # fmt: skip
        self.input_tokens = Histogram("inference_objective_input_tokens",
                                      "Inference objective input token count distribution for requests in each model.",
                                      model_labels, buckets=TOKEN_BUCKETS, registry=reg)  # fmt: skip
        self.output_tokens = Histogram("inference_objective_output_tokens",
                                       "Inference objective output token count distribution for requests in each "
                                       "model.", model_labels, buckets=TOKEN_BUCKETS, registry=reg)  # fmt: skip
        self.running = Gauge("inference_objective_running_requests",
                             "Inference objective number of running requests in each model.", ["model_name"],
                             registry=reg)  # fmt: skip
        self.scheduler_e2e = Histogram("inference_extension_scheduler_e2e_duration_seconds",
                                       "Scheduling latency distribution in seconds.", buckets=SCHEDULER_BUCKETS,
                                       registry=reg)  # fmt: skip
        self.plugin_duration = Histogram("inference_extension_plugin_duration_seconds",
                                         "Plugin latency distribution in seconds for each extension point, plugin "
                                         "type and plugin name.", ["extension_point", "plugin_type", "plugin_name"],
                                         buckets=SCHEDULER_BUCKETS, registry=reg)  # fmt: skip
        self.served = Counter("inference_extension_served_endpoint_reports",
                              "Responses for which the gateway reported the endpoint that served them, by whether "
                              "it was the EPP's pick.", ["result"], registry=reg)  # fmt: skip
        reg.register(_PoolCollector(pool_name, endpoints, prefix_index))
        self._children: dict[tuple, object] = {}
        self._served_models: set[str] = set()

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

    def child(self, metric, *labels: str):
        """A label child, created once and reused (labels() costs microseconds per call)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
