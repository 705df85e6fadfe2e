"""What only the EPP's own gRPC transport does (what both transports share is in test_transports.py): gRPC errors
for undecodable messages, connection errors for what is not HTTP/2, GOAWAY on stop."""

import asyncio
import socket
import struct

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import generate_latest

from epp.handlers import accesslog
from epp.handlers.extproc import BufferedBodyCollector
from epp.metrics import EPPMetrics
from epp.transport import h2
from epp.transport.h2 import MAX_RECEIVE_FRAME, PREFACE, ExtProcServer, UnaryMethod, frame, grpc_message
from harness.bench.chaos import goaway_code
from harness.bench.handler_cpu import CountingTransport
from protocol.limits import ByteBudget
from tests.epp.test_transports import PROCESS, EchoHandler, body, headers


@pytest.fixture
async def server():
    EchoHandler.log = []
    export = UnaryMethod(
        accesslog.ExportRecords, accesslog.ExportHandler(lambda request_id, ttft: None), accesslog.MAX_EXPORT_BYTES
    )
    server = ExtProcServer(EchoHandler, {accesslog.EXPORT_PATH: export})
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop(grace=0.2)


async def test_unknown_method_and_undecodable_message_get_grpc_errors(server, caplog):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        # unary calls: the whole request goes out before the answer, so the client cannot race the server's close
        other = channel.unary_unary("/envoy.service.ext_proc.v3.ExternalProcessor/Other")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await other(b"")
        assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED
        garbage = channel.unary_unary(PROCESS)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await garbage(b"\xff\xff\xff")
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        garbage = channel.unary_unary(accesslog.EXPORT_PATH.decode())
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await garbage(b"\xff\xff\xff")
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ExportLogsServiceRequest" in failure.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as failure:  # refused by its length alone, and said in the log
            await garbage(b"\0" * (accesslog.MAX_EXPORT_BYTES + 1))
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and server.oversized.count == 1
        assert "over its limit" in caplog.text and "buffer_size_bytes" in caplog.text
        # the connection is still good
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await call.write(headers())
        assert (await call.read()).HasField("request_headers")
        await call.done_writing()


def _raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
        return received


async def test_not_http2_and_oversized_frames_close_the_connection(server):
    loop = asyncio.get_running_loop()
    received = await loop.run_in_executor(None, _raw_exchange, server.port, b"POST / HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
    assert goaway_code(received) == 0x1  # PROTOCOL_ERROR
    oversized = PREFACE + frame(4, 0, 0) + struct.pack(">L", MAX_RECEIVE_FRAME + 1)[1:] + b"\x00\x00\x00\x00\x00\x01"
    received = await loop.run_in_executor(None, _raw_exchange, server.port, oversized)
    assert goaway_code(received) == 0x6  # FRAME_SIZE_ERROR


async def test_stop_sends_goaway_and_lets_open_streams_finish(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers())
        await call.read()
        stopping = asyncio.create_task(server.stop(grace=2.0))
        await asyncio.sleep(0.05)
        await call.write(body(b"last words"))
        assert (await call.read()).request_body.response.body_mutation.body == b"last words"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        await stopping
    assert "finish" in EchoHandler.log


def _frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, stream id, payload) of each frame in a server's bytes."""
    frames, offset = [], 0
    while offset + 9 <= len(data):
        length, kind, stream_id = int.from_bytes(data[offset : offset + 3], "big"), data[offset + 3], 0
        stream_id = int.from_bytes(data[offset + 5 : offset + 9], "big") & 0x7FFFFFFF
        frames.append((kind, stream_id, data[offset + 9 : offset + 9 + length]))
        offset += 9 + length
    return frames


