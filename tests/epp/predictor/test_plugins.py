"""predicted-latency-scorer and slo-headroom-filter over a trained predictor (synthetic pool: conftest.true_ttft)."""

import math
import time

import pytest

from epp.config import ConfigError
from epp.scheduling.framework import LatencyPredictionReader
from epp.scheduling.plugins import build_plugin
from epp.scheduling.plugins.predicted_latency_scorer import ROUTED_FEATURES
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import CycleState, ResponseInfo, SchedulingRequest, SchedulingResult
from tests.epp.helpers import endpoint
from tests.epp.predictor.conftest import reading, train, trained


def req(prompt_tokens=1000, headers=None, max_tokens=None, model="m", streamed=True):
    """A request whose timings come back (streamed) unless `streamed` says otherwise."""
    return SchedulingRequest(
        "r", model, "", prompt_tokens, headers=headers or {}, max_tokens=max_tokens, streamed=streamed
    )


def pool_of_three(predictions):
    """Idle; a long prompt just routed there (still in its prefill backlog); no queue but a big decode batch."""
    endpoints = [
        endpoint(0),
        endpoint(1, in_flight=1, in_flight_tokens=6000, waiting=1),
        endpoint(2, running=15, in_flight=15, in_flight_tokens=3000),
    ]
    predictions.predictor.routed(endpoints[1], 6000, 0, None)
    return endpoints


def test_scorer_abstains_while_cold(predictions):
    scorer = reading("predicted-latency-scorer", predictions)
    assert scorer.score(CycleState(), req(), pool_of_three(predictions)) is None


def test_scorer_prefers_the_fastest_predicted_endpoint(predictions):
    trained(predictions)
    scorer = reading("predicted-latency-scorer", predictions)
    endpoints, request, cycle = pool_of_three(predictions), req(), CycleState()
    scores = scorer.score(cycle, request, endpoints)
    ttfts = [
        t for t, _ in predictions.get(cycle, request, endpoints, tpot=False)
    ]  # the same cycle: what the scorer used
    assert scores[0] == 1.0 and all(0 < s < 1 for s in scores[1:])
    assert scores == pytest.approx([min(ttfts) / t for t in ttfts])
    assert ttfts[1] > 0.6  # ~6,000 tokens ahead at 0.1 ms each (and the waiting one) are learnt


def test_scorer_counts_tpot_for_long_outputs(predictions):
    trained(predictions)
    scorer = reading("predicted-latency-scorer", predictions, {"longOutputTokens": 100})
    # TTFT: 0 is a little better (no tokens in flight); TPOT: 0 has a 15-request decode batch, 1 none
    endpoints = [endpoint(0, running=15, in_flight=15, in_flight_tokens=0), endpoint(1, in_flight_tokens=200)]
    assert scorer.score(CycleState(), req(max_tokens=50), endpoints)[0] == 1.0  # short answer: TTFT decides
    costs = [t + p * 5000 for t, p in predictions.get(CycleState(), req(), endpoints, tpot=True)]
    long = scorer.score(CycleState(), req(max_tokens=5000), endpoints)
    assert long == pytest.approx([min(costs) / c for c in costs])
    assert long[1] == 1.0


def test_cached_tokens_lower_the_prediction(predictions):
    trained(predictions)
    candidates = predictions
    endpoints = [endpoint(0), endpoint(1)]
    candidates.cached_tokens = lambda cycle_state, request, endpoints: [
        4000 if e.name == "e1" else 0 for e in endpoints
    ]
    scores = reading("predicted-latency-scorer", predictions).score(CycleState(), req(prompt_tokens=5000), endpoints)
    assert scores[1] == 1.0 and scores[0] < 0.5


