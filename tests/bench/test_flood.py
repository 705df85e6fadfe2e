"""The flood benchmark's fairness arithmetic (the run itself is `epp-bench flood`, minutes long)."""

import pytest

from harness.bench.flood import ClassResult, FloodResult, _max_min_fair, jain_index, plots


def test_max_min_fair_shares_give_small_demands_all_and_split_the_rest():
    assert _max_min_fair([10, 1, 1], 6) == [4, 1, 1]
    assert _max_min_fair([2, 2, 2], 9) == [2, 2, 2]


@pytest.mark.parametrize(
    ("served", "demands", "expected"),
    [
        ([4, 1, 1], [10, 1, 1], 1.0),  # the quiet tenants got all they asked for, the noisy one the rest
        ([6, 0, 0], [10, 1, 1], 1 / 3),  # the noisy one took everything, the quiet ones starved: 1/n
        ([2, 2, 2], [10, 1, 1], 4.5**2 / (3 * 8.25)),  # equal service: quiet at 2x their share, noisy at 0.5x
    ],
)
def test_jain_index_relative_to_max_min_fair_shares(served, demands, expected):
    assert jain_index(served, demands) == pytest.approx(expected)


def test_plots_show_each_overloads_ttft_distribution_and_throughput(tmp_path):
    results = [
        FloodResult(
            target,
            2.0,
            20.0,
            10.0,
            5.0,
            classes={"critical": ClassResult(sent=3, ok=3)},
            ttft_samples_ms={"critical": [40.0 * scale, 60.0 * scale, 90.0 * scale], "sheddable": [200.0 * scale]},
            completed_per_s=[0, 8, 10, 9, 4],
            load_over_time=[[0, 1], [4, 6], [8, 7], [2, 3]],
        )
        for target, scale in (("epp", 1.0), ("round-robin", 3.0))
    ]
    paths = plots(results, tmp_path)
    assert {p.name for p in paths} == {
        "flood_ttft_cdf_2x.png",
        "flood_throughput_2x.png",
        "flood_load_epp_2x.png",
        "flood_load_round-robin_2x.png",
    }
    assert all(p.stat().st_size > 10_000 for p in paths)  # drawn, not empty
