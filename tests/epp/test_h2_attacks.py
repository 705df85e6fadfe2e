"""Attacks on the EPP's HTTP/2 transport over raw sockets (loopback only, bounded in count and time): each ends the
offending connection with the right GOAWAY code (or refuses the stream), never the process, and a well-behaved
connection beside it keeps working."""

import asyncio
import contextlib
import socket
import struct
import time

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hpack import Encoder

from epp.transport.h2 import (
    CONTINUATION,
    DATA,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_CONCURRENT_STREAMS,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    frame,
    grpc_message,
)
from tests.epp import test_grpc_h2
from tests.epp.test_transports import PROCESS, body, headers

# each test bounds how long a well-behaved client waits beside the attack
pytestmark = pytest.mark.timing

END_STREAM, END_HEADERS = 0x1, 0x4
server = test_grpc_h2.server  # the fixture: an ExtProcServer of EchoHandlers on a free port
REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", PROCESS),
    (":authority", "epp"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(PREFACE + frame(SETTINGS, 0, 0))
    return s


def read_frames(s: socket.socket, done, deadline: float = 10.0) -> list[tuple[int, int, bytes]]:
    """(type, stream id, payload) of the frames the server sends until `done(frames)`, it closes, or the deadline."""
    buffer, seen = b"", []
    end = time.monotonic() + deadline
    while time.monotonic() < end and not done(seen):
        try:
            data = s.recv(1 << 16)
        except (ConnectionResetError, TimeoutError):
            break
        if not data:
            break
        buffer += data
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, stream_id = buffer[3], struct.unpack(">L", buffer[5:9])[0] & 0x7FFFFFFF
            seen.append((kind, stream_id, buffer[9 : 9 + length]))
            buffer = buffer[9 + length :]
    return seen


def goaway_code(s: socket.socket) -> int | None:
    """The error code of the server's GOAWAY; None when it closed without one."""
    frames = read_frames(s, lambda seen: bool(seen) and seen[-1][0] == GOAWAY)
    if frames and frames[-1][0] == GOAWAY:
        return struct.unpack(">L", frames[-1][2][4:8])[0]
    return None


async def well_behaved_exchange(port: int) -> float:
    started = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers())
        reply = await call.read()
        assert reply.HasField("request_headers")
        await call.done_writing()
    return time.monotonic() - started


def attack(port: int, payload: bytes) -> int | None:
    with connect(port) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(payload)
        return goaway_code(s)


@pytest.mark.parametrize(
    ("name", "payload", "code"),
    [
        ("1-byte WINDOW_UPDATE", frame(WINDOW_UPDATE, 0, 0, b"\x01"), FRAME_SIZE_ERROR),
        ("WINDOW_UPDATE of 0", frame(WINDOW_UPDATE, 0, 0, b"\0\0\0\0"), PROTOCOL_ERROR),
        ("window over 2^31-1", frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 0x7FFFFFFF)), FLOW_CONTROL_ERROR),
        ("7-byte PING", frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR),
        ("PING on a stream", frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR),
        ("SETTINGS of 5 bytes", frame(SETTINGS, 0, 0, b"12345"), FRAME_SIZE_ERROR),
        ("3-byte RST_STREAM", frame(RST_STREAM, 0, 1, b"123"), FRAME_SIZE_ERROR),
        ("DATA on stream 0", frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
        ("padding longer than the frame", frame(DATA, 0x8, 1, b"\xff" + b"x" * 4), PROTOCOL_ERROR),
    ],
)
async def test_malformed_frames_end_the_connection_with_the_right_code(server, name, payload, code):
    assert await asyncio.to_thread(attack, server.port, payload) == code, name
    assert await well_behaved_exchange(server.port) < 2.0


async def test_continuation_flood_is_cut_at_the_header_block_limit(server):
    block = Encoder().encode(REQUEST_HEADERS)
    flood = frame(HEADERS, 0, 1, block) + frame(CONTINUATION, 0, 1, b"\x00" * 16_000) * 2_000  # 32 MB if read
    assert await asyncio.to_thread(attack, server.port, flood) == ENHANCE_YOUR_CALM
    assert await well_behaved_exchange(server.port) < 2.0


