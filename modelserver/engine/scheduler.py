"""Continuous batching with chunked prefill and preemption by recompute (vLLM V1's unified scheduler, simplified).

Each step has a token budget (`max_num_batched_tokens`). Running requests go first (a decode costs one token, an
unfinished prefill continues in chunks), then waiting ones in arrival order while the budget, `max_num_seqs` and
free KV blocks last. When a running request cannot get a block, the newest running request is preempted: its
blocks are freed (they stay in the prefix cache) and it goes to the front of the waiting queue to recompute.
A waiting request for a LoRA adapter that would exceed `max_loras` distinct adapters in the batch is deferred,
and the scan continues behind it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from modelserver.engine.block_manager import KVCacheManager
from modelserver.engine.config import EngineConfig
from modelserver.engine.executor import ScheduledBatch, ScheduledSequence, StepOutput
from modelserver.engine.lora import LoRASlots
from modelserver.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from modelserver.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats


@dataclass(slots=True)
class SchedulerOutput:
    batch: ScheduledBatch
    requests: list[Request]  # parallel to batch.sequences
    newly_scheduled: list[Request] = field(default_factory=list)
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, loras: LoRASlots, eos_token_id: int | None = None):
        self.config = config
        self.kv = kv
        self.loras = loras
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        # The stop conditions as plain numbers and a set, so the per-token check on the step is two comparisons.
        params = request.params
        request.max_len = min(
            request.num_prompt_tokens + params.max_tokens, self.config.max_model_len, self.kv.capacity_tokens
        )
        request.min_len = request.num_prompt_tokens + params.min_tokens
        stop_ids = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_token_id)
        request.stop_ids = stop_ids
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1  # QUEUED and first SCHEDULED stay: vLLM V1 counts the wait into the intervals
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        kv = self.kv
        sequences: list[ScheduledSequence] = []
        requests: list[Request] = []
        newly: list[Request] = []
        num_preemptions = 0
        uncached_prefill = decode = 0

        def emit(request: Request, num_new: int) -> None:
            nonlocal uncached_prefill, decode
            start = request.num_computed_tokens
            samples = start + num_new == len(request.token_ids)
            if samples and num_new == 1 and start >= request.num_prompt_tokens:
                decode += 1
            else:
                uncached_prefill += num_new
            seq = request.scheduled  # one object per request, refreshed each step: no allocation per decode
            if seq is None:
                seq = request.scheduled = ScheduledSequence(
                    request.request_id, request.token_ids, 0, 0, request.block_ids, False, request.params, 0, 0
                )
            seq.start = start
            seq.num_new_tokens = num_new
            seq.block_table = request.block_ids
            seq.samples = samples
            seq.lora_slot = request.lora_slot
            seq.num_sampled = len(request.token_ids) - request.num_prompt_tokens
            sequences.append(seq)
            requests.append(request)

        running = self.running
        block_size = kv.block_size
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = min(len(request.token_ids) - request.num_computed_tokens, budget)
            # A decode usually fits in the last block: only call the allocator when a new block is needed.
            if request.num_computed_tokens + num_new > len(request.block_ids) * block_size:
                preempted_self = False
                while not kv.allocate(request, num_new):
                    victim = running.pop()
                    self._preempt(victim)
                    num_preemptions += 1
                    if victim is request:
                        preempted_self = True
                        break
                if preempted_self:
                    continue
            emit(request, num_new)
            budget -= num_new
            i += 1

        waiting = self.waiting
        if waiting and not num_preemptions:
            busy_loras = {r.lora_name for r in running if r.lora_name}
            skipped: list[Request] = []
            while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
                request = waiting[0]
                if request.lora_name is not None and request.lora_name not in busy_loras:
                    slot = None
                    if len(busy_loras) < self.loras.max_loras:
                        slot = self.loras.slot_for(request.lora_name, busy_loras)
                    if slot is None:  # deferred: the batch already holds max_loras adapters
                        skipped.append(waiting.popleft())
                        continue
                    request.lora_slot = slot
                elif request.lora_name is not None:
                    request.lora_slot = self.loras.slot_for(request.lora_name, busy_loras) or 0
                cached = kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
                num_cached_tokens = len(cached) * kv.block_size
                num_new = min(request.num_tokens - request.num_computed_tokens - num_cached_tokens, budget)
                if not kv.allocate(request, num_new, cached):
                    break
                waiting.popleft()
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_cached_tokens
                    kv.record_query(request.num_tokens, num_cached_tokens)
                    request.scheduled_ts = time.monotonic()
                    newly.append(request)
                request.num_computed_tokens += num_cached_tokens
                request.status = RequestStatus.RUNNING
                running.append(request)
                if request.lora_name is not None:
                    busy_loras.add(request.lora_name)
                emit(request, num_new)
                budget -= num_new
            waiting.extendleft(reversed(skipped))

        loads, cold_loads = self.loras.take_pending_loads()
        batch = ScheduledBatch(sequences, uncached_prefill, decode, loads, cold_loads)
        return SchedulerOutput(batch, requests, newly, num_preemptions)

    def update_from_output(
        self, output: SchedulerOutput, step: StepOutput, now: float, deliver: Callable[[RequestOutput], None]
    ) -> IterationStats:
        """Apply a step's tokens: cache completed blocks, append tokens, check stops and finish requests; each
        request's output of this step goes to `deliver` as it is made (no second pass over the batch). Returns the
        step's stats."""
        stats = IterationStats(num_preemptions=output.num_preemptions)
        if output.newly_scheduled:
            newly = output.newly_scheduled
            stats.queue_times = [r.scheduled_ts - r.queued_ts for r in newly]
            stats.scheduled_prompts = [(r.num_prompt_tokens, r.num_cached_tokens) for r in newly]
        kv = self.kv
        block_size = kv.block_size
        logprobs = step.logprobs
        check_stop = self.check_stop
        itls = stats.inter_token_latencies  # the per-token path: local names, counters summed at the end
        generated = prompt_done = 0
        for i, (request, sequence, token) in enumerate(
            zip(output.requests, output.batch.sequences, step.tokens, strict=True)
        ):
            if request.status is RequestStatus.FINISHED:  # aborted while the step ran
                continue
            request.num_computed_tokens = computed = sequence.start + sequence.num_new_tokens
            if computed // block_size > request.num_registered_blocks:  # a block was completed: cache it
                kv.register_full_blocks(request)
            if token is None:
                continue
            request.token_ids.append(token)
            generated += 1
            if request.first_token_ts == 0.0:  # prefill done; a preemption before this stretches TTFT and prefill
                request.first_token_ts = now
                if not stats.ttfts:
                    stats.ttfts, stats.prefill_times = [], []
                stats.ttfts.append(now - request.arrival_time)
                stats.prefill_times.append(now - request.scheduled_ts)
                prompt_done += request.num_prompt_tokens
            else:  # a preemption during decode stretches this interval (and decode, inference)
                itls.append(now - request.last_token_ts)
            request.last_token_ts = now
            reason = check_stop(request, token)
            if reason is not None:
                self.finish(request, reason, now, stats)
            token_logprobs = logprobs[i] if logprobs is not None else None
            deliver(
                RequestOutput(
                    request.request_id,
                    [token],
                    reason is not None,
                    reason,
                    request.num_prompt_tokens,
                    request.num_cached_tokens,
                    [token_logprobs] if token_logprobs is not None else None,
                )
            )
        stats.num_generation_tokens, stats.num_prompt_tokens = generated, prompt_done
        stats.prefix_cache_queries, stats.prefix_cache_hits = kv.queries, kv.hits
        kv.queries = kv.hits = 0
        residency = kv.residency
        if residency.lifetimes or residency.reuse_gaps:
            stats.kv_block_lifetimes, residency.lifetimes = residency.lifetimes, []
            stats.kv_block_idle_before_evict, residency.idle_before_evict = residency.idle_before_evict, []
            stats.kv_block_reuse_gaps, residency.reuse_gaps = residency.reuse_gaps, []
        return stats

    def make_stats(self) -> SchedulerStats:
        stats = SchedulerStats(len(self.running), len(self.waiting), self.kv.usage)
        if self.config.enable_lora:
            stats.running_loras = tuple({r.lora_name for r in self.running if r.lora_name})
            stats.waiting_loras = tuple({r.lora_name for r in self.waiting if r.lora_name})
        return stats

    def finish(self, request: Request, reason: str, now: float = 0.0, stats: IterationStats | None = None) -> None:
        """Remove a request wherever it is, free its blocks, and add its intervals (ending `now`) to `stats`."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if stats is None:
            return
        num_output = request.num_output_tokens
        finished = FinishedRequestStats(
            reason,
            now - request.arrival_time,
            request.num_prompt_tokens,
            num_output,
            request.params.n,
            request.params.max_tokens or None,
        )
        if request.first_token_ts:
            finished.decode = decode = request.last_token_ts - request.first_token_ts
            finished.inference = request.last_token_ts - request.scheduled_ts
            finished.tpot = decode / (num_output - 1) if num_output > 1 else 0.0
        if not stats.finished:
            stats.finished = []
        stats.finished.append(finished)

    def check_stop(self, request: Request, token: int) -> str | None:
        """Why `request` finishes now that `token` was appended to it, or None."""
        num_tokens = len(request.token_ids)
        if num_tokens >= request.max_len:
            return FinishReason.LENGTH
        if token in request.stop_ids and num_tokens >= request.min_len:
            return FinishReason.STOP
        return None
