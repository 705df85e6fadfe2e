"""The replica channel (epp/replicas.py): snapshots merged into the endpoints' in-flight counts, expiry of a silent
peer, restarts and replays, prefix-index deltas, bad and forged datagrams, and the channel on real UDP sockets."""

import asyncio
import math
import os
import random
import time

import pytest

from epp import replicas
from epp.datalayer.datastore import Datastore
from epp.datalayer.endpoint import EndpointSpec, PoolState
from epp.replicas import (
    ENTRIES,
    HEADER,
    HOLD_SECONDS,
    LEARNED,
    MAGIC,
    MAX_DATAGRAM_BYTES,
    OBSERVED,
    RECORDS,
    SNAPSHOT,
    MalformedDatagram,
    ReplicaChannel,
    bodies,
    decode,
    decode_load,
    encode_load,
    learned_entry,
    pack,
    parse_peers,
    record_entry,
)
from epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from epp.scheduling.types import CycleState, SchedulingRequest, SchedulingResult
from tests.epp.helpers import until

A, B, C = ("127.0.0.1", 7001), ("127.0.0.1", 7002), ("127.0.0.1", 7003)


class Wire:
    """A transport that keeps what is sent, for delivery by hand."""

    def __init__(self):
        self.sent: list[tuple[bytes, tuple[str, int]]] = []

    def sendto(self, data: bytes, address) -> None:
        self.sent.append((data, address))

    def get_write_buffer_size(self) -> int:
        return 0

    def take(self, to: tuple[str, int]) -> list[bytes]:
        taken = [d for d, a in self.sent if a == to]
        self.sent = [(d, a) for d, a in self.sent if a != to]
        return taken


def pool(n: int = 3) -> Datastore:
    datastore = Datastore([])
    datastore.apply(PoolState(endpoints=tuple(EndpointSpec(f"e{i}", "10.0.0.1", 8000 + i) for i in range(n))))
    return datastore


class Timer:
    def __init__(self, delay, callback):
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self):
        self.cancelled = True


class FakeLoop:
    def __init__(self):
        self.timers: list[Timer] = []

    def call_soon(self, callback):
        pass  # flushed by hand in these tests

    def call_later(self, delay, callback):
        self.timers.append(Timer(delay, callback))
        return self.timers[-1]

    def fire(self) -> None:
        """Run the timers due (not cancelled) as time passes."""
        timers, self.timers = self.timers, []
        for timer in timers:
            if not timer.cancelled:
                timer.callback()


def datagram(instance: int, sequence: int, *sections: tuple[int, bytes]) -> bytes:
    ((count, payload),) = pack(sections)
    return HEADER.pack(MAGIC, instance, sequence, count) + payload


def channel(me, peers, datastore=None, secret=None, prefix_index=None) -> tuple[ReplicaChannel, Wire]:
    c = ReplicaChannel(datastore or pool(), prefix_index, me[1], [p for p in peers], "127.0.0.1", secret)
    wire = Wire()
    c.connection_made(wire)
    c._loop = FakeLoop()
    c.allowed = set(peers)
    c.addresses = [p for p in peers if p != me]
    return c, wire


def deliver(wire: Wire, source, to: ReplicaChannel, to_address) -> None:
    for data in wire.take(to_address):
        to.datagram_received(data, source)


def test_a_peers_snapshot_adds_to_the_counts_and_replaces_its_previous_one():
    a, wire = channel(A, [B])
    b, _ = channel(B, [A])
    e0, e1 = a.datastore.endpoints[0], a.datastore.endpoints[1]
    e0.in_flight_requests, e0.in_flight_tokens = 2, 300
    a.load_changed()
    a._flush()
    deliver(wire, A, b, B)
    f0, f1 = b.datastore.endpoints[0], b.datastore.endpoints[1]
    f0.in_flight_requests += 1  # B's own request there
    assert (f0.in_flight_requests, f0.in_flight_tokens, f0.peer_in_flight_requests) == (3, 300, 2)
    # A's request finished and another went to e1: its next snapshot replaces the first whole
    e0.in_flight_requests, e0.in_flight_tokens, e1.in_flight_requests = 1, 0, 1
    a._flush()
    deliver(wire, A, b, B)
    assert (f0.in_flight_requests, f0.in_flight_tokens, f1.in_flight_requests) == (2, 0, 1)
    assert b.own_load() == {f0.hostport: (1, 0)}  # what B itself sends: its own request only
    assert b.received["accepted"] == 2


def test_a_lost_snapshot_heals_with_the_next_and_a_silent_peer_expires():
    a, wire = channel(A, [B])
    b, _ = channel(B, [A])
    a.datastore.endpoints[2].in_flight_requests = 4
    a._flush()
    wire.take(B)  # lost
    assert b.datastore.endpoints[2].in_flight_requests == 0
    a.heartbeat()  # a snapshot went out within HEARTBEAT_SECONDS: no heartbeat on top of it
    assert not wire.sent
    a._snapshot_at -= replicas.HEARTBEAT_SECONDS
    a.heartbeat()  # none for as long: the heartbeat resends it, changed or not
    deliver(wire, A, b, B)
    assert b.datastore.endpoints[2].in_flight_requests == 4
    b.peers[A].seen_at -= replicas.EXPIRY_SECONDS + 0.1  # A said nothing for as long
    b.heartbeat()  # A said nothing since: its load no longer counts
    assert b.datastore.endpoints[2].in_flight_requests == 0 and not b.peers


