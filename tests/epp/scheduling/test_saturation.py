"""The saturation detector and the admission rule (sheddable requests get 429 while the pool is saturated)."""

import pytest

from epp.scheduling.errors import NoCapacityError, ShedError
from epp.scheduling.saturation import SaturationDetector, admit
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import SchedulingRequest
from tests.epp.helpers import endpoint


def never_scraped(i):
    e = endpoint(i)
    e.metrics = None
    return e


@pytest.mark.parametrize(
    ("e", "saturated"),
    [
        (endpoint(0), False),
        (endpoint(0, waiting=4, kv=0.79), False),
        (endpoint(0, waiting=5), True),
        (endpoint(0, waiting=2, in_flight=7, running=2), True),  # 5 routed since the scrape count as queued
        (endpoint(0, kv=0.8), True),
        (endpoint(0, stale=True), True),  # an endpoint we cannot see is assumed full
        (never_scraped(0), True),
    ],
)
def test_endpoint_saturation(e, saturated):
    assert SaturationDetector().endpoint_saturated(e) is saturated


@pytest.mark.parametrize(
    ("pool", "saturated"),
    [
        ([], True),
        ([endpoint(0, waiting=5), endpoint(1, kv=0.9), endpoint(2, stale=True)], True),
        ([endpoint(0, waiting=5), endpoint(1, kv=0.9), endpoint(2, waiting=4, kv=0.79)], False),  # one has room
    ],
)
def test_pool_is_saturated_when_every_endpoint_is(pool, saturated):
    assert SaturationDetector().is_saturated(pool) is saturated


@pytest.mark.parametrize(
    ("queue", "kv", "e", "saturated"),
    [
        (10, 0.95, endpoint(0, waiting=9, kv=0.94), False),
        (10, 0.95, endpoint(0, waiting=10), True),
        (2, 0.5, endpoint(0, waiting=2), True),
        (2, 0.5, endpoint(0, kv=0.5), True),
    ],
)
def test_thresholds_are_parameters(queue, kv, e, saturated):
    detector = SaturationDetector.from_config({"queueDepthThreshold": queue, "kvCacheUtilThreshold": kv})
    assert detector.endpoint_saturated(e) is saturated


BUSY = [endpoint(0, waiting=6), endpoint(1, kv=0.85)]
IDLE = [endpoint(0, waiting=6), endpoint(1)]


@pytest.mark.parametrize(
    ("priority", "pool", "shed"),
    [
        (-1, BUSY, True),
        (-10, BUSY, True),
        (0, BUSY, False),  # only negative priorities are sheddable
        (5, BUSY, False),
        (-1, IDLE, False),  # one endpoint with room: admitted, the scorers send it there
    ],
)
def test_admission_sheds_sheddable_requests_only_when_saturated(priority, pool, shed):
    request = SchedulingRequest(request_id="r", model="m", priority=priority)
    scheduler = Scheduler.from_config(None)
    if shed:
        with pytest.raises(ShedError, match="saturated") as error:
            scheduler.admit(request, pool)
        assert isinstance(error.value, NoCapacityError)
        assert error.value.status == 429
    else:
        assert admit(request, pool, SaturationDetector()) is None
        assert scheduler.admit(request, pool) is None


def test_configured_thresholds_reach_admission():
    config = (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: q, plugins: [{pluginRef: queue-scorer}]}]\n"
        "saturationDetector: {queueDepthThreshold: 100, kvCacheUtilThreshold: 1.0}"
    )
    scheduler = Scheduler.from_config(config)
    assert not scheduler.detector.is_saturated(BUSY)
    assert scheduler.admit(SchedulingRequest(request_id="r", model="m", priority=-1), BUSY) is None


def test_flow_control_dispatches_into_free_batch_slots_once_an_endpoint_was_seen_full():
    detector = SaturationDetector()
    e = endpoint(0, running=4, in_flight=4)
    e.in_flight_at_scrape = 4
    assert detector.endpoint_has_room(e)  # never seen full: its queue depth (0) under queueDepthThreshold
    e.batch_slots = 4
    assert not detector.endpoint_has_room(e)  # its 4 slots run 4 requests
    e.in_flight_requests = 3  # one finished since the scrape: its slot is free now, before the next scrape
    assert detector.endpoint_has_room(e)
    e.in_flight_requests = 4  # and routed one since: full again
    assert not detector.endpoint_has_room(e)
    e.in_flight_requests = 3
    e.metrics.kv_usage = 0.8  # the KV cache is full whatever the batch
    assert not detector.endpoint_has_room(e)
    e.metrics.kv_usage = 0.0
    e.stale = True
    assert not detector.endpoint_has_room(e)


def test_flow_control_sends_a_dispatched_request_to_an_endpoint_with_room():
    detector = SaturationDetector()
    full, free = endpoint(0, running=4, in_flight=4), endpoint(1, running=3, in_flight=3)
    for e in (full, free):
        e.batch_slots, e.in_flight_at_scrape = 4, e.in_flight_requests
    assert detector.has_room([full, free], 7)
    assert detector.with_room([full, free]) == [free]
    free.in_flight_requests = 4
    assert not detector.has_room([full, free], 8)
    assert detector.with_room([full, free]) == [full, free]  # none has room: the scheduler picks among all


def test_a_blind_pool_takes_queue_depth_threshold_requests_per_endpoint():
    pool = [never_scraped(0), endpoint(1, stale=True)]
    assert SaturationDetector().has_room(pool, 9)
    assert not SaturationDetector().has_room(pool, 10)
