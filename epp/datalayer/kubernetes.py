"""Kubernetes discovery: the EPP's own InferencePool, the Pods of its namespace, and the InferenceObjectives and
InferenceModelRewrites that refer to the pool, kept current with list + watch.

Each resource has its own watcher thread (the `kubernetes` client is synchronous; the event loop never blocks on
it, and the threads are our own so they never starve the loop's default executor): list, then watch from the
list's resourceVersion with bookmarks; a dropped or expired watch resumes from the last resourceVersion seen;
410 Gone (history compacted) relists; other errors back off (0.5 s doubling to 10 s). Changes are coalesced and a
whole new PoolState is computed on the event loop, published only once every resource has been listed and only
when it differs from the last one:

* a Pod is an endpoint when its labels match the pool's selector, it has an IP, it is Ready and not terminating;
* each Pod x target port is one endpoint `<pod>-rank-<i>` at `podIP:port` (data-parallel ranks);
* the engine type comes from the label `llm-d.ai/engine-type`, else `inference.networking.k8s.io/engine-type`
  (default vllm);
* no pool (deleted or not yet created) means no endpoints;
* InferenceObjectives and InferenceModelRewrites are read from llm-d's group `llm-d.ai` when the API server serves
  the kind there (discovery, at each list), else from the older `inference.networking.x-k8s.io`;
* InferenceObjectives give priorities by name; InferenceModelRewrites become ModelRewrites in upstream's
  precedence (exact model matches before catch-all rules; then the oldest resource; then rule order), so the
  first rewrite that fits a request is the one that applies.

`--pool-group inference.networking.x-k8s.io` reads a v1alpha2 InferencePool (flat `selector`, `targetPortNumber`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from epp.datalayer.endpoint import EndpointSpec, ModelRewrite, PoolState
from protocol.metrics import DEFAULT_ENGINE, ENGINES

log = logging.getLogger("epp.kubernetes")
# A Pod's engine (which metric names its server speaks): llm-d's label, else the older GIE one (llm-d's fallback).
ENGINE_LABEL = "llm-d.ai/engine-type"
LEGACY_ENGINE_LABEL = "inference.networking.k8s.io/engine-type"
POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSIONS = {POOL_GROUP: "v1", "inference.networking.x-k8s.io": "v1alpha2"}
# InferenceObjective and InferenceModelRewrite: llm-d's group (its config/crd/bases), and the older GIE group, read only
# while the API server does not serve the kind in llm-d's (llm-d's rule: with both installed the legacy one is ignored).
CRD_GROUP, CRD_VERSION = "llm-d.ai", "v1alpha2"
LEGACY_CRD_GROUP, LEGACY_CRD_VERSION = "inference.networking.x-k8s.io", "v1alpha2"
# Retries after an error: doubling from 0.25 s, capped at 2 s (so watching resumes within ~2 s of the API server
# answering again), each wait jittered to 50-100 % so that replicas do not retry in step after a restart.
BACKOFF_INITIAL, BACKOFF_MAX = 0.25, 2.0


def _short(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {str(exc)[:160]}"


class Gone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


@dataclass
class _Resource:
    name: str
    list_call: Callable[..., object]  # the client's list method with its positional arguments bound
    objects: dict[str, dict]
    resource_version: str = ""
    synced: bool = False  # listed at least once


def _ready(pod: dict) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _pool_selector_and_ports(spec: dict) -> tuple[dict, list[int]]:
    """(matchLabels, target ports) of a v1 pool, or of a v1alpha2 pool (flat selector, one targetPortNumber)."""
    if "targetPortNumber" in spec:
        return spec.get("selector") or {}, [spec["targetPortNumber"]]
    return (spec.get("selector") or {}).get("matchLabels") or {}, [p["number"] for p in spec.get("targetPorts") or []]


def _refers_to(obj: dict, pool_name: str, pool_group: str) -> bool:
    ref = (obj.get("spec") or {}).get("poolRef") or {}
    return (
        ref.get("name") == pool_name
        and ref.get("group", POOL_GROUP) == pool_group
        and ref.get("kind", "InferencePool") == "InferencePool"
    )


def _age(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("creationTimestamp") or "", meta.get("name") or ""  # RFC 3339 UTC sorts chronologically


def _rewrites(rewrites: list[dict]) -> tuple[ModelRewrite, ...]:
    exact, catch_all = [], []
    for obj in sorted(rewrites, key=_age):
        for rule in (obj.get("spec") or {}).get("rules") or []:
            targets = tuple((t["modelRewrite"], int(t.get("weight") or 1)) for t in rule.get("targets") or [])
            if not targets:
                continue
            matches = rule.get("matches") or []
            if matches:
                exact += [ModelRewrite(m["model"]["value"], targets) for m in matches]
            else:
                catch_all.append(ModelRewrite("*", targets))
    return tuple(exact + catch_all)


def pool_state(
    pool: dict | None,
    pods: dict[str, dict],
    objectives: dict[str, dict],
    rewrites: dict[str, dict],
    pool_name: str,
    pool_group: str = POOL_GROUP,
) -> PoolState:
    """The PoolState that the current objects describe."""
    if pool is None:
        return PoolState()
    selector, ports = _pool_selector_and_ports(pool.get("spec") or {})
    endpoints = []
    for name in sorted(pods):
        pod = pods[name]
        labels = pod.get("metadata", {}).get("labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()) or not _ready(pod):
            continue
        engine = labels.get(ENGINE_LABEL) or labels.get(LEGACY_ENGINE_LABEL, DEFAULT_ENGINE)
        if engine not in ENGINES:
            log.warning("pod %s: unknown engine type %r, reading %s metrics", name, engine, DEFAULT_ENGINE)
            engine = DEFAULT_ENGINE
        for rank, port in enumerate(ports):
            endpoints.append(
                EndpointSpec(f"{name}-rank-{rank}", pod["status"]["podIP"], port, engine, tuple(sorted(labels.items())))
            )
    priorities = {
        name: int((obj.get("spec") or {}).get("priority") or 0)
        for name, obj in objectives.items()
        if _refers_to(obj, pool_name, pool_group)
    }
    ours = [obj for obj in rewrites.values() if _refers_to(obj, pool_name, pool_group)]
    return PoolState(tuple(endpoints), priorities, None, _rewrites(ours))


class KubernetesSource:
    """A pool source (`epp.datalayer.source`): publishes the pool's PoolState whenever the pool, its Pods,
    objectives or rewrites change.

    `run(on_update)` calls `on_update(state)` on the event loop; it returns only when the task is cancelled or
    `stop()` is called."""

    name = "kubernetes"

    def __init__(
        self, api: k8s.ApiClient, pool_name: str, namespace: str, pool_group: str = POOL_GROUP, watch_timeout: int = 60
    ):
        if pool_group not in POOL_VERSIONS:
            raise ValueError(f"unknown --pool-group {pool_group!r}; known: {', '.join(POOL_VERSIONS)}")
        self.pool_name, self.namespace, self.pool_group = pool_name, namespace, pool_group
        self.watch_timeout = watch_timeout
        core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)

        def custom_list(group: str, version: str, plural: str) -> Callable[..., object]:
            return lambda **kw: custom.list_namespaced_custom_object(group, version, namespace, plural, **kw)

        def crd_list(kind: str, plural: str) -> Callable[..., object]:
            """Lists from the group that serves `kind` (asked at each list; a watch follows its list's group)."""
            chosen = [LEGACY_CRD_GROUP, LEGACY_CRD_VERSION]

            def call(**kw):
                if not kw.get("watch"):
                    chosen[:] = self._crd_group(custom, kind)
                return custom.list_namespaced_custom_object(*chosen, namespace, plural, **kw)

            return call

        self._resources = [
            _Resource("pods", lambda **kw: core.list_namespaced_pod(namespace, **kw), {}),
            _Resource("inferencepools", custom_list(pool_group, POOL_VERSIONS[pool_group], "inferencepools"), {}),
            _Resource("inferenceobjectives", crd_list("InferenceObjective", "inferenceobjectives"), {}),
            _Resource("inferencemodelrewrites", crd_list("InferenceModelRewrite", "inferencemodelrewrites"), {}),
        ]
        self.crd_groups: dict[str, str] = {}  # kind -> the group its objects were last listed from
        self._lock = threading.Lock()  # guards every _Resource and _publish_pending
        self._stop = threading.Event()
        self._open_watches: set = set()  # streaming responses, shut down on stop to unblock their threads
        self._publish_pending = False
        self._published: PoolState | None = None
        self.relists = 0

    def _crd_group(self, custom: k8s.CustomObjectsApi, kind: str) -> tuple[str, str]:
        """(group, version) to read `kind` from: llm-d's when the API server serves the kind there, else the
        legacy one (a 404: llm-d's CRDs are not installed). Other errors raise (the watcher backs off)."""
        try:
            served = {r.kind for r in custom.get_api_resources(CRD_GROUP, CRD_VERSION, _request_timeout=10).resources}
        except ApiException as exc:
            if exc.status != 404:
                raise
            served = set()
        group = (CRD_GROUP, CRD_VERSION) if kind in served else (LEGACY_CRD_GROUP, LEGACY_CRD_VERSION)
        if self.crd_groups.get(kind) != group[0]:
            log.info("%s: reading %s/%s%s", kind, *group, " (legacy group ignored)" if group[0] == CRD_GROUP else "")
            self.crd_groups[kind] = group[0]
        return group

    def state(self) -> PoolState:
        pods, pools, objectives, rewrites = (r.objects for r in self._resources)
        with self._lock:
            return pool_state(pools.get(self.pool_name), pods, objectives, rewrites, self.pool_name, self.pool_group)

    @property
    def synced(self) -> bool:
        return all(r.synced for r in self._resources)

    async def run(self, on_update: Callable[[PoolState], None]) -> None:
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def publish() -> None:  # on the loop: one computation for a burst of changes
            with self._lock:
                self._publish_pending = False
            if not self.synced:
                return
            state = self.state()
            if state != self._published:
                self._published = state
                on_update(state)

        def changed() -> None:  # from a watcher thread
            with self._lock:
                if self._publish_pending:
                    return
                self._publish_pending = True
            loop.call_soon_threadsafe(publish)

        def watcher(resource: _Resource) -> None:
            try:
                self._watch_forever(resource, changed)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is already closed
                    loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(None))

        self._stop.clear()
        for resource in self._resources:
            threading.Thread(target=watcher, args=(resource,), name=f"watch-{resource.name}", daemon=True).start()
        try:
            await finished  # a watcher only ends on stop()
        finally:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        for response in list(self._open_watches):
            response.shutdown()

    # -- one resource ------------------------------------------------------------------------------------------
    def _list(self, resource: _Resource, changed: Callable[[], None]) -> None:
        response = resource.list_call(_preload_content=False, _request_timeout=10)
        body = json.loads(response.data)
        with self._lock:
            resource.objects.clear()
            resource.objects.update({o["metadata"]["name"]: o for o in body.get("items") or []})
            resource.resource_version = body["metadata"]["resourceVersion"]
            resource.synced = True
        self.relists += 1
        changed()

    def _watch(self, resource: _Resource, changed: Callable[[], None]) -> None:
        response = resource.list_call(
            watch=True,
            resource_version=resource.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout,
            _preload_content=False,
            _request_timeout=(5, self.watch_timeout + 5),
        )
        self._open_watches.add(response)
        try:
            buffer = b""
            for chunk in response.stream(amt=None, decode_content=True):
                if self._stop.is_set():
                    return
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        self._apply(resource, json.loads(line), changed)
        finally:
            self._open_watches.discard(response)
            response.release_conn()

    def _apply(self, resource: _Resource, event: dict, changed: Callable[[], None]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", "resource version too old"))
            raise RuntimeError(f"watch error: {obj.get('code')} {obj.get('message')}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        with self._lock:
            if rv:
                resource.resource_version = rv
            if kind == "BOOKMARK":
                return
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                resource.objects.pop(name, None)
            else:
                resource.objects[name] = obj
        changed()

    def _watch_forever(self, resource: _Resource, changed: Callable[[], None]) -> None:
        backoff = BACKOFF_INITIAL
        listed = False
        outage_since = None  # monotonic time of the first failure of the current outage
        while not self._stop.is_set():
            try:
                if not listed:
                    self._list(resource, changed)
                    listed = True
                if outage_since is not None:
                    log.info(
                        "%s: the API server answers again after %.1fs", resource.name, time.monotonic() - outage_since
                    )
                    outage_since = None
                self._watch(resource, changed)  # returns when the server ends the watch: resume from the last rv
                backoff = BACKOFF_INITIAL
            except Gone:
                log.info("%s: watch history compacted (410); relisting", resource.name)
                listed = False
            except Exception as exc:  # a dropped connection or an API error: back off, resume
                if self._stop.is_set():
                    return
                if isinstance(exc, ApiException) and exc.status == 410:
                    log.info("%s: resourceVersion expired (410); relisting", resource.name)
                    listed = False
                    continue
                if outage_since is None:  # logged once per outage, and once when it ends (above)
                    outage_since = time.monotonic()
                    log.warning(
                        "%s: list/watch failed (%s); retrying every <= %.0fs, routing from the last known pool",
                        resource.name,
                        _short(exc),
                        BACKOFF_MAX,
                    )
                else:
                    log.debug("%s: still failing (%s)", resource.name, _short(exc))
                self._stop.wait(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, BACKOFF_MAX)
