"""The flow controller: fast path, band order, fairness, ordering, limits, TTL, cancellation, outcome accounting."""

from __future__ import annotations

import asyncio

import pytest

from epp.config import ConfigError
from epp.flowcontrol import (
    DISPATCHED,
    EVICTED_CANCELLED,
    EVICTED_TTL,
    REJECTED_CAPACITY,
    FlowControlConfig,
    FlowController,
    FlowControlRejected,
)


class Pool:
    """A pool that holds `slots` requests at once."""

    def __init__(self, slots: int):
        self.slots = slots

    def has_room(self, in_flight: int) -> bool:
        return in_flight < self.slots


class Outcomes(dict):
    """The controller's observer: a count per (priority, flow, outcome)."""

    def __call__(self, priority: int, flow: str, outcome: str, seconds: float) -> None:
        assert seconds >= 0
        self[(priority, flow, outcome)] = self.get((priority, flow, outcome), 0) + 1


def controller(slots: int = 0, **raw) -> tuple[FlowController, Pool]:
    pool = Pool(slots)
    fc = FlowController(FlowControlConfig.from_config(raw or None), pool.has_room, observer=Outcomes())
    return fc, pool


def total(fc: FlowController, outcome: str) -> int:
    return sum(n for (_, _, o), n in fc.observer.items() if o == outcome)


async def queue(fc: FlowController, order: list[str], priority: int, flow: str, tokens: int = 1, ttl=None):
    try:
        await fc.wait(priority, flow, 100, tokens, ttl)
        order.append(f"{priority}/{flow}")
    except FlowControlRejected as e:
        order.append(e.outcome)


async def release(fc: FlowController, pool: Pool, n: int) -> None:
    """Let n queued requests through one at a time, each completing before the next."""
    pool.slots = 1
    for _ in range(n):
        fc.pump()
        await asyncio.sleep(0)
        if fc.in_flight:
            fc.complete()
    pool.slots = 0


def test_fast_path_is_synchronous_and_counted():
    fc, pool = controller(slots=1)
    assert fc.try_dispatch(0, "a") is True
    assert fc.observer == {(0, "a", DISPATCHED): 1}
    pool.slots = 0
    assert fc.try_dispatch(0, "a") is False


async def test_highest_band_first_then_round_robin_between_flows_fcfs_within():
    fc, pool = controller()
    order: list[str] = []
    tasks = [asyncio.create_task(queue(fc, order, 0, "noisy")) for _ in range(6)]
    tasks += [asyncio.create_task(queue(fc, order, 0, "quiet")) for _ in range(2)]
    tasks += [asyncio.create_task(queue(fc, order, 1, "crit"))]
    tasks += [asyncio.create_task(queue(fc, order, -1, "batch"))]
    await asyncio.sleep(0)
    assert fc.count == 10
    await release(fc, pool, 10)
    await asyncio.gather(*tasks)
    assert order[0] == "1/crit"
    assert order[1:5] == ["0/noisy", "0/quiet", "0/noisy", "0/quiet"]
    assert order[5:9] == ["0/noisy"] * 4
    assert order[9] == "-1/batch"
    assert fc.count == 0 and fc.bytes == 0 and not fc.bands[0].flows  # drained flows hold nothing
    assert total(fc, DISPATCHED) == 10


async def test_deficit_by_tokens_shares_tokens_not_requests():
    fc, pool = controller(defaultPriorityBand={"fairnessCost": "tokens", "quantum": 100})
    order: list[str] = []
    tasks = [asyncio.create_task(queue(fc, order, 0, "big", tokens=100)) for _ in range(3)]
    tasks += [asyncio.create_task(queue(fc, order, 0, "small", tokens=25)) for _ in range(8)]
    await asyncio.sleep(0)
    await release(fc, pool, 6)
    # Equal tokens per turn: one 100-token request of "big" per four 25-token requests of "small".
    assert order == ["0/big"] + ["0/small"] * 4 + ["0/big"]
    await release(fc, pool, 5)
    await asyncio.gather(*tasks)
    assert total(fc, DISPATCHED) == 11