def test_a_drain_is_two_goaways_a_ping_apart_and_refuses_later_streams():
    """gRPC servers' graceful GOAWAY: the first names the highest possible stream, so a stream the proxy opened
    before it saw it is still served; once the proxy answered the PING sent with it, the second names the last
    stream taken, and a stream opened after that is refused (REFUSED_STREAM: the proxy may retry it elsewhere)."""
    from hpack import Encoder

    from epp.transport.h2 import (
        ACK,
        DATA,
        DRAIN_PING,
        END_HEADERS,
        GOAWAY,
        HEADERS,
        MAX_STREAM_ID,
        PING,
        REFUSED_STREAM,
        RST_STREAM,
        SETTINGS,
        U32,
        ExtProcConnection,
    )

    EchoHandler.log = []
    encoder = Encoder()

    def open_stream(stream_id: int) -> bytes:
        block = encoder.encode([(":method", "POST"), (":path", PROCESS), ("content-type", "application/grpc")])
        return frame(HEADERS, END_HEADERS, stream_id, block) + frame(
            DATA, 0, stream_id, grpc_message(headers().SerializeToString())
        )

    connection = ExtProcConnection(ExtProcServer(EchoHandler))
    transport = RecordingTransport()
    connection.connection_made(transport)
    connection.data_received(PREFACE + frame(SETTINGS, 0, 0) + open_stream(1))
    connection.drain()
    sent = _frames(bytes(transport.written))
    assert (GOAWAY, 0, U32.pack(MAX_STREAM_ID) + U32.pack(0)) in sent and (PING, 0, DRAIN_PING) in sent
    del transport.written[:]
    connection.data_received(open_stream(3))  # opened before the proxy saw the GOAWAY: taken
    assert [kind for kind, stream_id, _ in _frames(bytes(transport.written)) if stream_id == 3] == [HEADERS, DATA]
    del transport.written[:]
    connection.data_received(frame(PING, ACK, 0, DRAIN_PING) + open_stream(5))
    sent = _frames(bytes(transport.written))
    assert sent[0] == (GOAWAY, 0, U32.pack(3) + U32.pack(0))
    assert (RST_STREAM, 5, U32.pack(REFUSED_STREAM)) in sent and 5 not in connection.streams
    assert sorted(connection.streams) == [1, 3]  # the streams in flight go on


def test_header_blocks_are_decoded_once_while_the_hpack_table_stays_the_same():
    from hpack import Encoder

    from epp.transport.h2 import ExtProcConnection

    connection = ExtProcConnection(ExtProcServer(lambda reply: None))
    encoder = Encoder()
    first = [(":path", "/a"), ("x-new", "1")]
    block = encoder.encode(first)  # inserts x-new: a block that changes the table is never remembered
    assert connection._decode(block) == [(b":path", b"/a"), (b"x-new", b"1")]
    assert connection.decoded_blocks == {}
    again = encoder.encode(first)  # all indexed now: the table stays as it is, so the block is remembered
    assert connection._decode(again) == [(b":path", b"/a"), (b"x-new", b"1")]
    assert again in connection.decoded_blocks
    assert connection._decode(again) is connection.decoded_blocks[again]
    other = encoder.encode([("x-other", "2")])  # changes the table: what was remembered may now decode differently
    connection._decode(other)
    assert connection.decoded_blocks == {}
    assert connection._decode(encoder.encode(first)) == [(b":path", b"/a"), (b"x-new", b"1")]  # still in step


def test_a_traced_server_hands_each_stream_the_trace_context_its_call_carried():
    """With `trace_context` the stream's handler gets the call's traceparent (Envoy's trace of the request), None
    without one; untraced, the handler is made without it."""
    from hpack import Encoder

    from epp.transport.h2 import END_HEADERS, HEADERS, PROCESS_PATH, ExtProcConnection

    made = []
    call = [(":method", "POST"), (":path", PROCESS_PATH.decode()), ("content-type", "application/grpc")]
    context = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for traced, extra, expected in (
        (True, [("traceparent", context)], (context,)),
        (True, [], (None,)),
        (False, [("traceparent", context)], ()),
    ):
        connection = ExtProcConnection(ExtProcServer(lambda reply, *args: made.append(args), trace_context=traced))
        connection.connection_made(CountingTransport())
        connection.data_received(
            PREFACE + frame(4, 0, 0) + frame(HEADERS, END_HEADERS, 1, Encoder().encode(call + extra))
        )
        assert made.pop() == expected


