"""`epp-local --demo --once`: the whole stack comes up, the demo workload succeeds, everything stops."""

import subprocess
import sys

from tests.conftest import epp_local_ports


def test_epp_local_demo_once():
    args, _ = epp_local_ports()
    result = subprocess.run(
        [sys.executable, "-m", "harness.local", *args, "--demo", "--once", "--requests", "12"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gateway ready" in result.stdout
    assert "12/12 requests done, 0 failed" in result.stdout
    # every request under its model's own name (the pool declares them), none under `other`
    counted = next(line for line in result.stdout.splitlines() if "the EPP counted requests per model" in line)
    counts = dict(part.rsplit(" ", 1) for part in counted.split(": ", 1)[1].split(", "))
    assert set(counts) <= {"sim-llama-8b", "sql-lora", "chat-lora"} and sum(map(int, counts.values())) == 12, counted
    assert "stopping" in result.stdout


def test_adapter_paths_are_checked_at_start_up(tmp_path):
    """A torch model server refuses adapter dirs without PEFT files at start-up (it used to die at the first
    request for them), and epp-local's demo on a user's model says which adapters it needs."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "modelserver",
            "--backend",
            "torch",
            "--model",
            str(tmp_path),
            "--lora-modules",
            f"sql={tmp_path / 'nowhere'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "adapter_config.json" in result.stderr, result.stderr[-2000:]
    result = subprocess.run(
        [sys.executable, "-m", "harness.local", "--backend", "torch", "--model", str(tmp_path), "--demo", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "needs PEFT adapters" in result.stderr, result.stdout + result.stderr
