"""precise-prefix-cache-scorer: the server's own block hashes from the EPP's exact tokens, scored against the KV-event
index; a mixed pool (endpoints with and without events) with the approximate scorer; the approximate index learning
from the servers' cached_tokens."""

import asyncio
import itertools
import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from epp.datalayer.kv_events import KVBlockIndex
from epp.predictor import LatencyPredictor
from epp.scheduling.plugins import build_plugin
from epp.scheduling.plugins.precise_prefix_cache_scorer import PROMPT_BLOCKS, BlockHashCache, PromptBlocks
from epp.scheduling.plugins.prefix_cache_scorer import PREFIX_HASHES
from epp.scheduling.predictions import CandidatePredictions
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, SchedulingResult
from protocol.kv_events import request_block_hashes
from protocol.openai import prompt_text
from protocol.tokenizer import load_tokenizer
from tests.epp.helpers import endpoint

SEED = "1234"
CONTEXT = "You are a helpful assistant. Answer the question concisely and accurately. " * 30


def chat(question: str, model: str = "m") -> dict:
    return {"model": model, "messages": [{"role": "system", "content": CONTEXT}, {"role": "user", "content": question}]}


def request(payload: dict) -> SchedulingRequest:
    return SchedulingRequest(request_id="r", model=payload["model"], prompt=prompt_text(payload), payload=payload)


def server_hashes(payload: dict, lora_name=None) -> list[int]:
    """What a sim server with PYTHONHASHSEED=SEED announces for this request (its tokenizer, its block hashes)."""
    tokenizer = load_tokenizer(None)
    if "messages" in payload:
        ids = tokenizer.encode(tokenizer.apply_chat_template(payload["messages"]))
    else:
        ids = tokenizer.encode(payload["prompt"])
    return request_block_hashes(ids, 16, hash_seed=SEED, lora_name=lora_name)


# The tests score the held run over the whole prompt (scoreBeyondShared off) unless they say otherwise: its
# arithmetic is what they check; test_beyond_shared_... checks what the default takes off it.
WHOLE_PROMPT = {"hashSeed": SEED, "loadGuardQueueGap": 0, "scoreBeyondShared": False}


def precise(index: KVBlockIndex, **parameters):
    scorer = build_plugin("precise-prefix-cache-scorer", {**WHOLE_PROMPT, **parameters})
    scorer.use_kv_index(index)
    return scorer


def both_prefix_scorers(**precise_parameters) -> Scheduler:
    """A profile of the two prefix scorers, as a pool that mixes endpoints with and without KV events needs."""
    precise_parameters = {**WHOLE_PROMPT, **precise_parameters}
    plugins = [("prefix-cache-scorer", {"loadGuardQueueGap": 0}), ("precise-prefix-cache-scorer", precise_parameters)]
    config = {
        "plugins": [{"type": name, "parameters": parameters} for name, parameters in plugins],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": name} for name, _ in plugins]}],
    }
    return Scheduler.from_config(json.dumps(config))  # (JSON is YAML)


def prepared(scorer, payload) -> tuple[CycleState, SchedulingRequest]:
    cycle_state, req = CycleState(), request(payload)
    scorer.prepare(cycle_state, req)
    return cycle_state, req


