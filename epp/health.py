"""gRPC health (grpc.health.v1) for the proxy and Kubernetes probes: services "liveness", "readiness" and the
ext_proc service name. Ready once the pool is known (the pool file read, or every Kubernetes resource listed) and,
with leader election, while this replica serves (epp/leader.py: the leader, or a leader cut off from the API
that has seen no other holder), so the gateway sends traffic to that replica alone. `epp/cli.py` sets the status
on every change of either."""

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
