"""The gateway suite: the Gateway API Inference Extension's v1.6 Gateway-profile conformance tests, as far as one
gateway without Kubernetes can show them, and the data-path cases upstream misses, on loopback with a real Envoy,
our EPP in test mode and echo model servers.

The pool is three "pods" on their own loopback addresses (127.0.0.2-4), each listening on three ports: its
data-parallel ranks, as an InferencePool with three `targetPorts` makes them. Envoys are rendered from InferencePool
objects (`harness.envoy.GatewayPool`), one per pool of upstream's test setup that a single gateway can stand in for:
primary (failureMode omitted, so FailClose; appProtocol omitted, so HTTP/1.1; request and response bodies both
streamed through the EPP, FULL_DUPLEX_STREAMED), secondary (FailOpen, appProtocol http), h2c (appProtocol
kubernetes.io/h2c) and one whose EPP Service does not exist. The EPP runs the `header-based-testing-filter`, so the
test header `test-epp-endpoint-selection` designates the pods ("ip": any rank) or ranks ("ip:port") it may pick;
every echo answers with the address that served it, the protocol it arrived in, the headers it saw and a digest of
the body. The Envoy under test is our bootstrap template by default, or any bootstrap with the same placeholders
(`--envoy-template`); a Lua filter is added in front of ext_proc to turn a test header into the subset-hint metadata a
real gateway would set.

Upstream's other Gateway-profile tests check what a Gateway API implementation's controller writes (HTTPRoute and
InferencePool status conditions) or how it attaches HTTPRoutes to Gateways and pools; they are reported as skipped,
each with why (`NEEDS_A_GATEWAY_API_IMPLEMENTATION`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from harness.bench.ports import free_ports
from harness.conformance.echo import echo_app, serve_echo
from harness.conformance.framework import CheckFailed, Level, Skip, Suite, expect
from harness.envoy import H2C, HTTP, TEMPLATE, EnvoyProcess, GatewayPool, render_bootstrap
from harness.local import python_module
from protocol.extproc import (
    DESTINATION_ENDPOINT_HEADER,
    FALLBACK_ENDPOINT_HEADERS,
    HEADER_ALIASES,
    MODEL_NAME_REWRITE_HEADER,
)

UPSTREAM = "Gateway"  # GIE's conformance profile: its tests' ShortNames, as its suite reports them
OURS = "GatewayDataPath"
suite = Suite(OURS)
MUST, SHOULD = Level.MUST, Level.SHOULD
INFERENCE_EXTENSION_VERSION = "v1.6.0"  # the conformance tests these checks follow
GATEWAY_API_VERSION = "v1.6.1"  # the Gateway API release GIE v1.6.0's conformance suite builds on
SELECT = "test-epp-endpoint-selection"
SUBSET = "test-subset-hint"
READY_SECONDS = 60  # for the EPP to start and read the pods: seconds on a loaded 2-core machine
PODS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # the pool's pods, each its own loopback address
BROKEN_POD = "127.0.0.5"  # in the pool, scraped fine, resets every inference connection
TEST_CONFIG = """\
plugins:
- type: header-based-testing-filter
- type: max-score-picker
  parameters:
    maxNumOfEndpoints: 3