async def test_streams_beyond_the_advertised_limit_are_refused_then_the_connection_ends(server):
    def open_streams() -> tuple[int, int | None]:
        encoder = Encoder()
        with connect(server.port) as s:
            count = MAX_CONCURRENT_STREAMS + 5000
            s.sendall(
                b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, encoder.encode(REQUEST_HEADERS)) for i in range(count))
            )
            frames = read_frames(s, lambda seen: bool(seen) and seen[-1][0] == GOAWAY)
            refused = sum(f[0] == RST_STREAM and struct.unpack(">L", f[2])[0] == REFUSED_STREAM for f in frames)
            code = struct.unpack(">L", frames[-1][2][4:8])[0] if frames and frames[-1][0] == GOAWAY else None
            return refused, code

    refused, code = await asyncio.to_thread(open_streams)
    assert refused == 100 and code == ENHANCE_YOUR_CALM  # refused first (a proxy racing our SETTINGS), then cut off
    assert await well_behaved_exchange(server.port) < 2.0


async def test_rapid_reset_ends_the_connection(server):
    encoder = Encoder()
    flood = b"".join(
        frame(HEADERS, END_HEADERS, 2 * i + 1, encoder.encode(REQUEST_HEADERS))
        + frame(RST_STREAM, 0, 2 * i + 1, b"\0\0\0\x08")
        for i in range(500)
    )
    assert await asyncio.to_thread(attack, server.port, flood) == ENHANCE_YOUR_CALM
    assert await well_behaved_exchange(server.port) < 2.0


async def test_a_peer_that_never_reads_its_ping_acks_is_dropped(server):
    def flood() -> bool:
        with connect(server.port) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            ping = frame(PING, 0, 0, b"12345678") * 4096
            try:
                for _ in range(400):  # up to ~28 MB of PINGs, never reading the ACKs
                    s.sendall(ping)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                return True
            return False

    assert await asyncio.to_thread(flood)
    assert sum(c.transport.get_write_buffer_size() for c in server.connections) < 20 << 20
    assert await well_behaved_exchange(server.port) < 2.0


async def test_data_on_stream_0_with_the_reserved_bit_set_is_still_on_stream_0(server):
    assert await asyncio.to_thread(attack, server.port, frame(DATA, 0, 0x80000000, b"x")) == PROTOCOL_ERROR
    assert await well_behaved_exchange(server.port) < 2.0


@pytest.mark.parametrize("window", [0x7FFFFFFF, 0], ids=["huge windows, nothing read", "no window opened"])
async def test_answers_peers_leave_unread_share_one_budget_and_the_largest_backlogs_are_cut(server, window):
    """A peer may open huge flow-control windows and then read nothing (the answers pile up in the socket's buffer),
    or open none (they wait in the streams' queues): each connection's socket buffer is bounded
    (MAX_OUTBOUND_BYTES), and the sum of both over all connections too, or a few connections could hold gigabytes.
    Over the EPP-wide budget, the connections holding the most are aborted; the rest go on."""
    server.outbound.limit = 10 << 20  # (the EPP's: MAX_SHARED_OUTBOUND_BYTES)
    echo = body(b"x" * (256 << 10)).SerializeToString()  # EchoHandler echoes a body: a 256 KB answer per message
    message = grpc_message(echo)
    settings = struct.pack(">HL", SETTINGS_INITIAL_WINDOW_SIZE, window)
    connection_window = frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", window - 65_535)) if window else b""

    def never_reads(streams: int) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(PREFACE + frame(SETTINGS, 0, 0, settings) + connection_window)
        encoder = Encoder()
        for i in range(streams):  # each stream's body is echoed back: ~256 KB the peer never reads
            stream_id = 2 * i + 1
            wire = frame(HEADERS, END_HEADERS, stream_id, encoder.encode(REQUEST_HEADERS))
            for start in range(0, len(message), 16_384):
                wire += frame(DATA, 0, stream_id, message[start : start + 16_384])
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
                s.sendall(wire)
        return s

    def held() -> int:  # what the connections hold, counted here from the transports and the streams' queues
        return sum(
            c.transport.get_write_buffer_size()
            + sum(len(item) for stream in c.streams.values() for item in stream.pending if not isinstance(item, tuple))
            for c in server.connections
        )

    attackers = [await asyncio.to_thread(never_reads, 30) for _ in range(3)]  # ~8 MB of answers each
    try:
        await asyncio.sleep(0.3)
        assert 0 < held() <= server.outbound.limit
        assert held() <= server.outbound.held <= server.outbound.limit  # (counted as the connections last wrote)
        assert len(server.connections) < 3 and server.shed.count >= 1  # the largest backlogs were cut
        assert await well_behaved_exchange(server.port) < 2.0
    finally:
        for s in attackers:
            s.close()
    for _ in range(50):
        if not server.connections:
            break
        await asyncio.sleep(0.05)
    assert server.outbound.held == 0  # a closed connection gives its part back
