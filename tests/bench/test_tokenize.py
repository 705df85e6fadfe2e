"""`epp-bench tokenize` runs each of its ways, on a small prompt: the scorer's prepare finds the held blocks, and the
pre-token cache's encoding of the whole text equals the tokenizer's (the bench asserts both as it measures)."""

from harness.bench import tokenize


def test_the_tokenize_bench_measures_every_way_on_a_small_prompt():
    (row,) = tokenize.measure(repeats=1, sizes=(256,))
    assert row["prompt_tokens"] > 256  # the context, the chat template and the question
    for way in (
        "encode_whole_ms",
        "encode_whole_pre_token_cache_ms",
        "encode_segments_one_by_one_ms",
        "prepare_cold_ms",
        "prepare_cold_new_ms",
        "prepare_cached_context_ms",
        "prepare_same_prompt_ms",
    ):
        assert row[way] > 0, way
