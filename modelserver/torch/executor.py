"""TorchExecutor: runs each scheduled step through the transformer on the paged KV cache, in a worker thread so
the event loop (HTTP, other requests) stays responsive."""

from __future__ import annotations

import asyncio
import logging

import torch

from modelserver.engine.config import EngineConfig
from modelserver.engine.executor import ScheduledBatch, StepOutput, load_loras
from modelserver.torch.loader import load_lora_into_slot, load_model
from modelserver.torch.model import StepInput, Transformer
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
        dtype = next(model.parameters()).dtype
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
        ids, positions, slots, loras = [], [], [], []
        slices, contexts, starts, sample_rows, samplers = [], [], [], [], []
        bs = self.block_size
        for seq in batch.sequences:
            begin = len(ids)
            end_pos = seq.start + seq.num_new_tokens
            table = torch.tensor(seq.block_table, dtype=torch.long)
            context = torch.arange(end_pos)
            context_slots = table[context // bs] * bs + context % bs
            ids += seq.token_ids[seq.start : end_pos]
            positions.append(torch.arange(seq.start, end_pos))
            slots.append(context_slots[seq.start :])
            loras += [seq.lora_slot] * seq.num_new_tokens
            slices.append((begin, len(ids)))
            contexts.append(context_slots.to(self.device))
            starts.append(seq.start)
            if seq.samples:
                sample_rows.append(len(ids) - 1)
                samplers.append(seq)
        device = self.device
        step = StepInput(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.cat(positions).to(device),
            slot_mapping=torch.cat(slots).to(device),
            lora_slots=torch.tensor(loras, dtype=torch.long, device=device),
            seq_slices=slices,
            seq_context_slots=contexts,
            seq_starts=starts,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        )
        self.tokens_computed += len(ids)
        logits = self.model(step, self.kv_caches)
        tokens, logprobs = sample(logits, samplers) if samplers else ([], [])
        picked, lps = iter(tokens), iter(logprobs)
        out = [(next(picked), next(lps)) if seq.samples else (None, None) for seq in batch.sequences]
        return StepOutput([t for t, _ in out], [lp for _, lp in out] if any(logprobs) else None, failed)

    async def close(self) -> None:
        self.kv_caches = []
