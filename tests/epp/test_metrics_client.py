"""The scrapers' HTTP/1.1 client against a raw server that answers in each framing real exporters use, closes idle
keep-alive connections, stalls, or answers with something that is not HTTP."""

import asyncio

import pytest

from epp.datalayer.metrics_client import MetricsClient, ScrapeError
from tests.conftest import free_ports

PAGE = b'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 3.0\n'


def chunked(body: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:])) + b"0\r\n\r\n"


RESPONSES = {
    "length": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(PAGE) + PAGE,
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(PAGE),
    "until-close": b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + PAGE,
    "500": b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops",
    "garbage": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "huge": b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n",
    "bad-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    # a 300 KB page without Content-Length, written in pieces: read to the close, not cut at the first read
    "large-until-close": b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + PAGE + b"# padding\n" * 30_000,
}


class RawServer:
    """Answers every request on a connection with `mode`'s bytes; counts connections and requests."""

    def __init__(self, mode: str, piece: int = 50_000):
        self.mode, self.connections, self.requests, self.piece = mode, 0, 0, piece
        self.close_after_each = mode.endswith("until-close")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                assert request.startswith(b"GET /metrics HTTP/1.1\r\n") and b"Host: 127.0.0.1:" in request
                self.requests += 1
                if self.mode == "stall":
                    await asyncio.sleep(5)
                response = RESPONSES[self.mode]
                for start in range(0, len(response), self.piece):
                    writer.write(response[start : start + self.piece])
                    await writer.drain()
                    await asyncio.sleep(0.001)
                if self.close_after_each:
                    break
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        writer.close()


@pytest.fixture
async def serve():
    servers = []

    async def start(mode: str, piece: int = 50_000) -> tuple[RawServer, MetricsClient]:
        raw = RawServer(mode, piece)
        (port,) = free_ports(1)
        servers.append(await asyncio.start_server(raw.handle, "127.0.0.1", port))
        return raw, MetricsClient("127.0.0.1", port, timeout=0.5)

    yield start
    for server in servers:
        server.close()


@pytest.mark.parametrize("mode", ["length", "chunked", "until-close", "large-until-close"])
async def test_every_framing_and_connection_reuse(serve, mode):
    raw, client = await serve(mode)
    page = RESPONSES[mode].partition(b"\r\n\r\n")[2] if mode == "large-until-close" else PAGE
    for _ in range(5):
        assert await client.get() == page.decode()
    assert raw.requests == 5
    assert raw.connections == (5 if mode.endswith("until-close") else 1)  # kept alive unless the server closes
    client.close()


@pytest.mark.parametrize("mode", ["length", "chunked"])
async def test_a_response_in_small_pieces(serve, mode):
    """The framing is found across reads: every response arrives 7 bytes at a time."""
    _, client = await serve(mode, piece=7)
    for _ in range(2):
        assert await client.get() == PAGE.decode()
    client.close()


async def test_reconnects_when_the_server_dropped_an_idle_connection(serve):
    raw, client = await serve("length")
    assert await client.get() == PAGE.decode()
    raw.close_after_each = True  # the next response ends the connection without saying so
    assert await client.get() == PAGE.decode()
    assert await client.get() == PAGE.decode()  # the stale connection is noticed and replaced
    assert raw.connections >= 2
    client.close()


async def test_errors(serve):
    _, client = await serve("500")
    with pytest.raises(ScrapeError, match="HTTP 500"):
        await client.get()
    _, client = await serve("garbage")
    with pytest.raises(ScrapeError, match=r"not an HTTP/1\.1 response"):
        await client.get()
    _, client = await serve("huge")
    with pytest.raises(ScrapeError, match="byte metrics page"):
        await client.get()
    _, client = await serve("bad-chunk")
    with pytest.raises(ValueError):
        await client.get()
    _, client = await serve("stall")
    with pytest.raises(TimeoutError):
        await client.get()
    (port,) = free_ports(1)
    with pytest.raises(ConnectionRefusedError):
        await MetricsClient("127.0.0.1", port, timeout=0.5).get()
