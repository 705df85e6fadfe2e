"""The scrapers' HTTP/1.1 client against a raw server that answers in each framing real exporters use, closes idle
keep-alive connections, stalls, or answers with something that is not HTTP."""

import asyncio
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.datalayer.metrics_client import MetricsClient, ScrapeError, _Connection
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
    # int() takes a sign: a negative size moved the parse back into the chunk before, and round again, forever
    "negative-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n-7\r\n\r\n",
    "signed-length": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
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
    for mode in ("bad-chunk", "negative-chunk"):
        _, client = await serve(mode)
        with pytest.raises(ScrapeError, match="malformed chunk size"):
            await client.get()
    _, client = await serve("signed-length")
    with pytest.raises(ScrapeError, match="malformed Content-Length"):
        await client.get()
    _, client = await serve("stall")
    with pytest.raises(TimeoutError):
        await client.get()
    (port,) = free_ports(1)
    with pytest.raises(ConnectionRefusedError):
        await MetricsClient("127.0.0.1", port, timeout=0.5).get()


HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
# how a chunk's size line may be written: its true size, or something else (signed, prefixed, another number)
SIZE_LINES = (
    lambda n: b"%x" % n,
    lambda n: b"%X;ext=1" % n,
    lambda n: b"-%x" % (n + 4),
    lambda n: b"+%x" % n,
    lambda n: b"0x%x" % n,
    lambda n: b" %x" % n,
    lambda n: b"%x" % (n + 3),
    lambda n: b"zz",
    lambda n: b"",
)


@st.composite
def chunked_bodies(draw) -> bytes:
    chunks = draw(st.lists(st.tuples(st.sampled_from(SIZE_LINES), st.binary(max_size=12)), max_size=6))
    end = draw(st.sampled_from((b"0\r\n\r\n", b"0\r\nx-trailer: 1\r\n\r\n", b"", b"-1\r\n\r\n")))
    return b"".join(size_line(len(data)) + b"\r\n" + data + b"\r\n" for size_line, data in chunks) + end


class _Ignored:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def cancel(self) -> None:
        pass


@settings(max_examples=300)
@given(chunked_bodies(), st.lists(st.integers(1, 200), max_size=4))
def test_any_chunked_body_is_read_refused_or_awaited_and_never_stalls_the_loop(chunked_body, cuts):
    """Whatever a server sends as a chunked page, in reads cut anywhere, each read returns at once: the page, an
    error, or nothing yet (a hang here would be the EPP's event loop, and every request with it)."""
    response = HEAD + chunked_body
    bounds = sorted({min(c, len(response)) for c in cuts} | {len(response)})
    loop = asyncio.new_event_loop()
    connection = _Connection()
    connection.transport, connection.expiry = _Ignored(), _Ignored()
    connection.waiter = loop.create_future()
    signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(5)
    try:
        for start, end in zip([0, *bounds], bounds, strict=False):
            connection.data_received(response[start:end])
    finally:
        signal.alarm(0)
        loop.close()
    waiter = connection.waiter
    if waiter.done() and waiter.exception() is None:
        status, page = waiter.result()
        assert status == b"200" and len(page) <= len(response)


def _too_long(signum, frame):
    raise AssertionError("a read of the response did not return")