async def test_edf_orders_by_deadline_within_a_flow():
    fc, pool = controller(defaultPriorityBand={"orderingPolicyRef": "edf-ordering-policy"})
    done: list[float] = []

    async def one(ttl):
        await fc.wait(0, "t", 10, 1, ttl)
        done.append(ttl)

    tasks = [asyncio.create_task(one(ttl)) for ttl in (30, 10, 20)]
    await asyncio.sleep(0)
    await release(fc, pool, 3)
    await asyncio.gather(*tasks)
    assert done == [10, 20, 30]


async def test_ttl_expiry_and_cancellation_each_end_in_one_outcome():
    fc, pool = controller()
    order: list[str] = []
    expiring = asyncio.create_task(queue(fc, order, 0, "a", ttl=0.02))
    cancelled = asyncio.create_task(queue(fc, order, 0, "b"))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert fc.count == 1  # removed from its queue at once
    await expiring
    assert order == [EVICTED_TTL]
    assert fc.count == 0
    await release(fc, pool, 2)  # nothing left to dispatch; a freed slot must not resurrect them
    assert fc.observer == {(0, "a", EVICTED_TTL): 1, (0, "b", EVICTED_CANCELLED): 1}


async def test_a_waiter_cancelled_before_the_slot_came_is_not_dispatched_into_it():
    """A client goes away (its waiter's task is cancelled) and, before that task runs again, a slot frees: the
    slot goes to the next request, not to the one that left, whose task then gives back only a turn it was given
    (dispatching it leaked the slot for good: the pool looked one request fuller from then on)."""
    fc, pool = controller()
    order: list[str] = []
    leaving = asyncio.create_task(queue(fc, order, 0, "a"))
    staying = asyncio.create_task(queue(fc, order, 0, "b"))
    await asyncio.sleep(0)
    leaving.cancel()  # its clean-up runs at its next step, after the pump below
    pool.slots = 1
    assert fc.pump() == 1
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await staying
    assert order == ["0/b"] and fc.in_flight == 1 and fc.count == 0
    fc.complete()
    assert fc.in_flight == 0
    assert fc.observer == {(0, "a", EVICTED_CANCELLED): 1, (0, "b", DISPATCHED): 1}


