import math
import random
from dataclasses import replace

import pytest

from epp.predictor import Features, LatencyPredictor, endpoint_features
from epp.predictor import predictor as predictor_module
from tests.epp.helpers import endpoint
from tests.epp.predictor.conftest import random_features, train, true_tpot, true_ttft


def test_cold_until_enough_observations_then_accurate():
    predictor = LatencyPredictor(min_observations=100)
    f = Features(1, 4, 0.2, 3000, 5000, 1000)
    train(predictor, count=99)
    assert predictor.predict_ttft(f) is None and predictor.predict_tpot(f) is None
    train(predictor, count=200, seed=1)
    assert predictor.observations == 299
    assert predictor.predict_ttft(f) == pytest.approx(true_ttft(f), rel=0.05)
    assert predictor.predict_tpot(f) == pytest.approx(true_tpot(f), rel=0.05)
    assert predictor.ttft_mape < 0.1 and predictor.tpot_mape < 0.1


def test_stays_cold_while_its_error_is_too_large():
    predictor = LatencyPredictor(min_observations=50, max_mape=0.2)
    rng = random.Random(3)
    for _ in range(300):  # latencies unrelated to the features
        predictor.observe(random_features(rng), rng.uniform(0.01, 1.0), rng.uniform(0.005, 0.05))
    assert predictor.ttft_mape > 0.2
    assert predictor.predict_ttft(Features(0, 0, 0.0, 0, 100, 0)) is None


def test_goes_cold_again_when_the_servers_change():
    predictor = LatencyPredictor(min_observations=50, max_mape=0.2, window=50)
    train(predictor, count=200)
    assert predictor.ttft_ready
    rng = random.Random(4)
    for _ in range(30):  # the pool becomes 5x slower: predictions made before learning it are off by ~80 %
        f = random_features(rng)
        predictor.observe(f, 5 * true_ttft(f), true_tpot(f))
    assert not predictor.ttft_ready and predictor.tpot_ready


def test_tpot_is_optional_per_observation():
    predictor = LatencyPredictor(min_observations=10)
    rng = random.Random(5)
    for _ in range(50):
        f = random_features(rng)
        predictor.observe(f, true_ttft(f), None)
    assert predictor.ttft_ready and not predictor.tpot_ready and predictor.tpot_mape is None


@pytest.mark.parametrize("ttft, tpot", [(0.0, 0.01), (-1.0, None), (math.nan, None), (0.1, math.inf), (0.1, 0.0)])
def test_bad_observations_are_rejected(ttft, tpot):
    with pytest.raises(ValueError):
        LatencyPredictor().observe(Features(0, 0, 0.0, 0, 10, 0), ttft, tpot)


def test_cached_tokens_cannot_exceed_the_prompt():
    with pytest.raises(ValueError):
        Features(0, 0, 0.0, 0, 10, 11)


def test_memory_is_bounded_by_the_window():
    predictor = LatencyPredictor(window=64)
    train(predictor, count=1000)
    assert len(predictor.ttft.errors) == 64 and len(predictor.tpot.errors) == 64


def test_routed_records_the_backlog_ahead_and_adds_the_uncached_prompt():
    predictor = LatencyPredictor()
    e = endpoint(0, running=1, in_flight_tokens=300)
    first = predictor.routed(e, 3000, 1000, None, now=5.0)
    assert first == Features(0, 1, 0.0, 300, 3000, 1000, True, 0.0, "e0")
    second = predictor.routed(e, 100, 0, None, now=5.0)
    assert second.backlog_tokens == 2000
    per_token = predictor.backlog.seconds_per_token
    assert predictor.routed(e, 10, 0, None, now=5.0 + 1000 * per_token).backlog_tokens == pytest.approx(1100)