def test_peers_add_up_and_a_restarted_peers_old_load_is_gone():
    a, wire_a = channel(A, [B, C])
    c, wire_c = channel(C, [A, B])
    b, _ = channel(B, [A, C])
    a.datastore.endpoints[0].in_flight_requests = 2
    c.datastore.endpoints[0].in_flight_requests = 3
    for sender, wire, source in ((a, wire_a, A), (c, wire_c, C)):
        sender._flush()
        deliver(wire, source, b, B)
    assert b.datastore.endpoints[0].in_flight_requests == 5
    restarted, wire_r = channel(A, [B, C])  # A again, a new instance: nothing in flight, first sequence number
    restarted.heartbeat()
    deliver(wire_r, A, b, B)
    assert b.datastore.endpoints[0].in_flight_requests == 3


def test_replayed_and_reordered_datagrams_are_ignored():
    a, wire = channel(A, [B])
    b, _ = channel(B, [A])
    a.datastore.endpoints[0].in_flight_requests = 1
    a._flush()
    first = wire.take(B)
    a.datastore.endpoints[0].in_flight_requests = 0
    a._flush()
    a._loop.fire()  # a fall waits HOLD_SECONDS
    second = wire.take(B)
    for data in second + first + second:  # the newer first, then the older, then the newer again
        b.datagram_received(data, A)
    assert b.datastore.endpoints[0].in_flight_requests == 0
    assert b.received["stale"] == 2


def test_a_prompt_is_released_to_peers_when_its_prefill_is_due_not_at_the_next_decision():
    a, wire = channel(A, [B])
    b, _ = channel(B, [A])
    endpoint = a.datastore.endpoints[0]
    endpoint.in_flight_requests, endpoint.in_flight_tokens = 1, 500
    due = [time.monotonic() + 0.02]  # the director's pending prefill: the pick's recent TTFT from now

    def release() -> float:
        if due and due[0] <= time.monotonic():
            endpoint.in_flight_tokens = 0
            due.clear()
        return due[0] if due else 0.0

    a.release_prefilled = release
    a._flush()
    deliver(wire, A, b, B)
    assert b.datastore.endpoints[0].in_flight_tokens == 500
    ((timer,),) = [a._loop.timers]
    assert HOLD_SECONDS < timer.delay <= 0.02 + HOLD_SECONDS  # due, and a fall's hold: one wakeup sends it
    time.sleep(timer.delay)
    timer.callback()
    deliver(wire, A, b, B)
    assert (b.datastore.endpoints[0].in_flight_requests, b.datastore.endpoints[0].in_flight_tokens) == (1, 0)


def test_a_pick_goes_at_once_and_falls_and_deltas_ride_with_the_next_datagram():
    a, wire = channel(A, [B])
    b, _ = channel(B, [A])
    matched = []
    b.match_record = lambda *record: matched.append(record) or True
    e0, e1 = a.datastore.endpoints[0], a.datastore.endpoints[1]
    e0.in_flight_requests, e0.in_flight_tokens = 1, 500
    a._flush()
    assert len(wire.sent) == 1  # a pick: at once
    deliver(wire, A, b, B)
    e0.in_flight_tokens = 0  # its first byte came: a fall waits
    a._flush()
    a.forward_record("r-1", 0.1, "200", None)
    assert not wire.sent and [t.delay for t in a._loop.timers] == [HOLD_SECONDS]  # the fall's, before the delta's
    e1.in_flight_requests = 1  # the next pick: one datagram carries it, the fall and the delta
    a._flush()
    assert len(wire.sent) == 1 and all(t.cancelled for t in a._loop.timers)
    deliver(wire, A, b, B)
    f0, f1 = b.datastore.endpoints[0], b.datastore.endpoints[1]
    assert (f0.in_flight_requests, f0.in_flight_tokens, f1.in_flight_requests) == (1, 0, 1)
    assert matched == [("r-1", 0.1, "200", None)]
    e0.in_flight_requests = 0  # an end alone: sent when its wait is over
    a._flush()
    assert not wire.sent
    a._loop.fire()
    deliver(wire, A, b, B)
    assert f0.in_flight_requests == 0
    # sections past one datagram's room: as many datagrams as they need, each within the limit, in order
    sections = [
        (RECORDS, body) for body in bodies([record_entry(f"id-{i}" * 30, 0.1, "200", None) for i in range(900)])
    ]
    packed = pack(sections)
    assert len(packed) > 1 and all(len(payload) <= MAX_DATAGRAM_BYTES - HEADER.size for _, payload in packed)
    assert sum(count for count, _ in packed) == len(sections)


