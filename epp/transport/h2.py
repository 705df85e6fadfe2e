"""A lean gRPC-over-HTTP/2 server for the RPCs Envoy makes to the EPP: ext_proc's ExternalProcessor/Process and,
when the gateway sends its access log here, the unary methods given (OpenTelemetry's LogsService/Export:
`epp.handlers.accesslog`).

Why not grpcio: measured here (a do-nothing ext_proc servicer behind a real Envoy), grpcio aio
spends ~0.8 ms of CPU per request, because its completion-queue poller thread hands every message to the event
loop through a wake-up socket and both threads take turns on the GIL. This transport runs on the event loop: one
read wakes it, each message goes straight to the request's handler (`epp.handlers.extproc.RequestStream`), and the
answers of one read leave in one write.

Scope: cleartext HTTP/2 with prior knowledge (what Envoy's gRPC client speaks), uncompressed gRPC messages, the
Process method and the unary methods given (any other path gets grpc-status UNIMPLEMENTED). Flow control is honoured both ways. For
TLS or reflection use the grpcio transport (`epp --ext-proc-transport grpcio`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from operator import attrgetter

import cython
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError, Message
from hpack import Decoder
from hpack.exceptions import HPACKError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from epp.handlers import NewHandler
from epp.metrics import unlabelled
from epp.transport import oversized_messages
from protocol.limits import ByteBudget, RepeatedWarning

log = logging.getLogger("epp.transport.h2")

PROCESS_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x3, 0x4, 0x5
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, ENHANCE_YOUR_CALM = 0x1, 0x3, 0x6, 0x7, 0xB
NO_ERROR = 0x0
INVALID_ARGUMENT, UNIMPLEMENTED, INTERNAL, RESOURCE_EXHAUSTED = 3, 12, 13, 8  # gRPC status codes

FRAME_HEADER = struct.Struct(">BHBBL")  # 24-bit length as (high byte, low 16 bits), type, flags, stream id
GRPC_PREFIX = struct.Struct(">BL")  # compressed flag, message length
SETTING = struct.Struct(">HL")
U32 = struct.Struct(">L")
DATA_MESSAGE_HEADER = struct.Struct(">BHBBLBL")  # FRAME_HEADER then GRPC_PREFIX: a DATA frame of one whole message
# Their methods bound once, as globals: each request packs and reads a dozen headers, and a call then skips looking the
# method up on its Struct.
_pack_frame_header, _unpack_frame_header = FRAME_HEADER.pack, FRAME_HEADER.unpack_from
_pack_grpc_prefix, _unpack_grpc_prefix = GRPC_PREFIX.pack, GRPC_PREFIX.unpack_from
_pack_data_message_header = DATA_MESSAGE_HEADER.pack
_pack_u32, _unpack_u32 = U32.pack, U32.unpack

# Receive windows bound what a peer can push ahead of our parsing: per stream 4 MiB (a 1 MB body needs no window
# update), per connection 64 MiB.
RECEIVE_WINDOW = 1 << 22
CONNECTION_RECEIVE_WINDOW = 1 << 26
MAX_RECEIVE_FRAME = 1 << 20
MAX_MESSAGE = 64 << 20  # what the grpcio transport allows (grpc.max_receive_message_length)
DEFAULT_WINDOW = 65_535
MAX_WINDOW = (1 << 31) - 1
MAX_STREAM_ID = (1 << 31) - 1
# Limits of a real server (nghttp2 advertises 100 streams by default, Envoy 2^31-1 with per-stream buffer limits;
# Envoy as a client opens another connection when it reaches ours): a peer that breaks one gets GOAWAY and loses
# only its own connection.
MAX_CONCURRENT_STREAMS = 1024  # advertised; a stream beyond it is refused (RST_STREAM REFUSED_STREAM)
REFUSED_STREAMS_TOLERATED = 100  # a proxy may race its SETTINGS; one that keeps opening streams beyond gets GOAWAY
MAX_HEADER_BLOCK = 64 << 10  # HEADERS + CONTINUATION of one block (Envoy's default max_request_headers_kb is 60)
MAX_PARTIAL_BYTES = 4 * MAX_MESSAGE  # incomplete messages all streams of all connections may hold together
# Any number of peers may connect, and what one connection holds beyond the shared budgets (a frame in progress, a
# header block, its cache of decoded blocks, answers it has not read) is bounded per connection: the number of
# connections is bounded too. Envoy opens about one per worker thread, per EPP replica, for ext_proc and the access
# log each.
MAX_CONNECTIONS = 1024
REFUSED_LINGER_SECONDS = 1.0
PREFACE_TIMEOUT_SECONDS = 10.0  # a connection that has not sent the client preface by then gives its place back
MAX_OUTBOUND_BYTES = 16 << 20  # unread answers (e.g. PING ACKs of a peer that never reads): it is not a proxy
# Answers the peers have not read, all connections together: in the sockets' buffers (a peer may open huge
# flow-control windows and read nothing; 1,024 connections at MAX_OUTBOUND_BYTES each would be 16 GiB) and queued
# for window (a peer may open none). Over it, the connections holding the most are aborted.
MAX_SHARED_OUTBOUND_BYTES = 256 << 20
# A connection's unread answers are counted when it writes and when its socket drains below the low-water mark
# (resume_writing); one that drained without going over this high-water mark is counted at most this much too high.
WRITE_HIGH_WATER_BYTES = 64 << 10
MAX_CONTROL_FRAMES_PER_SECOND = 1000  # PINGs and SETTINGS we must acknowledge (Envoy sends a few per minute)
PREMATURE_RESETS = 100  # streams reset before their first message, once also over half of those opened (CVE-2023-44487)
MAX_DECODED_BLOCKS = 64  # header blocks remembered per connection (ExtProcConnection._decode)
MAX_DECODED_BLOCK_BYTES = 1024  # only blocks this short are remembered (Envoy 1.40's for a new stream: 46 bytes)
SMALL_MESSAGE = 4096  # a message this short is parsed from a copy: cheaper than through a memoryview
FIXED_PAYLOAD = {PRIORITY: 5, RST_STREAM: 4, PING: 8, WINDOW_UPDATE: 4}
# A drain (ExtProcServer.stop) is gRPC servers' two-step GOAWAY: first with the highest stream id there can be, so the
# proxy opens no new stream here and the streams it opened meanwhile are still taken; then, once the proxy answered
# this PING (so it has seen the first GOAWAY), with the last stream id taken: a later stream is refused
# (REFUSED_STREAM), which a proxy may retry on another replica.
DRAIN_PING = b"epp-drai"
DRAIN_POLL_SECONDS = 0.02


class H2ConnectionError(Exception):
    """A violation that ends the connection with GOAWAY `code`."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise H2ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return _pack_frame_header(size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def grpc_message(payload: bytes) -> bytes:
    """One uncompressed gRPC message as a client frames it: the length prefix, then `payload` (the server's own
    answers go out whole in one DATA frame with DATA_MESSAGE_HEADER instead)."""
    return _pack_grpc_prefix(0, len(payload)) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name (no Huffman): needs no encoder state."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


