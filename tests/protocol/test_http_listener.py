"""The HTTP listener of the EPP's metrics port and the model server's port (protocol/http_listener.py): requests are
served as aiohttp serves them (keep-alive, pipelined, a head split between reads, bodies of any size and pace), and a
connection beyond the limit, a request head too slow or too large, each cost only that connection."""

import asyncio

import pytest
from aiohttp import web

from protocol import http_listener as http
from protocol.http_listener import MAX_HEAD_BYTES, HttpListener
from tests.conftest import free_ports, read_response


@pytest.fixture
async def listener():
    served = HttpListener("the test port", "tests.http", max_connections=4)
    app = web.Application(middlewares=[served.middleware])

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    async def length(request: web.Request) -> web.Response:
        return web.Response(text=str(len(await request.read())))

    app.router.add_get("/hello", hello)
    app.router.add_post("/length", length)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    (port,) = free_ports(1)
    await served.start(runner.server, "127.0.0.1", port)
    served.port, served.runner = port, runner
    yield served
    served.close()
    await runner.cleanup()


async def connect(listener: HttpListener) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", listener.port)


async def response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response's status line and body."""
    status, _, body = await read_response(reader)
    return status, body


GET = b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the listener closed the connection (an end of stream, or a reset when bytes it never read were left)."""
    try:
        return await asyncio.wait_for(reader.read(), 2) == b""
    except ConnectionResetError:
        return True


async def test_keep_alive_pipelined_and_split_heads_are_served(listener):
    reader, writer = await connect(listener)
    writer.write(GET + GET)  # two requests in one write
    assert [await response(reader) for _ in range(2)] == [(b"HTTP/1.1 200 OK", b"hello")] * 2
    writer.write(GET[:-2])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(GET[-2:])  # the blank line in the next read
    assert await response(reader) == (b"HTTP/1.1 200 OK", b"hello")
    assert len(listener.connections) == 1
    writer.close()


async def test_a_connection_beyond_the_limit_gets_503_and_the_others_go_on(listener):
    held = [await connect(listener) for _ in range(4)]
    reader, writer = await connect(listener)
    status, body = await response(reader)
    assert status == b"HTTP/1.1 503 Service Unavailable" and b"too many connections" in body
    assert await closed(reader) and listener.refused.count == 1
    held_reader, held_writer = held[0]
    held_writer.write(GET)
    assert await response(held_reader) == (b"HTTP/1.1 200 OK", b"hello")
    for _, w in held:
        w.close()
    await asyncio.sleep(0.05)
    reader, writer = await connect(listener)  # room again once they closed
    writer.write(GET)
    assert await response(reader) == (b"HTTP/1.1 200 OK", b"hello")
    writer.close()


async def test_a_slow_request_head_is_closed_and_an_idle_keep_alive_is_not(listener, monkeypatch):
    monkeypatch.setattr(http, "HEAD_SECONDS", 0.3)
    monkeypatch.setattr(http, "SWEEP_SECONDS", 0.05)
    silent_reader, _silent = await connect(listener)  # never sends a byte
    slow_reader, slow = await connect(listener)
    served_reader, served = await connect(listener)
    served.write(GET)
    assert await response(served_reader) == (b"HTTP/1.1 200 OK", b"hello")
    for line in (b"GET /hello HTTP/1.1\r\n", b"Host: x\r\n", b"X-Slow: 1\r\n"):  # never the blank line
        slow.write(line)
        await asyncio.sleep(0.15)
    assert await closed(slow_reader) and await closed(silent_reader)
    assert listener.slow.count == 2
    assert len(listener.connections) == len(listener.runner.server.connections) == 1  # aiohttp let them go too
    served.write(GET)  # idle past HEAD_SECONDS between requests: still open
    assert await response(served_reader) == (b"HTTP/1.1 200 OK", b"hello")
    served.close()


async def test_a_request_head_over_the_limit_is_closed(listener):
    reader, writer = await connect(listener)
    writer.write(b"GET /hello HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(40)))
    assert MAX_HEAD_BYTES < 40 * 1000
    assert await closed(reader) and listener.slow.count == 1
    reader, writer = await connect(listener)
    writer.write(GET)
    assert await response(reader) == (b"HTTP/1.1 200 OK", b"hello")
    writer.close()


def post(body: bytes) -> bytes:
    return b"POST /length HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body


async def test_a_body_is_not_a_head_whatever_its_size_and_pace_and_the_next_head_is_timed_again(listener, monkeypatch):
    monkeypatch.setattr(http, "HEAD_SECONDS", 0.3)
    monkeypatch.setattr(http, "SWEEP_SECONDS", 0.05)
    reader, writer = await connect(listener)
    big = b"x" * (4 * MAX_HEAD_BYTES)
    writer.write(post(big) + post(b"yz"))  # a body over the head limit, and a pipelined request after it
    assert [await response(reader) for _ in range(2)] == [
        (b"HTTP/1.1 200 OK", str(len(big)).encode()),
        (b"HTTP/1.1 200 OK", b"2"),
    ]
    slow = post(b"z" * 30)
    writer.write(slow[:-30])
    for _ in range(30):  # a body slower than HEAD_SECONDS: its reader's business, not the listener's
        writer.write(b"z")
        await asyncio.sleep(0.02)
    assert await response(reader) == (b"HTTP/1.1 200 OK", b"30")
    writer.write(b"GET /hello HTTP/1.1\r\n")  # the next head, never ended
    assert await closed(reader) and listener.slow.count == 1


async def test_a_pipelined_requests_body_is_not_a_head(listener, monkeypatch):
    """A request pipelined behind another, its head in the same read as the first's (which the listener does not read
    past) and its body still arriving when the first ends: its handler's start says its head is over."""
    monkeypatch.setattr(http, "HEAD_SECONDS", 0.2)
    monkeypatch.setattr(http, "SWEEP_SECONDS", 0.05)
    reader, writer = await connect(listener)
    second = post(b"z" * 40)
    writer.write(post(b"first") + second[:-40])
    assert await response(reader) == (b"HTTP/1.1 200 OK", b"5")
    for _ in range(8):  # the second's body takes 0.4 s, twice HEAD_SECONDS
        writer.write(b"z" * 5)
        await asyncio.sleep(0.05)
    assert await response(reader) == (b"HTTP/1.1 200 OK", b"40")
    assert listener.slow.count == 0
    writer.close()