schedulingProfiles:
- name: conformance
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: max-score-picker
"""
SUBSET_LUA = f"""
function envoy_on_request(handle)
  local subset = handle:headers():get("{SUBSET}")
  if subset ~= nil then
    handle:streamInfo():dynamicMetadata():set("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
  end
end
"""
REPORT_WAIT_POLLS = 40  # every 50 ms: a gateway that reports through its access log has 2 s to flush it
REQUESTS_PER_CASE, CONCURRENCY = 30, 10  # upstream: 100 at 10 concurrently, against a cluster
STREAMED_EVENTS = 200
# Upstream's requests carry this body; a gateway that mishandles FULL_DUPLEX_STREAMED bodies fails every one.
BODY = json.dumps({"model": "conformance-fake-model", "prompt": "Write as if you were a critic: San Francisco"})


def inference_pool(name: str, ports: list[int], failure_mode: str | None = None, app_protocol: str | None = None):
    """An InferencePool (v1) as upstream's test setup writes them; None leaves a field to the CRD's default."""
    picker = {"name": f"{name}-epp", "port": {"number": 9002}}
    if failure_mode:
        picker["failureMode"] = failure_mode
    spec = {"selector": {"matchLabels": {"app": name}}, "targetPorts": [{"number": p} for p in ports]}
    if app_protocol:
        spec["appProtocol"] = app_protocol
    spec["endpointPickerRef"] = picker
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": spec,
    }


@dataclass
class Gateway:
    """Echo pods, our EPP in test mode, and one Envoy per pool (`urls`: pool name -> the Envoy's listener)."""

    envoy_template: Path = TEMPLATE
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gateway-conformance-")))
    rank_ports: list[int] = field(default_factory=list)  # every pod listens on each: its data-parallel ranks
    hits: list[str] = field(default_factory=list)  # every "ip:port" that served a request, in order
    urls: dict[str, str] = field(default_factory=dict)
    admin_urls: dict[str, str] = field(default_factory=dict)
    epp_metrics_url: str = ""
    session: aiohttp.ClientSession | None = None
    _runners: list = field(default_factory=list)
    _servers: list = field(default_factory=list)
    _epp: subprocess.Popen | None = None
    _envoys: list[EnvoyProcess] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        """Every rank of every pod, "ip:port"."""
        return [f"{pod}:{port}" for pod in PODS for port in self.rank_ports]

    @property
    def broken_endpoint(self) -> str:
        return f"{BROKEN_POD}:{self.rank_ports[0]}"

    async def start(self) -> None:
        ports = free_ports(3 + 3 + 2 * 4 + 1)
        self.rank_ports, ports = ports[:3], ports[3:]
        for broken, pods in ((False, PODS), (True, (BROKEN_POD,))):
            runner = web.AppRunner(echo_app(self.hits, broken), access_log=None)
            await runner.setup()
            self._runners.append(runner)
            for pod in pods:
                for port in self.rank_ports[:1] if broken else self.rank_ports:
                    self._servers.append(await serve_echo(runner, self.hits, pod, port))
        grpc_port, health_port, metrics_port, *envoy_ports, no_epp_port = ports
        pool = self.workdir / "pool.yaml"
        members = [{"name": f"pod-{i}", "address": pod, "ports": self.rank_ports} for i, pod in enumerate(PODS)]
        members.append({"name": "pod-broken", "address": BROKEN_POD, "port": self.rank_ports[0]})
        pool.write_text(yaml.safe_dump({"endpoints": members}))
        log = (self.workdir / "epp.log").open("ab")
        self._epp = subprocess.Popen(
            [
                *python_module("epp"),
                *("--pool-file", str(pool), "--bind-address", "127.0.0.1"),
                *("--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port)),
                *("--metrics-port", str(metrics_port), "--kv-events-port", "0"),
                *("--config-text", TEST_CONFIG, "--refresh-metrics-interval", "20ms"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.epp_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        pools = [  # (pool, its EPP's port, response bodies through the EPP)
            (inference_pool("primary", self.rank_ports), grpc_port, "FULL_DUPLEX_STREAMED"),
            (inference_pool("secondary", self.rank_ports, "FailOpen", HTTP), grpc_port, "NONE"),
            (inference_pool("h2c", self.rank_ports, app_protocol=H2C), grpc_port, "NONE"),
            (inference_pool("no-epp", self.rank_ports), no_epp_port, "NONE"),  # nothing listens there
        ]
        for (spec, epp_port, response_body_mode), listener, admin in zip(
            pools, envoy_ports[::2], envoy_ports[1::2], strict=True
        ):
            name = spec["metadata"]["name"]
            gateway = GatewayPool.from_inference_pool(spec)
            text = render_bootstrap(
                epp_host="127.0.0.1",
                epp_port=epp_port,
                fallback_endpoints=gateway.endpoints(PODS),
                listener_port=listener,
                admin_port=admin,
                fail_open=gateway.fail_open,
                app_protocol=gateway.app_protocol,
                response_body_mode=response_body_mode,
                template=self.envoy_template,
            )
            path = self.workdir / f"envoy-{name}.yaml"
            path.write_text(yaml.safe_dump(_with_subset_lua(yaml.safe_load(text)), sort_keys=False))
            envoy = EnvoyProcess(path, admin, self.workdir / f"envoy-{name}.log")
            envoy.start()
            self._envoys.append(envoy)
            self.urls[name] = f"http://127.0.0.1:{listener}"
            self.admin_urls[name] = f"http://127.0.0.1:{admin}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        await asyncio.gather(*(e.wait_ready() for e in self._envoys))
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:  # the EPP is up and has scraped the pods
            try:
                status, _ = await self.send(headers={SELECT: self.endpoints[0]})
                if status == 200:
                    return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError(f"the gateway routed no request within {READY_SECONDS} s; see {self.workdir}")

    async def send(
        self,
        body: bytes | str = BODY,
        headers: dict | None = None,
        pool: str = "primary",
        path: str = "/v1/completions",
    ) -> tuple[int, dict]:
        async with self.session.post(self.urls[pool] + path, data=body, headers=headers or {}) as r:
            payload = await r.read()
            return r.status, json.loads(payload) if r.status == 200 and payload.startswith(b"{") else {}

    async def ext_proc_stats(self, pool: str) -> dict[str, int]:
        """Envoy's ext_proc counters (http.gateway.ext_proc.*) of that pool's gateway."""
        async with self.session.get(self.admin_urls[pool] + "/stats", params={"filter": r"\.ext_proc\."}) as r:
            text = await r.text()
        stats = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.isdigit():
                stats[name.rsplit(".", 1)[1]] = int(value)
        return stats

    def stop_epp(self) -> None:
        if self._epp is not None and self._epp.poll() is None:
            self._epp.kill()
            self._epp.wait(10)

    async def stop(self) -> None:
        self.stop_epp()
        for envoy in self._envoys:
            envoy.stop()
        if self.session is not None:
            await self.session.close()
        for server in self._servers:
            server.close()
        for runner in self._runners:
            await runner.cleanup()


def _with_subset_lua(bootstrap: dict) -> dict:
    """Insert the test-only Lua filter (header -> subset-hint metadata) right before ext_proc."""
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                filters = network_filter["typed_config"].get("http_filters", [])
                names = [f["name"] for f in filters]
                if "envoy.filters.http.ext_proc" in names:
                    filters.insert(
                        names.index("envoy.filters.http.ext_proc"),
                        {
                            "name": "envoy.filters.http.lua",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                                "default_source_code": {"inline_string": SUBSET_LUA},
                            },
                        },
                    )
    return bootstrap


async def _served(g: Gateway, designated: str, count: int = REQUESTS_PER_CASE, pool: str = "primary") -> list[dict]:
    """The echoes of `count` requests designating `designated` (the test header's value), CONCURRENCY at a time."""
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one() -> dict:
        async with limit:
            status, echo = await g.send(headers={SELECT: designated}, pool=pool)
        expect(status == 200, f"{pool}: a request designating {designated} answered {status}")
        return echo

    return await asyncio.gather(*(one() for _ in range(count)))


def _pods(echoes: list[dict]) -> set[str]:
    return {e["served_by"].rpartition(":")[0] for e in echoes}


@suite.check(
    "GatewayFollowingEPPRouting",
    MUST,
    "requests go only to the pods the EPP returned: one, two or all three (upstream v1.6; the HTTPRoute and "
    "InferencePool Accepted conditions it waits for first need a Gateway API implementation)",
    UPSTREAM,
)
async def following_epp_routing(g: Gateway) -> None:
    for pod in PODS:  # each pod alone first, as upstream warms up
        served = _pods(await _served(g, pod, 3))
        expect(served == {pod}, f"designated {pod}, served by {served}")
    for designated in ([PODS[2]], list(PODS[:2]), list(PODS)):
        served = _pods(await _served(g, ",".join(designated)))
        expect(served <= set(designated), f"designated {designated}, served by {served}")


@suite.check(
    "GatewayFollowingEPPRoutingWithDataParallelism",
    MUST,
    "with three targetPorts (ranks) the gateway keeps to the pods and ports the EPP returned, and a pod designated "
    "by its IP alone is served on more than one of its ranks (the EPP picks among them)",
    UPSTREAM,
)
async def following_epp_routing_dp(g: Gateway) -> None:
    r0, r1, r2 = g.rank_ports
    cases = [  # pod -> the ports allowed for it (empty: any rank), as upstream's three cases
        {PODS[1]: ()},
        {PODS[0]: (), PODS[2]: (r1,)},
        {PODS[0]: (), PODS[1]: (r0, r2), PODS[2]: ()},
    ]
    for case in cases:
        designated = ",".join(
            pod if not ports else ",".join(f"{pod}:{p}" for p in ports) for pod, ports in case.items()
        )
        echoes = await _served(g, designated)
        for echo in echoes:
            pod, _, port = echo["served_by"].rpartition(":")
            allowed = case.get(pod)
            expect(allowed is not None, f"designated {designated}: served by {echo['served_by']}, another pod")
            expect(int(port) in (allowed or g.rank_ports), f"designated {designated}: served on rank port {port}")
    ranks = {e["served_by"] for e in await _served(g, PODS[1])}
    expect(len(ranks) > 1, f"{REQUESTS_PER_CASE} requests for pod {PODS[1]} were all served by one rank: {ranks}")


async def _served_reports(g: Gateway) -> float:
    async with g.session.get(g.epp_metrics_url) as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('inference_extension_served_endpoint_reports_total{result="pick"}')
    )


@suite.check(
    "GatewayDestinationEndpointServed",
    MUST,
    "the gateway tells the EPP which endpoint served each request, and it is the one picked (upstream's test EPP "
    "echoes it in x-conformance-test-served-endpoint; ours counts reports that match its pick)",
    UPSTREAM,
)
async def destination_endpoint_served(g: Gateway) -> None:
    before = await _served_reports(g)
    for pod in PODS:
        designated = f"{pod}:{g.rank_ports[0]}"
        (echo,) = await _served(g, designated, 1)
        expect(echo["served_by"] == designated, f"designated {designated}, served by {echo['served_by']}")
    # at the response headers, or in an access-log record within the gateway's flush interval (ours: 0.1 s)
    for _ in range(REPORT_WAIT_POLLS):
        if await _served_reports(g) >= before + len(PODS):
            return
        await asyncio.sleep(0.05)
    expect(False, "the EPP was not told, for each response, that its pick served it")


@suite.check(
    "InferencePoolAppProtocol",
    MUST,
    "the gateway speaks the pool's appProtocol to the model servers: HTTP/2 over cleartext for kubernetes.io/h2c, "
    "HTTP/1.1 for http and when appProtocol is omitted",
    UPSTREAM,
)
async def app_protocol(g: Gateway) -> None:
    for pool, protocol in (("h2c", "HTTP/2.0"), ("secondary", "HTTP/1.1"), ("primary", "HTTP/1.1")):
        for pod in PODS:
            designated = f"{pod}:{g.rank_ports[1]}"
            (echo,) = await _served(g, designated, 1, pool)
            expect(echo["served_by"] == designated, f"{pool}: designated {designated}, served by {echo['served_by']}")
            expect(
                echo["protocol"] == protocol, f"pool {pool}: the model server got {echo['protocol']}, not {protocol}"
            )
            expect(echo["sha256"] == hashlib.sha256(BODY.encode()).hexdigest(), f"pool {pool}: the body changed")


@suite.check(
    "InferencePoolInvalidEPPService",
    MUST,
    "a pool whose EPP Service does not exist answers 5xx and reaches no model server (the ResolvedRefs=False "
    "condition upstream also checks is a controller's)",
    UPSTREAM,
)
async def invalid_epp_service(g: Gateway) -> None:
    hits = len(g.hits)
    status, _ = await g.send(headers={SELECT: PODS[0]}, pool="no-epp")
    expect(status in (500, 501, 502, 503, 504), f"a pool without its EPP answered {status}")
    expect(len(g.hits) == hits, f"a pool without its EPP still sent the request to {g.hits[hits:]}")


@suite.check(
    "full-duplex-body-chunks",
    MUST,
    "in FULL_DUPLEX_STREAMED both ways, request and response body chunks go through the EPP, are echoed back as "
    "streamed mutations in order, and arrive whole (the v1.6 test EPP did not echo them: GIE #3028/#3033)",
)
async def full_duplex_body_chunks(g: Gateway) -> None:
    body = json.dumps({"model": "m", "prompt": "x" * (1 << 20)}).encode()

    async def request() -> None:
        status, echo = await g.send(body, headers={SELECT: g.endpoints[4]})
        expect(status == 200, f"a 1 MB body answered {status}")
        expect(echo["sha256"] == hashlib.sha256(body).hexdigest(), "the request body changed on its way through")

    async def response() -> None:
        events = await _stream(g, g.endpoints[5], "primary")
        expect(events == STREAMED_EVENTS, f"{events} of {STREAMED_EVENTS} streamed events came back")

    for what, exchange in (("request", request), ("response", response)):
        before = await g.ext_proc_stats("primary")
        await exchange()
        after = await g.ext_proc_stats("primary")
        sent, received = (after[k] - before.get(k, 0) for k in ("stream_msgs_sent", "stream_msgs_received"))
        # the headers and the body, in one chunk or more (Envoy hands on what it has read); each answered
        expect(sent >= 2 and received >= 2, f"{what}: {sent} ext_proc messages to the EPP, {received} back")
        expect(after["spurious_msgs_received"] == 0, f"{what}: answers out of order (spurious_msgs_received)")
        expect(after["streams_failed"] == before.get("streams_failed", 0), f"{what}: an ext_proc stream failed")


async def _stream(g: Gateway, designated: str, pool: str) -> int:
    """Stream STREAMED_EVENTS events from `designated` through `pool`'s gateway; how many came back in order."""
    async with g.session.post(
        g.urls[pool] + f"/v1/completions?stream={STREAMED_EVENTS}", data=BODY, headers={SELECT: designated}
    ) as r:
        expect(r.status == 200, f"streaming answered {r.status}")
        events = [line.decode().strip() for line in [line async for line in r.content] if line.strip()]
    expect(events and events[-1] == "data: [DONE]", "the stream was cut")
    indices = [json.loads(e[6:])["i"] for e in events[:-1]]
    expect(indices == list(range(len(indices))), "chunks were lost or reordered")
    return len(indices)


@suite.check("subset-hint", MUST, "the EPP picks only inside the gateway's subset hint; an impossible hint is 503")
async def subset_hint(g: Gateway) -> None:
    for endpoint in g.endpoints[2:5]:
        for _ in range(3):
            status, echo = await g.send(headers={SUBSET: endpoint})
            expect(
                status == 200 and echo["served_by"] == endpoint, f"subset {endpoint}: {status} {echo.get('served_by')}"
            )
    status, _ = await g.send(headers={SUBSET: "10.255.255.1:1"})
    expect(status == 503, f"a subset with no pool member answered {status}, not 503")


@suite.check("fallback-endpoints", SHOULD, "the gateway tries the EPP's fallback endpoints when the first fails")
async def fallback(g: Gateway) -> None:
    # The EPP returns both designated endpoints in random order (equal scores), the primary in the destination
    # header and all of them in the envoy.lb metadata; whenever the broken one comes first, only a gateway that
    # moves on to the fallback serves the request.
    live = g.endpoints[3]
    tried_broken = 0
    for _ in range(32):  # until the broken endpoint came first twice (each time with probability 1/2)
        before = len(g.hits)
        status, echo = await g.send(headers={SELECT: f"{g.broken_endpoint},{live}"})
        expect(status == 200, f"with the primary resetting connections the gateway answered {status}")
        expect(echo["served_by"] == live, f"served by {echo.get('served_by')}, not the fallback {live}")
        tried_broken += g.hits[before:].count(g.broken_endpoint)
        if tried_broken >= 2:
            return
    raise CheckFailed(f"the broken endpoint was tried {tried_broken} times in 32 requests: the EPP never put it first")


@suite.check("spoofed-header-epp-up", MUST, "a client-supplied destination header never steers routing")
async def spoofed_up(g: Gateway) -> None:
    target, spoof = g.endpoints[3], g.endpoints[0]
    for _ in range(4):
        status, echo = await g.send(headers={SELECT: target, DESTINATION_ENDPOINT_HEADER: spoof})
        expect(status == 200 and echo["served_by"] == target, f"spoofed header won: served by {echo.get('served_by')}")
        expect(echo["headers"].get(DESTINATION_ENDPOINT_HEADER) == target, "the backend saw the spoofed header")


@suite.check(
    "private-headers-stripped", MUST, "clients cannot set the gateway's private headers (model rewrite, fallbacks)"
)
async def private_headers(g: Gateway) -> None:
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    rewrites = (MODEL_NAME_REWRITE_HEADER, HEADER_ALIASES[MODEL_NAME_REWRITE_HEADER])  # llm-d's name and the older one
    spoofed = dict.fromkeys((*rewrites, *FALLBACK_ENDPOINT_HEADERS), "127.0.0.1:1") | dict.fromkeys(
        rewrites, "not-served"
    )
    status, echo = await g.send(body, headers={SELECT: g.endpoints[1], **spoofed})
    expect(status == 200, f"answered {status}")
    expect(echo["sha256"] == hashlib.sha256(body).hexdigest(), "the client's model-name rewrite changed the body")
    leaked = sorted(h for h in spoofed if echo["headers"].get(h) == spoofed[h])
    expect(not leaked, f"the client's copies of {leaked} reached the backend")


@suite.check("large-body", MUST, "a 1 MB request body arrives intact at the picked endpoint, FailClose and FailOpen")
async def large_body(g: Gateway) -> None:
    body = json.dumps({"model": "m", "prompt": "x" * 1_048_576}).encode()
    for pool in ("primary", "secondary"):  # streamed to the EPP; buffered (FailOpen)
        status, echo = await g.send(body, headers={SELECT: g.endpoints[2]}, pool=pool)
        expect(status == 200, f"{pool}: 1 MB body answered {status}")
        expect(
            echo["body_bytes"] == len(body) and echo["sha256"] == hashlib.sha256(body).hexdigest(),
            f"{pool}: the body changed",
        )
        expect(echo["served_by"] == g.endpoints[2], f"{pool}: the 1 MB request went elsewhere")


@suite.check("streamed-response", MUST, "a streamed (SSE) response passes through whole and in order")
async def streamed(g: Gateway) -> None:
    for pool in ("primary", "secondary", "h2c"):  # response bodies through the EPP, and not
        events = await _stream(g, g.endpoints[1], pool)
        expect(events == STREAMED_EVENTS, f"{pool}: {events} of {STREAMED_EVENTS} streamed events came back")


@suite.check(
    "EppUnAvailableFailOpen",
    MUST,
    "a FailOpen pool routes to the designated pod while its EPP is up, and still answers from the pool once the "
    "EPP is gone",
    UPSTREAM,
)
async def epp_unavailable_fail_open(g: Gateway) -> None:
    served = _pods(await _served(g, PODS[0], 3, "secondary"))
    expect(served == {PODS[0]}, f"with the EPP up, designated {PODS[0]}, served by {served}")
    g.stop_epp()
    seen = set()
    for _ in range(6):
        status, echo = await g.send(headers={SELECT: PODS[0]}, pool="secondary")
        expect(status == 200, f"FailOpen with the EPP down answered {status}")
        expect(echo["served_by"] in g.endpoints, f"served by {echo['served_by']}, outside the pool")
        seen.add(echo["served_by"])
    expect(len(seen) > 1, "FailOpen did not balance over the pool")


@suite.check("fail-close", MUST, "FailClose: with the pool's EPP down, requests get a clean 5xx and reach no server")
async def fail_close(g: Gateway) -> None:
    g.stop_epp()
    hits = len(g.hits)
    for pool in ("primary", "h2c"):
        status, _ = await g.send(headers={DESTINATION_ENDPOINT_HEADER: g.endpoints[0]}, pool=pool)
        expect(500 <= status < 600, f"{pool}: FailClose answered {status}")
    expect(len(g.hits) == hits, f"FailClose still sent requests to {g.hits[hits:]}")


@suite.check("spoofed-header-epp-down", MUST, "with the EPP down, a client destination header still goes nowhere")
async def spoofed_down(g: Gateway) -> None:
    g.stop_epp()
    for _ in range(8):
        status, echo = await g.send(pool="secondary", headers={DESTINATION_ENDPOINT_HEADER: "127.0.0.1:1"})
        expect(status == 200, f"answered {status}: the spoofed header steered the request")
        expect(DESTINATION_ENDPOINT_HEADER not in echo["headers"], "the spoofed header leaked to the backend")


# GIE v1.6's other Gateway-profile tests: what each checks that needs more than one gateway on one host.
NEEDS_A_GATEWAY_API_IMPLEMENTATION = {
    "GatewayWeightedAcrossTwoInferencePools": "splits an HTTPRoute's traffic across two InferencePools by its "
    "backendRef weights: route rules and two pools behind one Gateway",
    "HTTPRouteInvalidInferencePoolRef": "the HTTPRoute's Accepted=True / ResolvedRefs=False (BackendNotFound) "
    "conditions for a pool that does not exist: written by a Gateway API controller",
    "HTTPRouteMultipleGatewaysDifferentPools": "two Gateways, each with an HTTPRoute to its own pool, accepted and "
    "routed: route attachment by a controller in a cluster",
    "HTTPRouteMultipleRulesDifferentPools": "one HTTPRoute whose path rules go to two different pools",
    "InferencePoolAccepted": "the pool's Accepted condition per parent Gateway: written by a controller",
    "InferencePoolHTTPRoutePortValidation": "how a controller treats an HTTPRoute backendRef port to an InferencePool "
    "(unspecified, matching, not matching), with its status conditions",
    "InferencePoolMissingEPPRef": "a pool without endpointPickerRef: the Accepted condition (or "
    "EndpointPickerRefMissing) a controller writes",
    "InferencePoolResolvedRefsCondition": "the pool's parent statuses as HTTPRoutes on two Gateways are deleted, and "
    "the 404s after: controller status and route removal in a cluster",
}


def _needs_a_cluster(reason: str):
    async def skipped(g: Gateway) -> None:
        raise Skip(f"needs a Gateway API implementation and a cluster: {reason}")

    return skipped


for _name, _reason in NEEDS_A_GATEWAY_API_IMPLEMENTATION.items():
    suite.check(_name, MUST, _reason, UPSTREAM)(_needs_a_cluster(_reason))
