"""The live pool: one `Endpoint` object per endpoint for as long as it is in the pool, the pool's objectives,
models and rewrites; the endpoint sources (`epp.datalayer.source`: the metrics scraper, KV events) are told when an
endpoint joins or leaves."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from prometheus_client.core import GaugeMetricFamily

from epp.datalayer.endpoint import Endpoint, PoolState
from epp.datalayer.load import queue_depth
from epp.datalayer.source import EndpointSource

log = logging.getLogger("epp.datastore")


class Datastore:
    def __init__(
        self, sources: Sequence[EndpointSource], on_pool_changed: Callable[[list[Endpoint]], None] | None = None
    ):
        self.sources = tuple(sources)
        self.on_pool_changed = on_pool_changed
        self.state = PoolState()
        self.endpoints: list[Endpoint] = []  # what the scheduler reads, replaced (never mutated) on change
        self._by_name: dict[str, Endpoint] = {}
        self._by_hostport: dict[str, Endpoint] = {}

    def apply(self, state: PoolState) -> None:
        """Reconcile with a new PoolState: keep unchanged endpoints (and their metrics), add and drop the rest."""
        current = self._by_name
        wanted = {spec.name: spec for spec in state.endpoints}
        for name, endpoint in list(current.items()):
            if wanted.get(name) != endpoint.spec:
                for source in self.sources:
                    source.stop(endpoint)
                del current[name]
                log.info("endpoint %s (%s) left the pool", name, endpoint.hostport)
        for name, spec in wanted.items():
            if name not in current:
                endpoint = Endpoint(spec)
                current[name] = endpoint
                for source in self.sources:
                    source.start(endpoint)
                log.info("endpoint %s (%s, %s) joined the pool", name, spec.hostport, spec.engine)
        self.state = state
        self.endpoints = [current[spec.name] for spec in state.endpoints]
        self._by_hostport = {e.hostport: e for e in self.endpoints}
        if self.on_pool_changed is not None:
            self.on_pool_changed(self.endpoints)

    def note_request(self) -> None:
        """A request arrived: quiet endpoints go back to the fast scrape interval while its body arrives."""
        for source in self.sources:
            source.wake()

    def by_hostport(self, hostport: str) -> Endpoint | None:
        return self._by_hostport.get(hostport)

    def priority(self, objective: str | None) -> int:
        return self.state.objectives.get(objective, 0) if objective else 0

    async def close(self) -> None:
        for endpoint in self.endpoints:
            for source in self.sources:
                source.stop(endpoint)
        for source in self.sources:
            await source.close()


class PoolCollector:
    """The pool's gauges (GIE's inference_pool_*), computed from the datastore's endpoints when Prometheus scrapes."""

    def __init__(self, pool_name: str, datastore: Datastore):
        self.pool_name = pool_name
        self.datastore = datastore

    def collect(self):
        endpoints = self.datastore.endpoints
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