def test_filter_keeps_endpoints_predicted_to_meet_the_objective_with_the_error_margin(predictions):
    trained(predictions)
    f = reading("slo-headroom-filter", predictions, {"confidence": 0.9})
    margin = predictions.predictor.ttft.ratio_quantile(0.9)  # observed / predicted, 90th percentile
    assert 1.0 < margin < 1.2  # the synthetic pool's noise is 3 %
    endpoints = pool_of_three(predictions)
    ttfts = [t for t, _ in predictions.get(CycleState(), req(), endpoints, tpot=False)]
    slo_ms = max(ttfts[0], ttfts[2]) * margin * 1e3 * 1.001  # 0 and 2 meet it with the margin, 1 does not
    assert f.filter(CycleState(), req(headers={"x-llm-d-slo-ttft-ms": f"{slo_ms:.4f}"}), endpoints) == [
        endpoints[0],
        endpoints[2],
    ]
    without_margin = f"{ttfts[2] * 1e3 * 1.001:.4f}"  # 2 is predicted within it, but not with the margin
    assert endpoints[2] not in f.filter(CycleState(), req(headers={"x-llm-d-slo-ttft-ms": without_margin}), endpoints)
    tight = f"{ttfts[0] * 1e3 * 0.9:.3f}"  # nobody meets it: the best one is kept
    assert f.filter(CycleState(), req(headers={"x-llm-d-slo-ttft-ms": tight}), endpoints) == [endpoints[0]]


def test_the_margin_follows_the_predictor_error(predictions):
    predictor = predictions.predictor
    train(predictor, noise=0.01)
    tight = predictor.ttft.ratio_quantile(0.9)
    train(predictor, count=300, noise=0.3, seed=1)  # the pool becomes noisier: the window fills with larger errors
    assert predictor.ttft.ratio_quantile(0.9) > tight + 0.1
    assert predictor.ttft.ratio_quantile(0.5) < predictor.ttft.ratio_quantile(0.9)


def test_filter_checks_tpot_objectives(predictions):
    trained(predictions)
    f = reading("slo-headroom-filter", predictions)
    endpoints = pool_of_three(predictions)
    tpots = [p for _, p in predictions.get(CycleState(), req(), endpoints, tpot=True)]
    limit = f"{(tpots[0] + tpots[2]) / 2 * 1e3:.4f}"  # the 15-request decode batch of endpoint 2 misses it
    assert endpoints[2] not in f.filter(CycleState(), req(headers={"x-llm-d-slo-tpot-ms": limit}), endpoints)


@pytest.mark.parametrize(
    "headers", [{}, {"x-llm-d-slo-ttft-ms": "abc"}, {"x-llm-d-slo-ttft-ms": "-5"}, {"x-llm-d-slo-tpot-ms": "nan"}]
)
def test_filter_passes_everything_without_a_usable_objective(predictions, headers):
    trained(predictions)
    endpoints = pool_of_three(predictions)
    assert (
        reading("slo-headroom-filter", predictions).filter(CycleState(), req(headers=headers), endpoints) == endpoints
    )


def test_filter_passes_everything_while_cold(predictions):
    endpoints = pool_of_three(predictions)
    f = reading("slo-headroom-filter", predictions)
    assert f.filter(CycleState(), req(headers={"x-llm-d-slo-ttft-ms": "1"}), endpoints) == endpoints


@pytest.mark.parametrize(
    ("plugin", "parameters"),
    [
        ("slo-headroom-filter", {"confidence": 1}),
        ("slo-headroom-filter", {"confidence": 0}),
        ("slo-headroom-filter", {"headroom": 0.2}),
        ("predicted-latency-scorer", {"longOutputTokens": 0}),
        ("predicted-latency-scorer", {"pool": "default"}),  # one predictor per scheduler: no pool to name
        ("predicted-latency-scorer", {"unknown": 1}),
        ("predicted-latency-scorer", {"replaces": "prefix"}),
    ],
)
def test_bad_parameters_are_config_errors(plugin, parameters):
    with pytest.raises(ConfigError):
        build_plugin(plugin, parameters)


def profile_of(predictions, *plugins: str) -> Scheduler:
    """A scheduler whose one profile runs these plugins, in order, the predictor's reading `predictions` (None: the
    scheduler's own)."""
    declared = "".join(f"- type: {p}\n" for p in plugins)
    refs = "".join(f"  - pluginRef: {p}\n" for p in plugins)
    config = f"plugins:\n{declared}schedulingProfiles:\n- name: default\n  plugins:\n{refs}"
    return Scheduler.from_config(config, predictions)


def test_profile_with_both_plugins_routes_to_the_fastest(predictions):
    trained(predictions)
    scheduler = profile_of(predictions, "slo-headroom-filter", "predicted-latency-scorer")
    endpoints = pool_of_three(predictions)
    result = scheduler.schedule(req(headers={"x-llm-d-slo-ttft-ms": "10000"}), endpoints)
    assert result.primary is endpoints[0]