def test_endpoint_features_read_the_lag_corrected_load_and_the_adapter():
    e = endpoint(0, waiting=1, running=2, kv=0.4, running_adapters=("sql",), in_flight=6, in_flight_tokens=900)
    f = endpoint_features(e, prompt_tokens=500, cached_tokens=700, adapter="chat")
    # 6 in flight from this EPP, 3 reported: what the scrape does not show yet counts (epp.datalayer.load)
    assert f == Features(
        waiting=4,
        running=5,
        kv_usage=0.4,
        in_flight_tokens=900,
        prompt_tokens=500,
        cached_tokens=500,
        adapter_loaded=False,
        endpoint="e0",
    )
    assert endpoint_features(e, 500, 0, "sql").adapter_loaded and endpoint_features(e, 500, 0, None).adapter_loaded
    e.adapters_used(("chat",), 4)  # a scrape saw it running, or it was sent there: it idles in its slot, loaded
    assert endpoint_features(e, 500, 0, "chat").adapter_loaded
    never_scraped = endpoint(1, in_flight=2, in_flight_tokens=40)
    never_scraped.metrics = None
    assert endpoint_features(never_scraped, 10, 0, None) == Features(2, 2, 0.0, 40, 10, 0, True, endpoint="e1")


@pytest.mark.parametrize("few_candidates", [0, 6], ids=["numpy", "python"])
def test_predict_endpoints_matches_one_at_a_time_predictions(few_candidates, monkeypatch):
    """Both ways of predicting for all candidates at once (numpy's matrix product, or the same arithmetic in Python
    for a few) say what one-at-a-time predictions from the recorded features would."""
    monkeypatch.setattr(predictor_module, "FEW_CANDIDATES", few_candidates)
    predictor = LatencyPredictor(min_observations=50)
    train(predictor)
    endpoints = [
        endpoint(
            i,
            waiting=i % 3,
            running=i,
            kv=0.1 * i,
            in_flight=i,
            in_flight_tokens=700 * i,
            running_adapters=("a",) if i % 2 else (),
        )
        for i in range(6)
    ]
    for e in endpoints[4:]:  # more of this EPP's requests finished since the scrape than it routed there
        e.in_flight_at_scrape = e.in_flight_requests + 2
    cached = [0, 100, 3000, 0, 50, 10_000]
    per_token = predictor.backlog.seconds_per_token
    for _ in range(30):  # long prompts alone: endpoints 1 and 2 measured slower and faster than the pool
        for e, slowness in ((endpoints[1], 2.0), (endpoints[2], 0.5), (endpoints[3], 1.0)):
            predictor.backlog.learn(e.name, 5000, 0.0, 5000 * slowness * per_token)
    assert predictor.backlog.slowness(endpoints[1].name) > 1.2 > 0.8 > predictor.backlog.slowness(endpoints[2].name)
    predictor.routed(endpoints[1], 5000, 0, None, now=10.0)  # a prefill backlog on one of them
    batch = predictor.predict_endpoints(endpoints, 2000, cached, "a", now=10.1)
    assert batch[1][0] > batch[0][0] + 0.1
    ttft_only = predictor.predict_endpoints(endpoints, 2000, cached, "a", now=10.1, tpot=False)
    for e, c, (ttft, tpot), (alone, none) in zip(endpoints, cached, batch, ttft_only, strict=True):
        f = endpoint_features(e, 2000, c, "a", predictor.backlog.tokens(e.name, 10.1))
        assert ttft == pytest.approx(predictor.predict_ttft(f)) and tpot == pytest.approx(predictor.predict_tpot(f))
        assert alone == pytest.approx(ttft) and none is None


