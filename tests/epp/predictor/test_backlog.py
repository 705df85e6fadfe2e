import pytest

from epp.predictor import backlog
from epp.predictor.backlog import MAX_RATES, PrefillBacklog


def test_queue_drains_at_the_rate_and_never_below_zero():
    b = PrefillBacklog()
    b.seconds_per_token = 0.001
    assert b.add("a", 1000, now=0.0) == 0.0
    assert b.add("a", 500, now=0.2) == pytest.approx(800)  # 200 tokens done in 0.2 s
    assert b.tokens("a", 0.2) == pytest.approx(1300)
    assert b.tokens("a", 0.2 + 1.3) == pytest.approx(0.0, abs=1e-6)
    assert b.tokens("a", 10.0) == 0.0 and b.tokens("b", 10.0) == 0.0


def test_rate_is_learnt_from_long_prompts_that_found_the_queue_empty():
    b = PrefillBacklog()
    for _ in range(100):
        b.learn("", 5000, 0.0, 5000 * 2e-4)
    assert b.seconds_per_token == pytest.approx(2e-4, rel=1e-3) and b.rates == {}  # no endpoint named: the pool's
    b.learn("a", 200, 0.0, 10.0)  # short prompt: per-step costs dominate, not a rate sample
    b.learn("a", 5000, 4000, 10.0)  # waited behind others: not a rate sample
    assert b.seconds_per_token == pytest.approx(2e-4, rel=1e-3) and b.rates == {}


def test_drained_endpoints_are_forgotten_beyond_the_bound(monkeypatch):
    monkeypatch.setattr(backlog, "MAX_IDLE_ENTRIES", 8)
    b = PrefillBacklog()
    for i in range(100):
        b.add(f"e{i}", 10, now=float(i))  # each drained long before the next arrives
    assert len(b.queues) <= 8
    assert b.tokens("e99", 99.0) == 10


def test_a_slow_endpoints_backlog_drains_at_its_own_rate_and_only_clean_samples_teach_it():
    backlog = PrefillBacklog()
    per_token = backlog.seconds_per_token
    backlog.learn("e1", 5000, 0.0, 5000 * 2 * per_token)  # a long prompt with nothing ahead: the first sample
    assert backlog.rate("e1") == pytest.approx(1.5 * per_token, rel=0.05)  # half-way from the pool's rate
    assert backlog.slowness("e1") == 1.0  # the only one measured: the reference itself
    for _ in range(50):
        backlog.learn("e1", 5000, 0.0, 5000 * 2 * per_token)
        backlog.learn("e0", 5000, 0.0, 5000 * per_token)
    assert backlog.slowness("e1") / backlog.slowness("e0") == pytest.approx(2.0, rel=0.05)
    assert backlog.reference == pytest.approx((backlog.rate("e0") + backlog.rate("e1")) / 2)
    before = dict(backlog.rates), backlog.seconds_per_token
    backlog.learn("e1", 500, 0.0, 1.0)  # short prompt: no sample
    backlog.learn("e1", 5000, 2000.0, 10.0)  # queued behind another prefill: no sample
    assert (dict(backlog.rates), backlog.seconds_per_token) == before
    backlog.add("e0", 3000, 0.0)
    backlog.add("e1", 3000, 0.0)
    assert backlog.tokens("e0", 1000 * backlog.rate("e0")) == pytest.approx(2000)
    assert backlog.tokens("unmeasured", 0.0) == 0.0 and backlog.rate("unmeasured") == backlog.seconds_per_token
    assert backlog.tokens("e1", 1000 * backlog.rate("e1")) == pytest.approx(2000)
    backlog.forget({"e0"})
    assert set(backlog.rates) == {"e0"} and backlog.slowness("e1") == 1.0
    assert backlog.reference == pytest.approx(backlog.rate("e0")) and backlog.slowness("e0") == pytest.approx(1.0)


def test_rates_are_bounded():
    backlog = PrefillBacklog()
    for i in range(MAX_RATES + 5):
        backlog.learn(f"e{i}", 5000, 0.0, 1.0)
    assert len(backlog.rates) == MAX_RATES and "e0" not in backlog.rates
