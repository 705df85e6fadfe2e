"""The EPP's KV event subscriber and index against the model server's real publisher and block manager."""

import asyncio
import itertools
import resource
import sys
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.datalayer import kv_events
from epp.datalayer.endpoint import Endpoint, EndpointSpec
from epp.datalayer.kv_events import (
    EVICTION_RUN,
    MAX_MESSAGE_BYTES,
    IndexedBatch,
    KVBlockIndex,
    KVEventSubscriber,
)
from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.kv_events import ZmqEventPublisher
from modelserver.engine.request import SamplingParams
from modelserver.engine.sim import SimExecutor, SimTiming
from protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    block_hasher,
    external_block_hash,
    request_block_hashes,
)
from tests.conftest import flood_batch
from tests.epp.helpers import until


def receive(subscriber: KVEventSubscriber, endpoint: str, seq: int, batch: KVEventBatch) -> None:
    """The batch as if it came on the endpoint's live socket (model m), decoded as the subscriber decodes it."""
    message = msgspec.msgpack.encode(batch)
    subscriber._receive(endpoint, "m", seq, msgspec.msgpack.decode(message, type=IndexedBatch), len(message))


def in_pool(subscriber: KVEventSubscriber, *hostports: str) -> None:
    """The pool's servers, as discovery starts them: the subscriber indexes only these."""
    for hostport in hostports:
        address, _, port = hostport.rpartition(":")
        subscriber.start(Endpoint(EndpointSpec(hostport, address, int(port))))


async def test_the_index_follows_each_server_s_cache_through_evictions():
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, "tcp://127.0.0.1:*")
    in_pool(subscriber, "127.0.0.1:8000", "127.0.0.1:8001")
    # servers connect to the EPP's bound socket (no '*' in their endpoint), as llm-d points vLLM at its EPP
    config = KVEventsConfig.from_json(f'{{"enable_kv_cache_events": true, "endpoint": "{subscriber.endpoint}"}}')
    engines = []
    for port in (8000, 8001):
        publisher = ZmqEventPublisher(config, f"kv@127.0.0.1:{port}@m")
        cfg = EngineConfig(num_gpu_blocks=12, block_size=16)
        engine = AsyncEngine(
            cfg,
            SimExecutor(SimTiming.zero(), 16, 12, list(range(100, 164))),
            model_name="m",
            kv_events=publisher,
        )
        await engine.start()
        engines.append(engine)
    await asyncio.sleep(0.3)
    try:
        prompt = list(range(1, 50))  # 3 full blocks
        async for _ in engines[0].generate("a", prompt, SamplingParams(max_tokens=1)):
            pass
        hashes = request_block_hashes(prompt, 16)  # vLLM's hashes; unseeded as the servers in this process
        endpoints = ["127.0.0.1:8000", "127.0.0.1:8001"]
        await until(lambda: index.prefix_blocks(hashes, endpoints)["127.0.0.1:8000"] == 3)
        assert index.prefix_blocks(hashes, endpoints)["127.0.0.1:8001"] == 0

        for i in range(8):  # push that prompt's blocks out of server 0's 12-block cache
            async for _ in engines[0].generate(
                f"f{i}", [5000 + 100 * i + t for t in range(49)], SamplingParams(max_tokens=1)
            ):
                pass
        kv = engines[0].kv
        cached = {external_block_hash(d) for d in kv._cached}
        await until(
            lambda: (
                index.entries("127.0.0.1:8000") == len(cached)
                and all(index.prefix_blocks([h], ["127.0.0.1:8000"])["127.0.0.1:8000"] for h in cached)
            )
        )
        assert index.prefix_blocks(hashes, endpoints)["127.0.0.1:8000"] == 0
        assert subscriber.gaps == 0 and subscriber.bad_messages == 0
    finally:
        for engine in engines:
            await engine.stop()
        subscriber.shutdown()