def test_an_endpoint_that_joins_later_gets_its_peer_share_at_the_next_heartbeat():
    a, wire = channel(A, [B])
    b, _ = channel(B, [A], datastore=pool(2))
    a.datastore.endpoints[2].in_flight_requests = 2
    a._flush()
    deliver(wire, A, b, B)
    b.datastore.apply(PoolState(endpoints=tuple(EndpointSpec(f"e{i}", "10.0.0.1", 8000 + i) for i in range(3))))
    b.heartbeat()
    assert b.datastore.endpoints[2].in_flight_requests == 2


def test_a_pick_recorded_by_one_replica_is_learnt_by_its_peers():
    scorers = [PrefixCacheScorer({}), PrefixCacheScorer({})]
    a, wire = channel(A, [B], prefix_index=scorers[0])
    b, _ = channel(B, [A], prefix_index=scorers[1])
    request = SchedulingRequest(request_id="r", model="m", prompt="word " * 400)
    endpoints = a.datastore.endpoints
    state = CycleState()
    assert scorers[0].score(state, request, endpoints) is None  # nobody was sent it
    scorers[0].pre_request(request, SchedulingResult(endpoints=[endpoints[1]], cycle_state=state))
    a._loop.fire()  # deltas wait HOLD_SECONDS for a datagram
    deliver(wire, A, b, B)
    scores = scorers[1].score(CycleState(), request, b.datastore.endpoints)
    assert scores == [0.0, 1.0, 0.0]
    assert scorers[1].lookups == 0  # the peer's pick is not counted as this replica's own


def test_an_access_log_record_no_request_here_matched_goes_to_the_peers():
    """The gateway sends a request's access-log record to any replica: the one that routed it learns from it."""
    a, wire = channel(A, [B])
    b, _ = channel(B, [A])
    matched = []
    b.match_record = lambda *record: matched.append(record) or True
    a.forward_record("req-1", 0.125, "200", "10.0.0.1:8001")
    a.forward_record("req-2", None, "", None)
    assert not wire.sent and not a._loop.timers  # records ride with the next datagram, the heartbeat at the latest
    a._snapshot_at -= replicas.HEARTBEAT_SECONDS
    a.heartbeat()
    deliver(wire, A, b, B)
    assert matched == [("req-1", 0.125, "200", "10.0.0.1:8001"), ("req-2", None, "", None)]
    records = [(f"id-{i}" * 20, i / 7, "503", None) for i in range(2000)]
    sent = bodies([record_entry(*r) for r in records])
    assert len(sent) > 1 and [r for body in sent for r in decode(memoryview(body), ENTRIES[RECORDS])] == records


def test_what_a_replicas_predictor_learns_its_peers_learn():
    from epp.predictor import LatencyPredictor
    from epp.predictor.features import Features

    a, wire = channel(A, [B])
    b, _ = channel(B, [A])
    b.predictor = LatencyPredictor()
    own = LatencyPredictor()
    own.observed = a.observed
    features = Features(2, 3, 0.5, 900, 1200, 600, True, 250.0, "e1")
    own.observe(features, 0.08, 0.02)
    own.observe(features, 0.09, None)
    assert not wire.sent and not a._loop.timers  # observations ride with the next datagram: here a pick's
    a.datastore.endpoints[1].in_flight_requests = 1
    a._flush()
    deliver(wire, A, b, B)
    assert b.predictor.ttft.model.count == own.ttft.model.count == 2 and b.predictor.tpot.model.count == 1
    # each side counts its CPU by part: the sender's sending, the receiver's merging and its predictor's learning
    assert a.cpu["send"] > 0 and a.cpu["receive"] == a.cpu["peer_learning"] == 0
    assert b.cpu["receive"] > 0 and b.cpu["peer_learning"] > 0 and b.cpu["send"] == 0
    cpu = {
        s.labels["part"]: s.value
        for f in b.collect()
        for s in f.samples
        if f.name == "inference_extension_replica_cpu_seconds"
    }
    assert cpu == b.cpu
    b.predictor.observed = lambda *observation: pytest.fail("a peer's observation went back out")
    bad = datagram(a.instance, a.sequence + 1, (OBSERVED, bodies([b"\0" * 10])[0]))
    b.datagram_received(bad, A)
    assert b.received["malformed"] == 1


def test_bad_input_is_counted_and_ignored():
    b, _ = channel(B, [A])
    endpoint = b.datastore.endpoints[0]
    rng = random.Random(7)
    good = datagram(5, 1, (SNAPSHOT, encode_load({endpoint.hostport: (1, 10)})))
    bad = [
        b"",
        b"x" * 10,
        good[:-3],  # truncated
        good + b"\0",  # trailing bytes
        good.replace(MAGIC, b"EPPx"),
        datagram(5, 3, (LEARNED, b"\0\1\5abc")),  # an entry cut short
        datagram(5, 4, (SNAPSHOT, b"\xff\xff")),  # 65,535 entries announced, none there
        datagram(5, 5, (SNAPSHOT, b"\0\1\2\xff\xfe" + bytes(8))),  # a hostport that is not UTF-8
        HEADER.pack(MAGIC, 5, 6, 2) + good[HEADER.size :],  # two sections announced, one there
        datagram(5, 7, (SNAPSHOT, encode_load({}))) + b"\0",  # trailing bytes after the sections
    ]
    bad += [
        datagram(5, 10 + i, (rng.choice((SNAPSHOT, LEARNED, RECORDS, OBSERVED)), os.urandom(rng.randrange(64))))
        for i in range(300)
    ]
    for data in bad:
        b.datagram_received(data, A)
    b.datagram_received(b"\0" * (MAX_DATAGRAM_BYTES + 1), A)
    b.datagram_received(good, ("10.9.9.9", 7001))  # not a peer: dropped unparsed
    assert b.received["oversized"] == 1 and b.received["unknown_peer"] == 1
    assert b.received["malformed"] >= 8
    assert endpoint.in_flight_requests == 0 or b.peers  # only a random datagram that happened to parse could count
    b.datagram_received(datagram(6, 1, (SNAPSHOT, encode_load({endpoint.hostport: (1, 10)}))), A)
    assert endpoint.in_flight_requests == 1  # the channel still works
    # a section of a kind it does not know (a newer replica's) is skipped, and the rest of the datagram counts
    b.datagram_received(datagram(6, 2, (99, b"\0\1\2"), (SNAPSHOT, encode_load({endpoint.hostport: (3, 10)}))), A)
    assert endpoint.in_flight_requests == 3


