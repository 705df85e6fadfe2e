"""The flood benchmark's fairness arithmetic (the run itself is `epp-bench flood`, minutes long)."""

import pytest

from harness.bench.flood import _max_min_fair, jain_index


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