def test_a_gap_or_a_restart_drops_that_endpoint_only_and_resyncs(caplog):
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, "tcp://127.0.0.1:*")
    try:
        batch = KVEventBatch(0.0, [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU")])
        receive(subscriber, "a:1", 0, batch)
        receive(subscriber, "b:1", 0, batch)
        receive(subscriber, "a:1", 2, KVEventBatch(0.0, [BlockStored([7], None, list(range(16)), 16, None, "GPU")]))
        assert subscriber.gaps == 1
        assert index.prefix_blocks([1, 2], ["a:1", "b:1"]) == {"a:1": 0, "b:1": 2}
        assert index.prefix_blocks([7], ["a:1"]) == {"a:1": 1}
        receive(subscriber, "b:1", 1, KVEventBatch(0.0, [BlockRemoved([2], "GPU")]))
        assert index.prefix_blocks([1, 2], ["b:1"]) == {"b:1": 1}
        # the gap is said once per endpoint, with the batches it missed, however many follow
        receive(subscriber, "a:1", 5, batch)
        assert subscriber.gaps == 2
        said = [r.getMessage() for r in caplog.records if "missed" in r.getMessage()]
        assert said == [said[0]] and "a:1: batches 1 to 1 missed" in said[0], said
    finally:
        subscriber.shutdown()


def publishers(subscriber: KVEventSubscriber, ctx: zmq.Context, count: int) -> list[tuple[str, zmq.Socket]]:
    """`count` servers' publishers (bound, as vLLM's tcp://*:5557), in the pool of a subscriber that connects to
    each at its endpoint's port + 0."""
    out = []
    for _ in range(count):
        pub = ctx.socket(zmq.PUB)
        hostport = f"127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
        in_pool(subscriber, hostport)
        out.append((hostport, pub))
    time.sleep(0.3)
    return out


def close(subscriber: KVEventSubscriber, ctx: zmq.Context, servers: list[tuple[str, zmq.Socket]]) -> None:
    """A test's subscriber, its servers' sockets and their context, closed."""
    for _, pub in servers:
        pub.close(linger=0)
    subscriber.shutdown()
    ctx.term()


def publish(pub: zmq.Socket, hostport: str, seq: int, batch: KVEventBatch) -> None:
    """One batch on `pub` as a server's publisher sends it: its topic (kv@<address:port>@<model>), sequence number
    and msgpack body."""
    pub.send_multipart([f"kv@{hostport}@m".encode(), seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])


def test_malformed_messages_are_counted_and_do_not_stop_the_subscriber():
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, connect_port_offset=0)
    ctx = zmq.Context()
    (x, pub), (y, pub_y), (z, pub_z), (w, pub_w) = publishers(subscriber, ctx, 4)
    try:
        pub.send_multipart([b"kv@x:1@m", (0).to_bytes(8, "big"), b"\xc1garbage"])
        pub.send_multipart([b"kv@nope", (0).to_bytes(8, "big"), b""])
        good = KVEventBatch(0.0, [BlockStored([9], None, list(range(16)), 16, None, "GPU")])
        pub.send_multipart([b"kv@x:1@m", (0).to_bytes(8, "big"), msgspec.msgpack.encode(good)])
        deadline = time.monotonic() + 3
        while index.size == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert subscriber.bad_messages == 2 and index.prefix_blocks([9], [x]) == {x: 1}
        # a bug applying one batch costs that batch (and that server's entries), not the subscriber's thread
        apply, failed = subscriber._apply, []

        def broken(*args):
            failed.append(args)
            raise RuntimeError("a bug")

        subscriber._apply = broken
        pub.send_multipart([b"kv@x:1@m", (1).to_bytes(8, "big"), msgspec.msgpack.encode(good)])
        while not failed and time.monotonic() < deadline + 3:
            time.sleep(0.01)
        subscriber._apply = apply
        pub_y.send_multipart([b"kv@y:1@m", (0).to_bytes(8, "big"), msgspec.msgpack.encode(good)])
        while index.prefix_blocks([9], [y]) != {y: 1} and time.monotonic() < deadline + 6:
            time.sleep(0.01)
        assert failed and index.prefix_blocks([9], [x, y]) == {x: 0, y: 1}
        # a message over MAX_MESSAGE_BYTES is dropped (with its sender's connection) unread; the others go on
        big = KVEventBatch(0.0, [BlockStored([5], None, list(range(16)), 16, None, "GPU")])
        oversized, bad = msgspec.msgpack.encode(big) + b"\0" * MAX_MESSAGE_BYTES, subscriber.bad_messages
        pub_z.send_multipart([b"kv@z:1@m", (0).to_bytes(8, "big"), oversized])
        pub_w.send_multipart([b"kv@w:1@m", (0).to_bytes(8, "big"), msgspec.msgpack.encode(big)])
        while index.prefix_blocks([5], [w]) != {w: 1} and time.monotonic() < deadline + 9:
            time.sleep(0.01)
        assert index.prefix_blocks([5], [w, z]) == {w: 1, z: 0}
        assert subscriber.bad_messages == bad  # never received, so never decoded
    finally:
        for socket in (pub, pub_y, pub_z, pub_w):
            socket.close(linger=0)
        ctx.term()
        subscriber.shutdown()


def test_events_count_only_from_the_endpoint_s_own_publisher():
    """A forger (a process that is not the endpoint) publishing BlockStored, and a seq-0 AllBlocksCleared, under
    another endpoint's topic: neither reaches that endpoint's entries. Subscribed to each endpoint's own publisher,
    the EPP has nothing a forger can connect to, and a server's socket speaks for that server only, whatever its
    topic names; on a bound socket, a sender from another address than its topic names is ignored."""
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, connect_port_offset=0)
    ctx = zmq.Context()
    (victim, pub), (other, pub_other) = publishers(subscriber, ctx, 2)
    forger = ctx.socket(zmq.PUB)
    forger.bind_to_random_port("tcp://127.0.0.1")  # a publisher of its own, outside the pool
    try:
        stored = KVEventBatch(0.0, [BlockStored(list(range(1, 470)), None, [0] * 16, 16, None, "GPU")])
        publish(pub, victim, 0, stored)
        deadline = time.monotonic() + 3
        while index.size < 469 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert index.prefix_blocks([1, 2], [victim]) == {victim: 2}
        lure = KVEventBatch(0.0, [BlockStored([1000, 1001], None, [0] * 32, 16, None, "GPU")])
        wipe = KVEventBatch(0.0, [AllBlocksCleared()])
        for sender in (forger, pub_other):
            for seq, batch in enumerate((lure, wipe)):
                publish(sender, victim, seq, batch)
        while subscriber.batches < 3 and time.monotonic() < deadline + 3:
            time.sleep(0.01)
        time.sleep(0.2)  # the forger's messages, had any arrived, would have been applied by now
        assert subscriber.batches == 3  # the victim's and the other server's two, as its own
        assert index.prefix_blocks([1, 2], [victim]) == {victim: 2} and index.size == 469  # 0 entries wiped
        assert index.prefix_blocks([1000], [victim, other]) == {victim: 0, other: 0}  # 0 steered to the victim
    finally:
        for socket in (pub, pub_other, forger):
            socket.close(linger=0)
        ctx.term()
        subscriber.shutdown()

    bound_index = KVBlockIndex()
    bound = KVEventSubscriber(bound_index, "tcp://127.0.0.1:*")
    in_pool(bound, "10.0.0.1:8000")
    ctx = zmq.Context()
    sender = ctx.socket(zmq.PUB)
    sender.connect(bound.endpoint)
    time.sleep(0.3)
    try:
        sender.send_multipart([b"kv@10.0.0.1:8000@m", (0).to_bytes(8, "big"), msgspec.msgpack.encode(lure)])
        deadline = time.monotonic() + 3
        while bound.unverified == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bound.unverified == 1 and bound_index.size == 0 and not bound_index.publishes("10.0.0.1:8000")
    finally:
        sender.close(linger=0)
        ctx.term()
        bound.shutdown()


