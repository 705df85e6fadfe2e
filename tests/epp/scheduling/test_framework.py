"""The plugin contract: extension points found by type, scores clamped to [0, 1], a cycle state shared by the
plugins of one cycle and reaching the request's later hooks, declared data checked at startup, typed names."""

import math

import pytest

from epp.config import ConfigError
from epp.scheduling.framework import (
    Filter,
    PoolChanged,
    PreRequest,
    ResponseComplete,
    Scorer,
    Stability,
    check_data_dependencies,
    register,
)
from epp.scheduling.plugins import PLUGIN_TYPES, build_plugin
from epp.scheduling.scheduler import Profile, Scheduler
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, StateKey, TypedName
from tests.epp.helpers import endpoint

SEEN: StateKey[list[str]] = StateKey("seen")


class Fixed(Scorer):
    """Scores given per endpoint name, whatever their range."""

    consumes = (SEEN,)

    def __init__(self, name, scores):
        self.typed_name = TypedName("fixed", name)
        self.scores = scores
        self.seen = None

    def score(self, cycle_state, request, endpoints):
        self.seen = cycle_state.read(SEEN)
        return [self.scores[e.name] for e in endpoints]


class Recorder(Filter, PreRequest, ResponseComplete, PoolChanged):
    """Passes every candidate and writes their names into the cycle state; records every hook call."""

    typed_name = TypedName("recorder", "recorder")
    produces = (SEEN,)

    def __init__(self):
        self.calls = []

    def filter(self, cycle_state, request, endpoints):
        cycle_state.write(SEEN, [e.name for e in endpoints])
        return endpoints

    def pre_request(self, request, result):
        self.calls.append(("pre_request", result.cycle_state.read(SEEN)))

    def response_complete(self, request, result, endpoint, response):
        self.calls.append(("response_complete", result.cycle_state.read(SEEN), endpoint.name))

    def pool_changed(self, endpoints):
        self.calls.append(("pool_changed", len(endpoints)))


def scheduler_of(*scorers, recorder=None):
    picker = build_plugin("max-score-picker", {"maxNumOfEndpoints": 3})
    filters = (recorder,) if recorder else ()
    plugins = (*filters, *(s for s, _ in scorers), picker)
    return Scheduler(Profile("test", plugins, filters, tuple(scorers), picker))


def req():
    return SchedulingRequest(request_id="r", model="m")


def test_scores_are_clamped_to_0_1_and_nan_counts_as_0():
    wild = Fixed("wild", {"e0": 7.0, "e1": -3.0, "e2": math.nan})
    tame = Fixed("tame", {"e0": 0.0, "e1": 0.5, "e2": 0.9})
    scheduler = scheduler_of((wild, 1.0), (tame, 1.0), recorder=Recorder())
    result = scheduler.schedule(req(), [endpoint(i) for i in range(3)])
    assert result.scores == {wild.typed_name: [1.0, 0.0, 0.0], tame.typed_name: [0.0, 0.5, 0.9]}
    # totals 1.0, 0.5, 0.9: an unbounded 7.0 could not outweigh every other scorer
    assert [e.name for e in result.endpoints] == ["e0", "e2", "e1"]


def test_weighted_scores_add_up_clamped_in_place_and_a_wrong_count_is_refused():
    """The scheduler's sum (a C loop when compiled): ints and floats alike, clamped, NaN as 0; a scorer that returns
    more or fewer scores than there are candidates is a bug the cycle must not paper over."""
    from epp.scheduling.scheduler import add_weighted

    totals = [0.0, 1.0, 2.0, 0.5]
    add_weighted(totals, (0.5, 2, -1.0, math.nan), 2.0)
    assert totals == [1.0, 3.0, 2.0, 0.5]
    for wrong in ([0.5] * 3, [0.5] * 5):
        with pytest.raises(ValueError, match=f"{len(wrong)} scores for 4 candidates"):
            add_weighted(totals, wrong, 1.0)
    assert totals == [1.0, 3.0, 2.0, 0.5]


