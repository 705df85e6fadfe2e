"""The metrics and status port's listener: aiohttp's HTTP/1.1 handler behind limits like the ext_proc port's
(`epp.transport.h2`). aiohttp alone keeps any number of connections, waits forever for a request head that never
ends, and keeps an idle keep-alive connection for an hour (its default keepalive_timeout, 3,630 s). Measured before
these limits (2026-11-30, 3,000 connections to the metrics port each sending 60 header lines and never the blank
line): the EPP's RSS went from 84 to 185 MB and stayed at 173 MB after they closed, every one a file descriptor
meanwhile.

Limits:
* at most MAX_CONNECTIONS open: one beyond is answered 503 and closed (Prometheus, a browser on the status page and
  a few scripts need a handful);
* a request head (request line and headers) must end within HEAD_SECONDS of its first byte, or of the connection's
  opening for its first request, and within MAX_HEAD_BYTES: a connection that is slower or sends more is closed
  (Go's ReadHeaderTimeout; every route is a GET, so bytes after a head are the next head, or a body nobody reads);
* an idle keep-alive connection is closed after KEEPALIVE_SECONDS (aiohttp's keepalive_timeout).
So what the port's connections hold is bounded (tests/integration/test_memory_after_flood.py), and one that
breaks a limit costs only itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from epp.transport import RepeatedWarning

MAX_CONNECTIONS = 128
HEAD_SECONDS = 10.0
MAX_HEAD_BYTES = 32 << 10  # a browser's request head with its cookies is a few KB; Envoy's default limit is 60 KB
KEEPALIVE_SECONDS = 75.0  # longer than Prometheus's usual scrape interval, so its connection is reused
SWEEP_SECONDS = 1.0  # how often the heads in progress are checked against HEAD_SECONDS
_TOO_MANY = b"too many connections to this EPP port\n"
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_TOO_MANY), _TOO_MANY)
)
HEAD_END = b"\r\n\r\n"


class HttpListener:
    """Serves `protocol()` (aiohttp's request handler factory: `web.AppRunner.server`, the runner made with
    keepalive_timeout=KEEPALIVE_SECONDS) on one port, within the limits above."""

    def __init__(self, protocol: Callable[[], asyncio.Protocol], max_connections: int = MAX_CONNECTIONS):
        self.protocol = protocol
        self.max_connections = max_connections
        self.connections: set[_Limited] = set()
        self.refused = RepeatedWarning(
            "epp.transport.http", "refused a connection to the metrics port: %d are open; %d so far"
        )
        self.slow = RepeatedWarning(
            "epp.transport.http",
            "closed a connection to the metrics port: its request head took over %gs or %d bytes; %d so far",
        )
        self.server: asyncio.Server | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str, port: int) -> None:
        self._loop = asyncio.get_running_loop()
        self.server = await self._loop.create_server(lambda: _Limited(self), host, port, reuse_address=True)

    def close(self) -> None:
        """Stop listening (the runner's cleanup closes the connections)."""
        if self.server is not None:
            self.server.close()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def opened(self, connection: _Limited) -> bool:
        if len(self.connections) >= self.max_connections:
            self.refused.note(len(self.connections))
            return False
        self.connections.add(connection)
        if self._sweep is None:
            self._sweep = self._loop.call_later(SWEEP_SECONDS, self.sweep)
        return True

    def sweep(self) -> None:
        """Close the connections whose request head is overdue; again in SWEEP_SECONDS while any is open."""
        self._sweep = None
        overdue = time.monotonic() - HEAD_SECONDS
        for connection in [c for c in self.connections if c.head_since is not None and c.head_since < overdue]:
            self.slow.note(HEAD_SECONDS, MAX_HEAD_BYTES)
            connection.head_since = None
            connection.transport.close()
        if self.connections:
            self._sweep = self._loop.call_later(SWEEP_SECONDS, self.sweep)


class _Limited(asyncio.Protocol):
    """One connection: aiohttp's handler, with its request heads timed and measured on the way in."""

    __slots__ = ("head_bytes", "head_since", "inner", "listener", "tail", "transport")

    def __init__(self, listener: HttpListener):
        self.listener = listener
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.head_since: float | None = None  # when the head in progress began (None: none is)
        self.head_bytes = 0
        self.tail = b""  # the last bytes seen, for a head end split between two reads

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        if not self.listener.opened(self):
            transport.write(REFUSAL)
            transport.close()
            return
        self.head_since = time.monotonic()
        self.inner = self.listener.protocol()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        seen = self.tail + data
        end = seen.rfind(HEAD_END)
        if end >= 0:  # a head ended: what follows it starts the next one
            start = end + len(HEAD_END)
            after = len(seen) - start
            self.head_since, self.head_bytes = (time.monotonic() if after else None), after
            self.tail = seen[max(start, len(seen) - 3) :]  # never the end just found
        else:
            if self.head_since is None:
                self.head_since = time.monotonic()
            self.head_bytes += len(data)
            self.tail = seen[-3:]
        if self.head_bytes > MAX_HEAD_BYTES:
            self.listener.slow.note(HEAD_SECONDS, MAX_HEAD_BYTES)
            self.head_since = None
            self.transport.close()  # it stops reading: nothing more reaches the handler
            return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.connections.discard(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)
