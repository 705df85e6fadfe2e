"""Leader election on a coordination.k8s.io/v1 Lease (`--ha-enable-leader-election`): with several EPP replicas,
only the serving replica reports SERVING on readiness and the ext_proc health service, so the gateway sends it all
traffic.

Routing must not depend on the API server being up. So `serving` is not `is_leader`: a leader that cannot renew
because the API is unreachable (errors, hung requests) loses the lease on client-go's schedule (`is_leader` turns
False at the renew deadline) but keeps serving from its last known pool until it sees another holder — an attempt
that completes and finds the Lease held by someone else. The trade-off: during a partition that lets another
replica reach the API and take the Lease, both serve until the old leader hears of it (routing from two replicas
is harmless: each picks from the same pool); with "step down at the deadline", an API outage would leave no
replica ready, and the gateway would stop routing for the whole pool although every model server is fine.

The rules are client-go's leaderelection:
* Expiry is judged on this replica's own monotonic clock: a Lease held by another replica expires `leaseDuration`
  after this replica last saw its record change (holder, renewTime, resourceVersion), so clock skew between
  nodes cannot make two replicas lead at once.
* The leader renews every `retry_period`; a failed renewal (API blip) is retried, and the leader steps down once
  `renew_deadline` (< lease duration) has passed since its last successful renewal, before any other replica may
  take over. `is_leader` turns False at that deadline even while a request hangs.
* A write uses the Lease's resourceVersion (optimistic concurrency): of two replicas racing for an expired Lease,
  the API server accepts exactly one.
* On a clean stop the leader releases the Lease (empty holder), so another replica takes over at its next retry
  instead of after the lease duration.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections.abc import Callable

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("epp.leader")


class LeaseElector:
    RELEASE_TIMEOUT = 1.0  # seconds a request (or a renewal in flight) may take while this replica stops

    def __init__(
        self,
        api: k8s.ApiClient,
        name: str,
        namespace: str,
        identity: str,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_change: Callable[[bool], object] | None = None,
        release_on_stop: bool = True,
    ):
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("leader election needs retry_period < renew_deadline < lease_duration")
        self.leases = k8s.CoordinationV1Api(api)
        self.name, self.namespace, self.identity = name, namespace, identity
        self.lease_duration, self.renew_deadline, self.retry_period = lease_duration, renew_deadline, retry_period
        self.on_change = on_change
        self.release_on_stop = release_on_stop
        self.request_timeout = renew_deadline / 2  # one attempt is a read and a write: both fit in the deadline
        self._observed: tuple | None = None  # (holder, renewTime, resourceVersion) of the record last seen
        self._observed_at = 0.0
        self._leading = False
        self._renewed_at = -math.inf
        self._reported = False
        self._outage_logged = False

    @property
    def is_leader(self) -> bool:
        """client-go's view: the Lease was renewed within the renew deadline."""
        return self._leading and time.monotonic() - self._renewed_at < self.renew_deadline

    @property
    def serving(self) -> bool:
        """Leader, or a leader cut off from the API that has not yet seen another holder."""
        return self._leading

    def _now(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.UTC)

    def _observe(self, lease: k8s.V1Lease) -> None:
        spec = lease.spec
        record = (spec.holder_identity, spec.renew_time, lease.metadata.resource_version)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()

    def try_acquire_or_renew(self) -> bool:
        """One attempt (blocking: run it in a thread). True when this replica holds the Lease afterwards, False
        when another replica does; an API error raises."""
        now = self._now()
        try:
            lease = self.leases.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.request_timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise
            lease = k8s.V1Lease(
                metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=k8s.V1LeaseSpec(
                    holder_identity=self.identity,
                    lease_duration_seconds=self._duration_seconds(),
                    acquire_time=now,
                    renew_time=now,
                    lease_transitions=0,
                ),
            )
            try:
                self.leases.create_namespaced_lease(self.namespace, lease, _request_timeout=self.request_timeout)
                return True
            except ApiException as conflict:
                if conflict.status == 409:  # another replica created it first
                    return False
                raise
        self._observe(lease)
        spec = lease.spec
        holder = spec.holder_identity or ""
        expired = time.monotonic() > self._observed_at + (spec.lease_duration_seconds or 0)
        if holder and holder != self.identity and not expired:
            return False
        if holder != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.renew_time = now
        spec.lease_duration_seconds = self._duration_seconds()
        try:
            written = self.leases.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=self.request_timeout
            )
        except ApiException as exc:
            if exc.status == 409:  # another replica wrote first
                return False
            raise
        self._observe(written)
        return True

    def release(self) -> None:
        """Give the Lease up (blocking, at most about 4 s): an empty holder lets another replica take it at once.
        A conflict (a write between this read and this write) is read again once."""
        timeout = min(self.request_timeout, self.RELEASE_TIMEOUT)  # shutting down: an unreachable API is not waited on
        for last_try in (False, True):
            lease = self.leases.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
            if lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = self._now()
            try:
                self.leases.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=timeout)
                return
            except ApiException as exc:
                if exc.status != 409 or last_try:
                    raise

    def _duration_seconds(self) -> int:
        return max(1, round(self.lease_duration))

    def _until_deadline(self) -> float | None:
        return max(0.0, self._renewed_at + self.renew_deadline - time.monotonic()) + 0.001 if self.is_leader else None

    async def _report(self) -> None:
        serving = self.serving
        if serving and not self.is_leader and not self._outage_logged:
            self._outage_logged = True
            log.warning(
                "%s: the Lease was not renewed within %.0fs (API unreachable); still serving from the last "
                "known pool until another holder appears",
                self.identity,
                self.renew_deadline,
            )
        elif self.is_leader and self._outage_logged:
            self._outage_logged = False
            log.info("%s: the Lease is renewed again", self.identity)
        if serving == self._reported:
            return
        self._reported = serving
        log.info("%s is %s the leader", self.identity, "now" if serving else "no longer")
        if self.on_change is not None:
            result = self.on_change(serving)
            if asyncio.iscoroutine(result):
                await result

    async def run(self) -> None:
        """Campaign and renew until cancelled; then release the Lease if this replica holds it."""
        attempt: asyncio.Future | None = None
        try:
            while True:
                started = time.monotonic()
                attempt = asyncio.ensure_future(asyncio.to_thread(self.try_acquire_or_renew))
                while not attempt.done():  # a hung request: the lease lapses (logged), serving goes on
                    await asyncio.wait({attempt}, timeout=self._until_deadline())
                    await self._report()
                try:
                    held = attempt.result()
                except Exception as exc:  # API unreachable: keep trying until the renew deadline passes
                    log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
                else:
                    self._leading = held
                    if held:
                        self._renewed_at = started  # the earliest the API server can have recorded the renewal
                await self._report()
                await asyncio.sleep(self.retry_period)
        finally:
            was_leading, self._leading = self._leading, False
            if attempt is not None and not attempt.done() and self.release_on_stop:
                # Its thread runs on: it may yet write this replica into the Lease (acquiring it just after the
                # last holder released it), so its outcome decides whether there is anything to release.
                await asyncio.wait({attempt}, timeout=self.RELEASE_TIMEOUT)
                if not attempt.done():
                    log.warning(
                        "lease %s/%s: a renewal still in flight at stop; the Lease may be held until it expires",
                        self.namespace,
                        self.name,
                    )
                elif not attempt.cancelled() and attempt.exception() is None:
                    was_leading = was_leading or attempt.result()
            await self._report()
            if was_leading and self.release_on_stop:
                try:
                    await asyncio.to_thread(self.release)
                except Exception as exc:
                    log.warning("lease %s/%s: not released (%s); it expires on its own", self.namespace, self.name, exc)
