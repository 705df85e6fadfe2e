"""A request the processor answers without routing it (no destination in the envoy.lb metadata): FailClose answers
503 in the OpenAI error shape and no model server sees it; FailOpen balances it over the pool (real Envoy, the
pool's failureMode as harness.envoy renders it)."""

import json

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from harness.bench.ports import free_ports
from harness.envoy import EnvoyProcess, render_bootstrap


class Unrouting(pb_grpc.ExternalProcessorServicer):
    """Lets every message through unchanged and never names a destination."""

    async def Process(self, request_iterator, context):
        async for request in request_iterator:
            kind = request.WhichOneof("request")
            if kind in ("request_headers", "response_headers"):
                yield pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
            elif kind in ("request_trailers", "response_trailers"):
                yield pb.ProcessingResponse(**{kind: pb.TrailersResponse()})


@pytest.mark.parametrize("fail_open", [False, True])
async def test_a_request_the_epp_did_not_route(tmp_path, fail_open):
    hits = []

    async def echo(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    server_port, processor_port, listener, admin = free_ports(4)
    await web.TCPSite(runner, "127.0.0.1", server_port).start()
    processor = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Unrouting(), processor)
    processor.add_insecure_port(f"127.0.0.1:{processor_port}")
    await processor.start()
    config = tmp_path / "envoy.yaml"
    config.write_text(
        render_bootstrap(
            epp_host="127.0.0.1",
            epp_port=processor_port,
            fallback_endpoints=[f"127.0.0.1:{server_port}"],
            listener_port=listener,
            admin_port=admin,
            fail_open=fail_open,
        )
    )
    envoy = EnvoyProcess(config, admin, tmp_path / "envoy.log")
    envoy.start()
    try:
        await envoy.wait_ready()
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{listener}/v1/models") as r:
            status, body = r.status, await r.read()
        if fail_open:
            assert status == 200 and hits == ["/v1/models"], (status, body)
        else:
            assert status == 503 and hits == [], (status, body)
            error = json.loads(body)["error"]
            assert "the endpoint picker did not route it" in error["message"], error
    finally:
        envoy.stop()
        await processor.stop(None)
        await runner.cleanup()