RESPONSE_HEADERS = b"\x88" + _literal(b"content-type", b"application/grpc")  # 0x88: static ":status: 200"
OK_TRAILERS = _literal(b"grpc-status", b"0")


def status_trailers(code: int, message: str) -> bytes:
    text = "".join(c if 0x20 <= ord(c) < 0x7F and c != "%" else "%" for c in message)[:120]
    return _literal(b"grpc-status", str(code).encode()) + _literal(b"grpc-message", text.encode())


class UnaryMethod:
    """A unary RPC served beside Process: its request message type, the function that answers one, and the largest
    request it takes (a larger one gets RESOURCE_EXHAUSTED before it is buffered or parsed)."""

    __slots__ = ("answer", "max_message", "request_type")
    awaiting_reply = False  # (the handler interface: answered at once, nothing afterwards)

    def __init__(self, request_type: type[Message], answer: Callable[[Message], Message], max_message: int):
        self.request_type, self.answer, self.max_message = request_type, answer, max_message

    def handle(self, message: Message) -> list[bytes]:
        return [self.answer(message).SerializeToString()]

    def oversized(self, size: int) -> None:
        return None

    def after_reply(self) -> None:
        pass

    def finish(self) -> None:
        pass


@cython.annotation_typing(True)
@cython.final
@cython.cclass
class _Stream:
    id = cython.declare(cython.Py_ssize_t, visibility="public")
    send_window = cython.declare(cython.Py_ssize_t, visibility="public")
    handler = cython.declare(object, visibility="public")
    request_type = cython.declare(object, visibility="public")
    max_message = cython.declare(cython.Py_ssize_t, visibility="public")
    header_block = cython.declare(bytes, visibility="public")
    headers_sent = cython.declare(cython.bint, visibility="public")
    closed = cython.declare(cython.bint, visibility="public")
    message = cython.declare(bytearray, visibility="public")
    skip = cython.declare(cython.Py_ssize_t, visibility="public")
    pending = cython.declare(object, visibility="public")
    recv_unacked = cython.declare(cython.Py_ssize_t, visibility="public")
    handled = cython.declare(cython.bint, visibility="public")

    def __init__(self, stream_id: int, send_window: int):
        self.id = stream_id
        self.send_window = send_window
        self.handler = None  # the stream's handler once the headers named a method we serve
        self.request_type = None  # what its messages are (a message class, its FromString): set with its handler
        self.max_message = MAX_MESSAGE  # the largest of them it takes
        self.header_block = b""
        self.headers_sent = False
        self.closed = False  # our trailers are queued
        self.message = bytearray()  # gRPC framing across DATA frames
        self.skip = 0  # bytes still to come of a message the handler refused unread (see _refused_unread)
        self.pending = deque()  # DATA payloads (bytes) waiting for window; a tuple (bytes,) = trailers
        self.recv_unacked = 0
        self.handled = False  # a message reached the handler (a reset before that is "premature")


