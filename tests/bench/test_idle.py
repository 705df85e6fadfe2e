"""`epp-bench idle`: an idle EPP over a static page server scrapes every endpoint at its interval, and its CPU is read."""

from epp.bench import idle


def test_idle_measures_cpu_and_achieved_interval():
    (result,) = idle.measure([3], seconds=1.5, warmup=1.5, progress=lambda _: None)
    assert result.endpoints == 3
    # the default interval is 50 ms: ~20 scrapes per endpoint per second when the EPP keeps up
    assert 12 <= result.scrapes_per_endpoint_per_second <= 24, result
    assert 0 < result.epp_cpu_seconds < result.seconds
    assert "| 3 |" in idle.markdown([result])