def test_with_a_shared_secret_only_signed_datagrams_count(caplog):
    a, wire = channel(A, [B], secret=b"s3cret")
    b, _ = channel(B, [A], secret=b"s3cret")
    forger, forged = channel(A, [B], secret=b"guess")
    unsigned, plain = channel(A, [B])
    for sender in (a, forger, unsigned):
        sender.datastore.endpoints[0].in_flight_requests = 1 + (sender is not a) * 10
        sender._flush()
    for w in (forged, plain):
        deliver(w, A, b, B)
    assert b.datastore.endpoints[0].in_flight_requests == 0 and b.received["bad_signature"] == 2
    deliver(wire, A, b, B)
    assert b.datastore.endpoints[0].in_flight_requests == 1
    # a replica without the secret reads a signed datagram as malformed, and its log line names the likely cause
    reader, _ = channel(B, [A])
    a.datastore.endpoints[0].in_flight_requests = 2
    a._flush()
    with caplog.at_level("WARNING", logger="epp.replicas"):
        deliver(wire, A, reader, B)
    assert reader.received["malformed"] == 1 and reader.datastore.endpoints[0].in_flight_requests == 0
    assert "--replica-secret-file on one side only" in caplog.text


def test_codecs_round_trip_and_refuse_what_does_not_fit():
    load = {f"10.0.{i // 256}.{i % 256}:8000": (i, 100 * i) for i in range(1, 6000)}
    decoded = decode_load(memoryview(encode_load(load)))
    assert len(decoded) < len(load) and min(r for r, _ in decoded.values()) > 3000  # the busiest kept
    assert all(load[h] == v for h, v in decoded.items())
    picks = [(f"10.0.0.{i}:8000", list(range(i * 1000, i * 1000 + 500))) for i in range(40)]
    sent = bodies([learned_entry(*pick) for pick in picks])
    assert len(sent) > 1 and all(len(body) <= MAX_DATAGRAM_BYTES for body in sent)
    assert [entry for body in sent for entry in decode(memoryview(body), ENTRIES[LEARNED])] == picks
    with pytest.raises(MalformedDatagram):
        decode(memoryview(sent[0][:-1]), ENTRIES[LEARNED])
    assert parse_peers("epp-replicas.ns.svc:9005, [::1]:9006,") == [("epp-replicas.ns.svc", 9005), ("::1", 9006)]
    for text in ("nohost", "host:0", "host:port", ":9005"):
        with pytest.raises(ValueError):
            parse_peers(text)


async def test_three_channels_on_udp_agree_and_each_skips_itself():
    """Real sockets: every replica is given all three addresses (itself included, as a headless Service resolves)."""
    from tests.conftest import free_ports

    ports = free_ports(3)
    peers = [("127.0.0.1", p) for p in ports]
    channels = [ReplicaChannel(pool(), None, p, peers, "127.0.0.1") for p in ports]
    for c in channels:
        await c.start()
    try:
        channels[0].datastore.endpoints[1].in_flight_requests = 2
        channels[1].datastore.endpoints[1].in_flight_requests = 1
        for c in channels:
            c.load_changed()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = [c.datastore.endpoints[1].in_flight_requests for c in channels]
            if seen == [3, 3, 3] and all(len(c.addresses) == 2 for c in channels):
                break
            await asyncio.sleep(0.01)
        assert seen == [3, 3, 3]
        assert [len(c.addresses) for c in channels] == [2, 2, 2]  # each found itself among the three
        assert all(c.received["malformed"] == c.received["unknown_peer"] == 0 for c in channels)
    finally:
        for c in channels:
            await c.stop()


