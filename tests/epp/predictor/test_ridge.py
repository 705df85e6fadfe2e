import os
import random
import subprocess
import sys

import numpy as np
import pytest

from epp.predictor import ridge
from epp.predictor.ridge import OnlineRidge


def test_recovers_the_coefficients_of_noiseless_data():
    rng = random.Random(1)
    model = OnlineRidge(3, decay=1.0, ridge=1e-9)
    for _ in range(200):
        x = (1.0, rng.random(), rng.random() * 5)
        model.add(x, 0.5 + 2.0 * x[1] - 0.3 * x[2])
    assert model.coefficients == pytest.approx((0.5, 2.0, -0.3), abs=1e-4)
    assert model.predict((1.0, 1.0, 1.0)) == pytest.approx(2.2, abs=1e-3)


def test_forgetting_follows_a_change_in_the_data():
    rng = random.Random(2)
    model = OnlineRidge(2, decay=0.98, refit_every=1)
    for slope in (1.0, 3.0):
        for _ in range(400):
            x = (1.0, rng.random())
            model.add(x, slope * x[1])
    assert model.coefficients[1] == pytest.approx(3.0, rel=0.01)


def test_weights_pull_the_fit_towards_heavy_observations():
    model = OnlineRidge(1, decay=1.0, refit_every=1)
    model.add((1.0,), 1.0, weight=1.0)
    model.add((1.0,), 2.0, weight=3.0)
    assert model.coefficients[0] == pytest.approx(1.75, rel=1e-3)


def test_no_fit_before_data_and_state_stays_fixed_size():
    model = OnlineRidge(4)
    assert model.coefficients is None and model.predict((1.0, 0.0, 0.0, 0.0)) == 0.0
    model.refit()
    assert model.coefficients is None
    for i in range(1000):
        model.add((1.0, float(i % 7), 0.0, 0.0), 1.0)  # two inputs never vary: the ridge term keeps it solvable
    assert model._a.shape == (4, 4) and model._b.shape == (4,)
    assert model.predict((1.0, 3.0, 0.0, 0.0)) == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize(
    "kwargs", [{"size": 0}, {"size": 2, "decay": 0.0}, {"size": 2, "ridge": 0.0}, {"size": 2, "refit_every": 0}]
)
def test_bad_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        OnlineRidge(**kwargs)


def test_nonnegative_fit_matches_the_unconstrained_one_when_it_is_nonnegative_and_binds_the_others():
    rng = random.Random(3)
    free, bounded = OnlineRidge(3, decay=1.0, ridge=1e-9), OnlineRidge(3, decay=1.0, ridge=1e-9, nonnegative=True)
    for _ in range(300):
        x = (1.0, rng.random(), rng.random())
        y = 0.5 + 2.0 * x[1] + 0.3 * x[2]
        free.add(x, y)
        bounded.add(x, y)
    assert bounded.coefficients == pytest.approx(free.coefficients, abs=1e-6)
    model = OnlineRidge(3, decay=1.0, ridge=1e-9, nonnegative=True)
    points = []
    for _ in range(300):
        x = (1.0, rng.random(), rng.random())
        y = 0.5 + 2.0 * x[1] - 0.3 * x[2]  # the best unconstrained fit has a negative coefficient
        model.add(x, y)
        points.append((x, y))
    c = model.coefficients
    assert min(c) >= 0.0 and c[2] == 0.0
    # it is the best fit with that coefficient at zero: least squares on the other two
    free2 = OnlineRidge(2, decay=1.0, ridge=1e-9)
    for x, y in points:
        free2.add(x[:2], y)
    assert c[:2] == pytest.approx(free2.coefficients, abs=1e-6)


