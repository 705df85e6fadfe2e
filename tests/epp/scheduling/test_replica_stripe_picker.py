"""replica-stripe-picker: alone it is max-score-picker; active-active replicas that see the same scores take
different endpoints among the near-best ones, and one ahead by more than the margin on every replica."""

from collections import Counter

import pytest

from epp.config import ConfigError
from epp.scheduling.plugins import build_plugin
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import CycleState, SchedulingRequest
from tests.epp.helpers import endpoint

REQUEST = SchedulingRequest(request_id="r", model="m", prompt="")


def replica(rank: int, replicas: int, **parameters):
    picker = build_plugin("replica-stripe-picker", parameters or None)
    picker.use_replicas(lambda: (rank, replicas))
    return picker


def first(picker, endpoints, scores) -> str:
    return picker.pick(CycleState(), REQUEST, endpoints, scores)[0].name


def test_alone_it_takes_the_best_and_breaks_ties_at_random():
    endpoints = [endpoint(i) for i in range(5)]
    for picker in (build_plugin("replica-stripe-picker"), replica(0, 1)):  # never told of peers, or none live
        assert first(picker, endpoints, [0.2, 3.5, 3.4, 1.0, 3.45]) == "e1"
        tied = Counter(first(picker, endpoints, [2.0, 5.0, 5.0, 5.0, 1.0]) for _ in range(600))
        assert set(tied) == {"e1", "e2", "e3"} and min(tied.values()) > 120, tied


def test_replicas_take_different_endpoints_among_the_near_best():
    endpoints = [endpoint(i) for i in range(8)]
    scores = [5.0 - 0.01 * i for i in range(8)]  # one EPP would take e0; all within the margin
    picks = [first(replica(rank, 3), endpoints, scores) for rank in range(3)]
    assert picks == ["e0", "e1", "e2"]  # each the best of its own stripe: e0 e3 e6 / e1 e4 e7 / e2 e5
    assert first(replica(1, 3), endpoints[::-1], scores[::-1]) == "e1"  # stripes follow addresses, not list order


def test_a_candidate_ahead_by_more_than_the_margin_wins_on_every_replica():
    endpoints = [endpoint(i) for i in range(8)]
    scores = [4.0] * 8
    scores[5] = 5.0  # a cached prefix, say
    assert {first(replica(rank, 3, margin=0.5), endpoints, scores) for rank in range(3)} == {"e5"}
    # within a wider margin the others keep to their own stripes (ties within one broken at random)
    wide = [first(replica(rank, 3, margin=1.5), endpoints, scores) for rank in range(3)]
    assert wide[0] in {"e0", "e3", "e6"} and wide[1] in {"e1", "e4", "e7"} and wide[2] == "e5"


def test_fewer_near_best_than_replicas_go_to_the_replicas_in_rank_order():
    endpoints = [endpoint(i) for i in range(4)]
    scores = [5.0, 1.0, 4.9, 1.0]  # e0 and e2 near-best
    assert first(replica(1, 2), endpoints, scores) == "e2"  # both on rank 0's stripe (e0 e2 / e1 e3): it takes e0
    # stripes e0 e3 / e1 / e2: ranks 0 and 2 take theirs, rank 1 none of its own, and no near-best is left
    assert [first(replica(rank, 3), endpoints, scores) for rank in range(3)] == ["e0", "e0", "e2"]
    assert [first(replica(rank, 3), endpoints, [5.0, 1.0, 1.0, 4.9]) for rank in range(3)] == ["e0", "e3", "e0"]
    assert first(replica(1, 2), endpoints, [5.0, 1.0, 3.0, 1.0]) == "e0"  # one near-best: it, on every replica


def test_a_burst_split_between_three_replicas_spreads_as_one_epp_would():
    """Eight near-equal endpoints, a burst of nine requests dealt to three replicas that each count their own picks
    (a pick costs an endpoint a point) and not yet their peers': max-score-picker piles three on each of three
    endpoints, the stripes use all eight."""

    def burst(pickers) -> Counter:
        endpoints = [endpoint(i) for i in range(8)]
        placed = Counter()
        for picker in pickers:
            own = Counter()
            for _ in range(3):
                scores = [5.0 - 0.01 * i - own[e.name] for i, e in enumerate(endpoints)]
                name = first(picker, endpoints, scores)
                own[name] += 1
                placed[name] += 1
        return placed

    herded = burst([build_plugin("max-score-picker") for _ in range(3)])
    assert sorted(herded.values()) == [3, 3, 3]
    striped = burst([replica(rank, 3) for rank in range(3)])
    assert len(striped) == 8 and max(striped.values()) == 2


def test_fallbacks_follow_the_pick_best_first():
    endpoints = [endpoint(i) for i in range(4)]
    picked = replica(1, 2, maxNumOfEndpoints=3).pick(CycleState(), REQUEST, endpoints, [5.0, 4.8, 4.9, 1.0])
    assert [e.name for e in picked] == ["e1", "e0", "e2"]


@pytest.mark.parametrize(
    ("parameters", "error"),
    [({"margin": -0.1}, ">= 0.0"), ({"margin": "wide"}, "must be int or float"), ({"spread": 1}, "spread")],
)
def test_bad_parameters_are_config_errors(parameters, error):
    with pytest.raises(ConfigError, match=error):
        build_plugin("replica-stripe-picker", parameters)


def test_the_scheduler_hands_the_replicas_position_to_the_picker():
    config = """\
plugins:
- type: queue-scorer
- type: replica-stripe-picker
  parameters: {margin: 0.25}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: replica-stripe-picker
"""
    scheduler = Scheduler.from_config(config, allow_experimental_plugins=True)

    def position():
        return 2, 3

    scheduler.use_replicas(position)
    assert scheduler.profile.picker.position is position and scheduler.profile.picker.margin == 0.25
