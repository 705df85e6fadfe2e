"""Leader election on a coordination.k8s.io/v1 Lease (`--ha-enable-leader-election`): with several EPP replicas,
only the leader reports SERVING on readiness and the ext_proc health service, so the gateway sends it all traffic;
when the leader stops renewing, another replica takes the Lease once it expires (fail-over within its duration).

Updates use the Lease's resourceVersion (optimistic concurrency): of two replicas racing for an expired Lease,
the API server accepts exactly one write.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("epp.leader")


class LeaseElector:
    def __init__(self, api: k8s.ApiClient, name: str, namespace: str, identity: str, lease_duration: float = 15.0,
                 retry_period: float = 2.0, on_change: Callable[[bool], object] | None = None):  # fmt: skip
        self.leases = k8s.CoordinationV1Api(api)
        self.name, self.namespace, self.identity = name, namespace, identity
        self.lease_duration = lease_duration
        self.retry_period = retry_period
        self.on_change = on_change
        self.is_leader = False

    def _now(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.UTC)

    def try_acquire_or_renew(self) -> bool:
        """One attempt (blocking: run it in a thread). True when this replica holds the Lease afterwards."""
        now = self._now()
        try:
            lease = self.leases.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            lease = k8s.V1Lease(
                metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=k8s.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=int(self.lease_duration),
                                     acquire_time=now, renew_time=now, lease_transitions=0),
            )  # fmt: skip
            try:
                self.leases.create_namespaced_lease(self.namespace, lease)
                return True
            except ApiException as conflict:
                if conflict.status == 409:
                    return False
                raise
        spec = lease.spec
        renewed = spec.renew_time
        expired = renewed is None or now > renewed + datetime.timedelta(seconds=spec.lease_duration_seconds or 0)
        if spec.holder_identity not in (None, self.identity) and not expired:
            return False
        if spec.holder_identity != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.renew_time = now
        spec.lease_duration_seconds = int(self.lease_duration) or 1
        try:
            self.leases.replace_namespaced_lease(self.name, self.namespace, lease)
            return True
        except ApiException as exc:
            if exc.status == 409:  # another replica wrote first
                return False
            raise

    async def run(self) -> None:
        while True:
            try:
                leader = await asyncio.to_thread(self.try_acquire_or_renew)
            except Exception as exc:  # API unreachable: a leader that cannot renew must stop leading
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
                leader = False
            if leader != self.is_leader:
                self.is_leader = leader
                log.info("%s is %s the leader", self.identity, "now" if leader else "no longer")
                if self.on_change is not None:
                    result = self.on_change(leader)
                    if asyncio.iscoroutine(result):
                        await result
            await asyncio.sleep(self.retry_period)
