"""The stat loggers of the model server (`modelserver.engine.stats`): vLLM V1's metrics (its V1 metrics design) for
one engine, in its own prometheus_client registry, and the periodic log line. Metric and label names come from
`protocol.metrics`.

Histograms are observed on the engine step (inter-token latency once per running sequence per step), so they use a
small list-based histogram (~0.3 us per observation) instead of prometheus_client's locked Histogram. Gauges and
counters are prometheus_client's, bound to their labels once.

The page is scraped 20 times a second by every EPP, and prometheus_client's generate_latest took 2.8 ms for it
(~330 histogram lines), so `render()` writes the histograms from precomputed line prefixes and leaves only the
scalar series to prometheus_client. `registry` still exposes everything for any other consumer.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Collection, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily

from modelserver.engine.config import EngineConfig
from modelserver.engine.stats import IterationStats, SchedulerStats
from protocol.exposition import bucket_bounds, count_value, cumulative_buckets, sample_value
from protocol.metrics import (
    LABEL_ENGINE,
    LABEL_FINISHED_REASON,
    LABEL_MAX_LORA,
    LABEL_MODEL_NAME,
    LABEL_RUNNING_LORA_ADAPTERS,
    LABEL_WAITING_LORA_ADAPTERS,
    MODELSERVER_STORED_RESPONSE_BYTES,
    MODELSERVER_STORED_RESPONSES,
    MODELSERVER_STORED_RESPONSES_EVICTED,
    VLLM_CACHE_CONFIG_INFO,
    VLLM_GENERATION_TOKENS,
    VLLM_GPU_PREFIX_CACHE_HITS,
    VLLM_GPU_PREFIX_CACHE_QUERIES,
    VLLM_INTER_TOKEN_LATENCY_SECONDS,
    VLLM_ITERATION_TOKENS_TOTAL,
    VLLM_KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS,
    VLLM_KV_BLOCK_LIFETIME_SECONDS,
    VLLM_KV_BLOCK_REUSE_GAP_SECONDS,
    VLLM_KV_CACHE_USAGE,
    VLLM_KV_CACHE_USAGE_V0,
    VLLM_LORA_REQUESTS_INFO,
    VLLM_NUM_PREEMPTIONS,
    VLLM_NUM_REQUESTS_RUNNING,
    VLLM_NUM_REQUESTS_WAITING,
    VLLM_PREFIX_CACHE_HITS,
    VLLM_PREFIX_CACHE_QUERIES,
    VLLM_PROMPT_TOKENS,
    VLLM_REQUEST_DECODE_TIME_SECONDS,
    VLLM_REQUEST_GENERATION_TOKENS,
    VLLM_REQUEST_INFERENCE_TIME_SECONDS,
    VLLM_REQUEST_MAX_NUM_GENERATION_TOKENS,
    VLLM_REQUEST_PARAMS_MAX_TOKENS,
    VLLM_REQUEST_PARAMS_N,
    VLLM_REQUEST_PREFILL_TIME_SECONDS,
    VLLM_REQUEST_PROMPT_TOKENS,
    VLLM_REQUEST_QUEUE_TIME_SECONDS,
    VLLM_REQUEST_SUCCESS,
    VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
    VLLM_TIME_PER_OUTPUT_TOKEN_SECONDS,
    VLLM_TIME_TO_FIRST_TOKEN_SECONDS,
)

log = logging.getLogger("modelserver.stats")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
KV_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
                        1200, 1800)  # fmt: skip
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(maximum: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `maximum` (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return tuple(out)
            out.append(value)
        exponent += 1


class FastHistogram:
    __slots__ = ("bounds", "counts", "documentation", "name", "sum")

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...]):
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last = +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: list[float]) -> None:
        """`observe` each value (one call per step for a list the engine collected, not one per token)."""
        if values:
            counts, bounds = self.counts, self.bounds
            for value in values:
                counts[bisect_left(bounds, value)] += 1
            self.sum += sum(values)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _HistogramText:
    """Text exposition of fixed-label histograms with every constant part of every line precomputed."""

    def __init__(self, histograms: list[FastHistogram], label_names: list[str], label_values: list[str]):
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(label_names, label_values, strict=True))
        self._parts = []
        for h in histograms:
            header = f"# HELP {h.name} {_escape(h.documentation)}\n# TYPE {h.name} histogram\n"
            prefixes = [f'{h.name}_bucket{{{labels},le="{le}"}} ' for le in bucket_bounds(h.bounds)]
            self._parts.append((h, header, prefixes, f"{h.name}_count{{{labels}}} ", f"{h.name}_sum{{{labels}}} "))

    def render(self, names: Collection[str] | None = None) -> str:
        """Every histogram; with `names`, only the samples (`_bucket`, `_count`, `_sum`) named there, and a family's
        header only when one of its samples is (prometheus_client's `restricted_registry`)."""
        out = []
        for h, header, prefixes, count_prefix, sum_prefix in self._parts:
            if names is None:
                buckets = count = total = True
            else:
                buckets, count, total = (h.name + suffix in names for suffix in ("_bucket", "_count", "_sum"))
                if not (buckets or count or total):
                    continue
            out.append(header)
            if buckets:
                cumulative = 0
                for prefix, bucket_count in zip(prefixes, h.counts, strict=True):
                    cumulative += bucket_count
                    out.append(f"{prefix}{count_value(cumulative)}\n")
            else:
                cumulative = sum(h.counts)
            if count:
                out.append(f"{count_prefix}{count_value(cumulative)}\n")
            if total:
                out.append(f"{sum_prefix}{sample_value(h.sum)}\n")
        return "".join(out)


class _HistogramCollector:
    def __init__(self, histograms: list[FastHistogram], label_names: list[str], label_values: list[str]):
        self._histograms = [(h, bucket_bounds(h.bounds)) for h in histograms]
        self._label_names = label_names
        self._label_values = label_values

    def collect(self):
        for h, les in self._histograms:
            family = HistogramMetricFamily(h.name, h.documentation, labels=self._label_names)
            family.add_metric(self._label_values, cumulative_buckets(les, h.counts), h.sum)
            yield family

    def describe(self):
        return [HistogramMetricFamily(h.name, h.documentation, labels=self._label_names) for h, _ in self._histograms]


class PrometheusStatLogger:
    """A stat logger (`modelserver.engine.stats`): all vllm:* series of one engine, updated from the engine's
    scheduler and iteration stats (bound series, no label lookups on the step)."""

    log_interval = None

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        engine_index: int = 0,
        registry: CollectorRegistry | None = None,
        show_hidden_metrics_for_version: str | None = None,
    ):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.scalars = CollectorRegistry()  # gauges and counters; histograms are rendered by _HistogramText
        self.config = config
        names, values = [LABEL_MODEL_NAME, LABEL_ENGINE], [model_name, str(engine_index)]
        labels = dict(zip(names, values, strict=True))
        reg = self.scalars

        def gauge(name: str, doc: str):
            return Gauge(name, doc, names, registry=reg).labels(**labels)

        def counter(name: str, doc: str):
            return Counter(name, doc, names, registry=reg).labels(**labels)

        self.running = gauge(VLLM_NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.")
        self.waiting = gauge(VLLM_NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.")
        self.kv_usage = gauge(VLLM_KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.")
        self.stored_responses = gauge(MODELSERVER_STORED_RESPONSES, "Responses stored for previous_response_id.")
        self.stored_response_bytes = gauge(
            MODELSERVER_STORED_RESPONSE_BYTES, "Bytes of the stored responses and their conversations (estimated)."
        )
        self.stored_responses_evicted = counter(
            MODELSERVER_STORED_RESPONSES_EVICTED,
            "Stored responses dropped, oldest first, to keep within --max-stored-responses and its byte limit.",
        )
        # Deprecated names (vLLM v0 / before 0.11), only behind --show-hidden-metrics-for-version.
        self.gpu_cache_usage = self.gpu_prefix_queries = self.gpu_prefix_hits = self.tpot_deprecated = None
        hidden = f"shown because --show-hidden-metrics-for-version={show_hidden_metrics_for_version}."
        if show_hidden_metrics_for_version:
            self.gpu_cache_usage = gauge(
                VLLM_KV_CACHE_USAGE_V0,
                f"GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: use vllm:kv_cache_usage_perc; {hidden}",
            )
            self.gpu_prefix_queries = counter(
                VLLM_GPU_PREFIX_CACHE_QUERIES,
                "GPU prefix cache queries, in terms of number of queried tokens. "
                f"DEPRECATED: use vllm:prefix_cache_queries; {hidden}",
            )
            self.gpu_prefix_hits = counter(
                VLLM_GPU_PREFIX_CACHE_HITS,
                f"GPU prefix cache hits, in terms of number of cached tokens. DEPRECATED: use vllm:prefix_cache_hits; "
                f"{hidden}",
            )
        self.prompt_tokens = counter(VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.")
        self.generation_tokens = counter(VLLM_GENERATION_TOKENS, "Number of generation tokens processed.")
        self.preemptions = counter(VLLM_NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter(
            VLLM_PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(VLLM_PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter(
            VLLM_REQUEST_SUCCESS,
            "Count of successfully processed requests.",
            [*names, LABEL_FINISHED_REASON],
            registry=reg,
        )
        self.success = {r: success.labels(*values, r) for r in ("stop", "length", "abort")}
        cache_labels = config.cache_config_labels()
        Gauge(
            VLLM_CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", list(cache_labels), registry=reg
        ).labels(**cache_labels).set(1)
        self.lora_info = None
        self._lora_labels: tuple[str, str] | None = None
        if config.enable_lora:
            self.lora_info = Gauge(
                VLLM_LORA_REQUESTS_INFO,
                "Running stats on lora requests.",
                [LABEL_MAX_LORA, LABEL_RUNNING_LORA_ADAPTERS, LABEL_WAITING_LORA_ADAPTERS],
                registry=reg,
            )

        token_buckets = buckets_1_2_5(config.max_model_len)
        h = FastHistogram
        self.ttft = h(VLLM_TIME_TO_FIRST_TOKEN_SECONDS, "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = h(VLLM_INTER_TOKEN_LATENCY_SECONDS, "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = h(
            VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        if show_hidden_metrics_for_version:
            self.tpot_deprecated = h(
                VLLM_TIME_PER_OUTPUT_TOKEN_SECONDS,
                f"Histogram of time per output token in seconds. DEPRECATED: use vllm:inter_token_latency_seconds; "
                f"{hidden}",
                ITL_BUCKETS,
            )
        self.e2e = h(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = h(
            VLLM_REQUEST_QUEUE_TIME_SECONDS,
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = h(
            VLLM_REQUEST_INFERENCE_TIME_SECONDS,
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = h(
            VLLM_REQUEST_PREFILL_TIME_SECONDS,
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = h(
            VLLM_REQUEST_DECODE_TIME_SECONDS,
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_hist = h(VLLM_REQUEST_PROMPT_TOKENS, "Number of prefill tokens processed.", token_buckets)
        self.generation_hist = h(
            VLLM_REQUEST_GENERATION_TOKENS, "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = h(
            VLLM_ITERATION_TOKENS_TOTAL, "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.params_n = h(VLLM_REQUEST_PARAMS_N, "Histogram of the n request parameter.", REQUEST_N_BUCKETS)
        self.params_max_tokens = h(
            VLLM_REQUEST_PARAMS_MAX_TOKENS, "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.max_generation = h(
            VLLM_REQUEST_MAX_NUM_GENERATION_TOKENS,
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        histograms = [
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue,
            self.inference,
            self.prefill,
            self.decode,
            self.prompt_hist,
            self.generation_hist,
            self.iteration_tokens,
            self.params_n,
            self.params_max_tokens,
            self.max_generation,
        ]
        if self.tpot_deprecated is not None:
            histograms.append(self.tpot_deprecated)
        self.kv_lifetime = self.kv_idle = self.kv_reuse_gap = None
        if config.kv_cache_metrics_sample > 0:
            self.kv_lifetime = h(
                VLLM_KV_BLOCK_LIFETIME_SECONDS,
                "Histogram of KV cache block lifetime from allocation to eviction.",
                KV_RESIDENCY_BUCKETS,
            )
            self.kv_idle = h(
                VLLM_KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS,
                "Histogram of idle time before KV cache block eviction.",
                KV_RESIDENCY_BUCKETS,
            )
            self.kv_reuse_gap = h(
                VLLM_KV_BLOCK_REUSE_GAP_SECONDS,
                "Histogram of time gaps between consecutive KV cache block accesses.",
                KV_RESIDENCY_BUCKETS,
            )
            histograms += [self.kv_lifetime, self.kv_idle, self.kv_reuse_gap]
        for collector in list(self.scalars._collector_to_names):
            self.registry.register(collector)
        self.registry.register(_HistogramCollector(histograms, names, values))
        self._histogram_text = _HistogramText(histograms, names, values)

    def render(self, names: Collection[str] | None = None) -> bytes:
        """The /metrics page: what generate_latest(self.registry) gives, ~10x cheaper. With `names`, only those
        samples, as prometheus_client's exposition serves a request with `name[]` parameters (vLLM's /metrics): a
        scraper that reads a few gauges need not be sent ~30 KB of histograms it never reads."""
        scalars = self.scalars if names is None else self.scalars.restricted_registry(names)
        return generate_latest(scalars) + self._histogram_text.render(names).encode()

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)
        if scheduler_stats is not None:
            self.running.set(scheduler_stats.num_running)
            self.waiting.set(scheduler_stats.num_waiting)
            self.kv_usage.set(scheduler_stats.kv_usage)
            if self.gpu_cache_usage is not None:
                self.gpu_cache_usage.set(scheduler_stats.kv_usage)
            if self.lora_info is not None:
                self.set_lora_info(scheduler_stats.running_loras, scheduler_stats.waiting_loras)

    def _record_iteration(self, stats: IterationStats) -> None:
        self.queue.observe_many(stats.queue_times)
        self.ttft.observe_many(stats.ttfts)
        self.prefill.observe_many(stats.prefill_times)
        self.itl.observe_many(stats.inter_token_latencies)
        if self.tpot_deprecated is not None:
            self.tpot_deprecated.observe_many(stats.inter_token_latencies)
        if stats.is_step:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
            self.generation_tokens.inc(stats.num_generation_tokens)
            # vLLM's definition: prompt tokens of the prefills that completed this step plus the tokens generated
            self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.record_prefix_cache(stats.prefix_cache_queries, stats.prefix_cache_hits)
        if self.kv_lifetime is not None:
            self.kv_lifetime.observe_many(stats.kv_block_lifetimes)
            self.kv_idle.observe_many(stats.kv_block_idle_before_evict)
            self.kv_reuse_gap.observe_many(stats.kv_block_reuse_gaps)
        for finished in stats.finished:
            self.e2e.observe(finished.e2e)
            if finished.decode is not None:
                self.decode.observe(finished.decode)
                self.inference.observe(finished.inference)
                self.tpot.observe(finished.tpot)
            self.prompt_hist.observe(finished.num_prompt_tokens)
            self.generation_hist.observe(finished.num_generation_tokens)
            self.params_n.observe(finished.n)
            if finished.max_tokens:
                self.params_max_tokens.observe(finished.max_tokens)
            self.max_generation.observe(finished.num_generation_tokens)  # the most any sequence of it generated
            self.success[finished.finish_reason].inc()

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        if self.gpu_prefix_queries is not None:
            self.gpu_prefix_queries.inc(queries)
            self.gpu_prefix_hits.inc(hits)

    def set_lora_info(self, running: Sequence[str], waiting: Sequence[str]) -> None:
        if self.lora_info is None:
            return
        key = (",".join(sorted(running)), ",".join(sorted(waiting)))
        if key != self._lora_labels:
            if self._lora_labels is not None:  # old label combinations go, so the page never grows
                self.lora_info.remove(str(self.config.max_loras), *self._lora_labels)
            self._lora_labels = key
        self.lora_info.labels(str(self.config.max_loras), *key).set(time.time())


class LoggingStatLogger:
    """A stat logger that logs the seed's summary line every `log_interval` seconds: running/waiting, KV usage,
    prompt and generation throughput since the last line, and the prefix-cache hit rate over the most recent 1k
    queries (requests)."""

    def __init__(self, name: str, log_interval: float = 5.0, recent_queries: int = 1000):
        self.name = name
        self.log_interval = log_interval
        self._last = time.monotonic()
        self._prompt = self._generation = 0
        self._was_busy = False
        self._queries: deque[tuple[int, int]] = deque(maxlen=recent_queries)  # (queried, hit) tokens per request

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            self._prompt += iteration_stats.num_prompt_tokens
            self._generation += iteration_stats.num_generation_tokens
            self._queries.extend(iteration_stats.scheduled_prompts)
        if scheduler_stats is not None:
            self._maybe_log(scheduler_stats)

    @property
    def hit_rate(self) -> float:
        queried = sum(q for q, _ in self._queries)
        return sum(h for _, h in self._queries) / queried if queried else 0.0

    def _maybe_log(self, stats: SchedulerStats) -> None:
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed < self.log_interval:
            return
        busy = bool(self._prompt or self._generation)
        log_fn = log.info if busy or self._was_busy else log.debug  # like vLLM: quiet on an idle system
        self._was_busy = busy
        log_fn(
            "%s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self.name,
            self._prompt / elapsed,
            self._generation / elapsed,
            stats.num_running,
            stats.num_waiting,
            stats.kv_usage * 100,
            self.hit_rate * 100,
        )
        self._last, self._prompt, self._generation = now, 0, 0


def default_stat_loggers(
    config: EngineConfig,
    model_name: str,
    engine_index: int = 0,
    registry: CollectorRegistry | None = None,
    log_stats: bool = True,
    show_hidden_metrics_for_version: str | None = None,
) -> list[PrometheusStatLogger | LoggingStatLogger]:
    """What a served engine reports to: its Prometheus series (first) and, unless --disable-log-stats, the log line."""
    loggers: list = [PrometheusStatLogger(config, model_name, engine_index, registry, show_hidden_metrics_for_version)]
    if log_stats:
        loggers.append(LoggingStatLogger(f"Engine {engine_index:03d}"))
    return loggers


def prometheus_logger(loggers) -> PrometheusStatLogger:
    """The Prometheus logger among an engine's stat loggers (what /metrics renders)."""
    return next(logger for logger in loggers if isinstance(logger, PrometheusStatLogger))
