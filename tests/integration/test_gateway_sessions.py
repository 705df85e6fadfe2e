"""Session affinity to EPP replicas (render_bootstrap's epp_session_headers, real Envoy): a request's session header
rides in its ext_proc stream's gRPC metadata, every request of a session reaches one replica, requests without a
session spread over all of them, and a session whose replica is gone moves to another (FailOpen, so each request
also reaches the pool)."""

import asyncio
import collections

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp.health import EXT_PROC_SERVICE
from harness.bench.ports import free_ports
from harness.envoy import SESSION_HEADERS, EnvoyProcess, render_bootstrap


class Recording(pb_grpc.ExternalProcessorServicer):
    """Lets every message through unchanged and records each stream's session metadata."""

    def __init__(self, name: str, seen: list[tuple[str, str | None]]):
        self.name, self.seen = name, seen

    async def Process(self, request_iterator, context):
        metadata = dict(context.invocation_metadata())
        self.seen.append((self.name, next((metadata[h] for h in SESSION_HEADERS if h in metadata), None)))
        async for request in request_iterator:
            kind = request.WhichOneof("request")
            if kind in ("request_headers", "response_headers"):
                yield pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
            elif kind in ("request_trailers", "response_trailers"):
                yield pb.ProcessingResponse(**{kind: pb.TrailersResponse()})


async def test_a_sessions_requests_reach_one_epp_replica(tmp_path):
    app = web.Application()

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_get("/{tail:.*}", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    server_port, first_port, second_port, listener, admin = free_ports(5)
    await web.TCPSite(runner, "127.0.0.1", server_port).start()
    seen: list[tuple[str, str | None]] = []
    processors = {}
    for name, port in (("first", first_port), ("second", second_port)):
        processors[name] = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(Recording(name, seen), processors[name])
        checked = health.HealthServicer()
        checked.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checked, processors[name])
        processors[name].add_insecure_port(f"127.0.0.1:{port}")
        await processors[name].start()
    config = tmp_path / "envoy.yaml"
    config.write_text(
        render_bootstrap(
            epp_host="127.0.0.1",
            epp_port=first_port,
            more_epp_endpoints=[f"127.0.0.1:{second_port}"],
            epp_health_ports=[first_port, second_port],
            fallback_endpoints=[f"127.0.0.1:{server_port}"],
            listener_port=listener,
            admin_port=admin,
            fail_open=True,
            epp_session_headers=SESSION_HEADERS,
        )
    )
    envoy = EnvoyProcess(config, admin, tmp_path / "envoy.log")
    envoy.start()
    url = f"http://127.0.0.1:{listener}/v1/models"

    async def send(session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        async with session.get(url, headers=headers) as r:
            assert r.status == 200, await r.text()

    try:
        await envoy.wait_ready()
        async with aiohttp.ClientSession() as session:
            # each session header the agents send, three requests a session, interleaved
            sessions = [(SESSION_HEADERS[i % len(SESSION_HEADERS)], f"session-{i}") for i in range(30)]
            for _ in range(3):
                await asyncio.gather(*(send(session, {h: v}) for h, v in sessions))
            await asyncio.gather(*(send(session, {}) for _ in range(40)))
            by_session = collections.defaultdict(set)
            for name, value in seen:
                by_session[value].add(name)
            assert all(len(by_session[v]) == 1 for _, v in sessions), by_session
            homes = collections.Counter(next(iter(by_session[v])) for _, v in sessions)
            assert set(homes) == {"first", "second"}, homes  # sessions hash over both replicas
            assert by_session[None] == {"first", "second"}  # requests without a session go to either

            # the first replica goes away: once its health check failed, its sessions' requests start on the other
            await processors["first"].stop(None)
            for _ in range(50):
                async with session.get(f"http://127.0.0.1:{admin}/clusters") as r:
                    if f"epp::127.0.0.1:{first_port}::health_flags::/failed_active_hc" in await r.text():
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("Envoy's health check did not find the replica gone")
            moved = [(h, v) for h, v in sessions if by_session[v] == {"first"}]
            seen.clear()
            await asyncio.gather(*(send(session, {h: v}) for h, v in moved))
            assert {name for name, _ in seen} == {"second"} and len(seen) == len(moved), seen
    finally:
        envoy.stop()
        for processor in processors.values():
            await processor.stop(None)
        await runner.cleanup()
