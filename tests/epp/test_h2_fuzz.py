"""The EPP's gRPC transport under arbitrary byte streams: frames of every type with random flags, streams and
payloads (well-formed gRPC messages, truncated ones, garbage), cut into reads at random places. Whatever a peer
sends, `data_received` returns (a violation ends the connection, a handler's bug costs its stream) and what the
connection holds stays within its limits."""

import struct

from hpack import Encoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.handlers import accesslog
from epp.transport.h2 import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    GRPC_PREFIX,
    HEADERS,
    MAX_CONCURRENT_STREAMS,
    MAX_DECODED_BLOCK_BYTES,
    MAX_DECODED_BLOCKS,
    MAX_HEADER_BLOCK,
    MAX_PARTIAL_BYTES,
    MAX_RECEIVE_FRAME,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTING,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    ExtProcConnection,
    ExtProcServer,
    UnaryMethod,
    frame,
)
from harness.bench.handler_cpu import CountingTransport
from tests.epp.test_transports import PROCESS, EchoHandler, body, headers

PATHS = (PROCESS, accesslog.EXPORT_PATH.decode(), "/unknown.Service/Method")
streams = st.sampled_from((0, 1, 3, 5, 7, 2, 0x7FFFFFFF, 0x80000001))
flags = st.integers(0, 0xFF)


@st.composite
def grpc_payloads(draw) -> bytes:
    kind = draw(st.sampled_from(("headers", "crash", "body", "export", "garbage", "truncated", "compressed")))
    if kind == "headers":
        message = headers().SerializeToString()
    elif kind == "crash":  # the test handler raises on it: a handler's bug
        message = headers(("x-crash", "1")).SerializeToString()
    elif kind == "body":
        message = body(draw(st.binary(max_size=300))).SerializeToString()
    elif kind == "export":
        message = accesslog.export_request([("r", "1500", "200", "10.0.0.1:8000")]).SerializeToString()
    else:
        message = draw(st.binary(max_size=64))
    prefix = GRPC_PREFIX.pack(1 if kind == "compressed" else 0, len(message))
    if kind == "truncated":
        return prefix[: draw(st.integers(0, 5))] if draw(st.booleans()) else GRPC_PREFIX.pack(0, 1 << 30) + message
    return prefix + message


@st.composite
def frames(draw, encoder: Encoder, opened: list[int]) -> bytes:
    """Mostly what a proxy sends (streams opened in order, their messages, ends and resets, window updates,
    SETTINGS and PINGs on stream 0), so that the exchanges go on; one in eight is anything at all."""
    if draw(st.integers(0, 7)) == 0:
        return draw(chaos(encoder))
    kind = draw(st.sampled_from(("open", "data", "data", "data", "end", "reset", "window", "settings", "ping")))
    if kind == "open" or not opened:
        stream = opened[-1] + 2 if opened else 1
        opened.append(stream)
        path = draw(st.sampled_from(PATHS))
        block = encoder.encode([(":method", "POST"), (":path", path), ("content-type", "application/grpc")])
        if draw(st.booleans()):  # the block in a HEADERS and a CONTINUATION
            cut = draw(st.integers(0, len(block)))
            return frame(HEADERS, 0, stream, block[:cut]) + frame(CONTINUATION, END_HEADERS, stream, block[cut:])
        return frame(HEADERS, END_HEADERS, stream, block)
    stream = draw(st.sampled_from(opened))
    if kind == "data":
        payload = b"".join(draw(st.lists(grpc_payloads(), min_size=1, max_size=3)))
        if draw(st.booleans()):  # a message split over two frames
            cut = draw(st.integers(0, len(payload)))
            return frame(DATA, 0, stream, payload[:cut]) + frame(DATA, 0, stream, payload[cut:])
        return frame(DATA, 0, stream, payload)
    if kind == "end":
        return frame(DATA, END_STREAM, stream) + (
            frame(RST_STREAM, 0, stream, U32.pack(8)) if draw(st.booleans()) else b""
        )
    if kind == "reset":
        return frame(RST_STREAM, 0, stream, U32.pack(8))
    if kind == "window":
        return frame(WINDOW_UPDATE, 0, draw(st.sampled_from((0, stream))), U32.pack(draw(st.integers(1, 1 << 20))))
    if kind == "settings":
        return frame(SETTINGS, 0, 0, SETTING.pack(4, draw(st.sampled_from((0, 100, 65_535, 1 << 20)))))
    return frame(PING, 0, 0, b"12345678")


