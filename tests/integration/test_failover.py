"""`epp-bench failover` on a small stack: one of 3 EPP replicas SIGKILLed, one drained (SIGTERM), one of 3 model
servers SIGKILLed, each under streaming load through Envoy with FailOpen. No request fails in any phase; the drained
replica's streams in flight finish and it exits long before its --drain-timeout, with no request left unrouted (new
streams went to the other replicas)."""

import pytest

from harness.bench import failover


@pytest.mark.slow  # 13-23 s on 2 loaded cores: make bench
async def test_a_replica_killed_or_drained_and_a_server_killed_fail_no_request(tmp_path):
    report = await failover.run(
        servers=3, replicas=3, clients=8, seconds=1.5, drain_timeout=10.0, workdir=tmp_path, progress=lambda _: None
    )
    drained = report.phases[1]
    assert failover.missed_goals(report) == [], failover.markdown(report)
    for phase in report.phases:
        assert phase.outcomes.get("ok", 0) > 10, failover.markdown(report)
    assert drained.counters[failover.UNROUTED] == 0 and drained.exit_seconds < 5.0, failover.markdown(report)
