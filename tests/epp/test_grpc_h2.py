"""The EPP's own gRPC transport against grpcio's client (an independent HTTP/2 + gRPC implementation) and raw bytes:
many concurrent streams on one connection, messages larger than every flow-control window in both directions,
per-stream errors that leave the other streams alone, and connection errors for what is not HTTP/2."""

import asyncio
import socket
import struct

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.grpc_h2 import GOAWAY, MAX_RECEIVE_FRAME, PREFACE, ExtProcServer, frame

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class EchoHandler:
    """Answers request headers with a header naming how many messages it saw, and echoes request bodies back as a
    body mutation (so a large body is also a large response)."""

    log: list[str] = []

    def __init__(self):
        self.seen = 0

    def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.seen += 1
        if message.HasField("request_headers"):
            if any(h.key == "x-crash" for h in message.request_headers.headers.headers):
                raise RuntimeError("boom")
            common = pb.CommonResponse()
            common.header_mutation.set_headers.append(
                base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="x-seen", raw_value=str(self.seen).encode()))
            )
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))]
        if message.HasField("request_body"):
            mutation = pb.BodyMutation(body=message.request_body.body)
            return [
                pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation)))
            ]
        return []

    def after_reply(self) -> None:
        self.log.append("after_reply")

    def finish(self) -> None:
        self.log.append("finish")


def headers(*extra: tuple[str, str]) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    for key, value in ((":method", "POST"), (":path", "/v1/completions"), *extra):
        message.request_headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
    return message


def body(data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


@pytest.fixture
async def server():
    EchoHandler.log = []
    server = ExtProcServer(lambda: EchoHandler)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop(grace=0.2)


async def test_concurrent_streams_and_large_messages_both_ways(server):
    big = bytes(range(256)) * (12 * 1024)  # 3 MiB: over grpcio's and our initial windows and frame sizes
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def exchange(i: int) -> None:
            call = stub.Process()
            await call.write(headers())
            reply = await call.read()
            assert reply.request_headers.response.header_mutation.set_headers[0].header.raw_value == b"1"
            data = big if i % 10 == 0 else f"request {i}".encode()
            await call.write(body(data))
            reply = await call.read()
            assert reply.request_body.response.body_mutation.body == data
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK

        await asyncio.gather(*(exchange(i) for i in range(40)))
    assert EchoHandler.log.count("finish") == 40
    assert EchoHandler.log.count("after_reply") == 80  # once per read that produced answers


async def test_a_failing_handler_costs_its_own_stream_only(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        healthy = stub.Process()
        await healthy.write(headers())
        await healthy.read()
        crashing = stub.Process()
        await crashing.write(headers(("x-crash", "1")))
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await crashing.read()
        assert failure.value.code() == grpc.StatusCode.INTERNAL
        assert "RuntimeError" in failure.value.details()
        await healthy.write(body(b"still here"))
        assert (await healthy.read()).request_body.response.body_mutation.body == b"still here"
        await healthy.done_writing()
        assert await healthy.code() == grpc.StatusCode.OK


async def test_unknown_method_and_undecodable_message_get_grpc_errors(server):
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


def _goaway_code(received: bytes) -> int | None:
    position = 0
    while position + 9 <= len(received):
        length = int.from_bytes(received[position : position + 3], "big")
        if received[position + 3] == GOAWAY:
            return struct.unpack(">L", received[position + 13 : position + 17])[0]
        position += 9 + length
    return None


async def test_not_http2_and_oversized_frames_close_the_connection(server):
    loop = asyncio.get_running_loop()
    received = await loop.run_in_executor(None, _raw_exchange, server.port, b"POST / HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
    assert _goaway_code(received) == 0x1  # PROTOCOL_ERROR
    oversized = PREFACE + frame(4, 0, 0) + struct.pack(">L", MAX_RECEIVE_FRAME + 1)[1:] + b"\x00\x00\x00\x00\x00\x01"
    received = await loop.run_in_executor(None, _raw_exchange, server.port, oversized)
    assert _goaway_code(received) == 0x6  # FRAME_SIZE_ERROR


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