@cython.annotation_typing(True)
@cython.final
@cython.cclass
class ExtProcConnection:
    """One HTTP/2 connection from Envoy; each stream is one HTTP request's ext_proc exchange."""

    server = cython.declare(object, visibility="public")
    partial = cython.declare(object, visibility="public")
    backlog = cython.declare(cython.Py_ssize_t, visibility="public")
    queued = cython.declare(cython.Py_ssize_t, visibility="public")
    transport = cython.declare(object, visibility="public")
    buffer = cython.declare(bytearray, visibility="public")
    preface_seen = cython.declare(cython.bint, visibility="public")
    refused = cython.declare(cython.bint, visibility="public")
    preface_timer = cython.declare(object, visibility="public")
    streams = cython.declare(dict, visibility="public")
    decoder = cython.declare(object, visibility="public")
    decoded_blocks = cython.declare(dict, visibility="public")
    out = cython.declare(list, visibility="public")
    unsent_trailers = cython.declare(dict, visibility="public")
    after = cython.declare(list, visibility="public")
    send_window = cython.declare(cython.Py_ssize_t, visibility="public")
    peer_initial_window = cython.declare(cython.Py_ssize_t, visibility="public")
    peer_max_frame = cython.declare(cython.Py_ssize_t, visibility="public")
    recv_unacked = cython.declare(cython.Py_ssize_t, visibility="public")
    continuation_of = cython.declare(cython.Py_ssize_t, visibility="public")
    continuation_flags = cython.declare(cython.Py_ssize_t, visibility="public")
    last_stream_id = cython.declare(cython.Py_ssize_t, visibility="public")
    opened = cython.declare(cython.Py_ssize_t, visibility="public")
    premature_resets = cython.declare(cython.Py_ssize_t, visibility="public")
    refused_streams = cython.declare(cython.Py_ssize_t, visibility="public")
    control_frames = cython.declare(cython.Py_ssize_t, visibility="public")
    control_window_start = cython.declare(cython.double, visibility="public")
    last_taken = cython.declare(cython.Py_ssize_t, visibility="public")

    def __init__(self, server: ExtProcServer):
        self.server = server
        self.partial = server.partial  # (read on every DATA frame) messages not yet complete, of all connections
        self.backlog = 0  # this connection's part of the server's `outbound`, as last seen
        self.queued = 0  # bytes of DATA its streams hold until the peer opens their flow-control windows
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface_seen = False
        self.refused = False  # over the server's connection limit (ExtProcServer.refuse)
        self.preface_timer: asyncio.TimerHandle | None = None
        self.streams: dict[int, _Stream] = {}
        self.decoder = Decoder()
        self.decoded_blocks: dict[bytes, list] = {}  # see _decode
        self.out: list[bytes] = []
        # stream id -> where in `out` its trailers wait for this read's write: Envoy ends each ext_proc stream with
        # END_STREAM and RST_STREAM in one write (it does not wait for our trailers), so a reset in the same read
        # drops them, and a read that only ends streams needs no write
        self.unsent_trailers: dict[int, int] = {}
        self.after: list = []  # handlers whose after_reply runs once this read's answers are written
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16_384
        self.recv_unacked = 0
        self.continuation_of = 0
        self.continuation_flags = 0
        self.last_stream_id = 0
        self.last_taken = MAX_STREAM_ID  # the highest stream id this connection still takes (drain)
        self.opened = self.premature_resets = self.refused_streams = 0
        self.control_frames, self.control_window_start = 0, time.monotonic()

    # -- connection ----------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            self.refused = True
            server.refuse(transport)
            return
        server.connections.add(self)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        if server.loop is not None:  # (a connection driven by hand, as in the handler benchmark, has no timer)
            self.preface_timer = server.loop.call_later(PREFACE_TIMEOUT_SECONDS, self._preface_overdue)
        settings = (
            SETTING.pack(SETTINGS_MAX_CONCURRENT_STREAMS, MAX_CONCURRENT_STREAMS)
            + SETTING.pack(SETTINGS_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW)
            + SETTING.pack(SETTINGS_MAX_FRAME_SIZE, MAX_RECEIVE_FRAME)
        )
        transport.write(
            frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, U32.pack(CONNECTION_RECEIVE_WINDOW - DEFAULT_WINDOW))
        )

    def _preface_overdue(self) -> None:
        if not self.preface_seen and not self.transport.is_closing():
            self._fail(PROTOCOL_ERROR, f"no client preface in {PREFACE_TIMEOUT_SECONDS:.0f} s")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.preface_timer is not None:
            self.preface_timer.cancel()
        self.server.connections.discard(self)
        self.server.outbound.held -= self.backlog
        self.backlog = self.queued = 0
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            self._finish(stream)

    def drain(self) -> None:
        """The first GOAWAY of a drain (see DRAIN_PING); the second follows the PING's answer."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(
                frame(GOAWAY, 0, 0, U32.pack(MAX_STREAM_ID) + U32.pack(NO_ERROR)) + frame(PING, 0, 0, DRAIN_PING)
            )

    def _last_goaway(self) -> None:
        self.last_taken = self.last_stream_id
        self.out.append(frame(GOAWAY, 0, 0, U32.pack(self.last_taken) + U32.pack(NO_ERROR)))

    def _fail(self, code: int, reason: str) -> None:
        log.warning("closing ext_proc connection: %s", reason)
        transport = self.transport
        if transport.get_write_buffer_size() > MAX_OUTBOUND_BYTES:
            transport.abort()  # it does not read: a GOAWAY behind the backlog would never arrive
            return
        self.out.append(frame(GOAWAY, 0, 0, U32.pack(self.last_stream_id) + U32.pack(code)))
        transport.write(b"".join(self.out))  # what was already answered, then the GOAWAY
        self.out.clear()
        self.unsent_trailers.clear()
        transport.close()

    @cython.locals(
        position=cython.Py_ssize_t,
        size=cython.Py_ssize_t,
        high=cython.Py_ssize_t,
        low=cython.Py_ssize_t,
        kind=cython.Py_ssize_t,
        flags=cython.Py_ssize_t,
        stream_id=cython.Py_ssize_t,
        length=cython.Py_ssize_t,
        end=cython.Py_ssize_t,
    )
    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        if buffer or not self.preface_seen:  # a frame (or the preface) began in an earlier read
            if self.refused:
                return  # read and dropped: closing a socket with unread bytes would reset it, GOAWAY unread
            buffer += data
            if not self.preface_seen:
                if len(buffer) < len(PREFACE):
                    return
                if buffer[: len(PREFACE)] != PREFACE:
                    self._fail(PROTOCOL_ERROR, "not an HTTP/2 client (prior knowledge) preface")
                    return
                del buffer[: len(PREFACE)]
                self.preface_seen = True
                if self.preface_timer is not None:
                    self.preface_timer.cancel()
            if len(buffer) >= 9:
                high, low = _unpack_frame_header(buffer)[:2]
                length = (high << 16) | low
                if 9 + length > len(buffer) and length <= MAX_RECEIVE_FRAME:
                    return  # still incomplete: a large frame is copied out once, when whole
            data = bytes(buffer)
            buffer.clear()
        # Most reads hold whole frames: their payloads are sliced from the read itself (one copy each).
        position, size = 0, len(data)
        while size - position >= 9:
            high, low, kind, flags, stream_id = _unpack_frame_header(data, position)
            length = (high << 16) | low
            if length > MAX_RECEIVE_FRAME:
                self._fail(FRAME_SIZE_ERROR, f"a {length}-byte frame is over the advertised {MAX_RECEIVE_FRAME}")
                return
            end = position + 9 + length
            if end > size:
                break
            payload = data[position + 9 : end]
            position = end
            stream_id &= 0x7FFFFFFF  # (the reserved bit is ignored)
            try:
                if kind == DATA and stream_id and not self.continuation_of:  # most frames: no checks apply
                    self._on_data(flags, stream_id, payload)
                else:
                    self._on_frame(kind, flags, stream_id, payload)
            except H2ConnectionError as exc:
                self._fail(exc.code, str(exc))
                return
            except (HPACKError, ValueError, IndexError, struct.error) as exc:
                self._fail(PROTOCOL_ERROR, f"malformed frame: {exc}")
                return
            if self.transport.is_closing():
                return
        if position < size:
            buffer += data[position:]
        self._write()

    @cython.ccall
    def _write(self) -> None:
        if self.out:
            data = b"".join(self.out)
            self.out.clear()
            self.unsent_trailers.clear()
            if data:
                self.transport.write(data)
        # (after every read: a reset or a window update changes the queued part without a write)
        if self._count_backlog() > MAX_OUTBOUND_BYTES:
            self._fail(ENHANCE_YOUR_CALM, "the peer does not read its answers")
            return
        outbound = self.server.outbound
        if outbound.held > outbound.limit:
            self.server.shed_outbound()
            if self.transport.is_closing():
                return
        if self.after:
            after, self.after = self.after, []
            for handler in after:
                handler.after_reply()

    @cython.ccall
    def _count_backlog(self) -> int:
        """This connection's answers the peer has not read (in the socket's buffer, and queued for flow-control
        window: a peer that opens no window reads nothing either), brought up to date in the EPP-wide count; returns
        the socket buffer's part."""
        buffered = self.transport.get_write_buffer_size()
        backlog = buffered + self.queued
        self.server.outbound.held += backlog - self.backlog
        self.backlog = backlog
        return buffered

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark: `_write` counts it against the EPP-wide limit."""

    def resume_writing(self) -> None:
        """The transport's buffer drained below its low-water mark: the peer reads again."""
        self._count_backlog()

    def eof_received(self) -> None:
        """The proxy closed its side: the transport closes (answers to a closed peer go nowhere)."""

    # -- frames --------------------------------------------------------------------------------------------------
    @cython.locals(stream=_Stream)
    def _on_frame(
        self, kind: cython.Py_ssize_t, flags: cython.Py_ssize_t, stream_id: cython.Py_ssize_t, payload: bytes
    ) -> None:
        if self.continuation_of and kind != CONTINUATION:
            raise ValueError("expected CONTINUATION")
        size = FIXED_PAYLOAD.get(kind)
        if size is not None and len(payload) != size:
            raise H2ConnectionError(FRAME_SIZE_ERROR, f"a frame of type {kind} with a {len(payload)}-byte payload")
        if kind in (SETTINGS, PING, GOAWAY):
            if stream_id:
                raise H2ConnectionError(PROTOCOL_ERROR, f"a frame of type {kind} on stream {stream_id}")
        elif kind != WINDOW_UPDATE and kind <= CONTINUATION and not stream_id:
            raise H2ConnectionError(PROTOCOL_ERROR, f"a frame of type {kind} on stream 0")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            stream = self.streams.get(stream_id)
            if stream_id != self.continuation_of or stream is None:
                raise ValueError("unexpected CONTINUATION")
            stream.header_block += payload
            if len(stream.header_block) > MAX_HEADER_BLOCK:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, f"a header block over {MAX_HEADER_BLOCK} bytes")
            if flags & END_HEADERS:
                self.continuation_of = 0
                self._on_header_block(stream, self.continuation_flags)
        elif kind == WINDOW_UPDATE:
            increment = _unpack_u32(payload)[0] & 0x7FFFFFFF
            if not increment:
                raise H2ConnectionError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self._on_window_update(stream_id, increment)
        elif kind == SETTINGS:
            if len(payload) % 6 or (flags & ACK and payload):
                raise H2ConnectionError(FRAME_SIZE_ERROR, f"a SETTINGS frame of {len(payload)} bytes")
            if not flags & ACK:
                self._count_control_frame()
                self._on_settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self._count_control_frame()
                self.out.append(frame(PING, ACK, 0, payload))
            elif payload == DRAIN_PING and self.last_taken == MAX_STREAM_ID:
                self._last_goaway()
        elif kind == RST_STREAM:
            stream = self.streams.pop(stream_id, None)
            unsent = self.unsent_trailers.pop(stream_id, None)
            if unsent is not None:
                self.out[unsent] = b""
            if stream is not None:
                self.queued -= sum(len(item) for item in stream.pending if not isinstance(item, tuple))
                if not stream.handled:
                    self.premature_resets += 1
                    if self.premature_resets >= PREMATURE_RESETS and 2 * self.premature_resets > self.opened:
                        raise H2ConnectionError(ENHANCE_YOUR_CALM, "streams reset before their first message")
                self._finish(stream)
        elif kind == GOAWAY:
            pass  # the peer opens no new streams; the open ones finish normally
        elif kind == PUSH_PROMISE:
            raise ValueError("a client cannot push")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)

    @cython.ccall
    def _count_control_frame(self) -> None:
        self.control_frames += 1
        if self.control_frames > MAX_CONTROL_FRAMES_PER_SECOND:
            now = time.monotonic()
            if now - self.control_window_start < 1.0:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "a flood of PING or SETTINGS frames")
            self.control_frames, self.control_window_start = 0, now

    @cython.ccall
    @cython.locals(stream=_Stream)
    def _on_headers(self, flags: cython.Py_ssize_t, stream_id: cython.Py_ssize_t, payload: bytes) -> None:
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id % 2 == 0 or stream_id <= self.last_stream_id:
                raise ValueError(f"bad new stream id {stream_id}")
            self.last_stream_id = stream_id
            self.opened += 1
            stream = self.streams[stream_id] = _Stream(stream_id, self.peer_initial_window)
        if len(payload) > MAX_HEADER_BLOCK:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, f"a header block over {MAX_HEADER_BLOCK} bytes")
        stream.header_block = payload
        if flags & END_HEADERS:
            self._on_header_block(stream, flags)
        else:
            self.continuation_of, self.continuation_flags = stream_id, flags

    @cython.ccall
    def _on_header_block(self, stream: _Stream, flags: cython.Py_ssize_t) -> None:
        block, stream.header_block = stream.header_block, b""
        headers = self._decode(block)
        if stream.handler is None and not stream.headers_sent:  # the request's headers (else: trailers)
            # One walk finds the path and, when the EPP traces, the trace context the proxy's call carries (a loop, not
            # a generator: Cython compiles no closure in this method). Pseudo-headers come first (RFC 9113 8.3), so
            # it stops at the path unless it looks for a traceparent, then at that.
            path = b""
            traceparent = None
            trace_context = self.server.trace_context
            for name, value in headers:
                if name == b":path":
                    path = value
                    if not trace_context:
                        break
                elif name == b"traceparent":
                    traceparent = value.decode("latin-1")
                    break
            if stream.id > self.last_taken:  # opened after our last GOAWAY: another replica takes it
                self.streams.pop(stream.id)
                self.out.append(frame(RST_STREAM, 0, stream.id, U32.pack(REFUSED_STREAM)))
                return
            if len(self.streams) > MAX_CONCURRENT_STREAMS:
                self.streams.pop(stream.id)
                self.refused_streams += 1
                if self.refused_streams > REFUSED_STREAMS_TOLERATED:  # it ignores our SETTINGS: not a proxy
                    raise H2ConnectionError(ENHANCE_YOUR_CALM, "streams over the advertised concurrency limit")
                self.out.append(frame(RST_STREAM, 0, stream.id, U32.pack(REFUSED_STREAM)))
                return
            if path == PROCESS_PATH:
                reply = functools.partial(self._reply, stream)
                if trace_context:
                    stream.handler = self.server.new_handler(reply, traceparent)
                else:
                    stream.handler = self.server.new_handler(reply)
                stream.request_type = self.server.request_type
            elif path in self.server.unary:
                stream.handler = method = self.server.unary[path]
                stream.request_type, stream.max_message = method.request_type, method.max_message
            else:
                self._close_stream(stream, status_trailers(UNIMPLEMENTED, f"unknown method {path.decode('latin-1')}"))
                return
        if flags & END_STREAM:
            self._end_of_requests(stream)

    @cython.ccall
    def _decode(self, block: bytes) -> list:
        """HPACK-decode a header block; a block seen before that left the dynamic table as it was is answered from
        a cache. Envoy's header block for a new ext_proc stream is the same few indexed fields every time, and hpack's
        pure-Python decode of it was ~5 % of the EPP's busy time (py-spy). Safe because any decode that changes the
        table empties the cache, so a cached block is only reused against the table it was decoded with."""
        cached = self.decoded_blocks.get(block)
        if cached is not None:
            return cached
        table = self.decoder.header_table
        entries = table.dynamic_entries
        before = (len(entries), entries[0] if entries else None, table.maxsize)
        headers = self.decoder.decode(block, raw=True)  # always decoded on a miss: it keeps the table in step
        if len(entries) == before[0] and (entries[0] if entries else None) is before[1] and table.maxsize == before[2]:
            if len(block) > MAX_DECODED_BLOCK_BYTES:
                return headers
            if len(self.decoded_blocks) >= MAX_DECODED_BLOCKS:
                self.decoded_blocks.clear()
            self.decoded_blocks[block] = headers
        else:
            self.decoded_blocks.clear()
        return headers

    @cython.ccall
    @cython.locals(
        received=cython.Py_ssize_t,
        offset=cython.Py_ssize_t,
        size=cython.Py_ssize_t,
        compressed=cython.Py_ssize_t,
        length=cython.Py_ssize_t,
        end=cython.Py_ssize_t,
        dropped=cython.Py_ssize_t,
        stream=_Stream,
    )
    def _on_data(self, flags: cython.Py_ssize_t, stream_id: cython.Py_ssize_t, payload: bytes) -> None:
        received = len(payload)  # padding counts against flow control too
        if flags & PADDED:
            payload = _unpad(payload)
        self.recv_unacked += received
        if self.recv_unacked >= CONNECTION_RECEIVE_WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, _pack_u32(self.recv_unacked)))
            self.recv_unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.closed:
            return  # a stream we already answered or the proxy reset
        if stream.handler is not None:
            if stream.skip:
                dropped = min(stream.skip, len(payload))
                stream.skip -= dropped
                payload = payload[dropped:]
            partial = self.partial
            if partial.held + len(payload) > partial.limit:
                self._close_stream(
                    stream, status_trailers(RESOURCE_EXHAUSTED, "the EPP holds too many partial messages")
                )
                return
            message = stream.message
            if message:  # the rest of a message that began in an earlier frame
                message += payload
                partial.held += len(payload)
                data = message
            else:  # most frames carry whole messages: parsed straight from the frame
                data = payload
            offset, size = 0, len(data)
            while size - offset >= 5:
                compressed, length = _unpack_grpc_prefix(data, offset)
                if compressed:
                    self._close_stream(stream, status_trailers(UNIMPLEMENTED, "compressed messages are not supported"))
                    return
                if length > stream.max_message:
                    self.server.oversized.note(length, stream.request_type.__name__, stream.max_message)
                    self._close_stream(
                        stream, status_trailers(RESOURCE_EXHAUSTED, f"message over {stream.max_message} bytes")
                    )
                    return
                end = offset + 5 + length
                if size < end:
                    if offset + 5 > size - len(payload) and self._refused_unread(stream, length):
                        # its length just arrived, and the handler needs none of it: it is dropped as it comes
                        stream.skip = end - size
                        offset = size
                    if stream.closed:
                        return  # (the handler failed)
                    break
                request_type = stream.request_type
                try:
                    if length < SMALL_MESSAGE:
                        request = request_type.FromString(data[offset + 5 : end])
                    else:
                        with memoryview(data) as view:  # parsed in place: one copy less of a large body
                            request = request_type.FromString(view[offset + 5 : end])
                except DecodeError:
                    self._close_stream(stream, status_trailers(INVALID_ARGUMENT, f"not a {request_type.__name__}"))
                    return
                offset = end
                if data is message:  # parsed (copied): its bytes go before the handler makes more copies of them
                    del message[:offset]
                    partial.held -= offset
                    offset, size = 0, len(message)
                self._handle(stream, request)
                if stream.closed:
                    return  # (closing dropped the stream's held bytes, the parsed ones included)
            if data is message:
                del message[:offset]
                partial.held -= offset
            elif offset < size:  # a message that goes on in the next frame
                message += data[offset:]
                partial.held += size - offset
        if flags & END_STREAM:
            self._end_of_requests(stream)
            return
        stream.recv_unacked += received
        if stream.recv_unacked >= RECEIVE_WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, stream_id, _pack_u32(stream.recv_unacked)))
            stream.recv_unacked = 0

    @cython.ccall
    def _refused_unread(self, stream: _Stream, length: cython.Py_ssize_t) -> bool:
        """Whether the handler refuses a message of `length` bytes before it is buffered (its answers are sent):
        a request body over the EPP's limit in one message (Envoy coalesces the chunks of a fast upload) would
        otherwise be held three times over (here, parsed, as bytes) before the handler could refuse it."""
        handler = stream.handler
        try:
            responses = handler.oversized(length)
        except Exception as exc:  # as in _handle: a bug costs this request only
            log.exception("ext_proc handler failed")
            self._close_stream(stream, status_trailers(INTERNAL, f"EPP internal error: {type(exc).__name__}"))
            return False
        if responses is None:
            return False
        for response in responses:
            self._send_message(stream, response)
        if responses:
            self.after.append(handler)
        return True

    @cython.ccall
    def _handle(self, stream: _Stream, request: Message) -> None:
        stream.handled = True
        handler = stream.handler
        try:
            responses = handler.handle(request)
        except Exception as exc:  # a bug must cost this request only, never the connection
            log.exception("ext_proc handler failed")
            self._close_stream(stream, status_trailers(INTERNAL, f"EPP internal error: {type(exc).__name__}"))
            return
        for response in responses:
            self._send_message(stream, response)
        if responses:
            self.after.append(handler)

    @cython.ccall
    def _reply(self, stream: _Stream, responses: list[bytes]) -> None:
        """A handler's deferred answers (a request that waited in flow control): sent at once."""
        if stream.closed or stream.handler is None or self.transport is None or self.transport.is_closing():
            return
        for response in responses:
            self._send_message(stream, response)
        if responses:
            self.after.append(stream.handler)
        self._write()

    @cython.ccall
    def _on_settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - len(payload) % 6, 6):
            key, value = SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = value
        self.out.append(frame(SETTINGS, ACK, 0))
        self._flush_all()

    @cython.ccall
    @cython.locals(stream=_Stream)
    def _on_window_update(self, stream_id: cython.Py_ssize_t, increment: cython.Py_ssize_t) -> None:
        if stream_id == 0:
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "the connection's send window over 2^31-1")
            self._flush_all()
            return
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            if stream.send_window > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, f"stream {stream_id}'s send window over 2^31-1")
            self._flush(stream)

    # -- sending -------------------------------------------------------------------------------------------------
    @cython.ccall
    @cython.locals(size=cython.Py_ssize_t)
    def _send_message(self, stream: _Stream, message: bytes) -> None:
        if not stream.headers_sent:
            self.out.append(frame(HEADERS, END_HEADERS, stream.id, RESPONSE_HEADERS))
            stream.headers_sent = True
        size = 5 + len(message)
        if (
            not stream.pending
            and size <= stream.send_window
            and size <= self.send_window
            and size <= self.peer_max_frame
        ):  # the common case: nothing queued, the windows allow; one header packs the frame's and the message's
            self.out += (
                _pack_data_message_header(size >> 16, size & 0xFFFF, DATA, 0, stream.id, 0, len(message)),
                message,
            )
            stream.send_window -= size
            self.send_window -= size
            return
        stream.pending.append(_pack_grpc_prefix(0, len(message)) + message)
        self.queued += size
        self._flush(stream)

    @cython.ccall
    def _end_of_requests(self, stream: _Stream) -> None:
        """The proxy half-closed the stream: the HTTP request is over; answer with OK trailers."""
        self._close_stream(stream, OK_TRAILERS)

    @cython.ccall
    def _close_stream(self, stream: _Stream, trailers: bytes) -> None:
        if stream.closed:
            return
        stream.closed = True
        self._drop_message(stream)
        if not stream.headers_sent:
            trailers = RESPONSE_HEADERS + trailers  # trailers-only response
            stream.headers_sent = True
        stream.pending.append((trailers,))
        self._finish(stream)
        self._flush(stream)

    @cython.ccall
    def _drop_message(self, stream: _Stream) -> None:
        self.partial.held -= len(stream.message)
        stream.message = bytearray()

    @cython.ccall
    def _finish(self, stream: _Stream) -> None:
        self._drop_message(stream)
        handler, stream.handler = stream.handler, None
        if handler is not None:
            handler.finish()

    @cython.ccall
    @cython.locals(stream=_Stream)
    def _flush_all(self) -> None:
        for stream in list(self.streams.values()):
            if stream.pending:
                self._flush(stream)

    @cython.ccall
    @cython.locals(allowed=cython.Py_ssize_t)
    def _flush(self, stream: _Stream) -> None:
        pending, out = stream.pending, self.out
        while pending:
            item = pending[0]
            if isinstance(item, tuple):
                self.unsent_trailers[stream.id] = len(out)
                out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, item[0]))
                pending.popleft()
                self.streams.pop(stream.id, None)
                return
            allowed = min(stream.send_window, self.send_window, self.peer_max_frame)
            if allowed <= 0:
                return  # resumed by a WINDOW_UPDATE
            chunk = item[:allowed]
            out.append(frame(DATA, 0, stream.id, chunk))
            stream.send_window -= len(chunk)
            self.send_window -= len(chunk)
            self.queued -= len(chunk)
            if len(chunk) == len(item):
                pending.popleft()
            else:
                pending[0] = item[len(chunk) :]