@st.composite
def chaos(draw, encoder: Encoder) -> bytes:
    """Any frame type with random flags, streams and payloads, or bytes that are no frame."""
    kind = draw(st.sampled_from(("headers", "continuation", "data", "rst", "window", "settings", "ping", "goaway",
                                 "priority", "unknown", "garbage")))  # fmt: skip
    stream = draw(streams)
    if kind in ("headers", "continuation"):
        path = draw(st.sampled_from(PATHS))
        block = encoder.encode([(":method", "POST"), (":path", path), ("content-type", "application/grpc")])
        if draw(st.booleans()):
            block = block[: draw(st.integers(0, len(block)))]  # a block cut short, or its CONTINUATION's share
        head_flags = draw(flags)
        if head_flags & PRIORITY_FLAG:
            block = struct.pack(">LB", 0, 16) + block
        if head_flags & PADDED:
            block = bytes([draw(st.integers(0, 8))]) + block + b"\0" * draw(st.integers(0, 8))
        return frame(HEADERS if kind == "headers" else CONTINUATION, head_flags, stream, block)
    if kind == "data":
        payload = b"".join(draw(st.lists(grpc_payloads(), max_size=3)))
        data_flags = draw(st.sampled_from((0, END_STREAM, PADDED, PADDED | END_STREAM)))
        if data_flags & PADDED:
            payload = bytes([draw(st.integers(0, 12))]) + payload + b"\0" * draw(st.integers(0, 8))
        return frame(DATA, data_flags, stream, payload)
    if kind == "rst":
        return frame(RST_STREAM, 0, stream, U32.pack(draw(st.integers(0, 0xFF))))
    if kind == "window":
        return frame(WINDOW_UPDATE, 0, stream, U32.pack(draw(st.sampled_from((0, 1, 65_535, 1 << 30, 0x7FFFFFFF)))))
    if kind == "settings":
        pairs = draw(st.lists(st.tuples(st.integers(0, 8), st.sampled_from((0, 1, 16_384, 1 << 24, 0xFFFFFFFF)))))
        return frame(SETTINGS, draw(st.sampled_from((0, 1))), stream, b"".join(SETTING.pack(*p) for p in pairs))
    if kind == "ping":
        return frame(PING, draw(st.sampled_from((0, 1))), stream, draw(st.binary(min_size=8, max_size=8)))
    if kind == "goaway":
        return frame(GOAWAY, 0, stream, U32.pack(1) + U32.pack(0))
    if kind == "priority":
        return frame(PRIORITY, 0, stream, draw(st.binary(min_size=5, max_size=5)))
    if kind == "unknown":
        return frame(draw(st.integers(10, 0xFF)), draw(flags), stream, draw(st.binary(max_size=32)))
    return draw(st.binary(min_size=1, max_size=40))


@st.composite
def connections(draw) -> tuple[bytes, list[int]]:
    """A client's bytes (usually opened as HTTP/2 should be) and where its reads end."""
    encoder, opened = Encoder(), []
    start = PREFACE + frame(SETTINGS, 0, 0) if draw(st.integers(0, 9)) else draw(st.binary(max_size=30))
    wire = start + b"".join(draw(st.lists(frames(encoder, opened), min_size=1, max_size=30)))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(wire) - 1)), max_size=6))))
    return wire, cuts


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(connections())
def test_no_byte_stream_raises_or_breaks_the_connections_bounds(client):
    wire, cuts = client
    EchoHandler.log = []
    export = UnaryMethod(
        accesslog.ExportRecords, accesslog.ExportHandler(lambda *record: None), accesslog.MAX_EXPORT_BYTES
    )
    connection = ExtProcConnection(ExtProcServer(EchoHandler, {accesslog.EXPORT_PATH: export}))
    transport = CountingTransport()
    connection.connection_made(transport)
    for start, end in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        connection.data_received(wire[start:end])  # never raises: a violation ends the connection with GOAWAY
        assert len(connection.streams) <= MAX_CONCURRENT_STREAMS
        assert 0 <= connection.partial.held <= MAX_PARTIAL_BYTES
        assert len(connection.buffer) <= 9 + MAX_RECEIVE_FRAME
        assert all(len(s.header_block) <= MAX_HEADER_BLOCK for s in connection.streams.values())
        assert len(connection.decoded_blocks) <= MAX_DECODED_BLOCKS
        assert all(len(block) <= MAX_DECODED_BLOCK_BYTES for block in connection.decoded_blocks)
    connection.connection_lost(None)
    assert not connection.streams