def test_every_publisher_of_a_large_pool_is_read_through_bursts_and_departures():
    """64 servers, each sending a burst of batches at once, twice: every batch of every server is applied (the
    subscriber waits on the sockets' FDs, which signal once per change: each signalled socket is read to the end),
    and a server that left the pool is no longer read."""
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, connect_port_offset=0)
    ctx = zmq.Context()
    servers = publishers(subscriber, ctx, 64)
    try:
        for burst in range(2):
            for number, (hostport, pub) in enumerate(servers):
                for step in range(5):
                    seq = burst * 5 + step
                    block = 1 + number * 1000 + seq
                    batch = KVEventBatch(0.0, [BlockStored([block], None, [0] * 16, 16, None, "GPU")])
                    publish(pub, hostport, seq, batch)
            deadline = time.monotonic() + 10
            while subscriber.batches < 64 * 5 * (burst + 1) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert subscriber.batches == 64 * 5 * (burst + 1) and subscriber.gaps == 0
        assert all(index.entries(hostport) == 10 for hostport, _ in servers)
        gone, pub = servers[0]
        address, _, port = gone.rpartition(":")
        subscriber.stop(Endpoint(EndpointSpec(gone, address, int(port))))
        until_gone = time.monotonic() + 3
        while index.entries(gone) and time.monotonic() < until_gone:
            time.sleep(0.01)
        batch = KVEventBatch(0.0, [BlockStored([99], None, [0] * 16, 16, None, "GPU")])
        publish(pub, gone, 10, batch)
        time.sleep(0.3)
        assert index.entries(gone) == 0 and subscriber.batches == 640
    finally:
        close(subscriber, ctx, servers)


def flooded(pub: zmq.Socket, hostport: str, blocks: int, seconds: float) -> threading.Thread:
    """A thread that publishes `flood_batch(blocks)` on `pub` as fast as it can for `seconds`."""
    message = msgspec.msgpack.encode(flood_batch(blocks))
    assert len(message) < MAX_MESSAGE_BYTES

    def flood() -> None:
        seq, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            pub.send_multipart([f"kv@{hostport}@m".encode(), seq.to_bytes(8, "big"), message])
            seq += 1
            if seq % 8 == 0:
                time.sleep(0.001)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    return thread


def test_a_server_that_publishes_faster_than_its_batches_are_applied_does_not_hold_back_the_others():
    """One server floods batches of 20,000 blocks (each ~10 ms to apply) for 3 s; another publishes a batch every
    100 ms meanwhile: each of those is in the index within a few of the flood's batches. The subscriber read a socket
    until it had nothing more, so the quiet server's batches waited until the flood ended (5 s and more)."""
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, connect_port_offset=0)
    ctx = zmq.Context()
    servers = publishers(subscriber, ctx, 2)
    (loud, loud_pub), (quiet, quiet_pub) = servers
    try:
        flooding = flooded(loud_pub, loud, 20_000, 3.0)
        assert soon(lambda: index.entries(loud) > 0)
        waits = []
        for seq in range(10):
            publish(
                quiet_pub, quiet, seq, KVEventBatch(0.0, [BlockStored([10**9 + seq], None, [0] * 16, 16, None, "GPU")])
            )
            sent = time.monotonic()
            assert soon(lambda seq=seq: index.entries(quiet) == seq + 1, timeout=5.0)
            waits.append(time.monotonic() - sent)
            time.sleep(0.1)
        assert flooding.is_alive(), "the flood ended before the quiet server's batches: nothing was measured"
        assert max(waits) < 0.5, waits
        flooding.join()
    finally:
        close(subscriber, ctx, servers)


