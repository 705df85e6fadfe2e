"""Shared test helpers: free loopback ports (the same helpers the benchmarks use) and epp-local's port arguments."""

from harness.bench.ports import free_port_block, free_ports

__all__ = ["epp_local_ports", "free_port_block", "free_ports"]


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
