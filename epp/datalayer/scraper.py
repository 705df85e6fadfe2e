"""One task per endpoint scrapes its Prometheus page (default every 50 ms, 1 s timeout, keep-alive) and parses it
with the endpoint's engine spec.

Endpoints are scraped less often while this EPP has no traffic of its own (`idle_interval`; the EPP's default is
5x `interval`, 250 ms): an endpoint is quiet when this EPP has nothing of its own in flight to it (what peer replicas
said they routed there does not count: `Endpoint.peer_in_flight_requests`), no request of this EPP waits in flow
control (`pending`), and no request reached this EPP within the last `idle_interval`. Pages are read only to
route this EPP's requests, so while none arrive a busy pool (another client's load, or another EPP replica's) is not
worth 20 pages a second per endpoint from this one, and any traffic, even one request every 200 ms, keeps every
endpoint at `interval`: routing under load reads pages as fresh as with the quiet interval off. After a quiet spell,
`wake()` (the request path calls it for every request) scrapes every waiting endpoint at once; the request that woke
them is routed on pages up to `idle_interval` old rather than waiting for the new ones (measured on the 2-core host:
all pages fresh 2 / 17-35 / 96-217 ms after a wake at 8 / 64 / 256 endpoints, which a wait would add to the first
request after every spell). The cost: load that appeared on an endpoint in the last `idle_interval` is seen by that
first request only. Measured with `epp-bench idle [--busy]` and `epp-bench overhead`.

Replicas that share pages (`epp.replicas`, `--replica-share-pages`): an endpoint whose page a peer replica read
within two intervals is not scraped here (`peer_page`); each page this EPP reads goes to the peers (`page_read`), and
a peer's page is taken as this EPP's own (`apply_page`). Every endpoint is then read on the same ticks (multiples of
the interval), so the pages one replica reads for its peers leave in one datagram a tick, and an endpoint another
replica reads stays at the busy interval while any peer has requests in flight (`peers_busy`).

A failed scrape never raises: the endpoint keeps its last metrics and becomes
stale once no scrape succeeded within the staleness threshold (at once when the connection is refused). An endpoint
that has not served a valid page yet is logged as a WARNING with what it answered, once per change of answer (the
scheduler never picks it). Each endpoint
keeps one HTTP/1.1 connection (`metrics_client.MetricsClient`).
A scrape asks for only the samples the extractor reads (`name[]` parameters, which prometheus_client's exposition,
hence vLLM's and SGLang's /metrics, honours): ~1 KB instead of a ~28 KB page of histograms, less to send, read and
search on both sides. A server that ignores the parameters sends its whole page, which reads the same; one that
refuses them (a status below 500 other than 200) or answers without the samples read is read whole from then on,
once its whole page reads; a 5xx is the server's trouble, not the filter's. When the whole page does not read
either (no page at that path: a 404 to both), the whole page is tried again only every WHOLE_PAGE_RETRY seconds, so
a misconfigured server costs one request per scrape, not two."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.metrics_client import HTTPStatusError, MetricsClient, ScrapeError
from epp.datalayer.source import PageExtractor, PrometheusExtractor
from protocol.metrics import EndpointMetrics, InvalidMetricsError, MetricsParseError, sample_filter_query

WHOLE_PAGE_RETRY = 10.0  # seconds before a server whose filtered and whole pages both failed gets a whole-page try

log = logging.getLogger("epp.scraper")


class Scraper:
    """An endpoint source (`epp.datalayer.source`): polls each endpoint's page and hands it to `extractor`."""

    name = "metrics-scraper"

    def __init__(
        self,
        interval: float = 0.05,
        timeout: float = 1.0,
        staleness: float = 2.0,
        path: str = "/metrics",
        idle_interval: float = 0.05,
        extractor: PageExtractor | None = None,
    ):
        self.extractor = extractor or PrometheusExtractor()
        self.interval = interval
        self.idle_interval = max(interval, min(idle_interval, staleness / 2))
        self.timeout = timeout
        self.staleness = staleness
        self.path = path
        self._clients: dict[int, MetricsClient] = {}
        self._tasks: dict[int, asyncio.Task] = {}
        # endpoint id -> time.monotonic() before which its whole page is not tried again (both pages failed)
        self._whole_page_retry: dict[int, float] = {}
        self._idle_waits: set[asyncio.Future] = set()
        # endpoint id -> why its scrapes fail, for endpoints that have not served a valid page yet (logged per change)
        self._never_read: dict[int, str] = {}
        self._last_request = -math.inf  # time.monotonic() of the latest wake()
        # requests this EPP holds that no endpoint has yet (flow control's queue): wired by the EPP's startup
        self.pending: Callable[[], int] = _nothing_pending
        # Replicas that share pages (epp.replicas): whether a peer's page of this endpoint, at most the given seconds
        # old, stands for this EPP's scrape; told of each page this EPP read; whether peers route now (so pages of
        # the endpoints this EPP reads for them stay fresh while it has no traffic of its own)
        self.peer_page: Callable[[Endpoint, float], bool] | None = None
        self.page_read: Callable[[Endpoint], None] | None = None
        self.peers_busy: Callable[[], bool] = _nobody_busy
        self.scrapes = 0
        self.failures = 0

    def _client(self, endpoint: Endpoint) -> MetricsClient:
        client = self._clients.get(id(endpoint))
        if client is None:
            client = self._clients[id(endpoint)] = self._new_client(endpoint, self._filtered_path(endpoint))
        return client

    def _new_client(self, endpoint: Endpoint, path: str) -> MetricsClient:
        return MetricsClient(endpoint.spec.address, endpoint.spec.port, path, self.timeout)

    def _filtered_path(self, endpoint: Endpoint) -> str:
        """The page's path asking for only the samples the extractor reads (`sample_filter_query`)."""
        names = self.extractor.sample_names(endpoint)
        if not names:
            return self.path
        return f"{self.path}{'&' if '?' in self.path else '?'}{sample_filter_query(names)}"

    async def _read(self, endpoint: Endpoint) -> None:
        client = self._client(endpoint)
        try:
            self.extractor.extract(await client.get(), endpoint)
        except (HTTPStatusError, MetricsParseError) as exc:
            refused = isinstance(exc, HTTPStatusError) and exc.status < 500  # 3xx (not followed) or 4xx
            misread = isinstance(exc, MetricsParseError) and not isinstance(exc, InvalidMetricsError)
            if client.path == self.path or not (refused or misread):
                raise
            now = time.monotonic()
            if now < self._whole_page_retry.get(id(endpoint), -math.inf):
                raise
            # The server refused the sample filter, or answered it without what we read: if its whole page reads,
            # this endpoint is read whole from now on; if not, the filter was not the fault.
            whole = self._new_client(endpoint, self.path)
            try:
                self.extractor.extract(await whole.get(), endpoint)
            except Exception:
                whole.close()
                self._whole_page_retry[id(endpoint)] = now + WHOLE_PAGE_RETRY
                raise exc from None
            self._whole_page_retry.pop(id(endpoint), None)
            client.close()
            self._clients[id(endpoint)] = whole
            log.info("endpoint %s answered a filtered page with %s: its whole page is read instead", endpoint.name, exc)

    def start(self, endpoint: Endpoint) -> None:
        self._tasks[id(endpoint)] = asyncio.get_running_loop().create_task(self._loop(endpoint))

    def stop(self, endpoint: Endpoint) -> None:
        task = self._tasks.pop(id(endpoint), None)
        if task is not None:
            task.cancel()
        client = self._clients.pop(id(endpoint), None)
        if client is not None:
            client.close()
        self._whole_page_retry.pop(id(endpoint), None)
        self._never_read.pop(id(endpoint), None)
        endpoint.stale = True

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._whole_page_retry.clear()
        self._never_read.clear()

    async def scrape_once(self, endpoint: Endpoint) -> bool:
        """One scrape; True when it succeeded. Updates the endpoint in place."""
        self.scrapes += 1
        try:
            await self._read(endpoint)
            self._never_read.pop(id(endpoint), None)
            self._set_stale(endpoint, False)
            if self.page_read is not None:
                self.page_read(endpoint)
            return True
        except ConnectionRefusedError as exc:
            self._failed(endpoint, exc, stale=True)  # nothing listens there: do not wait out the threshold
        except InvalidMetricsError as exc:
            self._failed(endpoint, exc, stale=True)  # NaN, infinite or negative load: its state is unknown
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ScrapeError, ValueError, MetricsParseError) as exc:
            # (ValueError covers UnicodeDecodeError and malformed lengths)
            metrics = endpoint.metrics
            self._failed(endpoint, exc, stale=metrics is None or time.monotonic() - metrics.scraped_at > self.staleness)
        return False

    def apply_page(self, endpoint: Endpoint, metrics: EndpointMetrics, totals: tuple[float, float] | None) -> None:
        """A peer replica's page of `endpoint` (what it read and sent: `epp.replicas`), taken as this EPP's own."""
        self.extractor.apply(endpoint, metrics, totals)
        self._never_read.pop(id(endpoint), None)
        self._set_stale(endpoint, False)

    def _failed(self, endpoint: Endpoint, exc: BaseException, stale: bool) -> None:
        self.failures += 1
        log.debug("scrape of %s failed: %s", endpoint.name, exc)
        if endpoint.metrics is None:  # never read: the scheduler does not pick it (a wrong port, not a model server)
            reason = f"{type(exc).__name__}: {exc}"
            if self._never_read.get(id(endpoint)) != reason:
                self._never_read[id(endpoint)] = reason
                log.warning(
                    "endpoint %s (%s) has served no valid metrics page at %s, not routed to: %s (is a model server "
                    "listening at that address and port?)",
                    endpoint.name,
                    endpoint.hostport,
                    self.path,
                    reason,
                )
        if stale:
            self._set_stale(endpoint, True, f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _set_stale(endpoint: Endpoint, stale: bool, reason: str = "") -> None:
        """Logged once per change (a never-scraped endpoint starts stale; its first good page makes it ready); the
        latest reason is kept for the status page."""
        endpoint.stale_reason = reason
        if endpoint.stale == stale:
            return
        endpoint.stale = stale
        if stale:
            log.warning("endpoint %s (%s) is stale, not routed to: %s", endpoint.name, endpoint.hostport, reason)
        else:
            log.info("endpoint %s (%s) is ready: its metrics are fresh", endpoint.name, endpoint.hostport)

    def wake(self) -> None:
        """Traffic arrived: endpoints waiting out the idle interval are scraped now."""
        self._last_request = time.monotonic()
        if self._idle_waits:
            waits, self._idle_waits = self._idle_waits, set()
            for wait in waits:
                if not wait.done():
                    wait.set_result(None)

    def quiet(self, endpoint: Endpoint) -> bool:
        return (
            endpoint.metrics is not None
            and not endpoint.stale
            and endpoint.in_flight_requests == endpoint.peer_in_flight_requests  # none of this EPP's own
            and time.monotonic() - self._last_request >= self.idle_interval
            and not self.pending()
            and not self.peers_busy()
        )

    async def _idle_wait(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        wait = loop.create_future()
        self._idle_waits.add(wait)
        timer = loop.call_later(delay, _resolve, wait)
        try:
            await wait
        finally:
            timer.cancel()
            self._idle_waits.discard(wait)

    async def _loop(self, endpoint: Endpoint) -> None:
        """Never ends but by cancellation: an unexpected error costs one scrape (the endpoint goes stale), not the
        endpoint's scraping for good."""
        interval = self.interval
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                started = time.monotonic()
                peer_page = self.peer_page
                # a peer's page younger than two of this EPP's intervals stands for a scrape; an older one (the peer
                # died, or its scrapes fail) does not, and this EPP reads the page itself
                if peer_page is None or not peer_page(endpoint, 2 * interval):
                    try:
                        await self.scrape_once(endpoint)
                    except Exception as exc:
                        log.exception("scraping %s failed unexpectedly", endpoint.name)
                        self._failed(endpoint, exc, stale=True)
                quiet = self.idle_interval > self.interval and self.quiet(endpoint)
                interval = self.idle_interval if quiet else self.interval
                now = time.monotonic()
                # sharing pages, every endpoint is read on the same ticks, so the pages this EPP reads for its peers
                # go in one datagram a tick (`epp.replicas`)
                delay = interval - now % interval if peer_page is not None else interval - (now - started)
                if quiet:
                    await self._idle_wait(max(0.0, delay))
                else:
                    await asyncio.sleep(max(0.0, delay))


def _nothing_pending() -> int:
    return 0


def _nobody_busy() -> bool:
    return False


def _resolve(wait: asyncio.Future) -> None:
    if not wait.done():
        wait.set_result(None)
