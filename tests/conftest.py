"""Shared test helpers: free loopback ports (the same helpers the benchmarks use) and epp-local's port arguments;
how pytest-xdist's workers share the tests out."""

import pytest

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`: --dist loadgroup) the tests that share a module-scoped fixture (a built wheel,
    a loaded model) go to one worker, which makes it once. xdist hands such groups out first, the largest first, so
    that the longest (the wheel's, a minute) does not start last and keep one worker busy while the others idle."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures and any(defs[-1].scope == "module" for defs in fixtures.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
