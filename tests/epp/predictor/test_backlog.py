import pytest

from epp.predictor import backlog
from epp.predictor.backlog import PrefillBacklog


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
        b.learn(5000, 0.0, 5000 * 2e-4)
    assert b.seconds_per_token == pytest.approx(2e-4, rel=1e-3)
    b.learn(200, 0.0, 10.0)  # short prompt: per-step costs dominate, not a rate sample
    b.learn(5000, 4000, 10.0)  # waited behind others: not a rate sample
    assert b.seconds_per_token == pytest.approx(2e-4, rel=1e-3)


def test_drained_endpoints_are_forgotten_beyond_the_bound(monkeypatch):
    monkeypatch.setattr(backlog, "MAX_IDLE_ENTRIES", 8)
    b = PrefillBacklog()
    for i in range(100):
        b.add(f"e{i}", 10, now=float(i))  # each drained long before the next arrives
    assert len(b.queues) <= 8
    assert b.tokens("e99", 99.0) == 10
