"""Model-server metric names per engine, and the parser from a Prometheus page to an `EndpointMetrics` snapshot.

The EPP scrapes every endpoint every 50 ms, so parsing is on a hot path. A vLLM page is ~400 lines (~25 KB) of
histograms the EPP never reads; prometheus_client's parser over the whole page costs ~13 ms. We therefore cut out
the sample lines of the few wanted families with `str.find` (C speed, no split of the page) and parse only those
lines, with a regex sample parser that tests check against prometheus_client's.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import quote

# vLLM V1 names (vLLM's V1 metrics design), also served by our reference model server.
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
VLLM_KV_CACHE_USAGE_V0 = "vllm:gpu_cache_usage_perc"  # deprecated v0 name, accepted when the V1 one is absent
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"

# The reference model server's stored Responses (previous_response_id): vLLM keeps them unbounded and has no series.
MODELSERVER_STORED_RESPONSES = "modelserver:stored_responses"
MODELSERVER_STORED_RESPONSE_BYTES = "modelserver:stored_response_bytes"
MODELSERVER_STORED_RESPONSES_EVICTED = "modelserver:stored_responses_evicted"  # a counter (_total on the page)

# The rest of vLLM V1's series the reference model server exposes (its metrics design; the EPP reads the ones above).
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"
VLLM_GPU_PREFIX_CACHE_HITS = "vllm:gpu_prefix_cache_hits"
VLLM_GPU_PREFIX_CACHE_QUERIES = "vllm:gpu_prefix_cache_queries"
VLLM_INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
VLLM_ITERATION_TOKENS_TOTAL = "vllm:iteration_tokens_total"
VLLM_KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS = "vllm:kv_block_idle_before_evict_seconds"
VLLM_KV_BLOCK_LIFETIME_SECONDS = "vllm:kv_block_lifetime_seconds"
VLLM_KV_BLOCK_REUSE_GAP_SECONDS = "vllm:kv_block_reuse_gap_seconds"
VLLM_NUM_PREEMPTIONS = "vllm:num_preemptions"
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"
VLLM_REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
VLLM_REQUEST_INFERENCE_TIME_SECONDS = "vllm:request_inference_time_seconds"
VLLM_REQUEST_MAX_NUM_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
VLLM_REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
VLLM_REQUEST_PARAMS_N = "vllm:request_params_n"
VLLM_REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
VLLM_REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
VLLM_REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
VLLM_REQUEST_SUCCESS = "vllm:request_success"
VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:request_time_per_output_token_seconds"
VLLM_TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:time_per_output_token_seconds"
VLLM_TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"

# Label names of the info gauges (Model Server Protocol).
LABEL_MAX_LORA = "max_lora"
LABEL_RUNNING_LORA_ADAPTERS = "running_lora_adapters"
LABEL_WAITING_LORA_ADAPTERS = "waiting_lora_adapters"
LABEL_BLOCK_SIZE = "block_size"
LABEL_NUM_GPU_BLOCKS = "num_gpu_blocks"
LABEL_MODEL_NAME = "model_name"
LABEL_ENGINE = "engine"
LABEL_FINISHED_REASON = "finished_reason"

DEFAULT_ENGINE = "vllm"


class MetricsParseError(ValueError):
    """A page that is not valid Prometheus text, or lacks a metric the Model Server Protocol requires."""


class InvalidMetricsError(MetricsParseError):
    """A required gauge is NaN, infinite or negative: the server's state is unknown."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A metric family name, optionally narrowed to series whose labels have the given values."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MetricSpec:
        """Parse GIE's spec syntax: `name` or `name{label=value,label2=value2}`."""
        name, brace, rest = text.strip().partition("{")
        if not brace:
            return cls(name)
        if not rest.endswith("}"):
            raise ValueError(f"metric spec {text!r}: missing closing brace")
        pairs = []
        for item in filter(None, (p.strip() for p in rest[:-1].split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"metric spec {text!r}: expected label=value, got {item!r}")
            pairs.append((key.strip(), value.strip().strip('"')))
        return cls(name, tuple(pairs))

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.labels)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Where one engine publishes the Model Server Protocol's metrics. Alternatives are tried in order."""

    name: str
    waiting: tuple[MetricSpec, ...]
    running: tuple[MetricSpec, ...]
    kv_usage: tuple[MetricSpec, ...]
    lora_info: MetricSpec | None = None
    cache_info: MetricSpec | None = None
    # Histograms of the gaps between a request's tokens, in seconds (optional; `inter_token_totals`): their `_sum`
    # and `_count` series give the endpoint's mean inter-token latency between two scrapes.
    inter_token_latency: tuple[MetricSpec, ...] = ()

    def sample_names(self) -> tuple[str, ...]:
        """Every sample name `parse_metrics` and `inter_token_totals` read for this engine, alternatives included."""
        gauges = (*self.waiting, *self.running, *self.kv_usage, self.lora_info, self.cache_info)
        names = [spec.name for spec in gauges if spec is not None]
        names += [spec.name + suffix for spec in self.inter_token_latency for suffix in ("_sum", "_count")]
        return tuple(dict.fromkeys(names))


