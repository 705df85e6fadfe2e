"""Kubernetes discovery: the EPP's own InferencePool, the Pods of its namespace, and the InferenceObjectives and
InferenceModelRewrites that refer to the pool, kept current with list + watch.

Each resource has its own watcher thread (the `kubernetes` client is synchronous; the event loop never blocks on
it): list, then watch from the list's resourceVersion with bookmarks; a dropped watch resumes from the last
resourceVersion seen; 410 Gone (history compacted) relists; other errors back off (0.5 s doubling to 10 s). After
every change a whole new PoolState is published on the event loop:

* a Pod is an endpoint when its labels match the pool's selector, it has an IP, it is Ready and not terminating;
* each Pod x target port is one endpoint `<pod>-rank-<i>` at `podIP:port` (data-parallel ranks);
* the engine type comes from the label `inference.networking.k8s.io/engine-type` (default vllm);
* no pool (deleted or not yet created) means no endpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes import client as k8s

from epp.datalayer.endpoint import EndpointSpec, ModelRewrite, PoolState
from protocol.metrics import ENGINES

log = logging.getLogger("epp.kubernetes")
ENGINE_LABEL = "inference.networking.k8s.io/engine-type"
OBJECTIVES = ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives")
REWRITES = ("inference.networking.x-k8s.io", "v1alpha2", "inferencemodelrewrites")


class Gone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


@dataclass
class _Resource:
    name: str
    list_call: Callable[..., object]  # the client's list method with its positional arguments bound
    objects: dict[str, dict]
    resource_version: str = ""


def _ready(pod: dict) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pool_state(pool: dict | None, pods: dict[str, dict], objectives: dict[str, dict], rewrites: dict[str, dict],
               pool_name: str) -> PoolState:  # fmt: skip
    """The PoolState that the current objects describe."""
    if pool is None:
        return PoolState()
    spec = pool.get("spec") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [p["number"] for p in spec.get("targetPorts") or []]
    endpoints = []
    for name in sorted(pods):
        pod = pods[name]
        labels = pod.get("metadata", {}).get("labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()) or not _ready(pod):
            continue
        engine = labels.get(ENGINE_LABEL, "vllm")
        if engine not in ENGINES:
            log.warning("pod %s: unknown engine type %r, reading vLLM metrics", name, engine)
            engine = "vllm"
        for rank, port in enumerate(ports):
            endpoints.append(EndpointSpec(f"{name}-rank-{rank}", pod["status"]["podIP"], port, engine,
                                          tuple(sorted(labels.items()))))  # fmt: skip

    def ours(obj: dict) -> bool:
        return ((obj.get("spec") or {}).get("poolRef") or {}).get("name") == pool_name

    priorities = {n: int((o.get("spec") or {}).get("priority") or 0) for n, o in objectives.items() if ours(o)}
    model_rewrites = []
    for name in sorted(rewrites):
        if not ours(rewrites[name]):
            continue
        for rule in rewrites[name]["spec"].get("rules") or []:
            targets = tuple((t["modelRewrite"], int(t.get("weight", 1))) for t in rule.get("targets") or [])
            matches = [m["model"]["value"] for m in rule.get("matches") or []] or ["*"]  # no matches: every model
            model_rewrites += [ModelRewrite(model, targets) for model in matches]
    return PoolState(tuple(endpoints), priorities, None, tuple(model_rewrites))


class KubernetesSource:
    """Publishes the pool's PoolState whenever the pool, its Pods, objectives or rewrites change."""

    def __init__(self, api: k8s.ApiClient, pool_name: str, namespace: str,
                 pool_group: str = "inference.networking.k8s.io", watch_timeout: int = 60):  # fmt: skip
        self.api = api
        self.pool_name = pool_name
        self.namespace = namespace
        self.watch_timeout = watch_timeout
        core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        self._resources = [
            _Resource("pods", lambda **kw: core.list_namespaced_pod(namespace, **kw), {}),
            _Resource(
                "inferencepools",
                lambda **kw: custom.list_namespaced_custom_object(pool_group, "v1", namespace, "inferencepools", **kw),
                {},
            ),
            _Resource(
                "inferenceobjectives",
                lambda **kw: custom.list_namespaced_custom_object(*OBJECTIVES[:2], namespace, OBJECTIVES[2], **kw),
                {},
            ),
            _Resource(
                "inferencemodelrewrites",
                lambda **kw: custom.list_namespaced_custom_object(*REWRITES[:2], namespace, REWRITES[2], **kw),
                {},
            ),
        ]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._open_watches: set = set()  # streaming responses, shut down on stop to unblock their threads
        self.relists = 0

    def state(self) -> PoolState:
        pods, pools, objectives, rewrites = (r.objects for r in self._resources)
        with self._lock:
            return pool_state(pools.get(self.pool_name), dict(pods), dict(objectives), dict(rewrites), self.pool_name)

    async def run(self, on_update: Callable[[PoolState], None]) -> None:
        loop = asyncio.get_running_loop()

        def publish() -> None:
            state = self.state()
            loop.call_soon_threadsafe(on_update, state)

        threads = [asyncio.to_thread(self._watch_forever, r, publish) for r in self._resources]
        try:
            await asyncio.gather(*threads)
        finally:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        for response in list(self._open_watches):
            response.shutdown()

    # -- one resource ------------------------------------------------------------------------------------------
    def _list(self, resource: _Resource, publish: Callable[[], None]) -> None:
        response = resource.list_call(_preload_content=False, _request_timeout=10)
        body = json.loads(response.data)
        with self._lock:
            resource.objects.clear()
            resource.objects.update({o["metadata"]["name"]: o for o in body.get("items") or []})
            resource.resource_version = body["metadata"]["resourceVersion"]
        self.relists += 1
        publish()

    def _watch(self, resource: _Resource, publish: Callable[[], None]) -> None:
        response = resource.list_call(
            watch=True, resource_version=resource.resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout, _preload_content=False, _request_timeout=(5, self.watch_timeout + 5),
        )  # fmt: skip
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
                        self._apply(resource, json.loads(line), publish)
        finally:
            self._open_watches.discard(response)
            response.release_conn()

    def _apply(self, resource: _Resource, event: dict, publish: Callable[[], None]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", "resource version too old"))
            raise RuntimeError(f"watch error: {obj}")
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
        publish()

    def _watch_forever(self, resource: _Resource, publish: Callable[[], None]) -> None:
        backoff = 0.5
        listed = False
        while not self._stop.is_set():
            try:
                if not listed:
                    self._list(resource, publish)
                    listed = True
                self._watch(resource, publish)  # returns when the server ends the watch: resume from the last rv
                backoff = 0.5
            except Gone:
                log.info("%s: watch history compacted (410); relisting", resource.name)
                listed = False
            except Exception as exc:  # a dropped connection or an API error: back off, resume
                if self._stop.is_set():
                    return
                log.warning("%s: watch failed (%s); retrying in %.1fs", resource.name, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
