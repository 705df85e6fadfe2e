"""Shared test helpers: free loopback ports (the same helpers the benchmarks use)."""

from epp.bench.ports import free_port_block, free_ports

__all__ = ["free_port_block", "free_ports"]
