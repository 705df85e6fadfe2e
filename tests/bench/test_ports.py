"""Free ports come from below the ephemeral range, so no outgoing connection can take one before its server binds."""

import socket
from collections import deque

from harness.bench import ports
from harness.bench.ports import _ephemeral_low, free_port_block, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(12)
    assert len(set(ports)) == 12
    assert all(p < _ephemeral_low() for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_block_is_consecutive_and_skips_a_taken_port():
    base = free_port_block(4)
    assert base + 4 <= _ephemeral_low()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        for _ in range(20):  # never a block that holds the taken port
            other = free_port_block(4)
            assert not other <= base + 2 < other + 4


def test_ports_handed_out_but_not_yet_bound_are_not_handed_out_again(monkeypatch):
    # the blocks earlier tests of this worker handed out (256-port page servers among them) could leave no room
    monkeypatch.setattr(ports, "_handed_out", deque(maxlen=ports._handed_out.maxlen))
    block = range(base := free_port_block(256), base + 256)  # a page server about to bind 256 ports
    picks = iter([block.start + 7, block.stop - 3, block.stop + 1000])  # random first lands inside the block
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(picks))
    (port,) = free_ports(1)  # an EPP's port, chosen before that server binds
    assert port == block.stop + 1000


def test_each_pytest_xdist_worker_chooses_from_its_own_share(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    shares = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        low, high = ports._share()
        assert all(low <= p < high for p in free_ports(8)) and low <= free_port_block(4) <= high - 4
        shares.append(range(low, high))
    assert shares[0].start == ports.LOWEST_PORT and shares[0].stop <= shares[1].start
    assert shares[1].stop <= shares[2].start and shares[2].stop <= _ephemeral_low()
