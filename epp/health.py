"""gRPC health (grpc.health.v1) for the proxy and Kubernetes probes: services "liveness", "readiness" and the
ext_proc service name. Ready once the pool is known; with leader election, only the leader reports SERVING on
readiness and ext_proc, so the gateway sends traffic to the leader alone."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

LIVENESS = "liveness"
READINESS = "readiness"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class HealthState:
    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def set(self, live: bool, ready: bool) -> None:
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set(LIVENESS, serving if live else not_serving)
        await self.servicer.set("", serving if live else not_serving)
        for service in (READINESS, EXT_PROC_SERVICE):
            await self.servicer.set(service, serving if ready else not_serving)
