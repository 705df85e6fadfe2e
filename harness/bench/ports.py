"""Free loopback ports for processes the benchmarks and tests start.

The ports come from below the kernel's ephemeral range (`ip_local_port_range`), not from bind(("", 0)): a port the
kernel handed out that way and we released can be taken as the local port of any outgoing connection (a scraper, a
client, Envoy's upstream pool) before the server we meant it for binds it, which failed a model server's start with
EADDRINUSE in a test run while other processes were busy connecting. connect() never picks a port below that range.

Under pytest-xdist each worker chooses from its own share of that range: a worker cannot know the ports another
handed out and has not bound yet. The processes a test starts inherit the worker's environment, so its share.
"""

from __future__ import annotations

import os
import random
import socket
from collections import deque

LOWEST_PORT = 10_000  # above the well-known and registered ports services on a developer's machine tend to hold
MAX_TRIES = 1_000
# Ports handed out here are free but not yet bound: the next call must not hand them out again (an EPP's ports inside
# the block its page server was about to bind failed `epp-bench idle`'s start). The recent blocks are enough: by then
# the earlier ones are bound or given up.
_handed_out: deque[range] = deque(maxlen=64)


def _handed_out_overlaps(ports: range) -> bool:
    return any(ports.start < r.stop and r.start < ports.stop for r in _handed_out)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; other systems start theirs higher (49152)


def _share() -> tuple[int, int]:
    """The lowest and one past the highest port this process chooses from."""
    low, high = LOWEST_PORT, _ephemeral_low()
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and workers.isdigit():  # gw0, gw1, ...
        width = (high - low) // int(workers)
        low += int(worker[2:]) * width
        high = low + width
    return low, high


def _bindable(ports: range, held: list[socket.socket]) -> bool:
    """Bind every port of `ports` (appending the sockets to `held`); False, with none of them held, if one is taken."""
    start = len(held)
    try:
        for port in ports:
            s = socket.socket()
            held.append(s)
            s.bind(("", port))  # every address: a model server's KV-event publisher binds tcp://*
        return True
    except OSError:
        for s in held[start:]:
            s.close()
        del held[start:]
        return False


def _blocks(count: int, size: int) -> list[int]:
    """`count` distinct starts of `size` consecutive free ports, the blocks held open together while chosen."""
    low, high = _share()
    high -= size
    held: list[socket.socket] = []
    starts: list[int] = []
    try:
        for _ in range(MAX_TRIES):
            if len(starts) == count:
                _handed_out.extend(range(start, start + size) for start in starts)
                return starts
            if high <= low:  # no room in our share below the ephemeral range: let the kernel choose
                s = socket.socket()
                held.append(s)
                s.bind(("", 0))
                base = s.getsockname()[1]
                if size == 1 or _bindable(range(base + 1, base + size), held):
                    starts.append(base)
                continue
            base = random.randrange(low, high)
            if not _handed_out_overlaps(range(base, base + size)) and _bindable(range(base, base + size), held):
                starts.append(base)
        raise RuntimeError(f"no {count} free blocks of {size} ports")
    finally:
        for s in held:
            s.close()


def free_ports(count: int) -> list[int]:
    """Distinct TCP ports free on every address."""
    return _blocks(count, 1)


def free_port_block(count: int) -> int:
    """The first of `count` consecutive free ports (model-server replicas listen on port .. port+count-1)."""
    return _blocks(1, count)[0]
