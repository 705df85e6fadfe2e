"""Echo model servers for the gateway suite: each answers with where the request arrived (`served_by`, the listening
"ip:port"), the protocol it came in (`protocol`: "HTTP/1.1" or "HTTP/2.0"), its headers and a digest of its body, and
serves the metrics page the EPP scrapes.

One listening socket speaks HTTP/1.1 (aiohttp) and HTTP/2 over cleartext with prior knowledge (`h2`), whichever the
client starts with (the HTTP/2 connection preface), so one pool serves gateways of either `appProtocol` and the
answer says which one the gateway used; the EPP keeps scraping metrics over HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

import h2.config
import h2.connection
import h2.events
from aiohttp import web

HITS = web.AppKey("hits", list)  # every address an echo backend served from, in order
METRICS_PAGE = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_H2_BODY = 64 << 20  # bytes one HTTP/2 request may make the echo hold


def echo_info(served: str, protocol: str, headers: dict, body: bytes) -> dict:
    return {
        "served_by": served,
        "protocol": protocol,
        "headers": headers,
        "body_bytes": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
    }


def _events(count: int, served: str) -> list[bytes]:
    """A streamed completion's server-sent events: `count` numbered ones, then [DONE]."""
    events = [f"data: {json.dumps({'i': i, 'served_by': served})}\n\n".encode() for i in range(min(count, 10_000))]
    return [*events, b"data: [DONE]\n\n"]


def _served(request: web.Request) -> str:
    host, port = request.transport.get_extra_info("sockname")[:2]
    return f"{host}:{port}"


async def _echo(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    served = _served(request)
    request.app[HITS].append(served)
    if request.query.get("stream"):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in _events(int(request.query["stream"]), served):
            await response.write(event)
        return response
    version = f"HTTP/{request.version.major}.{request.version.minor}"
    return web.json_response(echo_info(served, version, dict(request.headers), body))


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=METRICS_PAGE)


async def _reset(request: web.Request) -> web.Response:
    """A model server that is down for inference but still scraped as healthy: the EPP keeps picking it, so only
    the gateway's fallback can save the request."""
    request.app[HITS].append(_served(request))
    request.transport.abort()
    raise web.HTTPServiceUnavailable()


def echo_app(hits: list[str], broken: bool = False) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/metrics", _metrics)
    app.router.add_route("*", "/{tail:.*}", _reset if broken else _echo)
    app[HITS] = hits
    return app


class _H2Echo:
    """One HTTP/2 connection: each request is answered with its echo once its stream ends."""

    def __init__(self, transport: asyncio.Transport, hits: list[str]):
        self.transport = transport
        self.hits = hits
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.requests: dict[int, tuple[dict, bytearray]] = {}
        host, port = transport.get_extra_info("sockname")[:2]
        self.served = f"{host}:{port}"

    def received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.requests[event.stream_id] = (dict(event.headers), bytearray())
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                body = self.requests[event.stream_id][1]
                body += event.data
                if len(body) > MAX_H2_BODY:
                    self.conn.reset_stream(event.stream_id)
                    del self.requests[event.stream_id]
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id in self.requests:
                self._answer(event.stream_id, *self.requests.pop(event.stream_id))
        self.transport.write(self.conn.data_to_send())

    def _answer(self, stream_id: int, headers: dict, body: bytearray) -> None:
        self.hits.append(self.served)
        query = parse_qs(urlsplit(headers.get(":path", "/")).query)
        # what it sends stays far below HTTP/2's initial flow-control window: no waiting for WINDOW_UPDATE
        if "stream" in query:
            self.conn.send_headers(stream_id, [(":status", "200"), ("content-type", "text/event-stream")])
            for event in _events(int(query["stream"][0]), self.served):
                self.conn.send_data(stream_id, event)
            self.conn.end_stream(stream_id)
            return
        plain = {k: v for k, v in headers.items() if not k.startswith(":")}
        payload = json.dumps(echo_info(self.served, "HTTP/2.0", plain, bytes(body))).encode()
        self.conn.send_headers(
            stream_id,
            [(":status", "200"), ("content-type", "application/json"), ("content-length", str(len(payload)))],
        )
        self.conn.send_data(stream_id, payload, end_stream=True)


class EchoProtocol(asyncio.Protocol):
    """Reads the first bytes of a connection: the HTTP/2 preface makes it an h2c echo, anything else is handed to
    aiohttp's HTTP/1.1 server (`http1`, the runner's protocol factory)."""

    def __init__(self, http1: Callable[[], asyncio.Protocol], hits: list[str]):
        self.http1 = http1
        self.hits = hits
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.h2: _H2Echo | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.h2 is not None:
            self.h2.received(data)
            return
        self.buffer += data
        if H2_PREFACE.startswith(self.buffer):
            return  # not enough bytes yet to tell
        if self.buffer.startswith(H2_PREFACE):
            self.h2 = _H2Echo(self.transport, self.hits)
            self.h2.received(self.buffer)
            return
        handler = self.http1()
        self.transport.set_protocol(handler)
        handler.connection_made(self.transport)
        handler.data_received(self.buffer)


async def serve_echo(runner: web.AppRunner, hits: list[str], host: str, port: int) -> asyncio.Server:
    """Listen on host:port with both protocols; `runner` (set up) holds the HTTP/1.1 application."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: EchoProtocol(runner.server, hits), host, port, reuse_address=True)
