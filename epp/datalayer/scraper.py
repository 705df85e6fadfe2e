"""One task per endpoint scrapes its Prometheus page (default every 50 ms, 1 s timeout, keep-alive) and parses it
with the endpoint's engine spec. A failed scrape never raises: the endpoint keeps its last metrics and becomes
stale once no scrape succeeded within the staleness threshold (at once when the connection is refused)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp

from epp.datalayer.endpoint import Endpoint
from protocol.metrics import MetricsParseError, engine_spec, parse_metrics

log = logging.getLogger("epp.scraper")


class Scraper:
    def __init__(self, interval: float = 0.05, timeout: float = 1.0, staleness: float = 2.0, path: str = "/metrics"):
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.staleness = staleness
        self.path = path
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[int, asyncio.Task] = {}
        self.scrapes = 0
        self.failures = 0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30), timeout=self.timeout
            )
        return self._session

    def start(self, endpoint: Endpoint) -> None:
        self._tasks[id(endpoint)] = asyncio.get_running_loop().create_task(self._loop(endpoint))

    def stop(self, endpoint: Endpoint) -> None:
        task = self._tasks.pop(id(endpoint), None)
        if task is not None:
            task.cancel()
        endpoint.stale = True

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()

    async def scrape_once(self, endpoint: Endpoint) -> bool:
        """One scrape; True when it succeeded. Updates the endpoint in place."""
        url = f"http://{endpoint.hostport}{self.path}"
        spec = engine_spec(endpoint.spec.engine)
        self.scrapes += 1
        try:
            async with self._client().get(url) as response:
                if response.status != 200:
                    raise MetricsParseError(f"HTTP {response.status}")
                text = await response.text()
            endpoint.metrics = parse_metrics(text, spec)
            endpoint.stale = False
            return True
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            endpoint.stale = True  # nothing listens there: do not wait out the threshold
            self._failed(endpoint, exc)
        except (TimeoutError, aiohttp.ClientError, MetricsParseError, UnicodeDecodeError) as exc:
            self._failed(endpoint, exc)
            if endpoint.metrics is None or time.monotonic() - endpoint.metrics.scraped_at > self.staleness:
                endpoint.stale = True
        return False

    def _failed(self, endpoint: Endpoint, exc: BaseException) -> None:
        self.failures += 1
        log.debug("scrape of %s failed: %s", endpoint.name, exc)

    async def _loop(self, endpoint: Endpoint) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                started = time.monotonic()
                await self.scrape_once(endpoint)
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