def test_the_cycle_state_is_shared_in_the_cycle_and_reaches_the_later_hooks():
    recorder = Recorder()
    scorer = Fixed("s", {"e0": 0.2, "e1": 0.8})
    scheduler = scheduler_of((scorer, 1.0), recorder=recorder)
    pool = [endpoint(0), endpoint(1)]
    result = scheduler.schedule(req(), pool)
    assert scorer.seen == ["e0", "e1"]  # written by the filter, read by the scorer
    scheduler.on_routed(req(), result)
    scheduler.on_finished(req(), result, result.primary, ResponseInfo("200"))
    scheduler.on_pool_changed(pool[:1])
    assert recorder.calls == [
        ("pre_request", ["e0", "e1"]),
        ("response_complete", ["e0", "e1"], "e1"),
        ("pool_changed", 1),
    ]
    assert scheduler.schedule(req(), pool).cycle_state is not result.cycle_state  # one state per cycle


class PickRecorder(Recorder):
    """A Recorder whose pre-request hook is an at-pick one."""

    typed_name = TypedName("pick-recorder", "pick-recorder")
    at_pick = True


def test_at_pick_hooks_run_once_the_answer_is_out_or_before_anything_else_reaches_the_plugins():
    recorder = PickRecorder()
    scheduler = scheduler_of((Fixed("s", {"e0": 0.2, "e1": 0.8}), 1.0), recorder=recorder)
    pool = [endpoint(0), endpoint(1)]
    first = scheduler.schedule(req(), pool)
    scheduler.on_picked(req(), first)
    assert recorder.calls == []  # the proxy's answer does not wait for it
    scheduler.record_picks()  # (the director, once the proxy has its answer)
    scheduler.record_picks()
    assert recorder.calls == [("pre_request", ["e0", "e1"])]
    reaches = {
        "the next cycle": lambda: scheduler.schedule(req(), pool),
        "its preparation": lambda: scheduler.prepare(req()),
        "a routed hook": lambda: scheduler.on_routed(req(), first),
        "a completion": lambda: scheduler.on_finished(req(), first, first.primary, ResponseInfo("200")),
        "timings": lambda: scheduler.on_timed(req(), first, first.primary, 0.1, None),
        "a pool change": lambda: scheduler.on_pool_changed(pool),
    }
    for name, reach in reaches.items():
        recorder.calls.clear()
        scheduler.on_picked(req(), scheduler.schedule(req(), pool))
        scheduler.on_picked(req(), scheduler.schedule(req(), pool))  # a burst: the first one's hook runs here
        assert recorder.calls == [("pre_request", ["e0", "e1"])], name
        reach()
        assert recorder.calls[:2] == [("pre_request", ["e0", "e1"])] * 2, name


def test_consuming_what_nothing_produces_is_a_config_error():
    with pytest.raises(ConfigError, match=r"fixed/s consumes 'seen', which no plugin of the profile produces"):
        scheduler_of((Fixed("s", {}), 1.0))

    class Misspelled(Scorer):
        typed_name = TypedName("misspelled", "misspelled")
        consumes = ("kv_usage", "kv_utilisation")

        def score(self, cycle_state, request, endpoints):
            return None

    with pytest.raises(ConfigError, match="consumes endpoint attribute 'kv_utilisation', which the data layer"):
        scheduler_of((Misspelled(), 1.0))


def test_every_built_in_plugin_can_be_configured_alone():
    """What a built-in consumes comes from the data layer or from the plugin itself."""
    build_plugin("queue-scorer")  # registers the built-ins
    for type_name in PLUGIN_TYPES:
        check_data_dependencies("alone", [build_plugin(type_name)])


def test_named_instances_keep_their_type():
    plugin = build_plugin("queue-scorer", None, "short-queues")
    assert plugin.typed_name == TypedName("queue-scorer", "short-queues")
    assert str(plugin.typed_name) == "queue-scorer/short-queues"
    assert build_plugin("queue-scorer").typed_name == TypedName("queue-scorer", "queue-scorer")


def test_a_plugin_must_implement_an_extension_point_to_register():
    class Nothing:
        pass

    with pytest.raises(TypeError, match="implements no extension point"):
        register("nothing", Stability.BETA)(Nothing)


def test_cycle_state_reads_what_was_written_under_the_same_key():
    state, other = CycleState(), StateKey("seen")
    state.write(SEEN, ["e0"])
    assert state.read(SEEN) == ["e0"]
    assert state.read(other) is None  # keys compare by identity, not by name
