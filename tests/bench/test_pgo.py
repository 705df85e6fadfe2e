"""The profile-guided build's driver (epp/bench/pgo.py): its training runs on this build, and whatever step fails,
the modules end built for use or built plain, never left instrumented."""

import json
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from epp import compiled
from epp.bench import pgo


def test_the_training_runs_the_request_path_of_this_build():
    """The training script drives the handler-cpu harness, which changes with the EPP: it must still run."""
    script = pgo.TRAINING.format(runs=tuple((32, batch, streamed, kv) for _, batch, streamed, kv in pgo.TRAINING_RUNS))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@dataclass
class Steps:
    """pgo's builds and training, recorded instead of run: what a build compiles and which modules the training
    leaves counts for."""

    compiled: dict = field(default_factory=lambda: {"epp.grpc_h2": "d1", "epp.metrics": "d2"})
    counted: list = field(default_factory=lambda: ["grpc_h2", "metrics"])
    taken: list = field(default_factory=list)

    def build(self, mode):
        self.taken.append(mode or "plain")
        if mode == "generate":
            pgo.PGO_DIR.mkdir(parents=True)
            compiled.STAMP.write_text(json.dumps(self.compiled))
        elif mode == "use":
            compiled.PGO_STAMP.write_text(json.dumps({"profile_guided": sorted(self.compiled)}))

    def train(self):
        self.taken.append("train")
        for name in self.counted:
            (pgo.PGO_DIR / f"{name}.gcda").write_bytes(b"")
        return len(self.counted)


@pytest.fixture
def steps(tmp_path, monkeypatch):
    monkeypatch.setattr(pgo, "PGO_DIR", tmp_path / "pgo")
    monkeypatch.setattr(pgo, "TRAINED", tmp_path / "pgo" / "trained.json")
    monkeypatch.setattr(compiled, "STAMP", tmp_path / "compiled.json")
    monkeypatch.setattr(compiled, "PGO_STAMP", tmp_path / "compiled-pgo.json")
    recorded = Steps()
    monkeypatch.setattr(pgo, "build", recorded.build)
    monkeypatch.setattr(pgo, "train", recorded.train)
    return recorded


def test_counts_from_a_fresh_training_build_the_modules_for_use(steps, capsys):
    pgo.PGO_DIR.mkdir()
    (pgo.PGO_DIR / "earlier.gcda").write_bytes(b"")  # an earlier run's counts: not added to
    assert pgo.main([]) == 0
    assert steps.taken == ["generate", "train", "use"]
    assert json.loads(pgo.TRAINED.read_text()) == steps.compiled  # the sources the counts belong to
    assert not (pgo.PGO_DIR / "earlier.gcda").exists()
    assert "2 of 2 compiled modules built with the counts of 2 that ran" in capsys.readouterr().out


def test_a_training_that_counted_nothing_builds_the_modules_plain(steps, capsys):
    steps.counted = []
    assert pgo.main([]) == 0
    assert steps.taken == ["generate", "train", "plain"]
    assert "the training run left no branch counts" in capsys.readouterr().err


def test_without_compiled_modules_there_is_nothing_to_train(steps):
    steps.compiled = {}
    assert pgo.main([]) == 0
    assert steps.taken == ["generate"]