def test_a_pool_larger_than_zmq_s_default_socket_count_is_heard_whole():
    """1,100 endpoints, one SUB socket each (zmq's default allows 1,023 a context: the endpoints past it got none, and
    their events were never heard); the last one's publisher is real, and its batch reaches the index. The others'
    addresses lead nowhere (their sockets retry in the background)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * 1100 + 512  # each SUB socket's mailbox and connection, and room for the test's own
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard open-files limit ({hard}) is under {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, connect_port_offset=0)
    ctx = zmq.Context()
    servers = []
    try:
        in_pool(subscriber, *(f"127.0.0.{2 + n // 250}:{1 + n % 250}" for n in range(1099)))
        servers = publishers(subscriber, ctx, 1)
        ((last, pub),) = servers
        assert soon(lambda: len(subscriber._connected) == 1100)
        batch, seqs = KVEventBatch(0.0, [BlockStored([7], None, [0] * 16, 16, None, "GPU")]), itertools.count()
        # published until heard (a subscription takes a moment to reach the publisher)
        assert soon(lambda: publish(pub, last, next(seqs), batch) or index.entries(last) == 1, timeout=10.0)
    finally:
        close(subscriber, ctx, servers)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_memory_cap_drops_the_largest_endpoint_s_oldest_entries_and_counts_them():
    index = KVBlockIndex(max_entries=4)
    index.store("a", [1, 2, 3])
    index.store("b", [10, 11])
    assert index.size == 4 and index.dropped_entries == 1
    assert index.prefix_blocks([1], ["a"]) == {"a": 0}  # a's oldest went first
    assert index.prefix_blocks([2, 3], ["a"]) == {"a": 2}


def test_over_the_cap_a_run_is_evicted_at_once_and_the_stores_that_follow_fill_its_room():
    """vLLM sends a block at a time while it decodes: at the cap, each of those evicting its own block paid for a
    search of the largest endpoint and an unlink pass apiece. The cap's eviction goes a run below it instead (at
    most a 64th of the cap), so the next run of single blocks evicts nothing."""
    cap = 64 * EVICTION_RUN
    index = KVBlockIndex(max_entries=cap)
    index.store("a:1", list(range(cap)))
    index.store("b:1", [cap])
    assert index.dropped_entries == EVICTION_RUN + 1 and index.size == cap - EVICTION_RUN
    for block in range(cap + 1, cap + 1 + EVICTION_RUN):
        index.store("b:1", [block])
    assert index.dropped_entries == EVICTION_RUN + 1 and index.size == cap
    index.store("b:1", [2 * cap])
    assert index.dropped_entries == 2 * (EVICTION_RUN + 1) and index.size == cap - EVICTION_RUN
    oldest_left = 2 * (EVICTION_RUN + 1)  # a's oldest went, twice a run and a block
    assert index.prefix_blocks([oldest_left - 1], ["a:1"]) == {"a:1": 0}
    assert index.prefix_blocks([oldest_left], ["a:1"]) == {"a:1": 1}


def test_idle_trims_leave_room_below_the_cap_so_that_batches_there_only_insert():
    """Evicting a batch's worth on the batch's own path cost it ~1.6x a batch below the cap (an evicted entry's
    memory is cold): `trim`, which the subscriber runs when idle, makes room ahead, a slice at a time, and the
    batches that follow evict nothing until that room is used up; the cap still holds without it."""
    cap = 256 * EVICTION_RUN  # its room: 4 runs
    index = KVBlockIndex(max_entries=cap)
    index.store("a:1", list(range(cap)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_events, "SLICE_SECONDS", 0.0)  # a run per slice
        assert index.trim() and index.dropped_entries == EVICTION_RUN
    while index.trim():
        pass
    assert index.size == index.low_mark == cap - cap // 64 and index.dropped_entries == cap // 64
    assert not index.trim() and index.dropped_entries == cap // 64
    for block in range(cap, cap + cap // 64, 16):
        index.store("b:1", list(range(block, block + 16)))
    assert index.size == cap and index.dropped_entries == cap // 64  # the room, filled without evicting
    index.store("b:1", [2 * cap])  # no room left: the store evicts, as without trims
    assert index.size == cap - EVICTION_RUN and index.dropped_entries == cap // 64 + EVICTION_RUN + 1
    assert index.prefix_blocks([cap // 64 + EVICTION_RUN], ["a:1"]) == {"a:1": 0}
    assert index.prefix_blocks([cap // 64 + EVICTION_RUN + 1], ["a:1"]) == {"a:1": 1}


async def test_the_subscriber_trims_its_index_while_no_batch_comes():
    index = KVBlockIndex(max_entries=64 * EVICTION_RUN)
    index.store("a:1", list(range(64 * EVICTION_RUN)))
    subscriber = KVEventSubscriber(index, connect_port_offset=0)
    try:
        await until(lambda: index.size == index.low_mark)
    finally:
        subscriber.shutdown()


async def test_an_endpoint_that_leaves_the_pool_loses_its_entries():
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, "tcp://127.0.0.1:*")
    try:
        index.store("10.0.0.1:8000", [1, 2, 3])
        index.store("10.0.0.2:8000", [1, 2])
        subscriber.stop(Endpoint(EndpointSpec("a", "10.0.0.1", 8000)))  # the datastore: it left the pool
        await until(lambda: "10.0.0.1:8000" not in index._entries)  # its log and count gone too
        assert index.prefix_blocks([1, 2, 3], ["10.0.0.1:8000", "10.0.0.2:8000"]) == {
            "10.0.0.1:8000": 0,
            "10.0.0.2:8000": 2,
        }
    finally:
        await subscriber.close()


def test_a_run_of_leading_blocks_is_followed_piece_by_piece_until_no_endpoint_holds_it():
    index = KVBlockIndex()
    index.store("a", [1, 2, 3, 4])
    index.store("b", [1, 2, 5, 6])
    assert index.extend_run([1, 2], None) == (2, {"a", "b"})
    assert index.extend_run([5, 6, 7], {"a", "b"}) == (2, {"b"})  # b's run goes on, then nobody holds 7
    assert index.extend_run([3, 5], {"a"}) == (1, {"a"})  # b holds 5 but not a's block 3 before it
    assert index.extend_run([9], None) == (0, None)
    full = index.prefix_blocks([1, 2, 5, 6, 7], ["a", "b"])
    assert full == {"a": 2, "b": 4}


def test_a_restarted_server_is_dropped_and_counted_apart_from_gaps():
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, "tcp://127.0.0.1:*")
    try:
        stored = KVEventBatch(time.time(), [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU")])
        for seq in range(3):
            receive(subscriber, "a:1", seq, stored)
        assert index.publishes("a:1") and not index.publishes("b:1") and index.block_size == 16
        receive(subscriber, "a:1", 0, KVEventBatch(time.time(), [BlockStored([5], None, [0] * 16, 16, None, None)]))
        assert subscriber.restarts == 1 and subscriber.gaps == 0
        assert index.prefix_blocks([1], ["a:1"]) == {"a:1": 0} and index.prefix_blocks([5], ["a:1"]) == {"a:1": 1}
        assert subscriber.batches == 4 and subscriber.events_applied == 4 and sum(subscriber.lag_buckets) == 4
    finally:
        subscriber.shutdown()


def soon(condition, timeout: float = 5.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class ReplayingServer:
    """A server's publisher (PUB, bound) and replay socket (ROUTER, bound), and a subscriber in whose pool it is,
    connected to the publisher, with the replay socket at the endpoint's port + its offset; a context manager that
    closes them all."""

    def __init__(self, replay_timeout: float = 1.0, others: int = 0):
        self.ctx = ctx = zmq.Context()
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        offset = self.router.bind_to_random_port("tcp://127.0.0.1") - port
        self.endpoint = f"127.0.0.1:{port}"
        self.index = KVBlockIndex()
        self.subscriber = KVEventSubscriber(
            self.index, connect_port_offset=0, replay_port_offset=offset, replay_timeout=replay_timeout
        )
        in_pool(self.subscriber, self.endpoint)
        # other servers of the pool, without a replay socket (nothing listens at their port + the offset)
        self.others = publishers(self.subscriber, ctx, others) if others else time.sleep(0.3) or []

    def publish(self, seq: int, batch: KVEventBatch, pub: zmq.Socket | None = None, endpoint: str | None = None):
        publish(pub or self.pub, endpoint or self.endpoint, seq, batch)

    def serve_replays(self, payloads, count: int = 1) -> threading.Thread:
        """Answers `count` replay requests, each with what `payloads(start)` gives ((seq, encoded batch) pairs),
        then the end marker; the starts asked go to `self.asked`."""
        self.asked: list[int] = []

        def serve():
            for _ in range(count):
                client, _, start = self.router.recv_multipart()
                self.asked.append(int.from_bytes(start, "big"))
                for seq, payload in payloads(self.asked[-1]):
                    self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        return thread

    def __enter__(self) -> "ReplayingServer":
        return self

    def __exit__(self, *exc) -> None:
        close(self.subscriber, self.ctx, [(self.endpoint, self.pub), ("replay", self.router), *self.others])


def stored(seq: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored([seq + 1], None, [seq] * 16, 16, None, "GPU")])


def buffered(first: int, end: int):
    """A replay socket's answers (`ReplayingServer.serve_replays`) when its buffer holds batches first..end-1: those
    from the start asked."""
    return lambda start: [(seq, msgspec.msgpack.encode(stored(seq))) for seq in range(max(first, start), end)]


def test_a_gap_is_closed_from_the_server_s_replay_socket():
    with ReplayingServer() as server:
        index, subscriber, endpoint = server.index, server.subscriber, server.endpoint
        replaying = server.serve_replays(buffered(0, 4))
        server.publish(0, stored(0))
        assert soon(lambda: subscriber.batches == 1)
        server.publish(3, stored(3))  # 1 and 2 were lost: fetched from the replay socket
        assert soon(lambda: subscriber.batches == 4)
        replaying.join(timeout=5)
        assert server.asked == [1] and subscriber.replays == 1 and subscriber.gaps == 0
        assert all(index.prefix_blocks([h], [endpoint]) == {endpoint: 1} for h in (1, 2, 3, 4))
        # no answer from the replay socket: a gap once it times out, the endpoint's entries dropped, and the batch
        # that showed the gap (and those after it) applied then
        subscriber.replay_timeout = 0.3
        server.publish(9, stored(9))
        server.publish(10, stored(10))
        assert soon(lambda: subscriber.gaps == 1)
        assert soon(lambda: index.prefix_blocks([10, 11], [endpoint]) == {endpoint: 2})
        assert index.prefix_blocks([4], [endpoint]) == {endpoint: 0} and subscriber.replays == 1


def test_a_replay_socket_that_does_not_answer_delays_its_own_endpoint_only():
    """While one server's replay is under way (its replay socket absent: it runs until its timeout), the other
    servers' batches are applied as they come; that server's own batches are held and applied, in order, once it
    ends."""
    with ReplayingServer(replay_timeout=1.5, others=1) as server:
        index, subscriber, endpoint = server.index, server.subscriber, server.endpoint
        ((other, other_pub),) = server.others
        server.router.close(linger=0)  # nothing answers there now
        server.publish(0, stored(0))
        assert soon(lambda: subscriber.batches == 1)
        asked = time.monotonic()
        server.publish(2, stored(2))  # batch 1 lost: a replay is asked, and never answered
        server.publish(3, stored(3))
        for seq in range(3):
            server.publish(seq, stored(100 + seq), other_pub, other)
        assert soon(lambda: index.entries(other) == 3, timeout=1.0)  # within the replay's wait
        assert time.monotonic() - asked < 1.0 and subscriber.gaps == 0 and index.entries(endpoint) == 1
        assert soon(lambda: subscriber.gaps == 1)
        assert soon(lambda: index.prefix_blocks([3, 4], [endpoint]) == {endpoint: 2})
        assert index.prefix_blocks([1], [endpoint]) == {endpoint: 0}  # dropped with the gap


@pytest.mark.timing
def test_a_new_subscriber_is_not_held_up_by_every_server_s_absent_replay_socket_in_turn():
    """16 servers already publishing, heard first in mid-sequence by a subscriber whose replay offset leads nowhere:
    their replays wait side by side, so every server's batch is in within about one replay timeout (0.5 s), where
    replays one after another took one each (64 servers: 64.20 s; docs/kv-events.md)."""
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, connect_port_offset=0, replay_port_offset=1, replay_timeout=0.5)
    ctx = zmq.Context()
    servers = publishers(subscriber, ctx, 16)
    try:
        started = time.monotonic()
        for number, (hostport, pub) in enumerate(servers):
            batch = KVEventBatch(0.0, [BlockStored([1000 + number], None, [0] * 16, 16, None, "GPU")])
            publish(pub, hostport, 7, batch)
        assert soon(lambda: all(index.entries(hostport) == 1 for hostport, _ in servers), timeout=8.0)
        took = time.monotonic() - started
        assert took < 2.0 and subscriber.gaps == 0 and subscriber.replays == 0, took
    finally:
        close(subscriber, ctx, servers)


def test_a_replay_that_would_hold_more_than_its_byte_budget_is_given_up_as_a_gap(monkeypatch):
    """What replays hold (the batches replayed and the live ones held meanwhile) is bounded in bytes, all replays
    together: a replay that would go over is given up, its endpoint's entries dropped as after a gap, and the live
    batches it held applied; nothing stays counted."""
    monkeypatch.setattr(kv_events, "MAX_REPLAY_BYTES", 4_000)
    with ReplayingServer() as server:
        index, subscriber, endpoint = server.index, server.subscriber, server.endpoint
        replaying = server.serve_replays(buffered(0, 200))  # ~60 bytes a batch: 198 of them are over 4,000
        server.publish(0, stored(0))
        assert soon(lambda: subscriber.batches == 1)
        server.publish(199, stored(199))
        assert soon(lambda: subscriber.gaps == 1)
        replaying.join(timeout=5)
        assert server.asked == [1] and subscriber.replays == 0 and subscriber._replay_bytes == 0
        assert soon(lambda: index.prefix_blocks([200], [endpoint]) == {endpoint: 1})  # the live batch, applied
        assert index.prefix_blocks([1], [endpoint]) == {endpoint: 0}  # dropped with the gap
        # within the budget, the next gap is closed from the replay socket as usual
        replaying = server.serve_replays(buffered(0, 204))
        server.publish(203, stored(203))
        assert soon(lambda: subscriber.replays == 1)
        replaying.join(timeout=5)
        assert subscriber.gaps == 1 and subscriber._replay_bytes == 0
        assert all(index.prefix_blocks([h], [endpoint]) == {endpoint: 1} for h in (201, 202, 203, 204))


def test_a_late_subscriber_fetches_what_the_server_still_buffers():
    with ReplayingServer() as server:
        index, subscriber, endpoint = server.index, server.subscriber, server.endpoint
        # its buffer kept batches 2..5 (buffer_steps): 0 and 1 are gone
        replaying = server.serve_replays(buffered(2, 6))
        server.publish(5, stored(5))  # the first it hears of this server
        assert soon(lambda: subscriber.batches == 4)
        replaying.join(timeout=5)
        assert server.asked == [0] and subscriber.replays == 1 and subscriber.gaps == 0
        assert [index.prefix_blocks([h], [endpoint])[endpoint] for h in range(1, 7)] == [0, 0, 1, 1, 1, 1]


@pytest.mark.timing
def test_a_replay_socket_that_sends_garbage_or_a_sequence_far_ahead_costs_that_endpoint_only():
    """A malformed batch from a replay socket, or a sequence number ~2^62 ahead (a gap no buffer could close), is a
    gap for that server: counted, its entries dropped, nothing held for the range, and the subscriber goes on."""
    with ReplayingServer(replay_timeout=2.0) as server:
        index, subscriber, endpoint = server.index, server.subscriber, server.endpoint
        first = msgspec.msgpack.encode(stored(0))
        # garbage first, then the batch asked for (and nothing after it)
        answers = iter(([(1, b"\xc1garbage")], None))
        replaying = server.serve_replays(lambda start: next(answers) or [(start, first)], count=2)
        server.publish(0, stored(0))
        assert soon(lambda: subscriber.batches == 1)
        server.publish(2, stored(0))  # batch 1 lost; its replay is garbage
        assert soon(lambda: subscriber.gaps == 1) and server.asked == [1]
        started = time.monotonic()
        server.publish(1 << 62, stored(0))  # no replay asked: far over any buffer
        assert soon(lambda: subscriber.gaps == 2, timeout=1.0) and time.monotonic() - started < 1.0
        assert server.asked == [1]
        server.publish((1 << 62) + 3, stored(0))  # the replay holds 1 << 62 + 1 only
        assert soon(lambda: subscriber.gaps == 3)
        replaying.join(timeout=5)
        assert server.asked == [1, (1 << 62) + 1]
        assert index.prefix_blocks([1], [endpoint]) == {endpoint: 1}  # relearnt from the batch that came


def test_only_the_pools_servers_are_indexed_and_a_server_that_leaves_is_forgotten():
    """A bound subscriber: a sender naming any other address:port (or a server after it left the pool) is counted
    and ignored, so what it keeps per server is bounded by the pool."""
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index, "tcp://127.0.0.1:*")
    in_pool(subscriber, "127.0.0.1:8000")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(subscriber.endpoint)
    time.sleep(0.3)
    batch = msgspec.msgpack.encode(KVEventBatch(0.0, [BlockStored([9], None, list(range(16)), 16, None, "GPU")]))
    try:
        for n in range(200):  # a sender making up servers
            pub.send_multipart([f"kv@10.9.{n // 250}.{n % 250}:8000@m".encode(), (0).to_bytes(8, "big"), batch])
        pub.send_multipart([b"kv@127.0.0.1:8000@m", (0).to_bytes(8, "big"), batch])
        deadline = time.monotonic() + 3
        while not index.publishes("127.0.0.1:8000") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert subscriber.outside_pool == 200 and index.prefix_blocks([9], ["127.0.0.1:8000"]) == {"127.0.0.1:8000": 1}
        assert index.size == 1 and len(subscriber._next_seq) == 1
        subscriber.stop(Endpoint(EndpointSpec("gone", "127.0.0.1", 8000)))
        pub.send_multipart([b"kv@127.0.0.1:8000@m", (1).to_bytes(8, "big"), batch])
        while subscriber.outside_pool == 200 and time.monotonic() < deadline + 3:
            time.sleep(0.01)
        assert subscriber.outside_pool == 201 and index.size == 0 and not index.publishes("127.0.0.1:8000")
    finally:
        pub.close(linger=0)
        ctx.term()
        subscriber.shutdown()


@settings(max_examples=300)
@given(
    operations=st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "clear", "trim"]),
            st.integers(0, 2),
            st.lists(st.integers(0, 15), max_size=6),
        ),
        max_size=40,
    ),
    cap=st.integers(1, 24),
)
def test_stores_removals_clears_trims_and_the_cap_keep_the_index_true_to_the_events(operations, cap):
    """Against the events' own account: the index never lists a block its endpoint does not hold, counts what it
    lists, stays within its cap and, until the cap or a trim drops something, lists all of it. Small chunks,
    eviction runs and room below the cap, so that logs are compacted, runs cut short by blocks listed twice or no
    longer held, and stores evict with and without room left by a trim."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_events, "CHUNK_BLOCKS", 2)
        patch.setattr(kv_events, "EVICTION_RUN", 3)
        patch.setattr(kv_events, "ROOM", 4)
        index = KVBlockIndex(max_entries=cap)
        assert index.low_mark == cap - cap // 4
        endpoints = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        truth: dict[str, set[int]] = {e: set() for e in endpoints}
        for operation, i, blocks in operations:
            endpoint, dropped, size = endpoints[i], index.dropped_entries, index.size
            if operation == "store":
                index.store(endpoint, blocks)
                truth[endpoint].update(blocks)
            elif operation == "remove":
                index.remove(endpoint, blocks)
                truth[endpoint].difference_update(blocks)
            elif operation == "clear":
                index.clear(endpoint)
                truth[endpoint].clear()
            else:
                while index.trim():
                    pass
                assert index.size == min(size, index.low_mark)
            listed = {e: {h for h in range(16) if index.prefix_blocks([h], [e])[e]} for e in endpoints}
            assert all(listed[e] <= truth[e] and index.entries(e) == len(listed[e]) for e in endpoints)
            assert index.size == sum(map(len, listed.values())) <= cap
            if operation == "store" and index.dropped_entries > dropped:  # down to a run below the cap (at most a
                assert index.size >= cap - min(3, cap // 4)  # ROOM-th of it), then perhaps the rest of the store
            if index.dropped_entries == 0:
                assert listed == truth


def test_blocks_stored_and_removed_over_and_over_keep_their_endpoint_s_log_short_and_rarely_compacted():
    """vLLM evicting and recomputing the same blocks: each removal leaves a stale place in the endpoint's log and
    each store a new one. A compaction keeps each held block once, at its latest place, so the log never outgrows
    twice its entries and a chunk, and compactions come once per that many removals (keeping every place listed
    would leave the log over its bound after each one, and compact it at every removal)."""
    index, compactions = KVBlockIndex(), []
    compact = KVBlockIndex._compact
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KVBlockIndex, "_compact", lambda *args: (compactions.append(1), compact(*args)))
        index.store("a", list(range(300)))
        for _ in range(4):
            for block in range(300):
                index.remove("a", [block])
                index.store("a", [block])
                assert len(index._entries["a"].log) <= 2 * (300 + kv_events.CHUNK_BLOCKS)
    assert index.entries("a") == 300 and index.prefix_blocks(list(range(300)), ["a"]) == {"a": 300}
    assert 1 <= len(compactions) <= 4 * 300 // kv_events.CHUNK_BLOCKS