def test_routing_replicas_agree_on_their_ranks_and_idle_or_silent_peers_leave_them():
    """`position` (replica-stripe-picker's stripes): every routing replica works out a different rank, all the same
    count; a peer that picks nothing (a shadow, one the gateway sends nothing) or falls silent has no stripe."""
    a, wire_a = channel(A, [B, C])
    b, wire_b = channel(B, [A, C])
    c, wire_c = channel(C, [A, B])
    assert a.position() == (0, 1)  # alone until a peer is heard
    nodes = ((a, wire_a, A), (b, wire_b, B), (c, wire_c, C))

    def exchange(picking: tuple[ReplicaChannel, ...]) -> None:
        """Those `picking` route a request (their snapshot goes out), the others send a heartbeat."""
        for sender, wire, source in nodes:
            if sender in picking:
                sender.datastore.endpoints[0].in_flight_requests += 1
                sender.load_changed()
                sender._flush()
            else:
                sender._snapshot_at = -math.inf  # a heartbeat is due
                sender.heartbeat()
            for receiver, _, address in nodes:
                if receiver is not sender:
                    deliver(wire, source, receiver, address)

    exchange(picking=(a,))  # b and c heard, but only a routes
    assert len(b.peers) == 2 and a.position() == (0, 1)
    exchange(picking=(a, b, c))
    assert sorted(n.position() for n, _, _ in nodes) == [(0, 3), (1, 3), (2, 3)]
    exchange(picking=())  # heartbeats alone keep the peers alive, not routing
    assert sorted(n.position() for n, _, _ in nodes) == [(0, 3), (1, 3), (2, 3)]
    for peer in a.peers.values():
        peer.picked_at -= replicas.ROUTING_SECONDS + 0.1
    assert len(a.peers) == 2 and a.position() == (0, 1)
    for peer in b.peers.values():
        peer.seen_at -= replicas.EXPIRY_SECONDS + 0.1
    b.heartbeat()
    assert b.position() == (0, 1)


def three_that_hear_each_other(n: int = 12) -> list[tuple[ReplicaChannel, Wire]]:
    """A, B and C over a pool of `n` endpoints, each having heard the other two (so each knows the live replicas)."""
    sides = [channel(me, [p for p in (A, B, C) if p != me], pool(n)) for me in (A, B, C)]
    for (sender, wire), me in zip(sides, (A, B, C), strict=True):
        sender.heartbeat()
        for (receiver, _), to in zip(sides, (A, B, C), strict=True):
            if to != me:
                deliver(wire, me, receiver, to)
    return sides


def test_each_page_has_one_reader_the_shares_are_even_and_a_silent_readers_share_moves_to_the_others():
    sides = three_that_hear_each_other()
    hostports = [e.hostport for e in sides[0][0].datastore.endpoints]
    readers = {h: [i for i, (c, _) in enumerate(sides) if c.owns(h)] for h in hostports}
    assert all(len(r) == 1 for r in readers.values())  # every replica agrees on one reader an endpoint
    shares = [sum(r == [i] for r in readers.values()) for i in range(3)]
    assert sorted(shares) == [4, 4, 4]  # and the pool is split evenly
    (a, _), (b, _), _ = sides
    for survivor in (a, b):  # C falls silent: once it expires, A and B read its share between them
        survivor.peers[C].seen_at -= 2 * replicas.EXPIRY_SECONDS
        survivor.heartbeat()
    assert all(a.owns(h) != b.owns(h) for h in hostports)
    assert sum(a.owns(h) for h in hostports) == 6
    sides = three_that_hear_each_other(8)  # 8 over 3: shares of 3, 3 and 2
    assert sorted(sum(c.owns(e.hostport) for e in c.datastore.endpoints) for c, _ in sides) == [2, 3, 3]
    for c, _ in sides:  # two servers leave: at the next heartbeat the six left are dealt again, 2 each
        c.datastore.apply(PoolState(endpoints=tuple(e.spec for e in c.datastore.endpoints[:6])))
        c.heartbeat()
    assert sorted(sum(c.owns(e.hostport) for e in c.datastore.endpoints) for c, _ in sides) == [2, 2, 2]


