"""Two EPP replicas elect one leader on a Lease through the real client; when the leader stops, the other takes
over within the lease duration."""

import asyncio
import time

from epp.leader import LeaseElector
from tests.kubernetes.test_discovery import NS


async def test_two_replicas_one_leader_and_fail_over(apiserver):
    server, api = apiserver
    changes = []
    a = LeaseElector(api, "epp-lease", NS, "epp-a", lease_duration=1, retry_period=0.1,
                     on_change=lambda leader: changes.append(("a", leader)))  # fmt: skip
    b = LeaseElector(api, "epp-lease", NS, "epp-b", lease_duration=1, retry_period=0.1,
                     on_change=lambda leader: changes.append(("b", leader)))  # fmt: skip
    task_a = asyncio.create_task(a.run())
    await asyncio.sleep(0.3)
    task_b = asyncio.create_task(b.run())
    try:
        for _ in range(10):  # over many renewals there is always exactly one leader
            await asyncio.sleep(0.1)
            assert (a.is_leader, b.is_leader) == (True, False)
        assert server.objects["leases"]["epp-lease"]["spec"]["holderIdentity"] == "epp-a"
        task_a.cancel()  # the leader dies without releasing the lease
        stopped = time.monotonic()
        while not b.is_leader:
            await asyncio.sleep(0.05)
            assert time.monotonic() - stopped < 2.5, "no fail-over within the lease duration"
        lease = server.objects["leases"]["epp-lease"]["spec"]
        assert lease["holderIdentity"] == "epp-b" and lease["leaseTransitions"] == 1
        assert ("a", True) in changes and ("b", True) in changes
    finally:
        for task in (task_a, task_b):
            task.cancel()
        await asyncio.gather(task_a, task_b, return_exceptions=True)