@settings(max_examples=300)
@given(
    held=st.lists(st.sets(st.integers(0, 11), max_size=12), min_size=1, max_size=5),
    removed=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 11)), max_size=6),
    prompt=st.lists(st.integers(0, 11), max_size=12, unique=True),
)
def test_each_endpoint_matches_the_leading_blocks_it_holds_whoever_else_holds_them(held, removed, prompt):
    """prefix_blocks against its definition: an endpoint's count is how many of the prompt's leading blocks it
    holds, whatever the others hold (one holder or several, a run that narrows, widens or ends)."""
    index = KVBlockIndex()
    endpoints = [f"10.0.0.{i}:8000" for i in range(len(held))]
    for endpoint, blocks in zip(endpoints, held, strict=True):
        index.store(endpoint, sorted(blocks))
    for i, block in removed:
        if i < len(endpoints):
            index.remove(endpoints[i], [block])
            held[i].discard(block)
    expected = {}
    for endpoint, blocks in zip(endpoints, held, strict=True):
        count = 0
        while count < len(prompt) and prompt[count] in blocks:
            count += 1
        expected[endpoint] = count
    assert index.prefix_blocks(prompt, endpoints) == expected
    assert index.prefix_blocks(prompt, endpoints[:1]) == {endpoints[0]: expected[endpoints[0]]}


