"""A pool-shaped synthetic latency model: TTFT and TPOT as the sim's step-time model would give them."""

import random

import pytest

from epp.predictor import Features, LatencyPredictor
from epp.scheduling.framework import LatencyPredictionReader
from epp.scheduling.plugins import build_plugin
from epp.scheduling.predictions import CandidatePredictions


@pytest.fixture
def predictions() -> CandidatePredictions:
    """A latency predictor of the test's own, as a scheduler hands its plugins (`Scheduler.predictions`)."""
    return CandidatePredictions(LatencyPredictor())


def reading(plugin_type: str, predictions: CandidatePredictions, parameters: dict | None = None):
    """The plugin built from `parameters`, reading `predictions` as a scheduler would hand them over."""
    plugin = build_plugin(plugin_type, parameters)
    assert isinstance(plugin, LatencyPredictionReader)
    plugin.use_predictions(predictions)
    return plugin


def true_ttft(f: Features) -> float:
    own, ahead = f.prompt_tokens - f.cached_tokens, f.backlog_tokens
    return 0.02 + 0.0001 * (own + ahead) + 0.00001 * f.in_flight_tokens + 0.01 * f.waiting


def true_tpot(f: Features) -> float:
    return 0.012 + 0.0004 * f.running + 0.000002 * f.in_flight_tokens


def random_features(rng: random.Random) -> Features:
    prompt = rng.choice((200, 5000))
    return Features(
        waiting=rng.randrange(4),
        running=rng.randrange(16),
        kv_usage=rng.random() * 0.5,
        in_flight_tokens=rng.randrange(12000),
        prompt_tokens=prompt,
        cached_tokens=rng.randrange(prompt // 2),
        backlog_tokens=rng.choice((0.0, rng.random() * 8000)),
    )


def train(predictor, count: int = 300, noise: float = 0.03, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        f = random_features(rng)
        predictor.observe(f, true_ttft(f) * (1 + noise * rng.gauss(0, 1)), true_tpot(f) * (1 + noise * rng.gauss(0, 1)))


def trained(predictions: CandidatePredictions) -> None:
    """`predictions`' predictor, past its cold start on the synthetic model."""
    predictor = predictions.predictor
    predictor.min_observations = 50
    train(predictor)