def test_predictions_are_shared_within_a_cycle_and_renewed_in_the_next(predictions):
    trained(predictions)
    candidates = predictions
    endpoints, request, cycle = [endpoint(0), endpoint(1)], req(prompt_tokens=3000), CycleState()
    first = candidates.get(cycle, request, endpoints, tpot=True)
    candidates.predictor.routed(endpoints[1], 5000, 0, None)
    # the scorer after the filter: same numbers
    assert candidates.get(cycle, request, endpoints[1:], tpot=True) == first[1:]
    again = candidates.get(
        CycleState(), request, endpoints, tpot=True
    )  # scheduled again (a retry): 1 now has a backlog
    assert again[0][0] == pytest.approx(first[0][0], rel=1e-3) and again[1][0] > first[1][0] + 0.1


def test_tpot_is_predicted_only_for_a_reader_that_needs_it(predictions):
    trained(predictions)
    candidates = predictions
    endpoints, request, cycle = [endpoint(0), endpoint(1)], req(prompt_tokens=3000), CycleState()
    ttft_only = candidates.get(cycle, request, endpoints, tpot=False)
    assert all(tpot is None for _, tpot in ttft_only)
    both = candidates.get(cycle, request, endpoints, tpot=True)  # a later reader that needs TPOT gets it
    assert all(tpot is not None for _, tpot in both)
    assert [t for t, _ in both] == pytest.approx([t for t, _ in ttft_only])


def test_an_adapter_not_loaded_on_the_pick_is_recorded_as_a_load(predictions):
    """The pick lacks the adapter another candidate runs: its features say the adapter must be loaded there, and
    still do once no endpoint reports it (the name is remembered as an adapter's); a base-model request's do not."""
    trained(predictions)
    scorer = reading("predicted-latency-scorer", predictions)
    holder, other = endpoint(0, running_adapters=("sql-lora",)), endpoint(1)
    scheduler = Scheduler.from_config(None)
    for model, endpoints, loaded in (
        ("sql-lora", [holder, other], False),
        ("sql-lora", [other], False),
        ("m", [holder, other], True),
    ):
        result = scheduler.schedule(req(model=model), endpoints)
        result.endpoints = [other]
        scorer.pre_request(req(model=model), result)
        assert result.cycle_state.read(ROUTED_FEATURES).adapter_loaded is loaded


def test_a_request_whose_timings_cannot_come_back_joins_the_backlog_without_features(predictions):
    """A response that is not streamed has no TTFT to learn from: its prompt still joins the pick's prefill backlog
    (the next request sees it), once per request however many predictor plugins the profile has, but no features
    are kept for it."""
    filter_, scorer = (reading(t, predictions) for t in ("predicted-latency-filter", "predicted-latency-scorer"))
    backlog = predictions.predictor.backlog
    # drained at a token a second, not at 10,000: the reads below give what was queued, however long this process
    # waited between the add and the read (4.7 ms, 47 tokens, with pytest-xdist's workers on 2 cores)
    backlog.seconds_per_token = 1.0
    pick = endpoint(0)
    for streamed, queued in ((False, 2000), (True, 4000)):
        result = SchedulingResult([pick], candidates=[pick], cycle_state=CycleState())
        for plugin in (filter_, scorer):
            plugin.pre_request(req(prompt_tokens=2000, streamed=streamed), result)
        assert backlog.tokens(pick.spec.name, time.monotonic()) == pytest.approx(queued, rel=0.01)
        assert (result.cycle_state.read(ROUTED_FEATURES) is not None) is streamed


def test_while_it_predicts_the_latency_scorer_replaces_the_scorers_whose_signals_it_models(predictions):
    """Default scorers plus the latency scorer: cold, they decide (the queue scorer prefers the idle endpoint 0) and
    the latency scorer is not run; warm, only the prediction counts, whatever the weights, and no other scorer runs."""
    config = """
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
- type: predicted-latency-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 100
  - pluginRef: prefix-cache-scorer
  - pluginRef: predicted-latency-scorer
"""
    scheduler = Scheduler.from_config(config, predictions)
    assert scheduler.profile.scorers[0][0].typed_name.type == "predicted-latency-scorer"  # runs first
    endpoints = pool_of_three(predictions)
    cold = scheduler.schedule(req(), endpoints)
    assert [name.type for name, _ in cold.timings] == ["queue-scorer", "prefix-cache-scorer", "max-score-picker"]
    assert [name.type for name in cold.raw_scores] == ["queue-scorer"]  # the prefix scorer abstained
    trained(predictions)
    warm = scheduler.schedule(req(), endpoints)
    assert [name.type for name in warm.raw_scores] == ["predicted-latency-scorer"]
    assert [name.type for name, _ in warm.timings] == ["predicted-latency-scorer", "max-score-picker"]
    assert warm.primary is endpoints[0]