class ExtProcServer:
    """Listens for Envoy's ext_proc connections. `new_handler(reply)` makes one handler per stream (the interface is
    in `epp.handlers`); `unary` maps the paths of further unary methods ("/package.Service/Method") to what serves
    them. Its connections share one budget for the messages they reassemble, and there are at most
    `max_connections` of them: a peer that connects beyond gets SETTINGS and GOAWAY (ENHANCE_YOUR_CALM).
    `request_type` is what Process's messages are parsed into (its FromString): the message class, or the EPP
    handler's `epp.handlers.wire.ExtProcRequest`, read from the wire bytes. With `trace_context` (the EPP traces
    requests) each handler is made as `new_handler(reply, traceparent)`, with the W3C traceparent of the stream's
    gRPC metadata (the proxy's trace of the request) or None."""

    def __init__(
        self,
        new_handler: NewHandler,
        unary: Mapping[bytes, UnaryMethod] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        request_type: type = pb.ProcessingRequest,
        trace_context: bool = False,
    ):
        self.new_handler = new_handler
        self.trace_context = trace_context
        self.request_type = request_type
        self.unary = dict(unary or {})
        self.max_connections = max_connections
        self.partial = ByteBudget(MAX_PARTIAL_BYTES)
        self.outbound = ByteBudget(MAX_SHARED_OUTBOUND_BYTES)  # held: the connections' backlogs as last counted
        self.shed = RepeatedWarning(
            "epp.transport.h2",
            "aborted an ext_proc connection holding %d bytes of unread answers: all connections held %d, over %d; "
            "%d so far",
        )
        self.oversized = oversized_messages()
        self.connections: set[ExtProcConnection] = set()
        self.refused = RepeatedWarning(
            "epp.transport.h2", "refused an ext_proc connection: %d are open (--max-ext-proc-connections); %d so far"
        )
        self.server: asyncio.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str, port: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.server = await self.loop.create_server(lambda: ExtProcConnection(self), host, port, reuse_address=True)

    def refuse(self, transport: asyncio.Transport) -> None:
        """A connection over the limit: told why (our first frame must be SETTINGS) before it sent anything, its
        half closed, and what it sends dropped until it closes or REFUSED_LINGER_SECONDS have passed. Logged at the
        first and at every thousandth (`refused`): a peer that keeps reconnecting must not flood the log."""
        transport.write(frame(SETTINGS, 0, 0) + frame(GOAWAY, 0, 0, U32.pack(0) + U32.pack(ENHANCE_YOUR_CALM)))
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_SECONDS, transport.close)
        self.refused.note(len(self.connections))

    def shed_outbound(self) -> None:
        """The connections' unread answers are over the EPP-wide budget: the connections that hold the most are
        aborted until the rest fit (a GOAWAY would wait behind their backlog, unread). A proxy reads its answers
        as they come, so its backlog is small beside a peer's that reads nothing. Logged at the first and at every
        thousandth (`shed`): a peer that keeps reconnecting to read nothing must not flood the log."""
        for connection in sorted(self.connections, key=attrgetter("backlog"), reverse=True):
            if self.outbound.held <= self.outbound.limit:
                break
            self.shed.note(connection.backlog, self.outbound.held, self.outbound.limit)
            self.outbound.held -= connection.backlog  # (now: an abort drops the buffer at once)
            connection.backlog = 0
            connection.transport.abort()

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    def collect(self):
        """Its connections and shared bounds (inference_extension_ext_proc_*), read when Prometheus scrapes."""
        gauges = (
            (
                "inference_extension_ext_proc_connections",
                "Open connections to the ext_proc port (h2 transport).",
                len(self.connections),
            ),
            (
                "inference_extension_ext_proc_partial_message_bytes",
                "Bytes of gRPC messages not yet complete that all connections hold now.",
                self.partial.held,
            ),
            (
                "inference_extension_ext_proc_unread_answer_bytes",
                "Bytes of answers the ext_proc peers have not read yet (in the sockets' buffers or waiting for flow-control "
                "window), all connections together.",
                self.outbound.held,
            ),
        )
        yield from unlabelled(GaugeMetricFamily, gauges)
        counters = (
            (
                "inference_extension_ext_proc_refused_connections",
                "Connections refused over --max-ext-proc-connections.",
                self.refused.count,
            ),
            (
                "inference_extension_ext_proc_refused_messages",
                "gRPC messages refused over their method's size limit (RESOURCE_EXHAUSTED), unread.",
                self.oversized.count,
            ),
            (
                "inference_extension_ext_proc_aborted_connections",
                "Connections aborted because all connections' unread answers went over the EPP-wide budget (the "
                "largest backlogs go first).",
                self.shed.count,
            ),
        )
        yield from unlabelled(CounterMetricFamily, counters)

    def in_flight(self) -> int:
        """Streams open on all connections (those a drain waits for)."""
        return sum(len(connection.streams) for connection in self.connections)

    async def stop(self, grace: float = 1.0) -> None:
        """Drain, then close: no new connection is accepted, every proxy is told to open no new stream here
        (ExtProcConnection.drain: it opens them on another replica), and the streams in flight get up to `grace`
        seconds to finish; whatever is still open then is closed."""
        if self.server is None:
            return
        self.server.close()
        for connection in list(self.connections):
            connection.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.in_flight() and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        left = self.in_flight()
        if left:
            log.warning("drain: %d ext_proc streams still open after %.1f s, closed", left, grace)
        for connection in list(self.connections):
            connection.transport.close()
        await self.server.wait_closed()
