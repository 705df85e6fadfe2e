"""EPP replicas elect one leader on a Lease through the real client: never two leaders, fail-over within the lease
duration when the leader dies, at once when it stops cleanly, and a leader that cannot reach the API steps down
before its Lease can expire for the others."""

import asyncio
import time

import pytest

from epp.leader import LeaseElector
from tests.kubernetes.test_discovery import NS

TIMING = {"lease_duration": 1.0, "renew_deadline": 0.6, "retry_period": 0.1}


class Replicas:
    """Electors on one Lease, and a monitor that records any moment with two leaders."""

    def __init__(self, api):
        self.api = api
        self.electors: dict[str, LeaseElector] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.changes: list[tuple[str, bool]] = []
        self.overlaps = 0
        self.monitor = asyncio.create_task(self._monitor())

    def start(self, name, **options):
        elector = LeaseElector(
            self.api,
            "epp-lease",
            NS,
            name,
            **{**TIMING, **options},
            on_change=lambda leader: self.changes.append((name, leader)),
        )
        self.electors[name] = elector
        self.tasks[name] = asyncio.create_task(elector.run())
        return elector

    async def stop(self, name):
        self.tasks[name].cancel()
        await asyncio.gather(self.tasks[name], return_exceptions=True)

    def leaders(self):
        return [name for name, e in self.electors.items() if e.serving]

    async def until_leader(self, name, within):
        started = time.monotonic()
        while self.leaders() != [name]:
            assert time.monotonic() - started < within, f"{name} not the only leader after {within}s: {self.leaders()}"
            await asyncio.sleep(0.02)
        return time.monotonic() - started

    async def _monitor(self):
        while True:
            self.overlaps += len(self.leaders()) > 1
            await asyncio.sleep(0.01)

    async def close(self):
        for task in [*self.tasks.values(), self.monitor]:
            task.cancel()
        await asyncio.gather(*self.tasks.values(), self.monitor, return_exceptions=True)


@pytest.fixture
async def replicas(apiserver):
    server, api = apiserver
    group = Replicas(api)
    try:
        yield server, group
    finally:
        await group.close()


def holder(server):
    return server.objects["leases"]["epp-lease"]["spec"].get("holderIdentity")


async def test_two_replicas_one_leader_and_fail_over_when_the_leader_dies(replicas):
    server, group = replicas
    group.start("epp-a", release_on_stop=False)
    await group.until_leader("epp-a", within=1)
    group.start("epp-b")
    for _ in range(10):  # over many renewals the first replica stays the only leader
        await asyncio.sleep(0.1)
        assert group.leaders() == ["epp-a"]
    assert holder(server) == "epp-a"
    await group.stop("epp-a")  # dies without releasing the Lease
    took = await group.until_leader("epp-b", within=TIMING["lease_duration"] + 2 * TIMING["retry_period"] + 0.3)
    assert took > TIMING["renew_deadline"]  # b waited for the Lease to expire
    lease = server.objects["leases"]["epp-lease"]["spec"]
    assert lease["holderIdentity"] == "epp-b" and lease["leaseTransitions"] == 1
    assert ("epp-a", True) in group.changes and ("epp-a", False) in group.changes and ("epp-b", True) in group.changes
    assert group.overlaps == 0


@pytest.mark.timing
async def test_a_clean_stop_releases_the_lease(replicas):
    server, group = replicas
    group.start("epp-a")
    await group.until_leader("epp-a", within=1)
    group.start("epp-b")
    await asyncio.sleep(0.3)
    await group.stop("epp-a")
    assert not holder(server)  # released
    took = await group.until_leader("epp-b", within=0.5)  # at b's next retry, not after the lease duration
    assert took < TIMING["renew_deadline"]
    assert group.overlaps == 0


async def test_a_stop_during_an_acquisition_in_flight_still_releases_the_lease(replicas):
    """The attempt's thread outlives the cancellation: if it wins the Lease, the stopping replica gives it back."""
    server, group = replicas
    server.lease_stall = 0.1  # every request slower than the stop, within the request timeout
    group.start("epp-b")
    await asyncio.sleep(0.05)  # the first attempt is reading the (missing) Lease
    await group.stop("epp-b")
    await asyncio.sleep(0.3)  # anything still in flight has landed
    assert holder(server) is None  # created for epp-b by the attempt in flight, then released
    assert group.changes == []  # never reported as serving


async def test_a_leader_cut_off_from_the_api_keeps_serving_until_it_sees_another_holder(replicas):
    server, group = replicas
    a = group.start("epp-a")
    await group.until_leader("epp-a", within=1)
    group.start("epp-b")
    await asyncio.sleep(0.3)

    server.lease_stall = 0.2  # a short blip (requests slower than the retry period): no change
    await asyncio.sleep(0.3)
    server.lease_stall = 0.0
    await asyncio.sleep(0.3)
    assert group.changes == [("epp-a", True)]

    server.lease_stall = 3.0  # the API hangs for longer than the lease: a's Lease lapses, but it keeps serving
    lost = time.monotonic()
    while a.is_leader:
        assert time.monotonic() - lost < TIMING["lease_duration"]
        await asyncio.sleep(0.02)
    await asyncio.sleep(TIMING["lease_duration"] - (time.monotonic() - lost) + 0.2)
    assert group.leaders() == ["epp-a"] and group.changes == [("epp-a", True)]  # ready the whole time
    # b saw no renewal for longer than the lease: once the API is back it may race a for it, and either may win
    # (client-go's rules); without b, a renews
    await group.stop("epp-b")
    server.lease_stall = 0.0
    await asyncio.sleep(1.0)
    assert group.leaders() == ["epp-a"] and a.is_leader  # the API is back: a renews

    # another replica took the Lease (e.g. a partition that let it reach the API): a stops once it sees that
    spec = server.objects["leases"]["epp-lease"]["spec"]
    spec["holderIdentity"], spec["renewTime"] = "epp-x", spec["renewTime"]
    server.objects["leases"]["epp-lease"]["metadata"]["resourceVersion"] = "999999"
    started = time.monotonic()
    while a.serving:
        assert time.monotonic() - started < 2, "a kept serving after seeing another holder"
        await asyncio.sleep(0.02)
    assert ("epp-a", False) in group.changes and group.overlaps == 0


def test_timings_must_nest():
    with pytest.raises(ValueError, match="retry_period < renew_deadline < lease_duration"):
        LeaseElector(None, "l", NS, "x", lease_duration=10, renew_deadline=10)