def test_until_the_predictor_predicts_its_readers_filters_and_scorer_are_not_called(predictions):
    """The default profile: cold, the predictor's filters would pass every endpoint and its scorer abstain, so the
    cycle leaves them out (no call, no timing) and picks as without them; once it predicts, they run."""
    scheduler = Scheduler.from_config(None, predictions)
    readers = {"slo-headroom-filter", "slo-interference-filter", "predicted-latency-filter", "predicted-latency-scorer"}
    assert readers <= {p.typed_name.type for p in scheduler.profile.plugins}
    endpoints = pool_of_three(predictions)
    cold = scheduler.schedule(req(), endpoints)
    assert readers.isdisjoint(name.type for name, _ in cold.timings)
    skipping = scheduler._cycles
    scheduler._cycles = (scheduler._plugins_that_run(predicting=True, kv_events=True),) * 4
    called = scheduler.schedule(req(), endpoints)  # every plugin called, cold: the same pick and scores
    scheduler._cycles = skipping
    assert readers <= {name.type for name, _ in called.timings}
    assert called.endpoints == cold.endpoints and called.raw_scores == cold.raw_scores
    trained(predictions)
    warm = scheduler.schedule(req(), endpoints)
    assert readers <= {name.type for name, _ in warm.timings}


def test_replacing_only_the_load_scorers_leaves_the_prefix_and_lora_scorers_to_add_theirs(predictions):
    """`replaces: load`: warm, the queue scorer is skipped and the prefix scorer still runs (it abstains here: no
    prompt blocks known); cold, the queue scorer decides as without it."""
    config = """
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
- type: predicted-latency-scorer
  parameters: {replaces: load}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: prefix-cache-scorer
  - pluginRef: predicted-latency-scorer
"""
    scheduler = Scheduler.from_config(config, predictions)
    endpoints = pool_of_three(predictions)
    cold = scheduler.schedule(req(), endpoints)
    assert [name.type for name in cold.raw_scores] == ["queue-scorer"]
    trained(predictions)
    warm = scheduler.schedule(req(), endpoints)
    assert [name.type for name, _ in warm.timings] == [
        "predicted-latency-scorer",
        "prefix-cache-scorer",
        "max-score-picker",
    ]
    assert [name.type for name in warm.raw_scores] == ["predicted-latency-scorer"]


def test_predicted_profile_sends_a_long_prompt_to_the_idle_server_not_to_one_still_busy_with_another(predictions):
    """The case that put 6,000-token prompts behind one another on the heterogeneous workload: in a burst, an idle
    server was just sent a chat turn (lag-corrected: one waiting) while another has a long prompt not answered yet
    (running, none waiting). Both pass the band; the queue scorer prefers the busy one, the prediction the idle
    one. (Both backlogs have drained, so that the predictions do not change while the test runs.)"""
    trained(predictions)
    predictor = predictions.predictor
    idle = endpoint(0, in_flight=1, in_flight_tokens=200)  # a chat turn routed since the last scrape
    busy = endpoint(1, running=1, in_flight=1, in_flight_tokens=4000)  # a long prompt not answered yet
    for e in (idle, busy):
        predictor.routed(e, e.in_flight_tokens, 0, None, now=time.monotonic() - 1.0)
    endpoints, request = [idle, busy], req(prompt_tokens=6000, max_tokens=50)
    load_scorers = """
plugins:
- type: predicted-latency-filter
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: in-flight-tokens-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-latency-filter
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: in-flight-tokens-scorer, weight: 1}
"""
    # the band, then the load scorers as the default profile weighs them: by the counts (one queued on the idle one,
    # none on the busy one)
    assert Scheduler.from_config(load_scorers, predictions).schedule(request, endpoints).primary is busy
    predicted = Scheduler.from_config(None, predictions)
    ttfts = [t for t, _ in predictions.get(CycleState(), request, endpoints, tpot=False)]
    assert ttfts[0] < ttfts[1]
    assert reading("predicted-latency-filter", predictions).filter(CycleState(), request, endpoints) == endpoints
    assert predicted.schedule(request, endpoints).primary is idle


