"""One suite for both ext_proc transports (the lean `epp.transport.h2` and grpcio's `epp.transport.grpcio`), driven by
grpcio's client: the handler interface of `epp.handlers` (answers now or later through `reply`, `after_reply`
after each batch of answers, `finish` once however the stream ends), many concurrent streams, messages larger than
every flow-control window in both directions, errors that cost one stream only, and the access log's unary Export
beside them."""

import asyncio

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.handlers import accesslog
from epp.handlers.extproc import RequestStream
from epp.handlers.wire import ExtProcRequest
from epp.transport.grpcio import access_log_service, ext_proc_service
from epp.transport.h2 import ExtProcServer, UnaryMethod
from harness.bench.handler_cpu import _director
from protocol import extproc
from protocol.limits import ByteBudget
from tests.epp.helpers import until

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DEFER_SECONDS = 0.05


class EchoHandler:
    """Answers request headers with a header naming how many messages it saw (`x-defer`: later, through reply),
    and echoes request bodies back as a body mutation (so a large body is also a large response)."""

    log: list[str] = []

    def __init__(self, reply):
        self.reply = reply
        self.seen = 0
        self.later: asyncio.TimerHandle | None = None

    @property
    def awaiting_reply(self) -> bool:
        return self.later is not None

    def handle(self, message: pb.ProcessingRequest) -> list[bytes]:
        self.seen += 1
        if message.HasField("request_headers"):
            names = {h.key for h in message.request_headers.headers.headers}
            if "x-crash" in names:
                raise RuntimeError("boom")
            common = pb.CommonResponse()
            common.header_mutation.set_headers.append(
                base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="x-seen", raw_value=str(self.seen).encode()))
            )
            answer = [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common)).SerializeToString()]
            if "x-defer" in names:
                self.later = asyncio.get_running_loop().call_later(DEFER_SECONDS, self._answer_later, answer)
                return []
            return answer
        if message.HasField("request_body"):
            mutation = pb.BodyMutation(body=message.request_body.body)
            return [
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
                ).SerializeToString()
            ]
        return []

    def _answer_later(self, answer: list[bytes]) -> None:
        self.later = None
        self.log.append("replied")
        self.reply(answer)

    def oversized(self, size: int) -> None:
        return None

    def after_reply(self) -> None:
        self.log.append("after_reply")

    def finish(self) -> None:
        if self.later is not None:
            self.later.cancel()
            self.later = None
            self.log.append("cancelled")
        self.log.append("finish")


def headers(*extra: tuple[str, str]) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    for key, value in ((":method", "POST"), (":path", "/v1/completions"), *extra):
        message.request_headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
    return message


def body(data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


ACCESS_LOG_RECORDS: list[tuple] = []
EXPORT = accesslog.ExportHandler(lambda *record: ACCESS_LOG_RECORDS.append(record))


@pytest.fixture(params=["h2", "grpcio"])
async def port(request):
    """The port of a transport serving EchoHandlers and the access log's Export (into ACCESS_LOG_RECORDS)."""
    EchoHandler.log = []
    ACCESS_LOG_RECORDS.clear()
    if request.param == "h2":
        server = ExtProcServer(
            EchoHandler,
            {accesslog.EXPORT_PATH: UnaryMethod(accesslog.ExportRecords, EXPORT, accesslog.MAX_EXPORT_BYTES)},
        )
        await server.start("127.0.0.1", 0)
        try:
            yield server.port
        finally:
            await server.stop(grace=0.2)
    else:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        server.add_generic_rpc_handlers([ext_proc_service(EchoHandler)])
        server.add_generic_rpc_handlers([access_log_service(EXPORT)])
        bound = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            yield bound
        finally:
            await server.stop(0.2)


async def test_concurrent_streams_and_large_messages_both_ways(port):
    big = bytes(range(256)) * (12 * 1024)  # 3 MiB: over grpcio's and our initial windows and frame sizes
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
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
    await until(lambda: EchoHandler.log.count("finish") == 40)
    assert EchoHandler.log.count("after_reply") == 80  # once per batch of answers


async def test_deferred_answers_arrive_through_reply_in_order(port):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def exchange(i: int) -> float:
            call = stub.Process()
            started = asyncio.get_running_loop().time()
            await call.write(headers(("x-defer", "1")))
            reply = await call.read()
            waited = asyncio.get_running_loop().time() - started
            assert reply.request_headers.response.header_mutation.set_headers[0].header.raw_value == b"1"
            await call.write(body(f"after the wait {i}".encode()))
            assert (await call.read()).request_body.response.body_mutation.body == f"after the wait {i}".encode()
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            return waited

        waits = await asyncio.gather(*(exchange(i) for i in range(10)))
    assert min(waits) >= DEFER_SECONDS * 0.9
    await until(lambda: EchoHandler.log.count("finish") == 10)
    assert EchoHandler.log.count("replied") == 10
    assert EchoHandler.log.count("after_reply") == 20  # after each deferred answer, and after each body answer
    assert "cancelled" not in EchoHandler.log


async def test_a_stream_that_ends_while_its_answer_is_pending_cancels_it(port):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers(("x-defer", "1")))
        await asyncio.sleep(DEFER_SECONDS / 5)
        call.cancel()  # the client went away (Envoy resets the stream)
        await until(lambda: "finish" in EchoHandler.log)
    await asyncio.sleep(DEFER_SECONDS * 2)
    assert EchoHandler.log == ["cancelled", "finish"]  # finish once, and no reply after it