def test_a_nonnegative_refit_started_from_the_previous_fit_finds_the_same_minimum_in_fewer_solves(monkeypatch):
    """The refit starts its active set from the previous coefficients; the problem has one minimum (A is positive
    definite), so the start may change the number of solves, never the answer."""
    solves = []
    solve = np.linalg.solve
    monkeypatch.setattr(ridge.np.linalg, "solve", lambda a, b: solves.append(len(b)) or solve(a, b))
    rng = np.random.default_rng(0)
    warm_solves = cold_solves = 0
    for _ in range(300):
        n = int(rng.integers(1, 14))
        m = rng.normal(size=(n, n))
        b = rng.normal(size=n)
        previous = ridge._nonnegative_solve(m @ m.T + 0.01 * np.eye(n), b)
        m += 0.05 * rng.normal(size=(n, n))  # the normal equations move a little between refits
        a, b = m @ m.T + 0.01 * np.eye(n), b + 0.05 * rng.normal(size=n)
        solves.clear()
        cold = ridge._nonnegative_solve(a, b)
        cold_solves += len(solves)
        solves.clear()
        warm = ridge._nonnegative_solve(a, b, tuple(previous))
        warm_solves += len(solves)
        assert warm.min() >= 0.0
        assert warm == pytest.approx(cold, abs=1e-9)
    assert warm_solves < cold_solves / 2
    # a start that is no point (NaN, negative, infinite) gives the same minimum
    bad = (float("nan"), -1.0, float("inf"), *([0.5] * (len(b) - 3)))[: len(b)]
    assert ridge._nonnegative_solve(a, b, bad) == pytest.approx(ridge._nonnegative_solve(a, b), abs=1e-9)


def test_online_refits_start_from_the_previous_coefficients_and_match_a_fit_from_scratch():
    rng = random.Random(5)
    model = OnlineRidge(6, decay=0.99, refit_every=8, nonnegative=True)
    for step in range(400):
        x = tuple(rng.uniform(0.0, 5.0) * (rng.random() < 0.7) for _ in range(6))
        drift = 1.0 if step < 200 else -1.0  # an input's effect turns negative half way: its coefficient binds
        model.add(x, 0.5 * x[0] + drift * x[1] + 2.0 * x[2] + rng.gauss(0.0, 0.1))
        if model.count % 8 == 0:
            fitted = model.coefficients
            model.coefficients = None  # the same normal equations solved from scratch
            model.refit()
            assert fitted == pytest.approx(model.coefficients, abs=1e-9)
    assert model.coefficients[1] == 0.0 and min(model.coefficients) >= 0.0


def test_the_decay_kept_as_one_scale_matches_every_observation_decayed_in_turn():
    """A decay of 0.5 folds the scale into the kept equations every ~330 observations: the fit after 1,000 is the
    weighted least squares of every observation weighted by 0.5 per later one."""
    rng = random.Random(6)
    model = OnlineRidge(3, decay=0.5, ridge=1e-6, refit_every=1000)
    rows = []
    for _ in range(1000):
        x, weight = (1.0, rng.random(), rng.random() * 3), rng.uniform(0.5, 2.0)
        y = 1.0 + 2.0 * x[1] + 0.5 * x[2] + rng.gauss(0.0, 0.3)  # noisy: the weights decide the fit
        rows.append((x, y, weight))
        model.add(x, y, weight)
    a, b = np.zeros((3, 3)), np.zeros(3)
    for age, (x, y, weight) in enumerate(reversed(rows)):
        a += 0.5**age * weight * np.outer(x, x)
        b += 0.5**age * weight * y * np.asarray(x)
    a += 1e-6 * np.trace(a) / 3 * np.eye(3)
    assert model._scale >= ridge.FOLD_SCALE_BELOW
    assert model.coefficients == pytest.approx(tuple(np.linalg.solve(a, b)), rel=1e-9)


def test_the_predictor_loads_openblas_without_worker_threads():
    """The predictor's products are small, and OpenBLAS's workers would busy-wait beside the EPP's event loop after
    each: importing the predictor first, numpy starts no thread (an environment's own OPENBLAS_NUM_THREADS stays)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    code = (
        "import epp.predictor, numpy, os; print(len(os.listdir('/proc/self/task')), os.environ['OPENBLAS_NUM_THREADS'])"
    )
    threads = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert threads.stdout.split() == ["1", "1"]
    code = "import epp.predictor, os; print(os.environ['OPENBLAS_NUM_THREADS'])"
    kept = subprocess.run(
        [sys.executable, "-c", code], env={**env, "OPENBLAS_NUM_THREADS": "2"}, capture_output=True, text=True
    )
    assert kept.stdout.strip() == "2"
