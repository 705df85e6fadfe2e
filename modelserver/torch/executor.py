"""TorchExecutor: runs each scheduled step through the transformer on the paged KV cache, in a worker thread so
the event loop (HTTP, other requests) stays responsive."""

from __future__ import annotations

import asyncio
import logging

import torch

from modelserver.engine.config import EngineConfig
from modelserver.engine.executor import ScheduledBatch, ScheduledSequence, StepOutput, load_loras
from modelserver.torch.loader import load_lora_into_slot, load_model
from modelserver.torch.model import AttentionGroup, StepInput, Transformer
from modelserver.torch.sampler import sample

log = logging.getLogger("modelserver.torch")
CPU_DEFAULT_BLOCKS = 2048


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


class TorchExecutor:
    def __init__(self, model: Transformer, block_size: int, num_gpu_blocks: int, eos_token_id: int | None):
        self.model = model
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.eos_token_id = eos_token_id
        self.device = next(model.parameters()).device
        c = model.config
        self.dtype = dtype = next(model.parameters()).dtype
        self.heads_per_kv = c.num_attention_heads // c.num_key_value_heads
        shape = (num_gpu_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(c.num_hidden_layers)
        ]
        self.tokens_computed = 0  # tokens that actually went through the model (cached prefixes do not)

    @classmethod
    def from_args(cls, args, config: EngineConfig) -> TorchExecutor:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        model = load_model(args.model, config.max_loras, config.max_lora_rank, device, dtype)
        num_blocks = args.num_gpu_blocks or cls.blocks_for_memory(model, config, device)
        from protocol.tokenizer import load_tokenizer

        eos = load_tokenizer(args.model).eos_token_id
        log.info("torch executor: %s %s, %d KV blocks of %d tokens", device, dtype, num_blocks, config.block_size)
        return cls(model, config.block_size, num_blocks, eos)

    @staticmethod
    def blocks_for_memory(model: Transformer, config: EngineConfig, device: torch.device) -> int:
        """Like vLLM: the KV blocks that fit in gpu_memory_utilization of the GPU after the weights; CPU: fixed."""
        if device.type != "cuda":
            return CPU_DEFAULT_BLOCKS
        c = model.config
        element = next(model.parameters()).element_size()
        per_block = 2 * c.num_hidden_layers * config.block_size * c.num_key_value_heads * c.head_dim * element
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free)
        return max(16, int(budget // per_block))

    def load_lora(self, slot: int, name: str, path: str) -> None:
        load_lora_into_slot(self.model, slot, path)
        log.info("LoRA adapter %s loaded into slot %d", name, slot)

    async def execute(self, batch: ScheduledBatch) -> StepOutput:
        return await asyncio.to_thread(self.step, batch)

    def step(self, batch: ScheduledBatch) -> StepOutput:
        failed = load_loras(self, batch.new_lora_loads) if batch.new_lora_loads else {}
        step = self.prepare(batch.sequences)
        self.tokens_computed += step.input_ids.shape[0]
        logits = self.model(step, self.kv_caches)
        samplers = [seq for seq in batch.sequences if seq.samples]
        tokens, logprobs = sample(logits, samplers) if samplers else ([], [])
        picked, lps = iter(tokens), iter(logprobs)
        out = [(next(picked), next(lps)) if seq.samples else (None, None) for seq in batch.sequences]
        return StepOutput([t for t, _ in out], [lp for _, lp in out] if any(logprobs) else None, failed)

    def prepare(self, sequences: list[ScheduledSequence]) -> StepInput:
        """The step's tensors, built here once rather than in every layer."""
        ids, positions, sample_rows = [], [], []
        lora_rows: dict[int, list[int]] = {}
        decodes, prefills = [], []  # (first flat token, sequence)
        for seq in sequences:
            begin, end_pos = len(ids), seq.start + seq.num_new_tokens
            ids += seq.token_ids[seq.start : end_pos]
            positions += range(seq.start, end_pos)
            if seq.lora_slot:
                lora_rows.setdefault(seq.lora_slot, []).extend(range(begin, len(ids)))
            # one token per sequence attends unpadded; a prefill chunk padded to the decodes' single query would
            # multiply their attention work by its length, so the chunks form a group of their own
            (decodes if seq.num_new_tokens == 1 else prefills).append((begin, seq))
            if seq.samples:
                sample_rows.append(len(ids) - 1)
        device = self.device
        slot_mapping = torch.empty(len(ids), dtype=torch.long)  # each group writes its new tokens' slots
        attention = [
            AttentionGroup.build(
                [begin for begin, _ in group],
                [seq.start for _, seq in group],
                [seq.num_new_tokens for _, seq in group],
                [seq.block_table for _, seq in group],
                self.block_size,
                self.heads_per_kv,
                self.dtype,
                device,
                slot_mapping,
            )
            for group in (decodes, prefills)
            if group
        ]
        return StepInput(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=slot_mapping.to(device),
            lora_rows=[(slot, torch.tensor(rows, device=device)) for slot, rows in lora_rows.items()],
            attention=attention,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        )

    async def close(self) -> None:
        self.kv_caches = []
