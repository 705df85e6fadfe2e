"""The flood benchmark's fairness arithmetic and charts, and one short real flood through the EPP (the full run is
`epp-bench flood`, minutes long)."""

import pytest

from harness.bench.compare import LOAD_SAMPLE_SECONDS
from harness.bench.flood import ClassResult, FloodResult, _max_min_fair, jain_index, plots, run_target


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


async def test_a_short_flood_samples_each_servers_load_while_it_runs(tmp_path):
    """Two sims through the EPP at twice a capacity they cannot serve in time (given, not measured: that takes 8 s),
    for 3 s: the load sampler reads every server's running + waiting from its metrics page while the flood lasts,
    and the load chart is drawn from those samples."""
    result = await run_target("epp", 2.0, 6.0, 3.0, 2, tmp_path / "flood")
    samples = result.load_over_time
    assert len(samples) >= 3.0 / LOAD_SAMPLE_SECONDS / 2  # sampled all along (the loaded machine stretches the period)
    assert all(len(sample) == 2 and min(sample) >= 0 for sample in samples)  # both servers, every page read
    assert all(max(sample[i] for sample in samples) > 0 for i in range(2))  # each server's work was seen
    assert max(map(sum, samples)) > 2  # queued beyond a request a server: the flood overloaded them
    assert result.accounted and sum(c.sent for c in result.classes.values()) > 0
    (chart,) = [p for p in plots([result], tmp_path) if p.name.startswith("flood_load_")]
    assert chart.name == "flood_load_epp_2x.png" and chart.stat().st_size > 10_000
