"""A local HTTP server that speaks the Kubernetes API's list and watch protocol for the few resources the EPP reads
(pods, inferencepools, inferenceobjectives, inferencemodelrewrites) and the leases it writes: resourceVersions,
watch events after a version, bookmarks, 410 Gone after compaction (as a watch event, or as the HTTP status when
`gone_as_status`), injected server errors, and connections it can drop mid-stream."""

from __future__ import annotations

import asyncio
import copy
import json

from aiohttp import web

PATHS = {
    "pods": "/api/v1/namespaces/{ns}/pods",
    "inferencepools": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    "x-inferencepools": "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferencepools",
    "inferenceobjectives": "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives",
    "inferencemodelrewrites": "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferencemodelrewrites",
    "llm-d-inferenceobjectives": "/apis/llm-d.ai/v1alpha2/namespaces/{ns}/inferenceobjectives",
    "llm-d-inferencemodelrewrites": "/apis/llm-d.ai/v1alpha2/namespaces/{ns}/inferencemodelrewrites",
}
# The discovery document of llm-d's group: served while `llm_d_kinds` names a kind (its CRD is installed), else 404.
LLM_D_DISCOVERY = "/apis/llm-d.ai/v1alpha2"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def _timestamp(seconds: int) -> str:
    return f"2026-01-01T{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}Z"


class FakeAPIServer:
    def __init__(self) -> None:
        self.rv = 100
        self.objects: dict[str, dict[str, dict]] = {kind: {} for kind in [*PATHS, "leases"]}
        self.history: dict[str, list[tuple[int, str, dict]]] = {kind: [] for kind in PATHS}
        self.compacted_before = 0
        self.changed = asyncio.Event()
        self.watches: list[web.StreamResponse] = []
        self.watch_requests = 0
        self.list_requests = 0
        self.fail_requests = 0  # the next n list/watch requests get 500
        self.gone_as_status = False
        self.lease_stall = 0.0  # seconds every lease request hangs before it is answered (an unreachable API)
        self.llm_d_kinds: set[str] = set()  # the kinds whose llm-d.ai CRDs are installed
        self.app = web.Application(middlewares=[self._stall_leases])
        self.app.router.add_get(LLM_D_DISCOVERY, self.discovery)
        for kind, path in PATHS.items():
            self.app.router.add_get(path, self._handler(kind))
        self.app.router.add_get(LEASES + "/{name}", self.get_lease)
        self.app.router.add_post(LEASES, self.create_lease)
        self.app.router.add_put(LEASES + "/{name}", self.replace_lease)

    # -- test controls -----------------------------------------------------------------------------------------
    def apply(self, kind: str, obj: dict) -> None:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        name = obj["metadata"]["name"]
        event = "MODIFIED" if name in self.objects[kind] else "ADDED"
        created = self.objects[kind][name]["metadata"].get("creationTimestamp") if event == "MODIFIED" else None
        obj["metadata"].setdefault("creationTimestamp", created or _timestamp(self.rv))
        self.objects[kind][name] = obj
        self.history[kind].append((self.rv, event, obj))
        self._notify()

    def delete(self, kind: str, name: str) -> None:
        self.rv += 1
        obj = copy.deepcopy(self.objects[kind].pop(name))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.history[kind].append((self.rv, "DELETED", obj))
        self._notify()

    def compact(self) -> None:
        """Forget the event history: a watch from an older resourceVersion now gets 410 Gone."""
        self.compacted_before = self.rv + 1
        for events in self.history.values():
            events.clear()

    async def drop_watches(self) -> None:
        for response in list(self.watches):
            transport = response._req.transport if response._req is not None else None
            if transport is not None:
                transport.close()
        self.watches.clear()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # -- list and watch ----------------------------------------------------------------------------------------
    def _handler(self, kind: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            if self.fail_requests > 0:
                self.fail_requests -= 1
                return web.json_response({"kind": "Status", "code": 500, "reason": "InternalError"}, status=500)
            if request.query.get("watch") in ("true", "1", "True"):
                return await self._watch(kind, request)
            self.list_requests += 1
            return web.json_response(
                {
                    "kind": "List",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.rv)},
                    "items": list(self.objects[kind].values()),
                }
            )

        return handle

    async def _watch(self, kind: str, request: web.Request) -> web.StreamResponse:
        self.watch_requests += 1
        since = int(request.query.get("resourceVersion") or 0)
        timeout = float(request.query.get("timeoutSeconds") or 30)
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "True", "1")
        if since < self.compacted_before and self.gone_as_status:
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired"}, status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        self.watches.append(response)

        async def send(event: dict) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        try:
            if since < self.compacted_before:
                await send(
                    {
                        "type": "ERROR",
                        "object": {
                            "kind": "Status",
                            "code": 410,
                            "reason": "Expired",
                            "message": f"too old resource version: {since}",
                        },
                    }
                )
                return response
            deadline = asyncio.get_running_loop().time() + timeout
            while asyncio.get_running_loop().time() < deadline:
                for rv, event, obj in self.history[kind]:
                    if rv > since:
                        await send({"type": event, "object": obj})
                        since = rv
                changed = self.changed
                try:
                    await asyncio.wait_for(changed.wait(), 0.2)
                except TimeoutError:
                    if bookmarks:
                        await send(
                            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": str(max(since, self.rv))}}}
                        )
                        since = max(since, self.rv)
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass
        finally:
            if response in self.watches:
                self.watches.remove(response)
        return response

    async def discovery(self, request: web.Request) -> web.Response:
        if not self.llm_d_kinds:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        plurals = {"InferenceObjective": "inferenceobjectives", "InferenceModelRewrite": "inferencemodelrewrites"}
        resources = [
            {"name": plurals[kind], "singularName": "", "namespaced": True, "kind": kind, "verbs": ["list", "watch"]}
            for kind in sorted(self.llm_d_kinds)
        ]
        return web.json_response(
            {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "llm-d.ai/v1alpha2", "resources": resources}
        )

    # -- leases ------------------------------------------------------------------------------------------------
    @web.middleware
    async def _stall_leases(self, request: web.Request, handler):
        if self.lease_stall and "/leases" in request.path:
            await asyncio.sleep(self.lease_stall)
        return await handler(request)

    async def get_lease(self, request: web.Request) -> web.Response:
        lease = self.objects["leases"].get(request.match_info["name"])
        if lease is None:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        return web.json_response(lease)

    async def create_lease(self, request: web.Request) -> web.Response:
        lease = await request.json()
        name = lease["metadata"]["name"]
        if name in self.objects["leases"]:
            return web.json_response({"kind": "Status", "code": 409, "reason": "AlreadyExists"}, status=409)
        self.rv += 1
        lease["metadata"]["resourceVersion"] = str(self.rv)
        self.objects["leases"][name] = lease
        return web.json_response(lease, status=201)

    async def replace_lease(self, request: web.Request) -> web.Response:
        lease = await request.json()
        name = request.match_info["name"]
        current = self.objects["leases"].get(name)
        if current is None:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        if lease["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return web.json_response({"kind": "Status", "code": 409, "reason": "Conflict"}, status=409)
        self.rv += 1
        lease["metadata"]["resourceVersion"] = str(self.rv)
        self.objects["leases"][name] = lease
        return web.json_response(lease)
