"""KV events from the real block manager, received by a real ZMQ subscriber and decoded from msgpack: vLLM v0.11.2's
wire format and block hashes, every store and eviction (preemption and LoRA included), resets, replay, and a
publisher that stays bounded when nobody reads."""

import asyncio
import time

import msgspec
import pytest
import zmq

from modelserver.cli import build_kv_events, build_parser
from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.kv_events import ZmqEventPublisher
from modelserver.engine.request import SamplingParams
from modelserver.engine.sim import SimExecutor, SimTiming
from protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    external_block_hash,
    request_block_hashes,
)

FILLER = list(range(100, 164))
BLOCK = 16
SEED = "42"
PROMPT = list(range(1, 41))  # 2 full blocks + 8 tokens
VLLM_PROMPT_HASHES = [4508471921923631364, 13026579715664180657]  # vLLM v0.11.2, PYTHONHASHSEED=42, sha256
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Preemptions:
    log_interval = None

    def __init__(self):
        self.count = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        if iteration_stats is not None:
            self.count += iteration_stats.num_preemptions


def start(
    num_gpu_blocks: int = 64, replay: bool = True, **engine_args
) -> tuple[AsyncEngine, zmq.Socket, zmq.Context, Preemptions]:
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "buffer_steps": 1000'
        + (', "replay_endpoint": "tcp://127.0.0.1:*"' if replay else "")
        + "}"
    )
    ctx = zmq.Context()
    publisher = ZmqEventPublisher(config, "kv@127.0.0.1:8000@m", ctx)
    cfg = EngineConfig(num_gpu_blocks=num_gpu_blocks, block_size=BLOCK, enable_lora=True, **engine_args)
    preemptions = Preemptions()
    engine = AsyncEngine(
        cfg,
        SimExecutor(SimTiming.zero(), BLOCK, num_gpu_blocks, FILLER),
        model_name="m",
        lora_modules={"sql": "/sql"},
        kv_events=publisher,
        stat_loggers=[preemptions],
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    return engine, sub, ctx, preemptions


async def run(engine: AsyncEngine, rid: str, prompt: list[int], lora: str | None = None, max_tokens: int = 1):
    """The request's whole token sequence (prompt + output)."""
    tokens = list(prompt)
    async for out in engine.generate(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), lora):
        tokens += out.new_token_ids
    return tokens


def receive(sub: zmq.Socket, timeout_ms: int = 2000) -> list[tuple[bytes, int, bytes]]:
    frames = []
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        frames.append((topic, int.from_bytes(seq, "big"), payload))
        timeout_ms = 200
    return frames


async def events_of(sub: zmq.Socket) -> list:
    return [e for _, _, p in await asyncio.to_thread(receive, sub) for e in DECODER.decode(p).events]


def replay_into_index(events: list) -> set[int]:
    """What a subscriber's index holds after these events; each store is new and each removal known."""
    index: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            assert not index & set(event.block_hashes), "a block was announced twice"
            index |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= index, "a removal of a block never announced"
            index -= set(event.block_hashes)
        else:
            index.clear()
    return index


def cached_hashes(engine: AsyncEngine) -> set[int]:
    return {external_block_hash(d) for d in engine.kv._cached}


def check_chains(events: list, sequences: list[tuple[list[int], str | None]]) -> None:
    """Every BlockStored is a run of some sequence's blocks: its hashes are vLLM's for that sequence, its parent
    the block before the run, its token ids the run's tokens."""
    blocks = {}  # hash -> (parent hash, tokens)
    for tokens, lora in sequences:
        hashes = request_block_hashes(tokens, BLOCK, lora_name=lora, hash_seed=SEED)
        for i, h in enumerate(hashes):
            blocks[h] = (hashes[i - 1] if i else None, tokens[i * BLOCK : (i + 1) * BLOCK])
    for event in events:
        if not isinstance(event, BlockStored):
            continue
        assert event.block_size == BLOCK and event.medium == "GPU"
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            assert h in blocks, "a stored hash no sequence of this test produces"
            assert blocks[h] == (parent, event.token_ids[i * BLOCK : (i + 1) * BLOCK])
            parent = h


