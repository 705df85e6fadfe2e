"""Load estimates of an endpoint, read by the scheduling plugins, the saturation detector, the latency predictor and
the pool's metrics.

Scrapes arrive every 50 ms; a burst routed in between is invisible to them. The EPP's own in-flight count covers
the gap: requests it routed that the endpoint does not yet report as running are counted as queued. The other way
round, a request the scrape saw waiting may have finished since; the EPP knows when more of its requests finished
than it routed since the scrape (`Endpoint.in_flight_at_scrape`), and each of those took a waiting request's place
(or was the waiting request). Without that, a client's previous request, caught waiting in the last scrape, made
its server look queued for the next one until the next scrape (a LoRA request then left its adapter's server).
"""

from __future__ import annotations

from epp.datalayer.endpoint import Endpoint

# The endpoint attributes the estimates below read, for the `consumes` of the plugins that use them.
QUEUE_DEPTH_READS = ("waiting", "running", "in_flight_requests", "in_flight_at_scrape")
RUNNING_REQUESTS_READS = ("running", "waiting", "in_flight_requests")


def queue_depth(endpoint: Endpoint) -> int:
    m = endpoint.metrics
    in_flight = endpoint.in_flight_requests
    if m is None:
        return in_flight
    finished = endpoint.in_flight_at_scrape - in_flight  # at least this many finished since the scrape
    return max(m.waiting - finished if finished > 0 else m.waiting, in_flight - m.running, 0)


def queue_depths(endpoints: list[Endpoint]) -> list[int]:
    """`queue_depth` of each endpoint; one loop without a call per endpoint (it runs on every request)."""
    depths = []
    append = depths.append
    for e in endpoints:
        m = e.metrics
        if m is None:
            append(e.in_flight_requests)
        else:
            in_flight = e.in_flight_requests
            finished = e.in_flight_at_scrape - in_flight
            waiting = m.waiting - finished if finished > 0 else m.waiting
            unseen = in_flight - m.running
            depth = unseen if unseen > waiting else waiting
            append(depth if depth > 0 else 0)
    return depths


def running_requests(endpoint: Endpoint) -> int:
    m = endpoint.metrics
    return endpoint.in_flight_requests if m is None else max(m.running, endpoint.in_flight_requests - m.waiting)
