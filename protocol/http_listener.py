"""An HTTP/1.1 port served by aiohttp's request handler behind connection and request-head limits: the EPP's metrics
and status port, and the model server's port. aiohttp alone keeps any number of connections and waits forever for a
request head that never ends (its keep-alive timeout only runs between requests). Measured before these limits
(2026-11-30, 3,000 connections each sending 60 header lines and never the blank line): the EPP's RSS went from 84 to
185 MB and stayed at 173 MB after they closed; the model server's from 55 to 156 MB, 134 after; every connection a
file descriptor meanwhile.

Limits:
* at most `max_connections` open: one beyond is answered 503 and closed;
* a request head (request line and headers) must end within HEAD_SECONDS of its first byte, or of the connection's
  opening for its first request, and within MAX_HEAD_BYTES: a connection that is slower or sends more is closed
  (Go's ReadHeaderTimeout).
Between a head's end and the end of its handler (`middleware`, which the app must run outermost) bytes are the
request's body, bounded by whoever reads it (the model server's `read_body`), and are not counted. An idle keep-alive
connection is closed by aiohttp's own keepalive_timeout, which the caller sets on its runner. So what a port's
connections hold is bounded (tests/integration/test_memory_after_flood.py), and one that breaks a limit costs only
itself.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

from aiohttp import web

from protocol.limits import RepeatedWarning

MAX_CONNECTIONS = 128  # the EPP's metrics port: Prometheus, a browser on the status page and a few scripts
HEAD_SECONDS = 10.0
MAX_HEAD_BYTES = 32 << 10  # a browser's request head with its cookies is a few KB; Envoy's default limit is 60 KB
SWEEP_SECONDS = 1.0  # how often the heads in progress are checked against HEAD_SECONDS
# A flood's end: the open connections fell to a quarter of a peak of at least FLOOD_CONNECTIONS. aiohttp's connections
# are reference cycles (handler, parser, transport) that outlive a few collections and wait for a full one, which an
# idle process may not run for hours: 3,000 connections that sent a head and closed left the model server 72-103 MB
# above idle, 19-24 MB after one full collection (40-130 ms of CPU, once a flood), run COLLECT_DELAY_SECONDS after the
# flood's end so that aiohttp's request tasks have ended.
FLOOD_CONNECTIONS = 256
COLLECT_DELAY_SECONDS = 1.0
_TOO_MANY = b"too many connections to this port\n"
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_TOO_MANY), _TOO_MANY)
)
HEAD_END = b"\r\n\r\n"


class HttpListener:
    """Serves an aiohttp app's request handler factory (`web.AppRunner.server`) on one port, within the limits above.
    `port` names the port in the log (`"the metrics port"`); the app's middlewares must start with `middleware`."""

    def __init__(self, port: str, logger: str, max_connections: int = MAX_CONNECTIONS):
        self.max_connections = max_connections
        self.connections: dict[asyncio.BaseTransport, _Limited] = {}
        self.refused = RepeatedWarning(logger, f"refused a connection to {port}: %d are open; %d so far")
        self.slow = RepeatedWarning(
            logger, f"closed a connection to {port}: its request head took over %gs or %d bytes; %d so far"
        )
        self.protocol: Callable[[], asyncio.Protocol] | None = None
        self.peak = 0  # the most connections open at once since the last flood's end
        self.server: asyncio.Server | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

        @web.middleware
        async def middleware(request: web.Request, handler):
            connection = self.connections.get(request.transport)
            if connection is not None:  # a head is over (one the listener did not read: pipelined behind another)
                connection.in_request, connection.head_since, connection.head_bytes = True, None, 0
            try:
                return await handler(request)
            finally:
                # a body its handler left unread is still arriving (aiohttp reads it away after the response): its
                # bytes are not a head, and the connection stays in the request until the next one ends
                if connection is not None and request.content.at_eof():
                    connection.in_request = False

        self.middleware = middleware

    async def start(self, protocol: Callable[[], asyncio.Protocol], host: str, port: int, backlog: int = 100) -> None:
        self.protocol = protocol
        self._loop = asyncio.get_running_loop()
        self.server = await self._loop.create_server(
            lambda: _Limited(self), host, port, reuse_address=True, backlog=backlog
        )

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
        self.connections[connection.transport] = connection
        self.peak = max(self.peak, len(self.connections))
        if self._sweep is None:
            self._sweep = self._loop.call_later(SWEEP_SECONDS, self.sweep)
        return True

    def sweep(self) -> None:
        """Close the connections whose request head is overdue; again in SWEEP_SECONDS while any is open."""
        self._sweep = None
        overdue = time.monotonic() - HEAD_SECONDS
        for connection in [c for c in self.connections.values() if c.head_since is not None and c.head_since < overdue]:
            self.slow.note(HEAD_SECONDS, MAX_HEAD_BYTES)
            connection.head_since = None
            connection.transport.close()
        if self.connections:
            self._sweep = self._loop.call_later(SWEEP_SECONDS, self.sweep)

    def closed(self, connection: _Limited) -> None:
        if self.connections.get(connection.transport) is connection:
            del self.connections[connection.transport]
        if self.peak >= FLOOD_CONNECTIONS and len(self.connections) <= self.peak // 4:
            self.peak = len(self.connections)
            self._loop.call_later(COLLECT_DELAY_SECONDS, gc.collect)


class _Limited(asyncio.Protocol):
    """One connection: aiohttp's handler, with its request heads timed and measured on the way in."""

    __slots__ = ("head_bytes", "head_since", "in_request", "inner", "listener", "tail", "transport")

    def __init__(self, listener: HttpListener):
        self.listener = listener
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.head_since: float | None = None  # when the head in progress began (None: none is)
        self.head_bytes = 0
        self.tail = b""  # the last bytes of a head in progress, for its end split between two reads
        self.in_request = False  # a head ended and its handler has not: what arrives is its body

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
        if not self.in_request:
            self.read_head(data)
            if self.transport.is_closing():
                return  # it stops reading: nothing more reaches the handler
        self.inner.data_received(data)

    def read_head(self, data: bytes) -> None:
        seen = self.tail + data
        end = seen.find(HEAD_END)
        if end >= 0:  # the head ended: what follows is its body (or the next request's head, pipelined)
            self.in_request, self.head_since, self.head_bytes, self.tail = True, None, 0, b""
            return
        if self.head_since is None:
            self.head_since = time.monotonic()
        self.head_bytes += len(data)
        self.tail = seen[-3:]
        if self.head_bytes > MAX_HEAD_BYTES:
            self.listener.slow.note(HEAD_SECONDS, MAX_HEAD_BYTES)
            self.head_since = None
            self.transport.close()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.closed(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)
