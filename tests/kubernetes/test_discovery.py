"""Discovery with the real `kubernetes` client against a local API server that implements list and watch."""

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from epp.datalayer.kubernetes import KubernetesSource

NS = "serving"


def pod(name, ip="10.0.0.1", ready=True, labels=None, terminating=False):
    meta = {"name": name, "namespace": NS, "labels": {"app": "model-server", **(labels or {})}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def rewrite(name, rules, created=None, pool_group=None):
    ref = {"name": "pool", **({"group": pool_group} if pool_group else {})}
    meta = {"name": name, **({"creationTimestamp": created} if created else {})}
    return {"metadata": meta, "spec": {"poolRef": ref, "rules": rules}}


def pool(selector=None, ports=(8000,)):
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "pool"},
        "spec": {
            "selector": {"matchLabels": selector or {"app": "model-server"}},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }


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


@contextlib.asynccontextmanager
async def discovery(api, **kwargs):
    source = KubernetesSource(api, "pool", NS, watch_timeout=5, **kwargs)
    seen = Collector()
    task = asyncio.create_task(source.run(seen))
    try:
        yield seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


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
        assert len(seen.states) == 1, "published before every resource was listed"
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
        server.apply(
            "inferencemodelrewrites",
            {
                "metadata": {"name": "r"},
                "spec": {
                    "poolRef": {"name": "pool"},
                    "rules": [
                        {
                            "matches": [{"model": {"type": "Exact", "value": "food"}}],
                            "targets": [
                                {"modelRewrite": "food-v1", "weight": 90},
                                {"modelRewrite": "food-v2", "weight": 10},
                            ],
                        },
                        {"targets": [{"modelRewrite": "default-model"}]},
                    ],
                },
            },
        )
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


async def test_rewrite_precedence_and_pool_references(apiserver):
    server, api = apiserver
    server.apply("inferencepools", pool())
    catch_all = [{"targets": [{"modelRewrite": "default"}]}]

    def food(target):
        return [{"matches": [{"model": {"value": "food"}}], "targets": [{"modelRewrite": target, "weight": 5}]}]

    server.apply("inferencemodelrewrites", rewrite("new", food("food-new"), created="2026-02-01T00:00:00Z"))
    server.apply("inferencemodelrewrites", rewrite("old", catch_all + food("food-old"), created="2026-01-01T00:00:00Z"))
    server.apply(
        "inferencemodelrewrites", rewrite("other-group", food("x"), pool_group="inference.networking.x-k8s.io")
    )
    server.apply("inferencemodelrewrites", rewrite("no-targets", [{"matches": [{"model": {"value": "x"}}]}]))
    server.apply("inferenceobjectives", {"metadata": {"name": "chat"}, "spec": {"poolRef": {"name": "pool"}}})
    server.apply(
        "inferenceobjectives",
        {"metadata": {"name": "alien"}, "spec": {"priority": 3, "poolRef": {"name": "pool", "kind": "Other"}}},
    )
    async with discovery(api) as seen:
        state = await seen.until(lambda s: s.rewrites)
        # Exact matches before catch-alls; among equals the oldest resource first; other pools' rewrites ignored.
        assert [(r.model, r.targets) for r in state.rewrites] == [
            ("food", (("food-old", 5),)),
            ("food", (("food-new", 5),)),
            ("*", (("default", 1),)),
        ]
        assert state.objectives == {"chat": 0}  # no priority: 0
        server.delete("inferencemodelrewrites", "old")
        state = await seen.until(lambda s: len(s.rewrites) == 1)
        assert state.rewrites[0].targets == (("food-new", 5),)


async def test_v1alpha2_pool_group(apiserver):
    server, api = apiserver
    v1alpha2 = {
        "metadata": {"name": "pool"},
        "spec": {"selector": {"app": "model-server"}, "targetPortNumber": 8001, "extensionRef": {"name": "epp"}},
    }
    server.apply("x-inferencepools", v1alpha2)
    server.apply("pods", pod("a", "10.0.0.1"))
    async with discovery(api, pool_group="inference.networking.x-k8s.io") as seen:
        state = await seen.until(lambda s: s.endpoints)
        assert addresses(state) == [("a-rank-0", "10.0.0.1:8001", "vllm")]


def test_unknown_pool_group_is_a_clear_error():
    with pytest.raises(ValueError, match="pool-group"):
        KubernetesSource(None, "pool", NS, pool_group="example.com")


async def test_unchanged_state_is_not_republished(apiserver):
    server, api = apiserver
    server.apply("inferencepools", pool())
    server.apply("pods", pod("a", "10.0.0.1"))
    async with discovery(api) as seen:
        await seen.until(lambda s: len(s.endpoints) == 1)
        for i in range(5):  # status churn that does not change the endpoint
            server.apply("pods", {**pod("a", "10.0.0.1"), "spec": {"nodeName": f"node-{i}"}})
        server.apply("pods", pod("b", "10.0.0.2"))
        await seen.until(lambda s: len(s.endpoints) == 2)
        assert [len(s.endpoints) for s in seen.states] == [1, 2]