class RecordingTransport(CountingTransport):
    """Keeps what it is written, too."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def write(self, data: bytes) -> None:
        super().write(data)
        self.written += data


def test_reads_split_anywhere_are_answered_as_one_read():
    """Frames come whole in one read (parsed from the read itself) or split across reads (buffered until whole): the
    answers are the same bytes either way."""
    from hpack import Encoder

    from epp.transport.h2 import (
        DATA,
        END_HEADERS,
        END_STREAM,
        HEADERS,
        SETTING,
        SETTINGS,
        SETTINGS_INITIAL_WINDOW_SIZE,
        U32,
        WINDOW_UPDATE,
        ExtProcConnection,
    )

    encoder = Encoder()
    # windows that let every answer out at once (the large echo too)
    client = PREFACE + frame(SETTINGS, 0, 0, SETTING.pack(SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20))
    client += frame(WINDOW_UPDATE, 0, 0, U32.pack(1 << 20))
    # the second body spans several reads at every split below; the last two streams' messages span two frames each
    for stream_id, size, frames in ((1, 10, 1), (3, 70_000, 1), (5, 100, 2), (7, 70_000, 2)):
        block = encoder.encode([(":method", "POST"), (":path", PROCESS), ("content-type", "application/grpc")])
        client += frame(HEADERS, END_HEADERS, stream_id, block)
        for message in (headers(), body(b"x" * size)):
            data = message.SerializeToString()
            wire = grpc_message(data)
            cut = len(wire) // frames
            for part in (wire[:cut], wire[cut:]) if frames == 2 else (wire,):
                client += frame(DATA, 0, stream_id, part)
        client += frame(DATA, END_STREAM, stream_id)

    def answers(chunk: int) -> bytes:
        EchoHandler.log = []
        connection = ExtProcConnection(ExtProcServer(EchoHandler))
        transport = RecordingTransport()
        connection.connection_made(transport)
        for start in range(0, len(client), chunk):
            connection.data_received(client[start : start + chunk])
        assert not connection.streams and not connection.buffer
        return bytes(transport.written)

    whole = answers(len(client))
    assert whole.count(b"grpc-status") == 4 and len(whole) > 140_000  # every stream answered, the large bodies echoed
    for chunk in (1, 5, 9, 100, 16_384):
        assert answers(chunk) == whole


def _client_sending(*messages: bytes, frame_size: int = 16_384) -> bytes:
    """A client's bytes for one Process stream whose messages go out in DATA frames of `frame_size` (Envoy's)."""
    from hpack import Encoder

    from epp.transport.h2 import DATA, END_HEADERS, END_STREAM, HEADERS, SETTINGS

    block = Encoder().encode([(":method", "POST"), (":path", PROCESS), ("content-type", "application/grpc")])
    wire = b"".join(grpc_message(m) for m in messages)
    frames = b"".join(frame(DATA, 0, 1, wire[start : start + frame_size]) for start in range(0, len(wire), frame_size))
    return PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, block) + frames + frame(DATA, END_STREAM, 1)


def test_a_message_the_handler_refuses_by_its_length_is_dropped_as_it_arrives():
    """A request body over the limit in one message (Envoy coalesces the chunks of a fast upload) is refused when its
    length arrives: its bytes are never held, parsed or copied, and the stream's next message is read as usual."""
    import tracemalloc

    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from epp.transport.h2 import ExtProcConnection

    refusal = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(body=b"too large")).SerializeToString()

    class Refusing(EchoHandler):
        def oversized(self, size: int) -> list[bytes] | None:
            self.log.append(f"oversized {size}")
            return [refusal] if size > 1 << 20 else None

    EchoHandler.log = []
    big = body(b"x" * (40 << 20)).SerializeToString()
    client = _client_sending(headers().SerializeToString(), big, body(b"after").SerializeToString())
    reads = [client[start : start + (256 << 10)] for start in range(0, len(client), 256 << 10)]
    del client
    connection = ExtProcConnection(ExtProcServer(Refusing))
    transport = RecordingTransport()
    connection.connection_made(transport)
    tracemalloc.start()
    try:
        for data in reads:
            connection.data_received(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20  # not the 40 MB message: a read's frames, one at a time
    assert Refusing.log.count(f"oversized {len(big)}") == 1 and Refusing.log.count("finish") == 1
    assert b"too large" in transport.written and b"after" in transport.written  # the next message was echoed
    assert not connection.streams and connection.partial.held == 0


def test_a_message_over_several_frames_is_let_go_before_its_handler_runs():
    """Once parsed, a message's bytes are no longer the transport's: the handler's copies do not come on top."""
    from epp.transport.h2 import ExtProcConnection

    held = []

    class Recording(EchoHandler):
        def handle(self, message):
            held.append(connection.partial.held)
            return super().handle(message)

    connection = ExtProcConnection(ExtProcServer(Recording))
    connection.connection_made(RecordingTransport())
    connection.data_received(_client_sending(headers().SerializeToString(), body(b"x" * 100_000).SerializeToString()))
    assert held == [0, 0]


def test_a_stream_the_proxy_ends_and_resets_in_one_read_costs_no_write():
    """Envoy ends each ext_proc stream with END_STREAM and RST_STREAM together (it does not wait for the server's
    trailers): trailers queued for a stream reset in the same read are dropped, so that read needs no write; a
    stream only half-closed still gets its OK trailers."""
    from epp.transport.h2 import DATA, END_STREAM, RST_STREAM, U32, ExtProcConnection

    EchoHandler.log = []
    connection = ExtProcConnection(ExtProcServer(EchoHandler))
    transport = RecordingTransport()
    connection.connection_made(transport)
    opened = _client_sending(headers().SerializeToString())
    connection.data_received(opened[: -len(frame(DATA, END_STREAM, 1))])  # the stream's message, not its end
    answered, writes = len(transport.written), transport.writes
    connection.data_received(frame(DATA, END_STREAM, 1) + frame(RST_STREAM, 0, 1, U32.pack(0x8)))
    assert transport.writes == writes and len(transport.written) == answered
    assert not connection.streams and EchoHandler.log.count("finish") == 1

    EchoHandler.log = []
    connection = ExtProcConnection(ExtProcServer(EchoHandler))
    transport = RecordingTransport()
    connection.connection_made(transport)
    connection.data_received(opened)  # half-closed only: the trailers go out
    assert transport.written.count(b"grpc-status") == 1 and not connection.streams
    connection.data_received(frame(RST_STREAM, 0, 1, U32.pack(0x8)))  # a reset after they went: nothing to drop
    assert transport.written.count(b"grpc-status") == 1


def test_the_connections_of_one_server_share_one_budget_for_partial_messages():
    """Any number of peers may connect: what they reassemble is bounded for the server, not per connection. The
    connection whose message would go over the budget loses that stream (RESOURCE_EXHAUSTED); the other's goes on."""
    from epp.transport.h2 import ExtProcConnection

    EchoHandler.log = []
    server = ExtProcServer(EchoHandler)
    server.partial.limit = 80_000  # more than one 60 KB message, less than two
    first, second = ExtProcConnection(server), ExtProcConnection(server)
    sinks = RecordingTransport(), RecordingTransport()
    message = body(b"x" * 60_000).SerializeToString()
    wires = [_client_sending(headers().SerializeToString(), message) for _ in range(2)]
    held_after = len(wires[0]) - 5_000  # the whole headers message, and most of the body's
    for connection, sink, wire in zip((first, second), sinks, wires, strict=True):
        connection.connection_made(sink)
        connection.data_received(wire[:held_after])
    assert 40_000 < server.partial.held <= 80_000
    assert b"the EPP holds too many partial messages" in sinks[1].written  # the second would have gone over
    assert not second.streams and "finish" in EchoHandler.log
    first.data_received(wires[0][held_after:])  # the first one's body is whole: echoed, and its bytes let go
    assert sinks[0].written.count(b"x" * 1000) >= 50 and not first.streams
    assert server.partial.held == 0


def test_answers_queued_for_window_count_as_unread_until_sent_or_reset():
    """Answers a stream holds until the peer opens its window are answers the peer has not read: they count in the
    EPP-wide budget of unread answers until a WINDOW_UPDATE lets them out or a reset drops them."""
    EchoHandler.log = []
    server = ExtProcServer(EchoHandler)
    connection, transport = h2.ExtProcConnection(server), RecordingTransport()
    connection.connection_made(transport)
    echo = body(b"x" * 60_000).SerializeToString()
    no_window = frame(h2.SETTINGS, 0, 0, h2.SETTING.pack(h2.SETTINGS_INITIAL_WINDOW_SIZE, 0))
    wire = _client_sending(headers().SerializeToString(), echo)
    settings_end = len(PREFACE) + 9  # (the client's empty SETTINGS frame, then its stream)
    connection.data_received(wire[:settings_end] + no_window + wire[settings_end:])
    queued = connection.queued
    assert queued > len(echo) and server.outbound.held == queued  # nothing went out: both answers wait
    connection.data_received(frame(h2.WINDOW_UPDATE, 0, 1, h2.U32.pack(20_000)))
    assert connection.queued == queued - 20_000 == server.outbound.held
    connection.data_received(frame(h2.RST_STREAM, 0, 1, h2.U32.pack(0x8)))  # the proxy gives up on the stream
    assert connection.queued == 0 == server.outbound.held


def test_header_blocks_too_long_to_be_common_are_not_remembered():
    from hpack import Encoder

    from epp.transport.h2 import MAX_DECODED_BLOCK_BYTES, ExtProcConnection

    connection = ExtProcConnection(ExtProcServer(lambda reply: None))
    encoder = Encoder()
    fields = [(":path", "/a"), ("x-long", "v" * MAX_DECODED_BLOCK_BYTES)]
    connection._decode(encoder.encode(fields))
    again = encoder.encode(fields, huffman=False)  # indexed now: the block leaves the table as it is
    assert connection._decode(again) == [(b":path", b"/a"), (b"x-long", b"v" * MAX_DECODED_BLOCK_BYTES)]
    assert len(again) <= MAX_DECODED_BLOCK_BYTES and again in connection.decoded_blocks
    literal = encoder.encode([(":path", "/a"), ("x-long", "w" * MAX_DECODED_BLOCK_BYTES, True)], huffman=False)
    assert len(literal) > MAX_DECODED_BLOCK_BYTES  # never indexed: the table stays, but the block is not kept
    connection._decode(literal)
    assert literal not in connection.decoded_blocks


async def test_connections_over_the_limit_get_goaway_and_the_count_comes_back():
    server = ExtProcServer(EchoHandler, max_connections=2)
    await server.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    try:
        held = []
        for _ in range(2):
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(PREFACE + frame(4, 0, 0))
            held.append(writer)
        while len(server.connections) < 2:
            await asyncio.sleep(0.01)
        received = await loop.run_in_executor(None, _raw_exchange, server.port, PREFACE + frame(4, 0, 0))
        assert received[3] == 4 and goaway_code(received) == 0xB  # SETTINGS first, then ENHANCE_YOUR_CALM
        assert server.refused.count == 1 and len(server.connections) == 2
        body_budget = ByteBudget(100)
        body_budget.reserve(40)
        metrics = EPPMetrics("pool")
        metrics.register(BufferedBodyCollector(body_budget))
        metrics.register(server)
        page = generate_latest(metrics.registry).decode()
        for line in (
            "inference_extension_ext_proc_connections 2.0",
            "inference_extension_ext_proc_refused_connections_total 1.0",
            "inference_extension_ext_proc_partial_message_bytes 0.0",
            "inference_extension_ext_proc_aborted_connections_total 0.0",
            "inference_extension_ext_proc_refused_messages_total 0.0",
            "inference_extension_ext_proc_unread_answer_bytes 0.0",
            "inference_extension_ext_proc_buffered_body_bytes 40.0",
        ):
            assert line in page.splitlines()
        held.pop().close()
        while len(server.connections) > 1:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # served again
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(headers())
            assert (await call.read()).HasField("request_headers")
            await call.done_writing()
        for writer in held:
            writer.close()
    finally:
        await server.stop(grace=0.2)


async def test_a_connection_that_sends_no_preface_gives_its_place_back(monkeypatch):
    monkeypatch.setattr("epp.transport.h2.PREFACE_TIMEOUT_SECONDS", 0.2)
    server = ExtProcServer(EchoHandler, max_connections=1)
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        received = await asyncio.wait_for(reader.read(), 5)  # read until the server closes
        assert goaway_code(received) == 0x1  # PROTOCOL_ERROR: no preface in time
        writer.close()
        while server.connections:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # the place is free again
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(headers())
            assert (await call.read()).HasField("request_headers")
            await asyncio.sleep(0.4)  # past the timeout: a connection that sent its preface stays
            await call.write(body(b"still here"))
            assert (await call.read()).request_body.response.body_mutation.body == b"still here"
            await call.done_writing()
    finally:
        await server.stop(grace=0.2)