@pytest.fixture
async def served(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    engine, sub, ctx, _ = start()
    await engine.start()
    await asyncio.sleep(0.3)  # the SUB socket's connection is up before anything is published
    yield engine, sub
    await engine.stop()
    sub.close(linger=0)
    ctx.term()


async def test_a_prompt_s_full_blocks_are_announced_in_vllm_s_wire_format_with_vllm_s_hashes(served):
    engine, sub = served
    await run(engine, "a", PROMPT)
    frames = await asyncio.to_thread(receive, sub)
    assert frames and frames[0][0] == b"kv@127.0.0.1:8000@m"
    assert [seq for _, seq, _ in frames] == list(range(len(frames)))
    raw = msgspec.msgpack.decode(frames[0][2])  # array-like, tagged: [ts, [[tag, fields...]], dp rank]
    assert isinstance(raw[0], float) and raw[2] == 0
    assert raw[1] == [["BlockStored", VLLM_PROMPT_HASHES, None, PROMPT[:32], 16, None, "GPU"]]
    assert DECODER.decode(frames[0][2]).events == [BlockStored(VLLM_PROMPT_HASHES, None, PROMPT[:32], 16, None, "GPU")]


async def test_continued_and_decoded_blocks_chain_to_their_parents(served):
    engine, sub = served
    await run(engine, "a", PROMPT)
    longer = PROMPT + list(range(41, 81))  # 5 blocks: 2 cached, 3 new
    await run(engine, "b", longer)
    decoded = await run(engine, "c", list(range(500, 520)), max_tokens=40)  # blocks completed by generated tokens
    events = await events_of(sub)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[1].token_ids == longer[32:80] and len(stored[1].block_hashes) == 3
    check_chains(events, [(longer, None), (decoded, None)])
    c_hashes = [h for e in stored[2:] for h in e.block_hashes]
    assert c_hashes == request_block_hashes(decoded[:-1], BLOCK, hash_seed=SEED)  # the last token is not computed
    assert replay_into_index(events) == cached_hashes(engine)


async def test_a_prompt_prefilled_in_chunks_is_cached_and_announced_chunk_by_chunk_as_one_chain(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    engine, sub, ctx, _ = start(max_num_batched_tokens=40)  # a 100-token prompt takes 3 steps
    await engine.start()
    await asyncio.sleep(0.3)
    try:
        prompt = list(range(2000, 2100))
        await run(engine, "chunked", prompt)
        stored = [e for e in await events_of(sub) if isinstance(e, BlockStored)]
        assert len(stored) == 3  # blocks 0-1 (tokens 0..39), 2-4 (..79), 5 (..99)
        assert [h for e in stored for h in e.block_hashes] == request_block_hashes(prompt, BLOCK, hash_seed=SEED)
        assert [e.parent_block_hash for e in stored] == [None, stored[0].block_hashes[-1], stored[1].block_hashes[-1]]
        assert [t for e in stored for t in e.token_ids] == prompt[:96]
        again = [o async for o in engine.generate("again", prompt, SamplingParams(max_tokens=1, ignore_eos=True))]
        assert again[-1].num_cached_tokens == 96  # the cached prefix runs across the chunk boundaries
    finally:
        await engine.stop()
        sub.close(linger=0)
        ctx.term()


async def test_lora_blocks_carry_vllm_s_adapter_id_and_the_adapter_name_in_their_hashes(served):
    engine, sub = served
    await run(engine, "base", PROMPT)
    await run(engine, "lora", PROMPT, "sql")
    engine.add_lora("chat", "/chat")  # a runtime load gets the next id, as vLLM's serving layer numbers them
    await run(engine, "lora2", PROMPT, "chat")
    stored = [e for e in await events_of(sub) if isinstance(e, BlockStored)]
    assert [e.lora_id for e in stored] == [None, 1, 2]
    assert stored[1].block_hashes == request_block_hashes(PROMPT, BLOCK, lora_name="sql", hash_seed=SEED)
    assert stored[2].block_hashes == request_block_hashes(PROMPT, BLOCK, lora_name="chat", hash_seed=SEED)


async def test_the_event_stream_reproduces_the_cache_through_evictions_and_preemptions(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    # 12 blocks, 4 sequences growing to 3-4 blocks each at once: the scheduler preempts (recompute) to make room
    engine, sub, ctx, preemptions = start(num_gpu_blocks=12, max_num_seqs=4)
    await engine.start()
    await asyncio.sleep(0.3)
    try:
        prompts = [[1000 * (i + 1) + t for t in range(20)] for i in range(8)]
        sequences = await asyncio.gather(*(run(engine, f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)))
        events = await events_of(sub)
        assert preemptions.count > 0
        assert any(isinstance(e, BlockRemoved) for e in events)
        check_chains(events, [(s, None) for s in sequences])
        assert replay_into_index(events) == cached_hashes(engine)
    finally:
        await engine.stop()
        sub.close(linger=0)
        ctx.term()


async def test_a_reset_clears_the_cache_with_all_blocks_cleared_but_not_while_blocks_are_in_use(served):
    engine, sub = served
    await run(engine, "a", PROMPT)
    running = asyncio.create_task(run(engine, "long", list(range(300, 340)), max_tokens=900))
    while engine.kv.num_free_blocks == engine.kv.num_blocks:
        await asyncio.sleep(0)
    assert engine.reset_prefix_cache() is False
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    assert engine.reset_prefix_cache() is True
    assert engine.kv._cached == {}
    await run(engine, "again", PROMPT)  # nothing cached: stored again from the start of the chain
    events = await events_of(sub)
    cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
    assert len(cleared) == 1
    assert events[cleared[0] + 1] == BlockStored(VLLM_PROMPT_HASHES, None, PROMPT[:32], 16, None, "GPU")
    assert replay_into_index(events) == cached_hashes(engine) == set(VLLM_PROMPT_HASHES)


async def test_sequence_numbers_are_gapless_and_replay_answers_as_vllm_even_after_malformed_requests(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    engine, sub, ctx, _ = start(num_gpu_blocks=8)
    await engine.start()
    await asyncio.sleep(0.3)
    try:
        for i in range(6):  # 6 prompts x 3 blocks through an 8-block cache: earlier blocks are re-allocated
            await run(engine, f"r{i}", [1000 * (i + 1) + t for t in range(50)])
        frames = await asyncio.to_thread(receive, sub)
        assert [seq for _, seq, _ in frames] == list(range(len(frames)))

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(engine.kv_events.replay_endpoint)
        dealer.send_multipart([b"", b"\x00" * 8, b"extra"])  # 4 frames at the ROUTER: ignored
        dealer.send(b"")  # 2 frames: ignored
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert await asyncio.to_thread(dealer.poll, 2000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        dealer.close(linger=0)
        assert replayed == [(seq, payload) for _, seq, payload in frames[1:]]
    finally:
        await engine.stop()
        sub.close(linger=0)
        ctx.term()


@pytest.mark.timing
@pytest.mark.parametrize("replay", [False, True])
def test_publishing_never_blocks_and_stays_bounded_when_nobody_reads(replay):
    """The replay buffer keeps the last buffer_steps batches for a replay socket, and none without one."""
    replay_endpoint = ', "replay_endpoint": "tcp://127.0.0.1:*"' if replay else ""
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "hwm": 10, "buffer_steps": 50,'
        f' "max_queue_size": 100{replay_endpoint}}}'
    )
    ctx = zmq.Context()
    publisher = ZmqEventPublisher(config, "t", ctx)
    stuck = ctx.socket(zmq.SUB)  # subscribed, never reads
    stuck.set_hwm(10)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(publisher.endpoint)
    time.sleep(0.2)
    batch = [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU")]
    try:
        started = time.monotonic()
        for _ in range(20_000):
            publisher.publish(KVEventBatch(0.0, list(batch)))
        assert time.monotonic() - started < 5.0
        deadline = time.monotonic() + 10
        while publisher.next_seq + publisher.dropped_batches < 20_000:
            assert time.monotonic() < deadline, "the publisher thread stalled"
            time.sleep(0.01)
        assert publisher.next_seq > 0 and len(publisher._buffer) == (50 if replay else 0)
        assert publisher._queue.qsize() == 0
    finally:
        publisher.close()
        stuck.close(linger=0)
        ctx.term()


def test_config_json_and_the_default_topic_per_replica():
    args = build_parser().parse_args(
        [
            "--port",
            "8100",
            "--replicas",
            "2",
            "--served-model-name",
            "m",
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*"}',
        ]
    )
    publishers = [build_kv_events(args, i) for i in range(2)]
    try:
        assert [p._topic for p in publishers] == [b"kv@127.0.0.1:8100@m", b"kv@127.0.0.1:8101@m"]
    finally:
        for p in publishers:
            p.close()
    assert build_kv_events(build_parser().parse_args([]), 0) is None
    for bad in ("[]", "{", '{"publisher": "kafka", "enable_kv_cache_events": true}', '{"nope": 1}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefix-caching-hash-algo", "md5"])
