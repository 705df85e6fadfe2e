"""KV events from the real block manager, received by a real ZMQ subscriber and decoded from msgpack."""

import asyncio

import msgspec
import pytest
import zmq

from modelserver.cli import build_kv_events, build_parser
from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.kv_events import ZmqEventPublisher
from modelserver.engine.request import SamplingParams
from modelserver.engine.sim import SimExecutor, SimTiming
from protocol.kv_events import END_SEQ, BlockRemoved, BlockStored, KVEventBatch, KVEventsConfig

FILLER = list(range(100, 164))
BLOCK = 16


def start(num_gpu_blocks: int = 64, replay: bool = True) -> tuple[AsyncEngine, zmq.Socket, zmq.Context]:
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "buffer_steps": 100'
        + (', "replay_endpoint": "tcp://127.0.0.1:*"' if replay else "")
        + "}"
    )
    ctx = zmq.Context()
    publisher = ZmqEventPublisher(config, "kv@127.0.0.1:8000@m", ctx)
    cfg = EngineConfig(num_gpu_blocks=num_gpu_blocks, block_size=BLOCK, enable_lora=True)
    engine = AsyncEngine(
        cfg,
        SimExecutor(SimTiming.zero(), BLOCK, num_gpu_blocks, FILLER),
        model_name="m",
        lora_modules={"sql": "/sql"},
        kv_events=publisher,
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    return engine, sub, ctx


async def run(engine: AsyncEngine, rid: str, prompt: list[int], lora: str | None = None) -> None:
    async for _ in engine.generate(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), lora):
        pass


def receive(sub: zmq.Socket, timeout_ms: int = 2000) -> list[tuple[bytes, int, bytes]]:
    frames = []
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        frames.append((topic, int.from_bytes(seq, "big"), payload))
        timeout_ms = 200
    return frames


@pytest.fixture
async def served():
    engine, sub, ctx = start()
    await engine.start()
    await asyncio.sleep(0.3)  # the SUB socket's connection is up before anything is published
    yield engine, sub
    await engine.stop()
    sub.close(linger=0)
    ctx.term()


async def test_a_prompt_s_full_blocks_are_announced_in_vllm_s_wire_format(served):
    engine, sub = served
    prompt = list(range(1, 41))  # 2 full blocks + 8 tokens
    await run(engine, "a", prompt)
    frames = await asyncio.to_thread(receive, sub)
    assert frames and frames[0][0] == b"kv@127.0.0.1:8000@m"
    assert [seq for _, seq, _ in frames] == list(range(len(frames)))
    raw = msgspec.msgpack.decode(frames[0][2])  # array-like, tagged: [ts, [[tag, fields...]]]
    assert isinstance(raw[0], float)
    tag, hashes, parent, token_ids, block_size, lora_id, medium = raw[1][0]
    assert (tag, parent, token_ids, block_size, lora_id, medium) == ("BlockStored", None, prompt[:32], 16, None, "GPU")
    # the chain: block i's hash is hash(parent's hash, its tokens), from the adapter name (None) on
    first = hash((hash(None), *prompt[:16]))
    assert hashes == [first, hash((first, *prompt[16:32]))]
    batch = msgspec.msgpack.decode(frames[0][2], type=KVEventBatch)
    assert batch.events[0] == BlockStored(hashes, None, prompt[:32], 16, None, "GPU")


async def test_a_continued_conversation_announces_only_new_blocks_with_its_parent(served):
    engine, sub = served
    prompt = list(range(1, 41))
    await run(engine, "a", prompt)
    longer = prompt + list(range(41, 81))  # 5 blocks: 2 cached, 3 new
    await run(engine, "b", longer)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events = [e for _, _, p in await asyncio.to_thread(receive, sub) for e in decoder.decode(p).events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 2
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[1].token_ids == longer[32:80] and len(stored[1].block_hashes) == 3


async def test_lora_blocks_carry_a_lora_id_and_a_different_chain(served):
    engine, sub = served
    prompt = list(range(1, 41))
    await run(engine, "base", prompt)
    await run(engine, "lora", prompt, "sql")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    stored = [e for _, _, p in await asyncio.to_thread(receive, sub) for e in decoder.decode(p).events]
    assert [e.lora_id for e in stored] == [None, 1]
    assert not set(stored[0].block_hashes) & set(stored[1].block_hashes)


async def test_evictions_are_announced_and_sequence_numbers_are_gapless_and_replayable():
    engine, sub, ctx = start(num_gpu_blocks=8)
    await engine.start()
    await asyncio.sleep(0.3)
    try:
        for i in range(6):  # 6 prompts x 3 blocks through an 8-block cache: earlier blocks are re-allocated
            await run(engine, f"r{i}", [1000 * (i + 1) + t for t in range(50)])
        frames = await asyncio.to_thread(receive, sub)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        events = [e for _, _, p in frames for e in decoder.decode(p).events]
        stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed and set(removed) <= stored  # only what was announced is removed, each once
        assert len(removed) == len(set(removed))
        assert len(stored) - len(removed) <= 8  # what the index would hold fits the cache
        assert [seq for _, seq, _ in frames] == list(range(len(frames)))

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(engine.kv_events.replay_endpoint)
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