async def test_server_errors_back_off_and_recover(apiserver):
    server, api = apiserver
    server.apply("inferencepools", pool())
    server.apply("pods", pod("a", "10.0.0.1"))
    server.fail_requests = 3
    async with discovery(api) as seen:
        await seen.until(lambda s: len(s.endpoints) == 1, timeout=10)
        assert server.fail_requests == 0


async def test_gone_status_relists_and_drops_pods_deleted_meanwhile(apiserver):
    server, api = apiserver
    server.gone_as_status = True
    server.apply("inferencepools", pool())
    server.apply("pods", pod("a", "10.0.0.1"))
    server.apply("pods", pod("b", "10.0.0.2"))
    async with discovery(api) as seen:
        await seen.until(lambda s: len(s.endpoints) == 2)
        lists = server.list_requests
        await server.drop_watches()
        server.delete("pods", "a")  # while no watch is open and then compacted away: only a relist sees it
        server.compact()
        await seen.until(lambda s: addresses(s) == [("b-rank-0", "10.0.0.2:8000", "vllm")], timeout=10)
        assert server.list_requests > lists


async def test_watchers_leave_the_default_executor_free(apiserver):
    server, api = apiserver
    server.apply("inferencepools", pool())
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(executor)
    try:
        async with discovery(api) as seen:
            await seen.until(lambda s: True)
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 2) == "free"
    finally:
        executor.shutdown(wait=False)


@pytest.mark.timing
async def test_an_outage_is_logged_once_and_watching_resumes_within_two_seconds(apiserver, caplog):
    server, api = apiserver
    server.apply("inferencepools", pool())
    server.apply("pods", pod("a", "10.0.0.1"))
    server.fail_requests = 10**9  # the API server answers 500 to every list and watch
    caplog.set_level("DEBUG", logger="epp.kubernetes")
    async with discovery(api) as seen:
        await asyncio.sleep(4)  # long enough to reach the backoff cap
        assert not seen.states
        server.fail_requests = 0
        back = time.monotonic()
        await seen.until(lambda s: len(s.endpoints) == 1, timeout=5)
        assert time.monotonic() - back < 2.5
        for _ in range(100):  # each watcher logs its recovery after its own list: the last may trail the publish
            if sum("answers again" in r.getMessage() for r in caplog.records) == 4:
                break
            await asyncio.sleep(0.02)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    resources = {w.split(":")[0] for w in warnings}
    assert len(warnings) == len(resources) == 4, warnings  # once per resource, not once per retry
    assert sum("answers again" in r.getMessage() for r in caplog.records) == 4


async def test_llm_d_crd_group_wins_and_the_legacy_group_is_ignored_while_it_is_installed(apiserver):
    server, api = apiserver
    server.apply("inferencepools", pool())
    server.apply("pods", pod("a", "10.0.0.1", labels={"llm-d.ai/engine-type": "sglang"}))
    server.apply("pods", pod("b", "10.0.0.2", labels={"inference.networking.k8s.io/engine-type": "sglang"}))
    both = {"llm-d.ai/engine-type": "vllm", "inference.networking.k8s.io/engine-type": "sglang"}
    server.apply("pods", pod("c", "10.0.0.3", labels=both))

    def objective(name, priority):
        return {"metadata": {"name": name}, "spec": {"priority": priority, "poolRef": {"name": "pool"}}}

    food = [{"matches": [{"model": {"value": "food"}}], "targets": [{"modelRewrite": "food-llm-d"}]}]
    server.apply("inferenceobjectives", objective("legacy", -1))
    server.apply("llm-d-inferenceobjectives", objective("current", 4))
    server.apply("llm-d-inferencemodelrewrites", rewrite("r", food))
    async with discovery(api) as seen:  # llm-d's CRDs not installed: the legacy group's objects
        state = await seen.until(lambda s: s.endpoints)
        # llm-d's engine label, else the older one; llm-d's wins where both are set
        assert {e.name: e.engine for e in state.endpoints} == {
            "a-rank-0": "sglang",
            "b-rank-0": "sglang",
            "c-rank-0": "vllm",
        }
        assert state.objectives == {"legacy": -1} and state.rewrites == ()
    server.llm_d_kinds = {"InferenceObjective", "InferenceModelRewrite"}
    async with discovery(api) as seen:  # both installed: llm-d's group alone
        state = await seen.until(lambda s: s.endpoints)
        assert state.objectives == {"current": 4}
        assert [(r.model, r.targets) for r in state.rewrites] == [("food", (("food-llm-d", 1),))]
        server.apply("llm-d-inferenceobjectives", objective("later", 1))  # watched in llm-d's group
        state = await seen.until(lambda s: "later" in s.objectives)
        assert state.objectives == {"current": 4, "later": 1}
    server.llm_d_kinds = {"InferenceModelRewrite"}  # the choice is per kind, as llm-d's
    async with discovery(api) as seen:
        state = await seen.until(lambda s: s.endpoints)
        assert state.objectives == {"legacy": -1} and len(state.rewrites) == 1
