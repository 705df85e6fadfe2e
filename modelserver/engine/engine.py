"""The async engine: one asyncio task per engine runs schedule -> execute -> update (the scheduler's `schedule()`
and `update_from_output()`), streams each request's tokens to its `generate()` iterator, and hands the scheduler's
and each step's stats (`stats.py`, plain data) to its stat loggers; it knows nothing of how they are exported.
Many engines (replicas) share one event loop; an idle engine waits on an event and costs nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

from modelserver.engine.block_manager import KVCacheManager
from modelserver.engine.config import EngineConfig
from modelserver.engine.executor import Executor, StepOutput
from modelserver.engine.kv_events import ZmqEventPublisher
from modelserver.engine.lora import LoRAError, LoRASlots
from modelserver.engine.request import FinishReason, Request, RequestOutput, RequestStatus, SamplingParams
from modelserver.engine.scheduler import Scheduler, SchedulerOutput
from modelserver.engine.stats import IterationStats, StatLogger
from protocol.kv_events import KVEventBatch, block_hasher

if TYPE_CHECKING:
    from modelserver.tracing import RequestTracer

log = logging.getLogger("modelserver.engine")


class EngineDeadError(RuntimeError):
    """The step loop crashed; the server answers 503 from now on."""


class _OutputStream:
    """A request's outputs between the step loop and its `generate()` iterator: a deque and, only while the
    consumer waits, a future (lighter than asyncio.Queue, which matters at 256 requests per step)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self):
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        model_name: str,
        engine_index: int = 0,
        stat_loggers: Sequence[StatLogger] = (),
        lora_modules: dict[str, str] | None = None,
        kv_events: ZmqEventPublisher | None = None,
        tracer: RequestTracer | None = None,
    ):
        self.config = config
        self.executor = executor
        self.model_name = model_name
        self.tracer = tracer  # request traces (--otlp-traces-endpoint), when on
        self.loras = LoRASlots(config.max_loras, config.max_cpu_loras)
        for name, path in (lora_modules or {}).items():
            self.loras.add(name, path)
        # vLLM seeds its block hashes (NONE_HASH) from PYTHONHASHSEED, and with none set from random bytes.
        hash_seed = os.environ.get("PYTHONHASHSEED")
        if kv_events is not None and hash_seed is None:
            log.warning("PYTHONHASHSEED is not set: KV event block hashes are random per process, no router can match")
        self.kv = KVCacheManager(
            config.num_gpu_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.kv_cache_metrics_sample,
            record_events=kv_events is not None,
            hasher=block_hasher(config.prefix_caching_hash_algo, hash_seed),
            lora_ids=self.loras.ids,
        )
        self.kv_events = kv_events
        self.scheduler = Scheduler(config, self.kv, self.loras, executor.eos_token_id)
        self.engine_index = engine_index
        self.stat_loggers = tuple(stat_loggers)
        intervals = [logger.log_interval for logger in self.stat_loggers if logger.log_interval]
        self._log_interval = min(intervals) if intervals else None
        self._requests: dict[str, tuple[Request, _OutputStream]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.is_dead = False
        self.dead_error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"engine-{self.model_name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for request_id in list(self._requests):
            self.abort(request_id)
        await self.executor.close()
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    # -- LoRA --------------------------------------------------------------------------------------------------
    @property
    def lora_adapters(self) -> dict[str, str]:
        return dict(self.loras.adapters)

    def add_lora(self, name: str, path: str) -> None:
        if not self.config.enable_lora:
            raise LoRAError("LoRA is not enabled (start the server with --enable-lora)")
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        if any(r.lora_name == name for r, _ in self._requests.values()):
            raise LoRAError(f"The lora adapter '{name}' has unfinished requests.")
        self.loras.remove(name)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's `POST /reset_prefix_cache`); refused while requests hold blocks.
        Subscribers hear AllBlocksCleared now, not at the next step."""
        done = self.kv.reset_prefix_cache()
        if done:
            log.info("prefix cache reset")
            self._publish_kv_events()
        else:
            log.warning("prefix cache not reset: %d blocks are in use", self.kv.num_blocks - self.kv.num_free_blocks)
        return done

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None and self.kv.events:
            self.kv_events.publish(KVEventBatch(time.time(), self.kv.drain_events()))

    # -- requests ----------------------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_name: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs. Closing or cancelling the iterator aborts the request. With a tracer,
        the request's spans continue the trace context in `trace_headers` (vLLM's name) once it is over."""
        if self.is_dead:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if lora_name is not None and lora_name not in self.loras.adapters:
            raise KeyError(lora_name)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"the prompt ({len(prompt_token_ids)} tokens) leaves no room for output within max_model_len "
                f"({self.config.max_model_len})"
            )
        if params.max_tokens < 1 or params.min_tokens < 0:
            raise ValueError("max_tokens must be >= 1 and min_tokens >= 0")
        if self.kv.blocks_needed(len(prompt_token_ids) + 1) > self.kv.num_blocks:
            raise ValueError(
                f"the prompt ({len(prompt_token_ids)} tokens) does not fit in the KV cache "
                f"({self.kv.capacity_tokens} tokens)"
            )
        request = Request(request_id, prompt_token_ids, params, lora_name)
        queue = _OutputStream()
        self._requests[request_id] = (request, queue)
        self.scheduler.add(request)
        self._record(None)
        self._wake.set()
        try:
            while True:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            if request.status is not RequestStatus.FINISHED:
                self.abort(request_id)
            self._requests.pop(request_id, None)
            if self.tracer is not None and trace_headers is not None:
                self.tracer.finished(request, trace_headers)

    def abort(self, request_id: str, reason: str = FinishReason.ABORT) -> None:
        """Finish a request now (client gone: "abort"; a stop string seen by the frontend: "stop")."""
        entry = self._requests.get(request_id)
        if entry is None or entry[0].status is RequestStatus.FINISHED:
            return
        request, queue = entry
        stats = IterationStats(is_step=False)
        self.scheduler.finish(request, reason, time.monotonic(), stats)
        queue.put(
            RequestOutput(request_id, [], True, reason, request.num_prompt_tokens, max(request.num_cached_tokens, 0))
        )
        self._record(stats)

    # -- the step loop -----------------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                if not self.scheduler.num_unfinished:
                    self._wake.clear()
                    if self._log_interval is None:
                        await self._wake.wait()
                    else:  # wake every log interval so the last busy interval (then idle ones) still get a line
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), self._log_interval)
                        self._record(None)
                    continue
                output = self.scheduler.schedule()
                if not output.requests:
                    await asyncio.sleep(0.001)  # nothing fits this step (e.g. all deferred); do not spin
                    continue
                self._record(None)  # like vLLM's scheduler stats: the state with this step's batch in flight
                step = await self.executor.execute(output.batch)
                self._process(output, step, time.monotonic())
                self._publish_kv_events()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine step failed; the engine is dead")
            self.is_dead, self.dead_error = True, exc
            for request, queue in self._requests.values():
                if request.status is not RequestStatus.FINISHED:
                    queue.put(EngineDeadError(f"engine is dead: {exc!r}"))

    def _fail_lora_loads(self, output: SchedulerOutput, failed: dict[str, str], now: float) -> None:
        """An adapter could not be loaded (files missing or unreadable): its requests in this step fail with the
        reason, every other request goes on, and the adapter stays registered (a later request tries again)."""
        for name, reason in failed.items():
            log.error("loading LoRA adapter %s failed (%s): its requests fail, the engine goes on", name, reason)
            self.loras.evict(name)
        stats = IterationStats(is_step=False)
        for request in output.requests:
            if request.lora_name in failed and request.status is not RequestStatus.FINISHED:
                self.scheduler.finish(request, FinishReason.ABORT, now, stats)
                message = f"loading LoRA adapter '{request.lora_name}' failed: {failed[request.lora_name]}"
                self._requests[request.request_id][1].put(LoRAError(message))
        self._record(stats)

    def _process(self, output: SchedulerOutput, step: StepOutput, now: float) -> None:
        if step.failed_lora_loads:
            self._fail_lora_loads(output, step.failed_lora_loads, now)
        self._record(self.scheduler.update_from_output(output, step, now, self._deliver))

    def _deliver(self, output: RequestOutput) -> None:
        self._requests[output.request_id][1].put(output)

    def _record(self, iteration_stats: IterationStats | None) -> None:
        """Hand the scheduler's state (and what a step or an abort produced) to every stat logger."""
        if self.stat_loggers:
            scheduler_stats = self.scheduler.make_stats()
            for logger in self.stat_loggers:
                logger.record(scheduler_stats, iteration_stats)
