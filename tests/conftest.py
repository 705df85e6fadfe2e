"""Shared test helpers: free loopback ports (the same helpers the benchmarks use), epp-local's port arguments, a metric
read off a Prometheus page, an HTTP/1.1 response read off a raw connection, a large KV-event batch; Hypothesis without
timing checks."""

import asyncio
import re

from hypothesis import HealthCheck, settings

from harness.bench.ports import free_port_block, free_ports
from protocol.kv_events import BlockStored, KVEventBatch

# Hypothesis' timing checks (200 ms an example, inputs generated within a second) measure the machine, not the code:
# under `make test` the property tests share two cores with the servers other workers start, and one draw that
# waited a second failed a run.
settings.register_profile("shared-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-machine")

__all__ = ["epp_local_ports", "flood_batch", "free_port_block", "free_ports", "metric_value", "read_response"]


def metric_value(page: str, name: str) -> float:
    """The value of the unlabelled sample `name` on a Prometheus text page; 0 when the page has none."""
    match = re.search(rf"^{name} (\S+)$", page, re.M)
    return float(match.group(1)) if match else 0.0


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One response off a raw connection: its status line, its headers (names in lower case) and its body
    (Content-Length framed)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines if line)}
    return status.encode(), headers, await reader.readexactly(int(headers["content-length"]))


def flood_batch(blocks: int) -> KVEventBatch:
    """A batch storing `blocks` blocks (hashes 0..blocks-1), the same each time it is sent; its parent makes it one
    that no hash check applies to, so a subscriber applies every copy. 24,000 blocks encode to ~2 MB."""
    return KVEventBatch(
        0.0, [BlockStored(list(range(blocks)), 1, [100_000 + t for t in range(16)] * blocks, 16, None, "GPU")]
    )


def epp_local_ports() -> tuple[list[str], list[int]]:
    """epp-local's arguments for 2 model servers on free ports, and the TCP ports it then listens on."""
    base = free_port_block(2)
    grpc, health, metrics, listener, admin, kv_events = free_ports(6)
    args = [
        "--model-servers",
        "2",
        "--base-port",
        str(base),
        "--grpc-port",
        str(grpc),
        "--grpc-health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        "--listener-port",
        str(listener),
        "--admin-port",
        str(admin),
        "--kv-events-port",
        str(kv_events),
    ]
    # Not the KV-event port: the servers' connections to it that a killed EPP leaves in TIME_WAIT make a plain bind
    # fail for a minute, and ZMQ binds with SO_REUSEADDR, so the next EPP gets it anyway.
    return args, [base, base + 1, grpc, health, metrics, listener, admin]
