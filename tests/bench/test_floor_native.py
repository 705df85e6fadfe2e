"""The native floor (harness/bench/floor_native.c): the Python floor's answers byte for byte from a gRPC client, and
behind a real Envoy in each of the overhead bench's floor modes, over zero-delay sims."""

import asyncio
import functools
import itertools
import re
import subprocess

import aiohttp
import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from harness.bench import floor, floor_native, overhead
from harness.bench.ports import free_port_block, free_ports
from harness.envoy import EnvoyProcess, terminate
from harness.local import LocalStack, StackConfig

pytestmark = pytest.mark.skipif(floor_native.compiler() is None, reason="no C compiler on PATH")

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
SUCCESS = re.compile(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    return floor_native.build(tmp_path_factory.mktemp("floor-native"))


@pytest.fixture
def processor(binary):
    """The native floor on a free port, routing to two made-up endpoints; its port."""
    (port,) = free_ports(1)
    process = subprocess.Popen(floor_native.command(binary, port, ["10.0.0.1:8000", "10.0.0.2:8000"]), stdout=-1)
    try:
        assert process.stdout.readline() == b"ready\n"
        yield port
    finally:
        process.terminate()
        assert process.wait(5) == 0  # SIGTERM is a clean exit


def test_answers_as_the_python_floor(processor):
    routes = [floor.routing_response(e).SerializeToString() for e in ("10.0.0.1:8000", "10.0.0.2:8000")]
    python_floor = floor.FloorHandler(itertools.cycle(routes), None)
    requests = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * 300_000)),  # over a frame, a window, 2 MB total
        pb.ProcessingRequest(request_body=pb.HttpBody(body=b"y" * 1_700_000)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True)),
        pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True)),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
        pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
        pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
    ]
    # Fields outside the oneof before it on the wire (protobuf merges concatenated messages): the processor walks
    # over them instead of taking the first field for the request.
    before = pb.ProcessingRequest(
        metadata_context={"filter_metadata": {"envoy.lb": {}}}, observability_mode=True
    ).SerializeToString()
    expected = [m for r in requests for m in python_floor.handle(r)]
    with grpc.insecure_channel(f"127.0.0.1:{processor}") as channel:
        process = channel.stream_stream(PROCESS, request_serializer=bytes, response_deserializer=bytes)
        assert list(process(iter(before + r.SerializeToString() for r in requests))) == expected
        # 32 streams at once on the one connection, each answered in turn over the two endpoints
        calls = [process(iter([requests[0].SerializeToString()])) for _ in range(32)]
        answers = [next(iter(call)) for call in calls]
        assert sorted(answers) == sorted(routes * 16)
        # a call to another method (the gateway's access log) sends no ext_proc request: UNIMPLEMENTED
        export = channel.unary_unary(
            "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
            request_serializer=bytes,
            response_deserializer=bytes,
        )
        with pytest.raises(grpc.RpcError) as failed:
            export(b"\x0a\x00")
        assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def _served(session: aiohttp.ClientSession, urls: list[str]) -> list[float]:
    counts = []
    for url in urls:
        async with session.get(f"{url}/metrics") as response:
            counts.append(sum(float(v) for v in SUCCESS.findall(await response.text())))
    return counts


async def test_behind_envoy_in_every_floor_mode(binary, tmp_path):
    """Requests all succeed through Envoy and the native floor, and land only where the floor routes them: two of
    the three servers (Envoy's fail-open route would use the third)."""
    servers = 3
    stack = LocalStack(
        StackConfig(
            model_servers=servers,
            base_port=free_port_block(servers),
            workdir=tmp_path,
            kv_events_port=0,
            modelserver_args=["--sim-zero-delay", "--disable-log-stats"],
        )
    )
    pool = [u.removeprefix("http://") for u in stack.model_server_urls]
    opened = []
    small = {"model": "sim-llama-8b", "prompt": "hello", "max_tokens": 1}
    large = {**small, "user": "u" * 100_000}  # one body over a 16 KiB frame, 2.4 MB over 24 of them
    try:
        stack.start_model_servers()
        await asyncio.gather(*(stack._wait_http("modelserver", f"{u}/health", 60) for u in stack.model_server_urls))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as session:
            for index, (mode, body_mode, response_mode) in enumerate(overhead.FLOOR_MODES):
                url, _ = await overhead._start_floor(
                    stack,
                    body_mode,
                    response_mode,
                    f"native-{index}",
                    opened,
                    functools.partial(floor_native.command, binary),
                    pool[:2],
                )
                before = await _served(session, stack.model_server_urls)

                async def post(body, url=url):
                    async with session.post(url, json=body) as response:
                        assert response.status == 200, await response.text()
                        return await response.json()

                answers = await asyncio.gather(*(post(small) for _ in range(32)))  # 32 at once
                answers += [await post(large) for _ in range(24)]
                assert all(a["choices"][0]["text"] for a in answers), mode
                after = await _served(session, stack.model_server_urls)
                spread = [a - b for a, b in zip(after, before, strict=True)]
                assert spread[2] == 0 and spread[0] > 10 and spread[1] > 10 and sum(spread) == 56, (mode, spread)
                # all of it over one connection to the processor: 2.4 MB of bodies there and back in body mode
                stats = f"http://127.0.0.1:{opened[-1].admin_port}/stats?filter=^cluster.epp.upstream_cx_total$"
                async with session.get(stats) as response:
                    assert (await response.text()).split() == ["cluster.epp.upstream_cx_total:", "1"]
    finally:
        for item in reversed(opened):
            item.stop() if isinstance(item, EnvoyProcess) else terminate(item)
        stack.stop()
