"""`epp-bench idle`: an idle EPP over a static page server scrapes every endpoint at its interval, and its CPU is read."""

from harness.bench import idle


def test_idle_and_busy_pools_are_scraped_at_their_intervals():
    (result,) = idle.measure([3], seconds=1.5, warmup=1.5, progress=lambda _: None, busy=True)
    assert result.endpoints == 3
    # busy endpoints: the default 50 ms interval, ~20 scrapes per endpoint per second when the EPP keeps up
    assert 12 <= result.scrapes_per_endpoint_per_second <= 24, result
    (quiet,) = idle.measure([3], seconds=2.0, warmup=1.5, progress=lambda _: None)
    assert 2 <= quiet.scrapes_per_endpoint_per_second <= 5, quiet  # quiet endpoints: every 250 ms by default
    (always,) = idle.measure(  # and from a page server that sends whole pages to the filtered scrapes
        [3],
        seconds=1.5,
        warmup=1.5,
        progress=lambda _: None,
        epp_args=["--refresh-metrics-idle-interval", "50ms"],
        whole_pages=True,
    )
    assert always.scrapes_per_endpoint_per_second >= 12, always  # the idle interval turned off
    assert 0 < result.epp_cpu_seconds < result.seconds
    assert "| 3 |" in idle.markdown([result])