async def test_capacity_displaces_the_noisy_flow_never_the_quiet_one():
    fc, pool = controller(maxRequests=4)
    order: list[str] = []
    noisy = [asyncio.create_task(queue(fc, order, 0, "noisy")) for _ in range(4)]
    await asyncio.sleep(0)
    quiet = asyncio.create_task(queue(fc, order, 0, "quiet"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the displaced request's task wakes one turn later
    assert order == [REJECTED_CAPACITY]  # the noisy flow's newest gave way
    assert fc.bands[0].flows["quiet"].count == 1
    # The noisy flow cannot push out the quiet one: it is rejected itself.
    extra = asyncio.create_task(queue(fc, order, 0, "noisy"))
    await asyncio.sleep(0)
    assert order == [REJECTED_CAPACITY, REJECTED_CAPACITY]
    await release(fc, pool, 4)
    await asyncio.gather(*noisy, quiet, extra)
    assert order[2] == "0/noisy" and order[3] == "0/quiet"
    assert total(fc, DISPATCHED) == 4 and total(fc, REJECTED_CAPACITY) == 2


async def test_band_byte_limit():
    fc, pool = controller(priorityBands=[{"priority": -1, "maxBytes": 150}])
    order: list[str] = []
    a = asyncio.create_task(queue(fc, order, -1, "x"))
    b = asyncio.create_task(queue(fc, order, -1, "x"))
    await asyncio.sleep(0)
    assert order == [REJECTED_CAPACITY]
    await release(fc, pool, 1)
    await asyncio.gather(a, b)


async def test_queued_request_dispatched_when_room_appears():
    fc, pool = controller()
    order: list[str] = []
    t = asyncio.create_task(queue(fc, order, 0, "a"))
    await asyncio.sleep(0)
    assert fc.try_dispatch(0, "b") is False  # something waits: no overtaking on the fast path
    pool.slots = 1
    assert fc.pump() == 1
    await t
    assert order == ["0/a"]
    assert fc.try_dispatch(0, "b") is False  # the pool is full with the dispatched one
    fc.complete()
    assert fc.try_dispatch(0, "b") is True


@pytest.mark.parametrize(
    "raw",
    [
        {"enabled": "yes"},
        {"maxRequests": "lots"},
        {"maxBytes": -1},
        {"defaultRequestTTL": "forever"},
        {"defaultRequestTTL": "0s"},
        {"priorityBands": [{"maxBytes": 1}]},
        {"priorityBands": [{"priority": 1}, {"priority": 1}]},
        {"defaultPriorityBand": {"fairnessPolicyRef": "lottery"}},
        {"defaultPriorityBand": {"orderingPolicyRef": "lifo"}},
        {"unknown": 1},
        {"objectiveRequestTTL": {"critical": "0s"}},
        {"objectiveRequestTTL": {"critical": "soon"}},
        {"objectiveRequestTTL": ["critical"]},
    ],
)
def test_invalid_config_is_a_clear_error(raw):
    with pytest.raises(ConfigError):
        FlowControlConfig.from_config(raw)


def test_config_defaults_and_disable():
    assert FlowControlConfig.from_config(None).enabled is True
    assert FlowControlConfig.from_config({"enabled": False}).enabled is False
    cfg = FlowControlConfig.from_config({"priorityBands": [{"priority": 1, "maxRequests": 5}, {"priority": 2}]})
    assert cfg.band(1).max_requests == 5
    # llm-d's defaults: 60 s in the queue, 5,000 requests and 1 GB per band (0 = unset = the default); ours adds a
    # bound over all bands together
    assert cfg.default_request_ttl == 60.0
    assert cfg.band(2).max_requests == cfg.band(7).max_requests == cfg.band(0).max_requests == 5000
    assert cfg.band(7).max_bytes == 1_000_000_000 and (cfg.max_requests, cfg.max_bytes) == (10_000, 1 << 30)
    zero = FlowControlConfig.from_config({"priorityBands": [{"priority": 1, "maxRequests": 0, "maxBytes": 0}]})
    assert (zero.band(1).max_requests, zero.band(1).max_bytes) == (5000, 1_000_000_000)


def test_llm_d_style_config_quantities_durations_policy_refs_and_feature_gate():
    cfg = FlowControlConfig.from_config(
        {
            "maxBytes": "1Gi",
            "maxRequests": "2k",
            "defaultRequestTTL": "1m30s",
            "defaultNegativePriorityBand": {"maxRequests": 10, "fairnessPolicyRef": "global-strict-fairness-policy"},
            "priorityBands": [{"priority": 1, "maxBytes": "500M", "orderingPolicyRef": "edf-ordering-policy"}],
        }
    )
    assert (cfg.max_bytes, cfg.max_requests, cfg.default_request_ttl) == (1 << 30, 2000, 90.0)
    assert cfg.band(1).max_bytes == 500_000_000 and cfg.band(1).ordering_policy == "edf"
    assert cfg.band(-3).max_requests == 10 and cfg.band(-3).fairness_policy == "global-strict"
    assert cfg.band(0).max_requests == 5000 and cfg.band(0).fairness_policy == "round-robin"  # the default template
    assert FlowControlConfig.from_text("featureGates: [flowControl=false]\n").enabled is False
    assert FlowControlConfig.from_text("featureGates: [flowControl]\n").enabled is True
    with pytest.raises(ConfigError):
        FlowControlConfig.from_text("featureGates: [flowControl=maybe]\n")


def test_objective_ttl_overrides_band_and_default_and_bounds_the_proxy_wait():
    cfg = FlowControlConfig.from_config(
        {
            "defaultRequestTTL": "10s",
            "priorityBands": [{"priority": 1, "defaultRequestTTL": "20s"}],
            "objectiveRequestTTL": {"interactive": "2s", "report": "5m"},
        }
    )
    assert cfg.request_ttl("interactive") == 2.0 and cfg.request_ttl("report") == 300.0
    assert cfg.request_ttl("other") is None and cfg.request_ttl(None) is None  # the band's or the default applies
    assert cfg.longest_ttl == 300.0  # the proxy is told to wait as long as the longest