def test_a_server_hashing_with_another_seed_is_found_out_and_left_to_the_approximate_index(caplog):
    """A server started with another PYTHONHASHSEED: its first block's hash is not what this EPP computes from
    the same tokens. Its events are ignored (a log line, the mismatched-endpoints gauge) so that it is not
    scored from an index that can never match; restarted with the right seed, it is indexed again."""
    index = KVBlockIndex()
    index.hasher = block_hasher("sha256", "0")  # as precise-prefix-cache-scorer sets it
    subscriber = KVEventSubscriber(index, connect_port_offset=0)
    tokens = list(range(32))

    def stored(seed: str) -> KVEventBatch:
        hashes = request_block_hashes(tokens, 16, hash_seed=seed)
        return KVEventBatch(time.time(), [BlockStored(hashes, None, tokens, 16, None, "GPU")])

    try:
        receive(subscriber, "a:1", 0, stored("1"))
        receive(subscriber, "a:1", 1, stored("1"))
        assert subscriber.mismatched == {"a:1"} and index.size == 0 and not index.publishes("a:1")
        gauge = next(m for m in subscriber.collect() if m.name.endswith("hash_mismatched_endpoints"))
        assert gauge.samples[0].value == 1
        assert sum("another PYTHONHASHSEED" in r.getMessage() for r in caplog.records) == 1
        receive(subscriber, "b:1", 0, stored("0"))
        assert index.publishes("b:1") and index.size == 2
        receive(subscriber, "a:1", 0, stored("0"))  # restarted, now with the pool's seed
        assert subscriber.mismatched == set() and index.publishes("a:1") and index.size == 4
    finally:
        subscriber.shutdown()