async def test_a_failing_handler_costs_its_own_stream_only(port):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
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


async def test_unknown_method_gets_unimplemented_and_the_connection_stays_good(port):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        other = channel.unary_unary("/envoy.service.ext_proc.v3.ExternalProcessor/Other")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await other(b"")
        assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers())
        assert (await call.read()).HasField("request_headers")
        await call.done_writing()


def access_log_export(*records: tuple[str, ...]) -> bytes:
    """An OTLP Export request as Envoy's OpenTelemetry access logger sends it: (body, ttft_us[, status[, upstream]])
    attribute records, each with an attribute the EPP does not read first."""
    request = accesslog.export_request(records)
    for record in getattr(getattr(request.resource_logs[0], accesslog._SCOPES)[0], accesslog._RECORDS):
        read = [(a.key, a.value.string_value) for a in record.attributes]
        del record.attributes[:]
        for key, value in [("other", "x"), *read]:
            record.attributes.add(key=key).value.string_value = value
    return request.SerializeToString()


async def test_access_log_export_beside_ext_proc_streams_on_one_connection(port):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers())
        export = channel.unary_unary(accesslog.EXPORT_PATH.decode())
        records = [
            ("a", "1500"),
            ("b", "-"),
            ("", "10", "200"),
            ("c", "0"),
            ("d", "²"),
            ("e", "9" * 40),
            ("f", "250000", "200", "10.0.0.1:8000"),
            ("g", "-", "503", "-"),  # no body came: its status still counts
            ("h", "-", "20x", "10.0.0.1:8000"),
            ("j", "-", "٢٠٠"),  # digits, but not a status
            ("k", "-", "700"),
            ("i", "1000", "0", "-"),  # the client went away before a response
            ("x" * 257, "1000", "200"),  # longer than any id the EPP gives a request
        ]
        answer = await export(access_log_export(*records))
        assert answer == b""  # an empty ExportLogsServiceResponse: every record accepted
        assert (await call.read()).HasField("request_headers")
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    # the rest lack an id, or both a positive time in us and a three-digit status
    assert ACCESS_LOG_RECORDS == [
        ("a", 0.0015, "", None),
        ("f", 0.25, "200", "10.0.0.1:8000"),
        ("g", None, "503", None),
        ("i", 0.001, "", None),
    ]


async def test_an_export_over_its_limit_is_refused_unparsed_and_the_connection_goes_on(port, caplog):
    """An Export's records cost the event loop ~42 ns a byte (a 64 MiB one held it 3.2 s): one over MAX_EXPORT_BYTES
    gets RESOURCE_EXHAUSTED, its records unread; the next one on the same channel is taken."""
    per_record = len(access_log_export(("request-0", "1500")))
    count = accesslog.MAX_EXPORT_BYTES // (per_record - 20) + 100
    oversized = access_log_export(*((f"request-{i}", "1500") for i in range(count)))
    assert len(oversized) > accesslog.MAX_EXPORT_BYTES
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        export = channel.unary_unary(accesslog.EXPORT_PATH.decode())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await export(oversized)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(accesslog.MAX_EXPORT_BYTES) in refused.value.details()
        assert "ExportLogsServiceRequest over its limit" in caplog.text  # (an operator sees why records are lost)
        assert ACCESS_LOG_RECORDS == []
        assert await export(access_log_export(("a", "1500"))) == b""
    assert ACCESS_LOG_RECORDS == [("a", 0.0015, "", None)]


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_the_epp_handler_routes_over_either_transport_reading_messages_from_their_bytes(transport):
    """As epp/cli.py serves it: RequestStreams over each transport, the messages read as `wire.ExtProcRequest`."""
    director = _director()
    hostports = {e.hostport for e in director.datastore.endpoints}

    def new_stream(reply):
        return RequestStream(director, reply, ByteBudget(1 << 20))

    if transport == "h2":
        server = ExtProcServer(new_stream, request_type=ExtProcRequest)
        await server.start("127.0.0.1", 0)
        port, stop = server.port, server.stop
    else:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([ext_proc_service(new_stream, ExtProcRequest)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stop = server.stop
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(headers(("content-type", "application/json"), ("X-Request-Id", "r-1")))
            assert (await call.read()).request_headers.response == pb.CommonResponse()  # BUFFERED: answered at once
            await call.write(body(b'{"model": "food-review", "prompt": "hi"}'))
            answer = (await call.read()).request_body.response.header_mutation.set_headers
            routed = {h.header.key: h.header.raw_value.decode() for h in answer}
            assert routed[extproc.DESTINATION_ENDPOINT_HEADER] in hostports
            assert routed[extproc.REQUEST_ID_HEADER] == "r-1"  # (read from a header that came capitalized)
            await call.done_writing()
    finally:
        await stop(0.2)
