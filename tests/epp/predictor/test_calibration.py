"""Per-endpoint calibration (epp/predictor/calibration.py): one model for a pool of two GPU speeds."""

import math
import random
from dataclasses import replace

import pytest

from epp.predictor import Features, LatencyPredictor, shared
from epp.predictor.calibration import MAX_ENDPOINTS, PRIOR, EndpointCalibration
from epp.scheduling.plugins.predicted_latency_scorer import PredictedLatencyScorer
from tests.epp.helpers import endpoint
from tests.epp.predictor.conftest import random_features, true_tpot, true_ttft


def test_a_factor_is_the_weighted_geometric_mean_of_its_ratios_and_stays_bounded():
    c = EndpointCalibration(weight=0.1)
    assert c.ttft("a") == 1.0 == c.tpot("a")  # not seen yet: the pool's model as it is
    for _ in range(200):
        c.learn("a", 0, 2.0)
    assert c.ttft("a") == pytest.approx(2.0, rel=1e-3) and c.tpot("a") == 1.0
    for _ in range(200):
        c.learn("a", 1, 0.5)
    assert c.tpot("a") == pytest.approx(0.5, rel=1e-3) and c.ttft("a") == pytest.approx(2.0, rel=1e-3)
    for i in range(400):  # a server as fast as the pool whose requests come out half and twice the prediction
        c.learn("b", 0, 2.0 if i % 2 else 0.5)
    assert c.ttft("b") == pytest.approx(1.0, rel=0.1)
    for bad in (0.0, -1.0, math.nan, math.inf):
        c.learn("c", 0, bad)
    assert "c" not in c.factors
    for _ in range(5000):
        c.learn("d", 0, 1e12)
    assert c.ttft("d") == pytest.approx(100.0)
    with pytest.raises(ValueError, match="weight"):
        EndpointCalibration(weight=0.0)


def test_a_new_endpoint_is_calibrated_within_a_few_requests():
    c = EndpointCalibration()
    c.learn("a", 0, 2.0)
    assert c.ttft("a") == pytest.approx(2 ** (1 / (1 + PRIOR)))  # one request against PRIOR of ratio 1
    for _ in range(11):
        c.learn("a", 0, 2.0)
    assert c.ttft("a") == pytest.approx(2 ** (12 / (12 + PRIOR)))


def test_calibration_starts_once_the_model_has_learnt_enough():
    predictor = LatencyPredictor(min_observations=50)
    rng = random.Random(2)
    for _ in range(50):
        f = replace(random_features(rng), endpoint="slow")
        predictor.observe(f, 2 * true_ttft(f), 2 * true_tpot(f))
    assert predictor.calibration.factors == {}
    predictor.observe(Features(0, 0, 0.0, 0, 200, 0, endpoint="slow"), 0.1, 0.02)
    assert set(predictor.calibration.factors) == {"slow"}
    predictor.observe(Features(0, 0, 0.0, 0, 200, 0), 0.1, 0.02)  # recorded without an endpoint: no entry
    assert set(predictor.calibration.factors) == {"slow"}


def test_entries_are_bounded_and_go_with_the_pool():
    c = EndpointCalibration()
    for i in range(MAX_ENDPOINTS + 10):
        c.learn(f"e{i}", 0, 2.0)
    assert len(c.factors) == MAX_ENDPOINTS and "e0" not in c.factors and f"e{MAX_ENDPOINTS + 9}" in c.factors
    c.forget({"e100", "e200", "gone"})
    assert set(c.factors) == {"e100", "e200"}


def test_a_pool_of_two_gpu_speeds_is_predicted_per_endpoint():
    predictor = LatencyPredictor(min_observations=50)
    speeds = {"fast-0": 1.0, "slow-0": 0.5, "fast-1": 1.0, "slow-1": 0.5}  # every other endpoint half as fast
    rng = random.Random(1)
    for _ in range(2000):
        name = rng.choice(list(speeds))
        f = replace(random_features(rng), endpoint=name)
        slowdown = 1 / speeds[name]
        predictor.observe(
            f,
            true_ttft(f) * slowdown * (1 + 0.03 * rng.gauss(0, 1)),
            true_tpot(f) * slowdown * (1 + 0.03 * rng.gauss(0, 1)),
        )
    f = Features(1, 4, 0.2, 3000, 5000, 1000)
    for name, speed in speeds.items():
        there = replace(f, endpoint=name)
        assert predictor.predict_ttft(there) == pytest.approx(true_ttft(f) / speed, rel=0.1)
        assert predictor.predict_tpot(there) == pytest.approx(true_tpot(f) / speed, rel=0.1)
    assert predictor.ttft_mape < 0.1 and predictor.tpot_mape < 0.1  # a pool-wide model alone: ~33 %
    # an endpoint not seen yet gets the pool's model: between the two speeds
    assert true_ttft(f) < predictor.predict_ttft(replace(f, endpoint="new")) < 2 * true_ttft(f)


def test_a_slow_endpoints_backlog_drains_at_its_own_rate():
    predictor = LatencyPredictor()
    for _ in range(500):
        predictor.calibration.learn("e1", 0, 2.0)
    fast, slow = endpoint(0), endpoint(1)
    per_token = predictor.backlog.seconds_per_token
    for e in (fast, slow):
        predictor.routed(e, 3000, 0, None, now=0.0)
    later = 1000 * per_token
    assert predictor.routed(fast, 10, 0, None, now=later).backlog_tokens == pytest.approx(2000)
    assert predictor.routed(slow, 10, 0, None, now=later).backlog_tokens == pytest.approx(2500, rel=0.01)
    assert predictor.prefill_seconds_per_token("e1") == pytest.approx(2 * per_token, rel=0.01)
    assert predictor.prefill_seconds_per_token("e0") == per_token
    # a long prompt alone on the slow endpoint teaches the pool's rate, not the slow one's
    predictor.observe(Features(0, 0, 0.0, 0, 5000, 0, endpoint="e1"), 5000 * per_token * 2, None)
    assert predictor.backlog.seconds_per_token == pytest.approx(per_token, rel=0.01)


def test_the_scorer_forgets_departed_endpoints_with_the_pool_change(pool):
    scorer = PredictedLatencyScorer({"pool": pool})
    calibration = shared(pool).predictor.calibration
    for name in ("e0", "e1", "e2"):
        calibration.learn(name, 0, 2.0)
    scorer.pool_changed([endpoint(0), endpoint(2)])
    assert set(calibration.factors) == {"e0", "e2"}