def sample_filter_query(names: Iterable[str]) -> str:
    """The query that asks a Prometheus client library's exposition for only these samples: `name[]` once per
    name, what prometheus_client's WSGI/ASGI apps (vLLM's and SGLang's /metrics) restrict their output by. A server
    that ignores it sends the whole page, which parses the same."""
    return "&".join("name%5B%5D=" + quote(name, safe="") for name in names)


def _specs(*texts: str) -> tuple[MetricSpec, ...]:
    return tuple(MetricSpec.parse(t) for t in texts)


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "vllm",
            waiting=_specs(VLLM_NUM_REQUESTS_WAITING),
            running=_specs(VLLM_NUM_REQUESTS_RUNNING),
            kv_usage=_specs(VLLM_KV_CACHE_USAGE, VLLM_KV_CACHE_USAGE_V0),
            lora_info=MetricSpec(VLLM_LORA_REQUESTS_INFO),
            cache_info=MetricSpec(VLLM_CACHE_CONFIG_INFO),
            inter_token_latency=_specs(VLLM_INTER_TOKEN_LATENCY_SECONDS, VLLM_TIME_PER_OUTPUT_TOKEN_SECONDS),
        ),
        EngineSpec(
            "sglang",
            waiting=_specs("sglang:num_queue_reqs"),
            running=_specs("sglang:num_running_reqs"),
            kv_usage=_specs("sglang:token_usage"),
            inter_token_latency=_specs("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        ),
        EngineSpec(
            "trtllm-serve",
            waiting=_specs("trtllm_num_requests_waiting"),
            running=_specs("trtllm_num_requests_running"),
            kv_usage=_specs("trtllm_kv_cache_utilization"),
        ),
        EngineSpec(
            "triton-tensorrt-llm",
            waiting=_specs("nv_trt_llm_request_metrics{request_type=waiting}"),
            running=_specs("nv_trt_llm_request_metrics{request_type=scheduled}"),
            kv_usage=_specs("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"),
        ),
    )
}


def engine_spec(engine: str | EngineSpec | None) -> EngineSpec:
    """The spec for an engine name (`None` or empty means vLLM); a clear error for an unknown name."""
    if isinstance(engine, EngineSpec):
        return engine
    try:
        return ENGINES[engine or DEFAULT_ENGINE]
    except KeyError:
        raise ValueError(f"unknown engine type {engine!r}; known: {', '.join(ENGINES)}") from None