def test_the_prompt_s_hashes_are_the_server_s_and_score_the_held_prefix():
    pool = [endpoint(0), endpoint(1), endpoint(2)]
    index = KVBlockIndex()
    payload = chat("What is the capital of France?")
    hashes = server_hashes(payload)
    assert len(hashes) > 10
    index.saw(pool[0].hostport, "m")
    index.store(pool[0].hostport, hashes)  # it served this very prompt
    index.saw(pool[1].hostport, "m")
    index.store(pool[1].hostport, hashes[: len(hashes) // 2])  # it holds half (the rest was evicted)
    index.saw(pool[2].hostport, "m")  # it publishes, and holds none of it
    scorer = precise(index)
    cycle_state, req = prepared(scorer, payload)
    assert cycle_state.read(PROMPT_BLOCKS) == PromptBlocks(hashes, len(hashes))  # held to its end: read whole
    scores = scorer.score(cycle_state, req, pool)
    assert scores == [1.0, (len(hashes) // 2) / len(hashes), 0.0]
    # another question on the same context: the context's blocks still match
    other_state, other = prepared(scorer, chat("How many days are there in a year?"))
    assert 0.5 < scorer.score(other_state, other, pool)[0] < 1.0


def test_beyond_shared_a_prefix_every_candidate_holds_counts_for_nothing():
    pool = [endpoint(0), endpoint(1), endpoint(2)]
    index = KVBlockIndex()
    payload = chat("What is the capital of France?")
    hashes = server_hashes(payload)
    shared = len(hashes) - 4  # the context, held everywhere, as an agent's tools prompt is
    for e, held in zip(pool, (hashes, hashes[:shared], hashes[: shared + 2]), strict=True):
        index.saw(e.hostport, "m")
        index.store(e.hostport, held)
    plain, beyond = precise(index), precise(index, scoreBeyondShared=True)
    assert build_plugin("precise-prefix-cache-scorer", {"hashSeed": SEED}).beyond_shared  # the default
    cycle_state, req = prepared(plain, payload)
    assert plain.score(cycle_state, req, pool) == [1.0, shared / len(hashes), (shared + 2) / len(hashes)]
    assert beyond.score(cycle_state, req, pool) == [1.0, 0.0, 0.5]
    for e in pool[1:]:
        index.store(e.hostport, hashes)  # every candidate holds all of it: no preference
    cycle_state, req = prepared(beyond, payload)  # (a cycle looks the index up once: PromptBlocks.held_by)
    assert beyond.score(cycle_state, req, pool) is None


def test_beyond_shared_nothing_is_shared_while_a_candidate_has_published_nothing():
    # a new pool: the first request's server has sent its events, the other none yet; the next request with that
    # prompt goes back to it (were what the one publisher holds taken as shared, it would score nothing)
    pool = [endpoint(0), endpoint(1)]
    index = KVBlockIndex()
    payload = chat("What is the capital of France?")
    index.saw(pool[0].hostport, "m")
    index.store(pool[0].hostport, server_hashes(payload))
    beyond = precise(index, scoreBeyondShared=True)
    cycle_state, req = prepared(beyond, payload)
    assert beyond.score(cycle_state, req, pool) == [1.0, 0.0]


def test_an_adapter_s_blocks_carry_its_name_and_the_block_size_comes_from_the_events():
    index = KVBlockIndex()
    index.saw("127.0.0.1:8000", "base")
    index.block_size = 32
    scorer = precise(index)
    payload = {"model": "my-adapter", "prompt": "the quick brown fox jumps over the lazy dog " * 20}
    ids = load_tokenizer(None).encode(payload["prompt"])
    hashes = request_block_hashes(ids, 32, hash_seed=SEED, lora_name="my-adapter")
    index.store("127.0.0.1:8000", hashes)
    cycle_state, _ = prepared(scorer, payload)
    assert cycle_state.read(PROMPT_BLOCKS).hashes == hashes


def test_blocks_are_read_only_up_to_the_first_one_no_endpoint_s_run_holds():
    """Hashing stops where every endpoint's run of leading blocks has ended: the matches are those of the whole
    prompt's hashes, the rest is not tokenized, and the block count is estimated (here within 6 %)."""
    pool = [endpoint(0), endpoint(1), endpoint(2)]
    index = KVBlockIndex()
    payload = {"model": "m", "prompt": "".join(f"line {i}: the weather today is sunny, " for i in range(400))}
    hashes = server_hashes(payload)
    assert len(hashes) > 100
    for e in pool:
        index.saw(e.hostport, "m")
    index.store(pool[0].hostport, hashes[:12])
    index.store(pool[1].hostport, hashes[:5] + hashes[6:40])  # it lost block 5: its run ends there
    scorer = precise(index)
    misses = scorer.tokenizer.misses
    cycle_state, req = prepared(scorer, payload)
    prompt_blocks = cycle_state.read(PROMPT_BLOCKS)
    assert prompt_blocks.hashes == hashes[:12]
    assert scorer.tokenizer.misses - misses < 5  # a few 1,024-character segments of the ~14,000
    assert abs(prompt_blocks.blocks - len(hashes)) <= 0.1 * len(hashes)  # 300 against 317 (longer numbers later)
    matched = [round(s * prompt_blocks.blocks) for s in scorer.score(cycle_state, req, pool)]
    assert matched == [12, 5, 0] == [index.prefix_blocks(hashes, [e.hostport])[e.hostport] for e in pool]


def test_a_long_prompt_no_endpoint_holds_costs_one_segment():
    index = KVBlockIndex()
    index.saw(endpoint(0).hostport, "m")
    scorer = precise(index)
    payload = {"model": "m", "prompt": "a prompt nobody has sent before, " * 400}
    misses = scorer.tokenizer.misses
    cycle_state, req = prepared(scorer, payload)
    assert scorer.tokenizer.misses - misses == 1  # of 13 segments
    assert cycle_state.read(PROMPT_BLOCKS).hashes == []
    assert scorer.score(cycle_state, req, [endpoint(0)]) == [0.0]


def test_nothing_is_tokenized_while_no_endpoint_publishes_and_the_load_guard_applies():
    pool = [endpoint(0, waiting=8), endpoint(1)]
    index = KVBlockIndex()
    scorer = precise(index, loadGuardQueueGap=16)
    payload = chat("What is the capital of France?")
    cycle_state, req = prepared(scorer, payload)
    assert cycle_state.read(PROMPT_BLOCKS) is None and scorer.score(cycle_state, req, pool) is None
    index.saw(pool[0].hostport, "m")
    index.store(pool[0].hostport, server_hashes(payload))
    cycle_state, req = prepared(scorer, payload)
    assert scorer.score(cycle_state, req, pool) == [0.5, 0.0]  # 8 queued beyond the other: half its score


async def test_a_long_prompt_is_prepared_in_a_worker_thread_and_mixed_pools_use_both_scorers():
    scheduler = both_prefix_scorers(threadPromptChars=1000)
    assert scheduler.requires_kv_events
    index = KVBlockIndex()
    scheduler.use_kv_index(index)
    pool = [endpoint(0), endpoint(1), endpoint(2)]  # 0 and 1 publish KV events, 2 does not
    payload = chat("What is the capital of France?")
    index.saw(pool[0].hostport, "m")
    index.saw(pool[1].hostport, "m")
    index.store(pool[1].hostport, server_hashes(payload))
    req = request(payload)
    first = scheduler.prepare(req)
    assert asyncio.iscoroutine(first)  # longer than threadPromptChars
    result = scheduler.schedule(req, pool, await first)
    assert result.primary is pool[1]
    scheduler.on_routed(req, result)
    # the approximate index skipped the publishing pick; route the same prompt to the silent endpoint 2
    approx = scheduler.profile.scorers[0][0]
    state = CycleState()
    approx.score(state, request(payload), pool)
    approx.pre_request(request(payload), SchedulingResult([pool[2]], cycle_state=state))
    again = request(payload)
    prepared = scheduler.prepare(again)
    assert isinstance(prepared, CycleState)  # its tokens are cached now: no thread hop
    result = scheduler.schedule(again, pool, prepared)
    scores = {name.type: s for name, s in result.raw_scores.items()}
    assert scores["prefix-cache-scorer"] == [0.0, 0.0, 1.0]  # endpoints 0 and 1 are the precise scorer's
    assert scores["precise-prefix-cache-scorer"] == [0.0, 1.0, 0.0]


def test_until_an_endpoint_publishes_kv_events_the_precise_scorer_is_not_called():
    """With no publisher the precise scorer would prepare nothing and abstain: the cycle leaves it out (no call, no
    timing) and the approximate scorer scores every endpoint. Once one endpoint publishes, it prepares and scores."""
    scheduler = both_prefix_scorers()
    index = KVBlockIndex()
    scheduler.use_kv_index(index)
    pool = [endpoint(0), endpoint(1)]
    payload = chat("What is the capital of France?")
    silent = request(payload)
    state = scheduler.prepare(silent)
    result = scheduler.schedule(silent, pool, state)
    assert [name.type for name, _ in result.timings] == ["prefix-cache-scorer", "max-score-picker"]
    assert state.read(PROMPT_BLOCKS) is None and state.read(PREFIX_HASHES)  # the approximate scorer hashed it
    index.saw(pool[1].hostport, "m")
    index.store(pool[1].hostport, server_hashes(payload))
    publishing = request(payload)
    state = scheduler.prepare(publishing)
    result = scheduler.schedule(publishing, pool, state)
    assert [name.type for name, _ in result.timings] == [
        "precise-prefix-cache-scorer",
        "prefix-cache-scorer",
        "precise-prefix-cache-scorer",
        "max-score-picker",
    ]  # its preparation, then the scorers and the picker
    assert result.raw_scores[scheduler.profile.scorers[1][0].typed_name] == [0.0, 1.0]
    assert result.primary is pool[1]


def test_the_approximate_index_learns_from_the_servers_cached_tokens():
    scorer = build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": 0})
    e = endpoint(0, num_gpu_blocks=1000)
    prompts = [f"tenant {i}: " + CONTEXT for i in range(4)]

    def route(prompt, cached_tokens):
        state, req = CycleState(), SchedulingRequest(request_id="r", model="m", prompt=prompt)
        scorer.score(state, req, [e])
        result = SchedulingResult([e], cycle_state=state)
        scorer.pre_request(req, result)
        blocks = len(state.read(PREFIX_HASHES))
        scorer.response_complete(
            req, result, e, ResponseInfo("200", prompt_tokens=blocks * 16, cached_tokens=cached_tokens)
        )

    for prompt in prompts:
        route(prompt, 0)
    assert "e0" not in scorer._capacity or scorer._capacity["e0"] == 1000  # it believed none cached: nothing learnt
    route(prompts[0], 0)  # the index believed all of it cached; the server had none: it keeps fewer blocks
    capacity = scorer._capacity["e0"]
    assert capacity < 1000 and len(scorer._held["e0"]) <= capacity
    route(prompts[1], 0)
    assert scorer._capacity["e0"] < capacity


def test_the_latency_predictor_s_cached_tokens_come_from_the_kv_index_for_publishing_endpoints():
    pool = [endpoint(0), endpoint(1)]
    index = KVBlockIndex()
    payload = chat("What is the capital of France?")
    hashes = server_hashes(payload)
    index.saw(pool[0].hostport, "m")
    index.store(pool[0].hostport, hashes[:10])
    approx = build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": 0})
    approx.use_kv_index(index)
    cycle_state, req = prepared(precise(index), payload)
    assert approx.cached_tokens(cycle_state, req, pool) == [10 * 16, 0]
    assert cycle_state.read(PREFIX_HASHES)  # endpoint 1 does not publish: the text's blocks were hashed for it
    # every endpoint publishing: the exact index answers for all, and the prompt's text is not hashed at all
    index.saw(pool[1].hostport, "m")
    index.store(pool[1].hostport, hashes[:3])
    cycle_state, req = prepared(precise(index), payload)
    assert approx.cached_tokens(cycle_state, req, pool) == [10 * 16, 3 * 16]
    assert cycle_state.read(PREFIX_HASHES) is None


WORDS = ["the", "weather", "today", "is", "sunny,", "line", "déjà", "vu", "🙂", "\n", "x" * 40, "42", "a-b"]


@settings(max_examples=60)
@given(
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=1200),
    runs=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), min_size=1, max_size=3),
    chat_request=st.booleans(),
)
def test_reading_a_prompt_in_segments_matches_what_its_whole_hashes_match(words, runs, chat_request):
    """Whatever the prompt (any length, segment boundaries anywhere, a chat template or not) and whatever runs of
    its blocks the endpoints hold (a run, then a lost block, then more), each endpoint's matched blocks are those the
    whole prompt's server hashes match."""
    text = " ".join(words)
    payload = chat(text) if chat_request else {"model": "m", "prompt": text}
    hashes = server_hashes(payload)
    pool = [endpoint(i) for i in range(len(runs))]
    index = KVBlockIndex()
    for e, (held, gap) in zip(pool, runs, strict=True):
        index.saw(e.hostport, "m")
        index.store(e.hostport, hashes[:held] + hashes[held + 1 : held + 1 + gap])
    scorer = precise(index)
    cycle_state, req = prepared(scorer, payload)
    prompt_blocks = cycle_state.read(PROMPT_BLOCKS)
    expected = index.prefix_blocks(hashes, [e.hostport for e in pool])
    if not hashes:
        assert prompt_blocks is None or not prompt_blocks.blocks
        return
    matched = [round(s * prompt_blocks.blocks) for s in scorer.score(cycle_state, req, pool)]
    assert matched == [expected.get(e.hostport, 0) for e in pool]
    assert prompt_blocks.hashes == hashes[: max(expected.values(), default=0)]


def test_block_digests_come_from_the_cache_for_a_known_prefix_and_equal_the_servers_for_any_ids():
    cache = BlockHashCache("sha256", SEED, capacity=1000)
    rng = random.Random(7)
    ids = [rng.randrange(1 << 32) for _ in range(100)] + [0, (1 << 32) - 1] * 8  # the whole unsigned 32-bit range
    cut = [ids[:5], ids[5:40], ids[40:41], ids[41:]]  # pieces of any length, blocks straddling them
    for lora in (None, "my-adapter"):
        assert list(itertools.chain.from_iterable(cache.hashes(cut, 16, lora))) == request_block_hashes(
            ids, 16, hash_seed=SEED, lora_name=lora
        )
    cached = len(cache._digests)
    longer = ids + [3] * 16  # one more block: only it is hashed anew
    assert list(itertools.chain.from_iterable(cache.hashes([longer], 16, None))) == request_block_hashes(
        longer, 16, hash_seed=SEED
    )
    assert len(cache._digests) == cached + 1
    # token ids no 32-bit vocabulary has name no real token: nothing to match, the scorer abstains
    index = KVBlockIndex()
    index.saw("127.0.0.1:8000", "m")
    state, req = prepared(precise(index), {"model": "m", "prompt": [1 << 32] * 64})
    assert state.read(PROMPT_BLOCKS) is None and precise(index).score(state, req, [endpoint(0)]) is None


def test_the_pieces_table_stays_within_its_capacity_and_its_answers_stay_exact():
    cache = BlockHashCache("sha256", SEED, capacity=64)
    rng = random.Random(11)
    for _ in range(40):  # 40 prompts of 4 pieces of 2 blocks: 320 blocks through a 64-block table
        ids = [rng.randrange(1 << 16) for _ in range(128)]
        pieces = [ids[i : i + 32] for i in range(0, 128, 32)]
        assert list(itertools.chain.from_iterable(cache.hashes(pieces, 16, None))) == request_block_hashes(
            ids, 16, hash_seed=SEED
        )
        assert cache._piece_blocks <= 64 and cache._piece_blocks == sum(len(p[0]) for p in cache._pieces.values())


def test_a_server_new_to_the_pool_is_expected_to_hold_what_every_publisher_holds():
    """The agentic workload's lock-in (docs/2026-11-30-replicas-notebook.md, "Agent sessions locked onto the first
    servers"): two servers hold the shared tools prompt (here the system prompt) and are busy, two have never been sent
    a request. A new session's prompt differs from theirs only after the shared prefix. Counted as a miss on the new
    servers (~10x the busy ones' TTFT for a long shared prompt), the new session went to a busy holder, with the scorers
    alone and with a trained latency predictor (whose filter then dropped the new servers), so the servers that happened
    to be sent that prompt first kept every new session. The new servers are expected to hold what every publisher
    holds: the idle ones win."""
    from tests.epp.predictor.conftest import train

    index = KVBlockIndex()
    earlier = chat("Fix the failing test in the parser module.")
    new_session = chat("Add a command-line flag that prints the version.")
    busy = [endpoint(0, waiting=1, running=3, in_flight=2, in_flight_tokens=3000), endpoint(1, waiting=1, running=4)]
    pool = [*busy, endpoint(2), endpoint(3)]
    for predicting in (False, True):
        predictor = LatencyPredictor(min_observations=50)
        if predicting:
            train(predictor)
        scheduler = Scheduler.from_config(None, CandidatePredictions(predictor))
        scheduler.use_kv_index(index)
        precise_scorer = next(
            p for p in scheduler.profile.plugins if p.typed_name.type == "precise-prefix-cache-scorer"
        )
        hashes = request_block_hashes(
            load_tokenizer(None).encode(load_tokenizer(None).apply_chat_template(earlier["messages"])),
            16,
            hash_seed=precise_scorer.hash_seed,
        )
        for e in busy:
            index.saw(e.hostport, "m")
            index.store(e.hostport, hashes)
        req = request(new_session)
        state = scheduler.prepare(req)
        blocks = state.read(PROMPT_BLOCKS)
        assert 0 < blocks.common(index, [e.hostport for e in busy], len(pool)) < blocks.blocks
        result = scheduler.schedule(req, pool, state)
        assert result.primary in pool[2:], (predicting, result.totals)
        assert all(e in result.candidates for e in pool[2:])  # the latency filter kept the new servers
        # what the predictor learns from (the pick's features) counts what is known: nothing on the new servers
        cached = scheduler.predictions.cached(state, req, pool)
        assert cached[0] == cached[1] > 0 and cached[2:] == [0, 0]


def test_beyond_shared_is_what_the_scored_candidates_hold_after_the_predictor_looked_at_the_whole_pool():
    """The latency predictor asks for every candidate before its filter drops some; the scorer after it takes off
    what the candidates it scores all hold (a shared system prompt that a dropped endpoint lacks still counts for
    nothing), as with no predictor."""
    pool = [endpoint(0), endpoint(1), endpoint(2)]
    index = KVBlockIndex()
    payload = chat("What is the capital of France?")
    hashes = server_hashes(payload)
    shared = len(hashes) - 4
    for e, held in zip(pool, (hashes, hashes[:shared], hashes[:1]), strict=True):
        index.saw(e.hostport, "m")
        index.store(e.hostport, held)
    approx = build_plugin("prefix-cache-scorer", {"loadGuardQueueGap": 0})
    approx.use_kv_index(index)
    beyond = precise(index, scoreBeyondShared=True)
    cycle_state, req = prepared(beyond, payload)
    assert approx.unknown_endpoint_tokens(cycle_state, req, pool) == [0, 0, 0]  # every one publishes
    assert beyond.score(cycle_state, req, pool[:2]) == [1.0, 0.0]  # endpoint 2 dropped by a filter
