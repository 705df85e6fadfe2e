"""Golden tests: our engine + torch executor produce Hugging Face transformers' greedy tokens, token for token —
single and batched, with prefix-cache hits, chunked prefill, preemption, and LoRA (against merged weights). Both in
float32, on the CPU and, where one is present, on a CUDA device (the reference runs on the same device)."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.request import SamplingParams
from modelserver.metrics import PrometheusStatLogger, prometheus_logger
from modelserver.torch.executor import TorchExecutor
from modelserver.torch.loader import load_model
from modelserver.torch.tiny import make_tiny_model
from protocol.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

PROMPTS = [
    "You are a helpful assistant. What is the capital of France?",
    "Translate the sentence into German, then into Spanish.",
    "def add(a, b): return a + b  # a small function",
    "The weather today is sunny with a light breeze from the west, and the temperature will reach twenty degrees.",
]
NEW_TOKENS = 10


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
    ],
)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), lora_names=["sql"], seed=3)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


def hf_greedy(model_dir, prompt_ids, device, lora_dir=None) -> list[int]:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if lora_dir is not None:  # the reference for an adapter: merged weights W + scale * B @ A
        config = json.loads((lora_dir / "adapter_config.json").read_text())
        scale = config["lora_alpha"] / config["r"]
        state = model.state_dict()
        for key, a in load_file(str(lora_dir / "adapter_model.safetensors")).items():
            if ".lora_A." in key:
                b = load_file(str(lora_dir / "adapter_model.safetensors"))[key.replace("lora_A", "lora_B")]
                target = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
                state[target] += scale * (b @ a)
        model.load_state_dict(state)
    model.to(device)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


async def run_engine(model_dir, prompts, device, loras=None, **config):
    cfg = EngineConfig(**{"num_gpu_blocks": 256, "block_size": 16, "enable_lora": True, "max_loras": 2, **config})
    model = load_model(model_dir, cfg.max_loras, cfg.max_lora_rank, device, torch.float32)
    executor = TorchExecutor(model, cfg.block_size, cfg.num_gpu_blocks, eos_token_id=None)
    engine = AsyncEngine(
        cfg,
        executor,
        model_name="tiny",
        stat_loggers=[PrometheusStatLogger(cfg, "tiny")],
        lora_modules={"sql": str(model_dir / "loras" / "sql")},
    )
    await engine.start()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(i, ids):
        tokens, last = [], None
        async for out in engine.generate(f"r{i}", ids, params, (loras or {}).get(i)):
            tokens += out.new_token_ids
            last = out
        return tokens, last.num_cached_tokens

    try:
        results = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        return results, engine, executor
    finally:
        await engine.stop()


def test_single_and_batched_match_transformers(tiny, tokenizer, device):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(tiny, ids, device) for ids in prompts]
    (single,), _, _ = asyncio.run(run_engine(tiny, prompts[:1], device))
    assert single[0] == expected[0]
    batched, _, _ = asyncio.run(run_engine(tiny, prompts, device))
    assert [tokens for tokens, _ in batched] == expected


def test_prefix_cache_hits_skip_compute_and_match(tiny, tokenizer, device):
    ids = tokenizer.encode(PROMPTS[3] * 2)
    expected = hf_greedy(tiny, ids, device)

    async def twice():
        cfg = EngineConfig(num_gpu_blocks=128, block_size=16)
        model = load_model(tiny, 1, 16, device, torch.float32)
        executor = TorchExecutor(model, 16, 128, eos_token_id=None)
        engine = AsyncEngine(cfg, executor, model_name="tiny")
        await engine.start()
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        runs = []
        try:
            for name in ("cold", "warm"):
                before = executor.tokens_computed
                tokens, cached = [], 0
                async for out in engine.generate(name, ids, params):
                    tokens += out.new_token_ids
                    cached = out.num_cached_tokens
                runs.append((tokens, cached, executor.tokens_computed - before))
        finally:
            await engine.stop()
        return runs

    (cold, cold_cached, cold_work), (warm, warm_cached, warm_work) = asyncio.run(twice())
    assert cold == expected and warm == expected
    assert cold_cached == 0 and warm_cached == 16 * ((len(ids) - 1) // 16)
    assert warm_work == cold_work - warm_cached  # exactly the cached tokens were not computed again


def test_chunked_prefill_matches(tiny, tokenizer, device):
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    expected = [hf_greedy(tiny, ids, device) for ids in prompts]
    results, _, _ = asyncio.run(run_engine(tiny, prompts, device, max_num_batched_tokens=7))
    assert [tokens for tokens, _ in results] == expected


def test_preemption_recompute_matches(tiny, tokenizer, device):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(tiny, ids, device) for ids in prompts]
    results, engine, _ = asyncio.run(run_engine(tiny, prompts, device, num_gpu_blocks=14, block_size=4))
    preemptions = prometheus_logger(engine.stat_loggers).registry.get_sample_value(
        "vllm:num_preemptions_total", {"model_name": "tiny", "engine": "0"}
    )
    assert preemptions > 0
    assert [tokens for tokens, _ in results] == expected


def test_lora_matches_merged_weights_in_a_mixed_batch(tiny, tokenizer, device):
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    lora_dir = tiny / "loras" / "sql"
    expected = [
        hf_greedy(tiny, prompts[0], device, lora_dir),
        hf_greedy(tiny, prompts[1], device),
        hf_greedy(tiny, prompts[2], device, lora_dir),
    ]
    assert expected[0] != hf_greedy(tiny, prompts[0], device)  # the adapter changes the output
    results, _, _ = asyncio.run(run_engine(tiny, prompts, device, loras={0: "sql", 2: "sql"}))
    assert [tokens for tokens, _ in results] == expected


def test_seeded_sampling_is_reproducible(device):
    from modelserver.engine.executor import ScheduledSequence
    from modelserver.torch.sampler import sample

    logits = torch.randn(2, 50, device=device)
    seqs = [
        ScheduledSequence("a", [1], 0, 1, [0], True, SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=5), 0, 3)
        for _ in range(2)
    ]
    assert sample(logits[:1], seqs[:1])[0] == sample(logits[:1], seqs[:1])[0]
    greedy = [ScheduledSequence("g", [1], 0, 1, [0], True, SamplingParams(temperature=0.0), 0, 0)]
    assert sample(logits[:1], greedy) == ([int(logits[0].argmax())], [None])
    wants = [ScheduledSequence("l", [1], 0, 1, [0], True, SamplingParams(temperature=0.0, logprobs=3), 0, 0)]
    (token,), (logprobs,) = sample(logits[:1], wants)
    assert token in logprobs and len(logprobs) == 3
    assert logprobs[token] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()))


def test_decodes_and_prefill_chunks_of_different_lengths_in_one_step_match(tiny, tokenizer, device, monkeypatch):
    prompts = [tokenizer.encode(p) for p in (PROMPTS[1], PROMPTS[3] * 6, PROMPTS[0], PROMPTS[2])]
    expected = [hf_greedy(tiny, ids, device) for ids in prompts]
    steps, step = [], TorchExecutor.step

    def recording_step(self, batch):
        steps.append([(seq.start, seq.num_new_tokens) for seq in batch.sequences])
        return step(self, batch)

    monkeypatch.setattr(TorchExecutor, "step", recording_step)
    results, _, _ = asyncio.run(run_engine(tiny, prompts, device, max_num_batched_tokens=24))
    assert [tokens for tokens, _ in results] == expected
    # the attention groups pad: some step holds a decode and prefill chunks of different lengths, one of them
    # continuing its prompt (after tokens computed in earlier steps); some holds decodes of different contexts
    assert any(
        any(n == 1 for _, n in s) and len({n for _, n in s if n > 1}) >= 2 and any(b > 0 for b, n in s if n > 1)
        for s in steps
    )
    assert any(len({b for b, n in s if n == 1}) >= 2 for s in steps)