@pytest.mark.timing
async def test_a_huge_batch_at_the_cap_neither_takes_long_nor_stops_the_event_loop():
    """60,000 new hashes into an index full at 60,000: every entry evicted, in O(1) each (the dict-based index
    took seconds, its cost growing with the square of the evictions), and applied on another thread in slices
    that give the GIL up: with the interpreter never switching threads by itself (as the compiled release build),
    the event loop still runs every few milliseconds."""
    index = KVBlockIndex(max_entries=60_000)
    index.store("a:1", list(range(60_000)))
    gaps, stop = [], threading.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1000)
    try:
        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await asyncio.to_thread(index.store, "b:1", list(range(100_000, 160_000)))
        took = time.monotonic() - started
        stop.set()
        await ticking
    finally:
        sys.setswitchinterval(switch)
    # evicted down to a run below the cap: the last chunk's eviction left room for the next stores
    assert index.size == 60_000 - EVICTION_RUN and index.dropped_entries == 60_000 + EVICTION_RUN
    assert index.prefix_blocks([0], ["a:1"]) == {"a:1": 0} and index.prefix_blocks([159_999], ["b:1"]) == {"b:1": 1}
    assert took < 3.0 and max(gaps) < 0.25, (took, max(gaps))


def test_has_publishers_follows_the_endpoints_that_publish():
    index = KVBlockIndex()
    assert not index.has_publishers
    index.saw("10.0.0.1:8000", "m")
    index.saw("10.0.0.2:8000", "m")
    assert index.has_publishers and index.publishes("10.0.0.1:8000")
    index.forget("10.0.0.1:8000")
    assert index.has_publishers and not index.publishes("10.0.0.1:8000")
    index.forget("10.0.0.2:8000")
    assert not index.has_publishers and index.base_models == frozenset()
