"""Discovery with the real `kubernetes` client against a local API server that implements list and watch."""

import asyncio
import contextlib

from epp.datalayer.kubernetes import KubernetesSource

NS = "serving"


def pod(name, ip="10.0.0.1", ready=True, labels=None, terminating=False):
    meta = {"name": name, "namespace": NS, "labels": {"app": "model-server", **(labels or {})}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}  # fmt: skip


def pool(selector=None, ports=(8000,)):
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "pool"},
            "spec": {"selector": {"matchLabels": selector or {"app": "model-server"}},
                     "targetPorts": [{"number": p} for p in ports], "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}  # fmt: skip


class Collector:
    def __init__(self):
        self.states = []
        self.changed = asyncio.Event()

    def __call__(self, state):
        self.states.append(state)
        self.changed.set()

    async def until(self, predicate, timeout=5.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while not (self.states and predicate(self.states[-1])):
            self.changed.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            assert remaining > 0, f"condition not reached; last state {self.states[-1] if self.states else None}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)
        return self.states[-1]


def addresses(state):
    return sorted((e.name, e.hostport, e.engine) for e in state.endpoints)


async def test_pods_pool_objectives_and_rewrites(apiserver):
    server, api = apiserver
    server.apply("inferencepools", pool(ports=(8000, 8001)))
    server.apply("pods", pod("a", "10.0.0.1", labels={"inference.networking.k8s.io/engine-type": "sglang"}))
    server.apply("pods", pod("b", "10.0.0.2", ready=False))
    server.apply("pods", pod("other", "10.0.0.9", labels={"app": "something-else"}))
    source = KubernetesSource(api, "pool", NS, watch_timeout=5)
    seen = Collector()
    task = asyncio.create_task(source.run(seen))
    try:
        state = await seen.until(lambda s: len(s.endpoints) == 2)
        assert addresses(state) == [("a-rank-0", "10.0.0.1:8000", "sglang"), ("a-rank-1", "10.0.0.1:8001", "sglang")]

        server.apply("pods", pod("b", "10.0.0.2", ready=True))  # becomes ready
        await seen.until(lambda s: len(s.endpoints) == 4)
        server.apply("pods", pod("a", "10.0.0.7"))  # IP changes (engine label gone: vllm)
        state = await seen.until(lambda s: ("a-rank-0", "10.0.0.7:8000", "vllm") in addresses(s))
        server.apply("pods", pod("b", "10.0.0.2", terminating=True))  # terminating
        await seen.until(lambda s: len(s.endpoints) == 2)
        server.apply("pods", pod("b", "10.0.0.2"))  # back, then deleted
        await seen.until(lambda s: len(s.endpoints) == 4)
        server.delete("pods", "b")
        await seen.until(lambda s: len(s.endpoints) == 2)
        server.apply("pods", pod("a", "10.0.0.7", labels={"app": "renamed"}))  # labels no longer match
        await seen.until(lambda s: len(s.endpoints) == 0)
        server.apply("inferencepools", pool(selector={"app": "renamed"}))  # the pool's selector follows (one port)
        await seen.until(lambda s: addresses(s) == [("a-rank-0", "10.0.0.7:8000", "vllm")])

        server.apply(
            "inferenceobjectives",
            {"metadata": {"name": "batch"}, "spec": {"priority": -1, "poolRef": {"name": "pool"}}},
        )
        server.apply(
            "inferenceobjectives",
            {"metadata": {"name": "elsewhere"}, "spec": {"priority": 5, "poolRef": {"name": "x"}}},
        )
        await seen.until(lambda s: s.objectives == {"batch": -1})
        server.apply("inferencemodelrewrites", {"metadata": {"name": "r"}, "spec": {"poolRef": {"name": "pool"}, "rules": [
            {"matches": [{"model": {"type": "Exact", "value": "food"}}],
             "targets": [{"modelRewrite": "food-v1", "weight": 90}, {"modelRewrite": "food-v2", "weight": 10}]},
            {"targets": [{"modelRewrite": "default-model"}]}]}})  # fmt: skip
        state = await seen.until(lambda s: len(s.rewrites) == 2)
        assert state.rewrites[0].model == "food" and state.rewrites[0].targets == (("food-v1", 90), ("food-v2", 10))
        assert state.rewrites[1].model == "*"

        server.delete("inferencepools", "pool")  # pool deleted: no endpoints
        await seen.until(lambda s: len(s.endpoints) == 0)
    finally:
        source.stop()
        await server.drop_watches()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_dropped_watch_resumes_and_410_relists(apiserver):
    server, api = apiserver
    server.apply("inferencepools", pool())
    server.apply("pods", pod("a", "10.0.0.1"))
    source = KubernetesSource(api, "pool", NS, watch_timeout=5)
    seen = Collector()
    task = asyncio.create_task(source.run(seen))
    try:
        await seen.until(lambda s: len(s.endpoints) == 1)
        while server.list_requests < 4:  # all four resources listed once
            await asyncio.sleep(0.01)
        lists = server.list_requests
        await server.drop_watches()  # connections cut mid-stream
        server.apply("pods", pod("b", "10.0.0.2"))
        await seen.until(lambda s: len(s.endpoints) == 2, timeout=10)
        assert server.list_requests == lists  # resumed from the resourceVersion, no relist

        await server.drop_watches()
        server.compact()  # history gone: the resumed watch gets 410 and the watcher relists
        server.apply("pods", pod("c", "10.0.0.3"))
        await seen.until(lambda s: len(s.endpoints) == 3, timeout=10)
        assert server.list_requests > lists
    finally:
        source.stop()
        await server.drop_watches()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