@dataclass(slots=True)
class EndpointMetrics:
    """What the EPP knows of one model server at one scrape."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # fraction in [0, 1]
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_lora: int | None = None
    running_adapters: frozenset[str] = field(default_factory=frozenset)
    waiting_adapters: frozenset[str] = field(default_factory=frozenset)
    scraped_at: float = 0.0  # time.monotonic() of the scrape


def _family_lines(page: str, name: str, out: list[str]) -> None:
    """Append the sample lines of exactly family `name` (not `name_bucket`, not `name_other`).

    The text format requires a family's lines to form one group, so the scan stops at the end of the first group:
    no second pass over the rest of the page (a miss costs one `find` through ~25-40 KB).
    """
    needle = "\n" + name
    size = len(page)
    start = page.find(needle)
    while start != -1:
        line_start = start + 1
        after = line_start + len(name)
        end = page.find("\n", after)
        if end == -1:
            end = size
        if after < size and page[after] in "{ \t":
            out.append(page[line_start:end])
        elif out and out[-1].startswith(name):
            return
        start = end if page.startswith(needle, end) else -1


# Sample-line pieces. Label values may hold escaped quotes, backslashes and newlines.
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_PAIR = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(?:,|$)')
_UNESCAPE = re.compile(r"\\(.)")


def _unescape(raw: str) -> str:
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), raw) if "\\" in raw else raw


MAX_CACHED_LINE_CHARS = 4096


def _parse_sample_line(line: str) -> tuple[str, dict[str, str], float]:
    """Parse one sample line of the text format (`name{labels} value [timestamp]`); ValueError if malformed.

    prometheus_client's own sample parser walks labels a character at a time (~100 us for vLLM's 13-label
    cache_config_info line here); this is ~5x faster and is property-tested against it. Cached: most lines the
    scrapers read are the same from one page to the next (the info gauges always, the load gauges while an endpoint
    is idle), and a hit costs a hash of the line instead of ~17 us for the info lines. Only lines up to
    MAX_CACHED_LINE_CHARS are cached (vLLM's longest is ~600): a page's lines are its server's choice, and 1,024
    cached lines of megabytes each would be gigabytes. Callers must not change the returned labels.
    """
    return _parse_cached(line) if len(line) <= MAX_CACHED_LINE_CHARS else _parse_line(line)


def _parse_line(line: str) -> tuple[str, dict[str, str], float]:
    labels: dict[str, str] = {}
    brace = line.find("{")
    if brace == -1:
        name, _, rest = line.partition(" ")
    else:
        close = line.rfind("}")
        if close < brace:
            raise ValueError(f"unclosed label set: {line[:200]!r}")
        name, body, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
        pos, size = 0, len(body)
        while pos < size:
            pair = _LABEL_PAIR.match(body, pos)
            if pair is None:
                if body[pos:].strip(" \t"):
                    raise ValueError(f"malformed labels: {line[:200]!r}")
                break
            labels[pair.group(1)] = _unescape(pair.group(2))
            pos = pair.end()
    if _METRIC_NAME.fullmatch(name) is None:
        raise ValueError(f"malformed metric name: {line[:200]!r}")
    value = rest.split()
    if not 1 <= len(value) <= 2:
        raise ValueError(f"expected a value and an optional timestamp: {line[:200]!r}")
    return name, labels, float(value[0])


_parse_cached = functools.lru_cache(maxsize=1024)(_parse_line)


def _int_label(value: str | None) -> int | None:
    """Info-gauge label values are integers; anything else (e.g. "None") means unknown."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        try:
            number = float(value)
        except ValueError:
            return None
        return int(number) if number.is_integer() else None


def _adapter_names(value: str) -> frozenset[str]:
    return frozenset(n for n in (part.strip() for part in value.split(",")) if n)


def _series(page: str, spec: MetricSpec) -> list[tuple[dict[str, str], float]]:
    lines: list[str] = []
    _family_lines(page, spec.name, lines)
    series = []
    for line in lines:
        _, labels, value = _parse_sample_line(line)
        if spec.matches(labels):
            series.append((labels, value))
    return series


def _every_line(page: str, name: str, start: int, end: int) -> list[str]:
    """The sample lines of exactly `name` that begin in page[start:end]."""
    needle, size, lines = "\n" + name, len(page), []
    at = page.find(needle, start, end)
    while at != -1:
        after = at + len(needle)
        line_end = page.find("\n", after)
        if line_end == -1:
            line_end = size
        if after < size and page[after] in "{ \t":
            lines.append(page[at + 1 : line_end])
        at = page.find(needle, line_end, end)
    return lines


def _metadata_line(page: str, start: int) -> int:
    """Where the first `#` line after `start` begins (-1: none). `#` is looked for alone (a memchr) since a
    search for "\n#" is ~20x slower; one inside a label value is passed over."""
    hash_at = page.find("#", start)
    while hash_at != -1 and page[hash_at - 1] != "\n":
        hash_at = page.find("#", hash_at + 1)
    return hash_at - 1 if hash_at != -1 else -1


def _histogram_totals(page: str, alternatives: tuple[MetricSpec, ...]) -> tuple[float, float] | None:
    """The `_sum` and `_count` of the first histogram family present, each summed over its matching series; None
    when none is present. A histogram's series interleave (each one's buckets, count and sum in turn), so the
    family's whole block is searched: from its first line to the next family's metadata (`# HELP`/`# TYPE`), not
    the rest of the page (a search through a whole ~40 KB page costs ~15 us)."""
    for spec in alternatives:
        prefix = "\n" + spec.name + "_"
        start = page.find(prefix)
        while start != -1:
            end = _metadata_line(page, start)
            stop = len(page) if end == -1 else end
            sums, counts = (
                [
                    v
                    for _, labels, v in map(_parse_sample_line, _every_line(page, spec.name + suffix, start, stop))
                    if spec.matches(labels)
                ]
                for suffix in ("_sum", "_count")
            )
            if counts:
                return sum(sums), sum(counts)
            start = -1 if end == -1 else page.find(prefix, end)  # another family of that prefix (`_created`)
    return None


def _first_present(page: str, alternatives: tuple[MetricSpec, ...]) -> list[float]:
    for spec in alternatives:  # the fallback (e.g. a deprecated name) is only searched when needed
        if series := _series(page, spec):
            return [value for _, value in series]
    return []


def inter_token_totals(page: str, engine: str | EngineSpec | None = None) -> tuple[float, float] | None:
    """The engine's inter-token latency histogram on a Prometheus text page: its total seconds and its count of
    gaps between tokens since the server started (`EngineSpec.inter_token_latency`); None when the engine publishes
    none or it is unreadable (only the latency predictor's TPOT reads it: not a reason to call the page bad). Kept
    apart from `parse_metrics`, so that a scraper reads it only when a sample is wanted (~7 us on a vLLM page)."""
    try:
        totals = _histogram_totals("\n" + page, engine_spec(engine).inter_token_latency)
    except ValueError:
        return None
    return totals if totals is not None and all(0.0 <= v < math.inf for v in totals) else None


def parse_metrics(
    page: str, engine: str | EngineSpec | None = None, scraped_at: float | None = None
) -> EndpointMetrics:
    """Parse a Prometheus text page into an `EndpointMetrics` snapshot for the given engine.

    Waiting and running sum over all matching series (e.g. several data-parallel engines); KV usage takes the
    largest. Raises `MetricsParseError` for a malformed page or a missing required gauge; never anything else.
    """
    spec = engine_spec(engine)
    page = "\n" + page
    try:
        waiting = _first_present(page, spec.waiting)
        running = _first_present(page, spec.running)
        kv = _first_present(page, spec.kv_usage)
        cache_info = _series(page, spec.cache_info) if spec.cache_info else []
        lora_info = _series(page, spec.lora_info) if spec.lora_info else []
    except ValueError as exc:
        raise MetricsParseError(str(exc)) from None
    missing = [
        alts[0].name for alts, v in ((spec.waiting, waiting), (spec.running, running), (spec.kv_usage, kv)) if not v
    ]
    if missing:
        raise MetricsParseError(f"metrics page lacks required gauge(s): {', '.join(missing)}")
    for name, values in (("waiting", waiting), ("running", running), ("KV usage", kv)):
        if not all(0.0 <= v < math.inf for v in values):  # NaN fails both comparisons
            raise InvalidMetricsError(f"{name} gauge is {next(v for v in values if not 0.0 <= v < math.inf)}")
    snapshot = EndpointMetrics(
        waiting=int(sum(waiting)),
        running=int(sum(running)),
        kv_usage=min(1.0, max(0.0, max(kv))),
        scraped_at=time.monotonic() if scraped_at is None else scraped_at,
    )
    if cache_info:
        labels = cache_info[0][0]
        snapshot.block_size = _int_label(labels.get(LABEL_BLOCK_SIZE))
        snapshot.num_gpu_blocks = _int_label(labels.get(LABEL_NUM_GPU_BLOCKS))
    if lora_info:
        labels = max(lora_info, key=lambda s: s[1])[0]  # the value is the update time: newest wins
        snapshot.max_lora = _int_label(labels.get(LABEL_MAX_LORA))
        snapshot.running_adapters = _adapter_names(labels.get(LABEL_RUNNING_LORA_ADAPTERS, ""))
        snapshot.waiting_adapters = _adapter_names(labels.get(LABEL_WAITING_LORA_ADAPTERS, ""))
    return snapshot
