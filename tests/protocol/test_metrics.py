"""The metrics parser against real-shaped pages of vLLM (V1 and v0), SGLang, trtllm-serve and Triton TensorRT-LLM."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from protocol.metrics import (
    ENGINES,
    EndpointMetrics,
    MetricsParseError,
    MetricSpec,
    _parse_sample_line,
    engine_spec,
    inter_token_totals,
    parse_metrics,
)

FIXTURES = Path(__file__).parent / "fixtures"


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize(
    ("fixture", "engine", "expected"),
    [
        (
            "vllm_v1.txt",
            "vllm",
            dict(
                waiting=3,
                running=7,
                kv_usage=0.4271,
                block_size=16,
                num_gpu_blocks=27545,
                max_lora=4,
                # the newest series (largest timestamp) wins; names are trimmed, empty names dropped
                running_adapters=frozenset({"sql-lora", "chat-lora"}),
                waiting_adapters=frozenset({"code-lora"}),
            ),
        ),
        (
            "vllm_v0.txt",
            None,
            dict(waiting=5, running=2, kv_usage=0.75, block_size=32, num_gpu_blocks=None),
        ),
        ("sglang.txt", "sglang", dict(waiting=2826, running=28, kv_usage=0.28, block_size=None, max_lora=None)),
        ("trtllm_serve.txt", "trtllm-serve", dict(waiting=4, running=12, kv_usage=0.62)),
        ("triton_trtllm.txt", "triton-tensorrt-llm", dict(waiting=9, running=6, kv_usage=0.4)),
    ],
)
def test_real_pages(fixture, engine, expected):
    snapshot = parse_metrics(page(fixture), engine, scraped_at=12.5)
    assert isinstance(snapshot, EndpointMetrics)
    assert snapshot.scraped_at == 12.5
    for field, value in expected.items():
        assert getattr(snapshot, field) == value, field


def test_v1_name_preferred_over_v0():
    text = page("vllm_v1.txt") + "vllm:gpu_cache_usage_perc 0.99\n"
    assert parse_metrics(text).kv_usage == pytest.approx(0.4271)


def test_scrape_time_defaults_to_monotonic_now():
    import time

    before = time.monotonic()
    assert before <= parse_metrics(page("vllm_v1.txt")).scraped_at <= time.monotonic()


def test_sums_data_parallel_engines_and_takes_max_kv():
    text = (
        'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 3\n'
        'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 4\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.7\n'
    )
    snapshot = parse_metrics(text)
    assert (snapshot.waiting, snapshot.running, snapshot.kv_usage) == (5, 5, 0.7)


def test_lines_as_long_as_a_server_likes_are_read_but_not_kept():
    """The parse cache keeps only lines of vLLM's sizes: a server's page of megabyte lines, new on every scrape,
    must not fill it with gigabytes."""
    from protocol import metrics

    huge = "x" * (1 << 20)
    before = metrics._parse_cached.cache_info().currsize
    for n in range(3):
        text = (
            f'vllm:num_requests_waiting{{engine="{n}{huge}"}} 2\nvllm:num_requests_running{{engine="0"}} 1\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.2\n'
        )
        assert parse_metrics(text).waiting == 2
    assert metrics._parse_cached.cache_info().currsize <= before + 2  # the two short lines; none of the three long


def test_inter_token_totals_sum_every_series_of_the_first_histogram_present():
    """A histogram's series interleave (buckets, count and sum of one, then the next): every one counts. The
    deprecated name is read only when the current one is absent; a NaN total or a malformed line is unknown."""
    gauges = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
    series = "".join(
        f'{name}_bucket{{engine="{e}",le="+Inf"}} {count}\n{name}_count{{engine="{e}"}} {count}\n'
        f'{name}_sum{{engine="{e}"}} {total}\n'
        for name, e, count, total in (
            ("vllm:inter_token_latency_seconds", 0, 10, 0.5),
            ("vllm:time_per_output_token_seconds", 0, 99, 9.9),
            ("vllm:inter_token_latency_seconds", 1, 30, 0.7),
        )
    )
    assert inter_token_totals(gauges + series) == (pytest.approx(1.2), 40)
    deprecated = series.replace("vllm:inter_token_latency_seconds", "other")
    assert inter_token_totals(gauges + deprecated) == (pytest.approx(9.9), 99)
    nan = "vllm:inter_token_latency_seconds_count 3\nvllm:inter_token_latency_seconds_sum NaN\n"
    assert inter_token_totals(gauges + nan) is None
    assert inter_token_totals(gauges + 'vllm:inter_token_latency_seconds_count{engine="0} 3\n') is None
    assert inter_token_totals(gauges) is None
    assert inter_token_totals(page("vllm_v1.txt")) == (127.32, 4.0)
    assert inter_token_totals(page("sglang.txt"), "sglang") is None  # that capture has no such histogram


def test_family_prefix_is_not_confused_with_longer_names():
    text = (
        "vllm:num_requests_waiting_by_reason 100\nvllm:num_requests_waiting 1\n"
        "vllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.5\n"
    )
    assert parse_metrics(text).waiting == 1


@pytest.mark.parametrize(
    ("labels", "block_size", "num_gpu_blocks"),
    [
        ('block_size="16",num_gpu_blocks="100"', 16, 100),
        ('block_size="None",num_gpu_blocks="None"', None, None),
        ('block_size="16.0",num_gpu_blocks="abc"', 16, None),
        ("", None, None),
    ],
)
def test_cache_config_values_are_integers_or_unknown(labels, block_size, num_gpu_blocks):
    text = (
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
        f"vllm:cache_config_info{{{labels}}} 1\n"
    )
    snapshot = parse_metrics(text)
    assert (snapshot.block_size, snapshot.num_gpu_blocks) == (block_size, num_gpu_blocks)


def test_lora_info_newest_series_wins_and_names_are_trimmed():
    text = (
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 100\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters=" a ,b,, ",waiting_lora_adapters=" c"} 200\n'
    )
    snapshot = parse_metrics(text)
    assert snapshot.running_adapters == {"a", "b"}
    assert snapshot.waiting_adapters == {"c"}
    assert snapshot.max_lora == 2


def test_kv_usage_is_clamped_to_a_fraction():
    text = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 1.7\n"
    assert parse_metrics(text).kv_usage == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage that is not prometheus",
        "vllm:num_requests_waiting 1\nvllm:num_requests_running 1\n",  # no KV usage
        "vllm:num_requests_waiting one\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n",
        'vllm:num_requests_waiting{a="b} 1\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n',
        "vllm:num_requests_waiting{a=b} 1\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n",
        "\x00\xff" * 100,
    ],
)
def test_malformed_pages_raise_a_clear_error(text):
    with pytest.raises(MetricsParseError):
        parse_metrics(text)


def test_wrong_engine_reports_missing_gauges():
    with pytest.raises(MetricsParseError, match="sglang:num_queue_reqs"):
        parse_metrics(page("vllm_v1.txt"), "sglang")


def test_unknown_engine_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown engine type"):
        engine_spec("tgi")
    assert engine_spec(None) is ENGINES["vllm"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:x", MetricSpec("vllm:x")),
        ("m{request_type=waiting}", MetricSpec("m", (("request_type", "waiting"),))),
        ('m{a="1", b=2}', MetricSpec("m", (("a", "1"), ("b", "2")))),
    ],
)
def test_metric_spec_syntax(text, expected):
    assert MetricSpec.parse(text) == expected


@pytest.mark.parametrize("text", ["m{a=1", "m{a}"])
def test_metric_spec_errors(text):
    with pytest.raises(ValueError):
        MetricSpec.parse(text)


label_values = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r"), max_size=20)
label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True).filter(lambda s: not s.startswith("__"))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@settings(max_examples=300)
@given(
    labels=st.dictionaries(label_names, label_values, max_size=5),
    value=st.one_of(st.floats(allow_nan=False), st.integers(-(2**53), 2**53)),
)
def test_sample_parser_agrees_with_prometheus_client(labels, value):
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    line = f"vllm:some_gauge{{{body}}} {float(value)!r}" if labels else f"vllm:some_gauge {float(value)!r}"
    line = line.replace("inf", "Inf")
    (family,) = text_string_to_metric_families(line + "\n")
    (reference,) = family.samples
    name, parsed_labels, parsed_value = _parse_sample_line(line)
    assert name == reference.name
    assert parsed_labels == reference.labels
    assert parsed_value == reference.value


def test_parse_benchmark(benchmark):
    """Target: <= 100 us per realistic vLLM page (~400 lines of V1 histograms)."""
    text = page("vllm_v1.txt")
    assert len(text.splitlines()) > 350
    snapshot = benchmark(parse_metrics, text)
    assert snapshot.running == 7
