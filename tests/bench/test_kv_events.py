"""`epp-bench kv-events`: a real EPP subscribed to publishers this process plays."""

import pytest

from harness.bench import kv_events


@pytest.mark.timing
def test_a_late_joiner_hears_every_server_within_one_replay_timeout(capsys):
    """`--late-join`: six servers heard first in mid-sequence, their replay sockets absent: the EPP has all their
    first batches about one replay timeout (1 s) after they were sent, not one timeout per server."""
    kv_events.report(
        kv_events.measure(
            servers=6, rate=5.0, prompt_tokens=64, seconds=2.0, num_gpu_blocks=1000, step_ms=20.0, late_join=True
        )
    )
    said = capsys.readouterr().out
    assert "late join, 6 servers" in said and "not within the run" not in said, said
    took = float(said.split("index ")[1].split(" s after")[0])
    assert 0.9 <= took < 3.0, said
