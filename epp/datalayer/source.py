"""The data layer's two kinds of source, and the extractor that turns what a source collected into what the
scheduler reads. A new signal plugs in as one more source (and its extractor), with no change to the scheduler:

* `PoolSource` — discovery: what the pool is (endpoints, objectives, models, rewrites). `run(on_update)` calls
  `on_update` with each new PoolState until it is cancelled. Implementations: `pool_file.PoolFileSource`,
  `kubernetes.KubernetesSource`.
* `EndpointSource` — collects per endpoint, for as long as the endpoint is in the pool: the datastore calls
  `start(endpoint)` when it joins, `stop(endpoint)` when it leaves, `wake()` when a request arrives (a source that
  slows down while the pool is quiet speeds up again) and `close()` at shutdown. Implementations:
  `scraper.Scraper` (Prometheus pages, polled), `kv_events.KVEventSubscriber` (KV-cache events, pushed).
* `Extractor` — what an endpoint source hands its raw data to: it updates the endpoint's attributes (the ones the
  scheduling plugins declare in `consumes`) or an index the plugins read. `PrometheusExtractor` parses a metrics
  page with the endpoint's engine's metric names into `Endpoint.metrics`; as a `PageExtractor` it names the samples
  it reads, and the scraper asks the server for only those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from epp.datalayer.endpoint import Endpoint, PoolState
from protocol.metrics import EndpointMetrics, engine_spec, inter_token_totals, parse_metrics

Raw = TypeVar("Raw", contravariant=True)


class PoolSource(Protocol):
    name: str

    async def run(self, on_update: Callable[[PoolState], None]) -> None: ...


class EndpointSource(Protocol):
    name: str

    def start(self, endpoint: Endpoint) -> None: ...

    def stop(self, endpoint: Endpoint) -> None: ...

    def wake(self) -> None: ...

    async def close(self) -> None: ...


class Extractor(Protocol[Raw]):
    def extract(self, raw: Raw, endpoint: Endpoint) -> None:
        """Update `endpoint` (or what the plugins read about it) from `raw`; raise ValueError (or a subclass) when
        `raw` is malformed, leaving the endpoint as it was."""
        ...


class PageExtractor(Extractor[str], Protocol):
    def sample_names(self, endpoint: Endpoint) -> tuple[str, ...] | None:
        """The Prometheus samples `extract` reads from this endpoint's page (None: the whole page)."""
        ...

    def apply(self, endpoint: Endpoint, metrics: EndpointMetrics, totals: tuple[float, float] | None) -> None:
        """Set what a page said (read by `extract`, or by a peer replica that sent it) on `endpoint`."""
        ...


class PrometheusExtractor:
    """A Prometheus text page -> `endpoint.metrics` (queue, running, KV usage, LoRA adapters, cache config), read
    with the metric names of the endpoint's engine (`protocol.metrics.ENGINES`); also the EPP's in-flight count at
    this scrape, the LoRA adapters it ran (`Endpoint.adapters_used`), the endpoint's batch slots once it is
    seen full (`Endpoint.batch_slots`) and its inter-token latency totals over time (`Endpoint.inter_token_latency`)."""

    def sample_names(self, endpoint: Endpoint) -> tuple[str, ...]:
        """The samples `extract` reads from this endpoint's page: the scraper asks for only these."""
        return engine_spec(endpoint.spec.engine).sample_names()

    def extract(self, raw: str, endpoint: Endpoint) -> None:
        spec = engine_spec(endpoint.spec.engine)
        previous = endpoint.metrics
        metrics = parse_metrics(raw, spec)
        totals = None
        # tokens come only while requests run: an idle endpoint's totals stand still (the scrape after the last
        # request ended still reads them), and a sample is kept at most every INTER_TOKEN_SAMPLE_SECONDS
        busy = metrics.running or metrics.waiting or (previous is not None and (previous.running or previous.waiting))
        if busy and endpoint.inter_token_sample_due(metrics.scraped_at):
            totals = inter_token_totals(raw, spec)
        self.apply(endpoint, metrics, totals)

    @staticmethod
    def apply(endpoint: Endpoint, metrics: EndpointMetrics, totals: tuple[float, float] | None) -> None:
        """What one page says, set on `endpoint`: its metrics, its inter-token latency `totals` when read; from this
        EPP's scrape or a peer replica's (`epp.replicas`), which reads and sends the same figures."""
        endpoint.metrics = metrics
        endpoint.in_flight_at_scrape = endpoint.in_flight_requests
        if metrics.running_adapters or endpoint.recent_adapters:
            endpoint.adapters_used(metrics.running_adapters, metrics.max_lora)
        if totals is not None:
            endpoint.record_inter_token_totals(metrics.scraped_at, *totals)
        slots = endpoint.batch_slots
        if metrics.waiting:
            if metrics.running > (slots or 0):
                endpoint.batch_slots = metrics.running
        elif slots is not None and metrics.running >= slots:
            # every slot busy and nothing waiting: the limit learnt is not its batch size (a long prompt's prefill
            # chunk or the KV cache made requests wait then), so one more; flow control dispatches only up to the
            # limit, so a low one would never again be seen exceeded with requests waiting and would hold for good
            endpoint.batch_slots = metrics.running + 1