def test_error_ratios_are_kept_per_prompt_size_class():
    predictor = LatencyPredictor(min_observations=10)
    rng = random.Random(6)
    for _ in range(300):  # short prompts' latencies are noisy, long ones' exact
        prompt = rng.choice((200, 5000))
        noise = 1 + (0.5 * rng.uniform(-1, 1) if prompt == 200 else 0.0)
        predictor.observe(Features(0, 1, 0.1, 0, prompt, 0), (0.02 + 1e-4 * prompt) * noise, None)
    target = predictor.ttft
    short_band = target.ratio_quantile(0.9, 200) / target.ratio_quantile(0.1, 200)
    long_band = target.ratio_quantile(0.9, 5000) / target.ratio_quantile(0.1, 5000)
    pool_band = target.ratio_quantile(0.9) / target.ratio_quantile(0.1)
    assert long_band < 1.05 < pool_band < short_band
    assert target.ratio_quantile(0.9, 150) == target.ratio_quantile(0.9, 200)  # one class: 128-255 tokens
    assert target.ratio_quantile(0.9, 60_000) == target.ratio_quantile(0.9)  # a size not seen: pool-wide


def test_each_endpoint_learns_its_own_prefill_rate_from_long_prompts_that_found_nothing_ahead():
    predictor = LatencyPredictor(min_observations=50)
    rng = random.Random(7)
    speeds = {"fast-0": 1.0, "slow-0": 0.5, "fast-1": 1.0, "slow-1": 0.5}  # every other endpoint half as fast
    for _ in range(2000):
        name = rng.choice(list(speeds))
        f = replace(random_features(rng), endpoint=name)
        noise = 1 + 0.03 * rng.gauss(0, 1)
        predictor.observe(f, true_ttft(f) / speeds[name] * noise, true_tpot(f) * noise)
    backlog = predictor.backlog
    assert backlog.slowness("slow-0") / backlog.slowness("fast-0") == pytest.approx(2.0, rel=0.1)
    f = Features(1, 4, 0.2, 3000, 5000, 1000)
    for name, speed in speeds.items():
        assert predictor.predict_ttft(replace(f, endpoint=name)) == pytest.approx(true_ttft(f) / speed, rel=0.15)
    assert predictor.ttft_mape < 0.1  # the pool's model alone: ~33 %
    assert predictor.predict_ttft(replace(f, endpoint="new")) == predictor.predict_ttft(f)  # not measured: the pool's
    assert backlog.rate("slow-1") == backlog.rates["slow-1"][0]
    assert backlog.rate("new") == backlog.seconds_per_token


def test_about_max_learn_rate_observations_a_second_are_learnt_at_most():
    predictor = LatencyPredictor(min_observations=50, max_learn_rate=200)
    rng = random.Random(11)
    now = 1000.0

    def observe(count: int, interval: float) -> int:
        nonlocal now
        before = predictor.observations
        for _ in range(count):
            f = random_features(rng)
            predictor.observe(f, true_ttft(f), true_tpot(f), now=now)
            now += interval
        return predictor.observations - before

    assert observe(1000, 0.01) == 1000  # 100 a second: every one
    observe(4000, 0.0005)  # 2,000 a second for 2 s: the stride follows within a quarter of a second
    assert observe(4000, 0.0005) == pytest.approx(400, abs=2)  # 2 s more: every 10th, 200 a second
    f = Features(1, 4, 0.2, 3000, 5000, 1000)
    assert predictor.predict_ttft(f) == pytest.approx(true_ttft(f), rel=0.05)
    observe(200, 0.01)  # back to 100 a second: the stride falls back within a quarter of a second
    assert observe(200, 0.01) == 200


def test_the_prefill_rates_learn_from_observations_the_models_skip():
    predictor = LatencyPredictor(max_learn_rate=1)
    f = Features(0, 0, 0.0, 0, 4000, 0, endpoint="e")  # a long prompt with nothing ahead: a clean prefill sample
    for i in range(20):
        predictor.observe(f, 0.4 + 0.01 * (i % 2), None, now=float(i) / 100)  # 100 a second, 1 learnt a second
    assert predictor.backlog.rates["e"][1] == 20  # every sample counted
    assert predictor.observations == 20  # (the first quarter of a second learns at the starting stride, 1)
    for i in range(200):
        predictor.observe(f, 0.4, None, now=1.0 + i / 100)
    assert predictor.backlog.rates["e"][1] == 220
    assert predictor.observations < 20 + 200 // 10