def test_a_page_read_for_the_peers_stands_for_their_scrape_until_it_is_late():
    from epp.datalayer.scraper import Scraper
    from protocol.metrics import EndpointMetrics

    (a, wire), (b, _), _ = three_that_hear_each_other()
    wire.sent.clear()
    scraper = Scraper(interval=0.05)
    a.apply_page = b.apply_page = scraper.apply_page
    mine = next(e for e in a.datastore.endpoints if a.owns(e.hostport))
    theirs = next(e for e in a.datastore.endpoints if not a.owns(e.hostport))
    read_at = time.monotonic()
    mine.metrics = EndpointMetrics(3, 5, 0.4, 16, 2000, 4, frozenset({"sql"}), frozenset({"chat"}), read_at)
    mine.record_inter_token_totals(read_at, 12.5, 900.0)
    a.page_read(mine)
    a.page_read(theirs)  # another replica reads that one: nothing to send
    assert not wire.sent and [t.delay for t in a._loop.timers] == [replicas.PAGE_HOLD_SECONDS]
    a._loop.fire()  # the tick's pages go together
    copy = b.datastore.by_hostport(mine.hostport)
    copy.in_flight_requests = 2
    deliver(wire, A, b, B)
    m = copy.metrics
    assert (m.waiting, m.running, m.kv_usage, m.block_size, m.num_gpu_blocks, m.max_lora) == (3, 5, 0.4, 16, 2000, 4)
    assert (m.running_adapters, m.waiting_adapters) == ({"sql"}, {"chat"}) and copy.adapter_loaded("sql")
    assert abs(m.scraped_at - read_at) < 0.05 and not copy.stale and copy.in_flight_at_scrape == 2
    assert [t[1:] for t in copy.inter_token_totals] == [(12.5, 900.0)] and copy.batch_slots == 5
    assert b.peer_page(copy, 0.1)  # B's scraper skips it
    assert a.pages == {"sent": 1, "received": 0} and b.pages == {"sent": 0, "received": 1}
    # a quiet replica still reads its share fast while a peer routes: the peer reads those pages from it
    quiet = Scraper(interval=0.05, idle_interval=0.25)
    copy.in_flight_requests = 0
    assert quiet.quiet(copy) and not b.peers_busy()
    b.peers[A].load = {copy.hostport: (1, 100)}
    quiet.peers_busy = b.peers_busy
    assert not quiet.quiet(copy)
    assert not b.peer_page(next(e for e in b.datastore.endpoints if b.owns(e.hostport)), 0.1)  # B reads its own
    b._page_at[mine.hostport] -= 0.2  # A's next page is late: B reads it itself
    assert not b.peer_page(copy, 0.1)
    bad = datagram(a.instance, a.sequence + 1, (replicas.PAGES, bodies([b"\x01x" + b"\xff" * 48 + b"\0\0"])[0]))
    b.datagram_received(bad, A)  # KV usage NaN
    assert b.received["malformed"] == 1


async def test_the_scraper_skips_what_a_peers_page_stands_for_and_reads_the_rest_on_common_ticks():
    from epp.datalayer.scraper import Scraper

    datastore = pool(2)
    fresh, late = datastore.endpoints
    scraper = Scraper(interval=0.02)
    read: list[tuple[str, float]] = []

    async def scrape_once(endpoint) -> bool:
        read.append((endpoint.name, time.monotonic()))
        return True

    scraper.scrape_once = scrape_once
    scraper.peer_page = lambda endpoint, within: endpoint is fresh and within == 2 * scraper.interval
    for endpoint in (fresh, late):
        scraper.start(endpoint)
    await asyncio.sleep(0.2)
    await scraper.close()
    assert {name for name, _ in read} == {late.name} and len(read) >= 3
    # read on the ticks of the interval's multiples (but for the loop's lateness on a busy host)
    on_tick = [at % scraper.interval < scraper.interval / 4 for _, at in read[1:]]
    assert sum(on_tick) >= len(on_tick) / 2


# -- turns (--replica-turns) -----------------------------------------------------------------------------------------
async def pick_least_loaded(c: ReplicaChannel) -> str:
    """A pick as the director makes one: its turn first (when it must wait for one), then the endpoint with the
    fewest in-flight requests as this replica sees them (the first on ties), counted and told to the channel."""
    turn = c.turn()
    if turn is not None:
        await turn
    endpoint = min(c.datastore.endpoints, key=lambda e: e.in_flight_requests)
    endpoint.in_flight_requests += 1
    c.load_changed()
    return endpoint.hostport


@pytest.fixture
def patient_turns(monkeypatch):
    """Turns that neither time out nor are taken back while a test looks at them (a busy test machine may take
    longer than TURN_WAIT_SECONDS to answer)."""
    monkeypatch.setattr(replicas, "TURN_WAIT_SECONDS", 5.0)
    monkeypatch.setattr(replicas, "TURN_HOLD_SECONDS", 5.0)


def routing(channels: list[ReplicaChannel]) -> None:
    """Each replica's peers as if each had picked a moment ago: a pool in use, whose replicas take turns
    (TURN_ROUTING_SECONDS)."""
    for c in channels:
        for peer in c.peers.values():
            peer.picked_at = time.monotonic()


async def started_channels(n: int, turns: bool, in_use: bool = True) -> list[ReplicaChannel]:
    from tests.conftest import free_ports

    peers = [("127.0.0.1", p) for p in free_ports(n)]
    channels = [ReplicaChannel(pool(), None, port, peers, "127.0.0.1") for _, port in peers]
    for c in channels:
        c.turns = turns
        await c.start()
    deadline = time.monotonic() + 10
    while not all(len(c.peers) == n - 1 for c in channels):  # each has heard the others' first snapshots
        assert time.monotonic() < deadline, "the replicas did not hear each other"
        for c in channels:
            c.heartbeat()
        await asyncio.sleep(0.01)
    if in_use:
        routing(channels)
    return channels


@pytest.mark.parametrize("turns", [True, False])
async def test_replicas_picking_at_once_in_turns_place_their_picks_as_one_epp_would(turns, patient_turns):
    """Three replicas of a pool in use each pick at the same moment on an idle pool. In turns, each pick sees those
    granted before it and the three take three endpoints, as one EPP's three picks would; without turns all three
    take the first."""
    channels = await started_channels(3, turns)
    try:
        picked = await asyncio.gather(*(pick_least_loaded(c) for c in channels))
        if turns:
            assert sorted(picked) == sorted(e.hostport for e in channels[0].datastore.endpoints)
            sequencer = min(channels, key=lambda c: c.instance)
            others = [c for c in channels if c is not sequencer]
            assert sequencer.turn_counts["free"] == 1 and sequencer.turn_counts["given"] == 2
            assert all(c.turn_counts["granted"] == 1 and c.turn_counts["timed_out"] == 0 for c in others)
        else:
            assert picked == [channels[0].datastore.endpoints[0].hostport] * 3
            assert all(c.turn() is None for c in channels)
        assert all(c.received["malformed"] == 0 for c in channels)
    finally:
        for c in channels:
            await c.stop()