def test_latency_filter_drops_only_what_the_prediction_tells_apart_beyond_its_error(predictions):
    endpoints = pool_of_three(predictions)
    f = reading("predicted-latency-filter", predictions)
    assert f.filter(CycleState(), req(), endpoints) == endpoints  # cold: everything passes
    trained(predictions)
    target = predictions.predictor.ttft
    band = target.ratio_quantile(0.9) / target.ratio_quantile(0.1)
    assert 1.0 < band < 1.3  # the synthetic pool's noise is 3 %
    ttfts = [t for t, _ in predictions.get(CycleState(), req(), endpoints, tpot=False)]
    kept = f.filter(CycleState(), req(), endpoints)
    assert kept == [e for e, t in zip(endpoints, ttfts, strict=True) if t <= min(ttfts) * band]
    assert endpoints[0] in kept and endpoints[1] not in kept  # 1 has a 6,000-token prefill ahead


def test_latency_filter_for_a_long_answer_keeps_the_fastest_ttft_then_the_fastest_tpot_among_them(predictions):
    trained(predictions)
    f = reading("predicted-latency-filter", predictions, {"longOutputTokens": 100})
    # 3: the same TTFT as 0 (nothing queued), but a 15-request decode batch: a slower TPOT (synthetic pool)
    idle, backlogged, _ = pool_of_three(predictions)
    batch = endpoint(3, running=15, in_flight=15)
    endpoints = [idle, backlogged, batch]
    assert f.filter(CycleState(), req(max_tokens=50), endpoints) == [idle, batch]  # a short answer: TTFT alone
    # a long answer: TTFT first (the ~0.6 s backlog is out however good its TPOT), then TPOT among the rest
    assert f.filter(CycleState(), req(max_tokens=500), endpoints) == [idle]


def test_with_both_predictor_plugins_a_request_is_learnt_once(predictions):
    # every observation learnt: how many a second the training's pace left to learn is not what this test is about
    predictions.predictor.max_learn_rate = math.inf
    trained(predictions)
    scheduler = profile_of(predictions, "predicted-latency-filter", "predicted-latency-scorer")
    endpoints = pool_of_three(predictions)
    predictor = predictions.predictor
    observations = predictor.observations
    request = req()
    result = scheduler.schedule(request, endpoints)
    scheduler.on_picked(request, result)
    scheduler.on_routed(request, result)
    scheduler.on_finished(request, result, result.primary, ResponseInfo(status="200", output_tokens=10))
    scheduler.on_timed(request, result, result.primary, 0.05, 0.01)
    scheduler.on_timed(request, result, result.primary, 0.05, None)  # a second source of the same request
    assert predictor.observations == observations + 1


def test_a_scheduler_has_one_predictor_for_its_plugins_and_shares_it_with_no_other_scheduler(predictions):
    plugins = ("slo-headroom-filter", "predicted-latency-filter", "predicted-latency-scorer", "prefix-cache-scorer")
    scheduler = profile_of(None, *plugins)
    readers = [p for p in scheduler.profile.plugins if isinstance(p, LatencyPredictionReader)]
    assert len(readers) == 3 and all(p.predictions is scheduler.predictions for p in readers)
    # it counts what the profile's prefix index expects cached
    assert scheduler.predictions.cached_tokens == scheduler.prefix_index.cached_tokens
    # what one scheduler's plugins learn, another built from the same config does not see
    other = profile_of(None, *plugins)
    assert other.predictions is not scheduler.predictions
    request = req()
    result = scheduler.schedule(request, [endpoint(0), endpoint(1)])
    scheduler.on_picked(request, result)
    scheduler.on_timed(request, result, result.primary, 0.05, 0.01)
    assert scheduler.predictions.predictor.observations == 1
    assert other.predictions.predictor.observations == 0
    # one trained elsewhere, when given, is the one every reader reads; a profile without readers has none
    given = profile_of(predictions, *plugins)
    assert given.predictions is predictions
    assert all(p.predictions is predictions for p in given.profile.plugins if isinstance(p, LatencyPredictionReader))
    assert profile_of(None, "queue-scorer").predictions is None
