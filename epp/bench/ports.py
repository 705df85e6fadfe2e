"""Free loopback ports for processes the benchmarks and tests start."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (held open together so they differ, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_block(count: int) -> int:
    """The first of `count` consecutive free ports (model-server replicas listen on port .. port+count-1)."""
    for _ in range(200):
        (base,) = free_ports(1)
        if base + count >= 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no block of free ports")