async def test_a_replica_whose_peers_have_not_picked_routes_alone_until_one_does(patient_turns):
    """Peers that stand by (or a new pool's, before its first picks) grant turns nobody needs: a replica asks for
    none until a peer picks, so the pool's first picks at once go as without turns, and the next ones in turns."""
    channels = await started_channels(3, True, in_use=False)
    try:
        first = await asyncio.gather(*(pick_least_loaded(c) for c in channels))
        assert first == [channels[0].datastore.endpoints[0].hostport] * 3
        sequencer = min(channels, key=lambda c: c.instance)
        others = [c for c in channels if c is not sequencer]
        assert all(c.turn_counts["alone"] == 1 and c.turn_counts["granted"] == 0 for c in others)
        for c in channels:  # those requests end
            c.datastore.endpoints[0].in_flight_requests = 0
            c.load_changed()
        await until(lambda: all(not p.load for c in channels for p in c.peers.values()))
        second = await asyncio.gather(*(pick_least_loaded(c) for c in channels))  # each peer picked: in turns
        assert sorted(second) == sorted(e.hostport for e in channels[0].datastore.endpoints)
        assert all(c.turn_counts["granted"] == 1 for c in others)
    finally:
        for c in channels:
            await c.stop()


async def test_picks_waiting_for_a_turn_share_it_and_the_sequencer_queues_its_own_behind_a_peers(patient_turns):
    channels = await started_channels(2, True)
    sequencer, other = sorted(channels, key=lambda c: c.instance)
    try:
        # two picks on the other replica at once: one turn asked, both made in it, one after the other
        first, second = await asyncio.gather(pick_least_loaded(other), pick_least_loaded(other))
        assert first != second and other.turn_counts["granted"] == 1
        await until(lambda: sequencer._holder is None)
        assert sum(e.in_flight_requests for e in sequencer.datastore.endpoints) == 2  # the turn's done carried them
        # while a peer holds the turn, the sequencer's own pick waits for it, and then sees the peer's
        other._transport.pause_reading()  # its grant waits in its socket until the sequencer's pick is queued
        turn = other.turn()
        await until(lambda: sequencer._holder is not None)
        mine = asyncio.ensure_future(pick_least_loaded(sequencer))
        await asyncio.sleep(0)
        assert not mine.done() and sequencer.turn_counts["queued"] == 1
        other._transport.resume_reading()
        await turn
        other.datastore.endpoints[2].in_flight_requests += 1  # the peer's pick in its turn: e2, the only idle one
        other.load_changed()
        assert await mine == sequencer.datastore.endpoints[0].hostport  # it saw e2 taken: all at 1, the first
    finally:
        for c in channels:
            await c.stop()


async def test_a_turn_not_granted_is_taken_after_the_wait_and_a_late_grant_is_given_back():
    """The sequencer is gone (its datagrams stop, it has not expired yet): a replica's picks wait TURN_WAIT_SECONDS
    at most, then go ahead; and a sequencer whose replica gives no turn back moves on after TURN_HOLD_SECONDS."""
    channels = await started_channels(2, True)
    sequencer, other = sorted(channels, key=lambda c: c.instance)
    try:
        sequencer._transport.pause_reading()  # hears nothing: grants nothing
        started = time.monotonic()
        assert await pick_least_loaded(other)
        assert replicas.TURN_WAIT_SECONDS <= time.monotonic() - started < 1.0
        assert other.turn_counts["timed_out"] == 1
        # the next picks do not wait for it again until it is heard: they go at once
        started = time.monotonic()
        assert await pick_least_loaded(other) and time.monotonic() - started < replicas.TURN_WAIT_SECONDS
        assert other.turn_counts["free"] == 1
        sequencer._transport.resume_reading()
        await until(lambda: sequencer.turn_counts["given"] == 1)  # the ask it read late: granted, given back
        sequencer.heartbeat()  # heard again: it sequences again
        await until(lambda: other._sequencer() is not None)
        await until(lambda: sequencer._holder is None)
        # a replica that asked and never says it is done: the sequencer takes the turn back after the hold
        sequencer._asked(("127.0.0.1", 9), 1)
        assert sequencer._holder is not None
        await until(lambda: sequencer._holder is None, timeout=1.0)
        assert sequencer.turn() is None  # free again
    finally:
        for c in channels:
            await c.stop()


def test_only_peers_that_offer_to_take_turns_sequence():
    """A peer with --no-replica-turns, or of a version before turns, never offers: a replica does not wait for turns
    it would never grant, even with the lowest instance id."""
    a, wire = channel(A, [B])
    a.turns = True
    a.instance = 1 << 40
    a.datagram_received(datagram(1, 1, (SNAPSHOT, encode_load({}))), B)  # a lower id, no offer
    assert a.turn() is None and a.turn_counts["free"] == 1
    a.datagram_received(datagram(1, 2, (SNAPSHOT, encode_load({})), (replicas.TURN, replicas._TURN.pack(0, 0))), B)
    a.peers[B].picked_at = time.monotonic()  # B routes too
    a._loop = asyncio.new_event_loop()
    try:
        assert isinstance(a.turn(), asyncio.Future)  # B sequences now: a turn is asked of it
        ((sent, to),) = wire.sent
        assert to == B and replicas._TURN.pack(replicas.ASK, 1) in sent
    finally:
        a._loop.close()
    # this replica's own snapshots offer to take turns only when it does
    offer = replicas.SECTION.pack(replicas.TURN, replicas._TURN.size) + replicas._TURN.pack(0, 0)
    a._send_all({}, heartbeat=True)
    assert wire.sent[-1][0].endswith(offer)
    a.turns = False
    a._send_all({}, heartbeat=True)
    assert offer not in wire.sent[-1][0]


def test_turn_sections_that_do_not_parse_are_malformed_and_asks_beyond_the_bound_are_dropped():
    a, _ = channel(A, [B])
    a.turns = True
    a.datagram_received(datagram(1, 1, (replicas.TURN, b"\x01")), B)
    a.datagram_received(datagram(1, 2, (replicas.RELAYED, b"\x00\x00")), B)
    assert a.received["malformed"] == 2
    a._holder = "held"  # asks queue behind a turn held
    for sequence in range(3, 13):  # a peer that asks again and again keeps one place, with its newest ask
        a.datagram_received(datagram(1, sequence, (replicas.TURN, replicas._TURN.pack(replicas.ASK, sequence))), B)
    assert list(a._asks) == [(B, 12)]
    for port in range(10_000, 10_000 + 2 * replicas.MAX_PEERS):  # and no more places than peers
        a._asked(("127.0.0.1", port), 1)
    assert len(a._asks) == replicas.MAX_PEERS


async def test_a_request_cancelled_while_waiting_for_the_turn_leaves_the_others_waiting_and_routed():
    """The director's side: picks wait for the turn without an answer to the proxy; one whose stream ends meanwhile
    is dropped alone, and the others are routed once the turn comes."""
    import json

    from tests.epp.helpers import ParsedStream
    from tests.epp.test_server import BASE_HEADERS, body_message, headers_message, make_picker

    director = make_picker()
    loop = asyncio.get_running_loop()
    waiters: list[asyncio.Future] = []
    director.turn = lambda: waiters.append(loop.create_future()) or waiters[-1]
    replies: list = []
    streams = []
    for _ in range(3):
        stream = ParsedStream(director, replies.append)
        assert stream.handle(headers_message(BASE_HEADERS)) == []
        (wait,) = stream.handle(body_message(json.dumps({"model": "m", "prompt": "hello"}).encode()))
        assert wait.HasField("override_message_timeout")  # no decision yet: the proxy waits for it
        streams.append(stream)
    await asyncio.sleep(0)
    assert len(waiters) == 3 and replies == []
    streams[0].finish()  # its client went away while it waited
    await asyncio.sleep(0)
    replicas._wake(waiters)
    await until(lambda: len(replies) == 2)
    assert all(answers[0].HasField("request_headers") for answers in replies)
    assert sum(e.in_flight_requests for e in director.datastore.endpoints) == 2
    # the two picks' waits for their turn (the one cancelled made none)
    assert director.metrics.registry.get_sample_value("inference_extension_replica_turn_wait_seconds_count") == 2


def test_a_grant_or_a_relayed_load_counts_only_from_the_sequencer_asked():
    a, _ = channel(A, [B, C])
    a.turns = True
    a.instance = 1 << 40
    loop = a._loop = asyncio.new_event_loop()
    try:
        for sequence, peer in enumerate((B, C), start=1):  # both offer; B has the lower id
            offer = (replicas.TURN, replicas._TURN.pack(replicas.OFFER, 0))
            a.datagram_received(datagram(sequence, 1, (SNAPSHOT, encode_load({})), offer), peer)
            a.peers[peer].picked_at = time.monotonic()  # and routes
        turn = a.turn()
        assert a._turn_from == B
        c_load = {a.datastore.endpoints[0].hostport: (5, 500)}
        forged = (replicas.RELAYED, replicas._INSTANCE.pack(2) + encode_load(c_load))
        a.datagram_received(datagram(2, 2, forged, (replicas.TURN, replicas._TURN.pack(replicas.GRANT, 1))), C)
        assert not turn.done() and a.datastore.endpoints[0].in_flight_requests == 0  # C is not who was asked
        relayed = (replicas.RELAYED, replicas._INSTANCE.pack(2) + encode_load(c_load))
        a.datagram_received(datagram(1, 2, relayed, (replicas.TURN, replicas._TURN.pack(replicas.GRANT, 1))), B)
        assert turn.done() and a.datastore.endpoints[0].in_flight_requests == 5  # C's load as the sequencer knew it
    finally:
        loop.close()
