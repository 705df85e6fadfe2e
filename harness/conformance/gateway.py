"""The gateway data-path suite: the EPP-facing tests of GIE's gateway conformance that need no Kubernetes, plus the
cases upstream misses, on loopback with a real Envoy, our EPP in test mode and echo backends.

The EPP runs the `header-based-testing-filter`, so a request header designates the endpoints it may pick; every
echo backend answers with the address that served it, the headers it saw and a digest of the body, so each check
sees exactly where a request went and what arrived. The Envoy under test is our bootstrap template by default, or
any bootstrap with the same placeholders (`--envoy-template`); a Lua filter is added in front of ext_proc to turn a
test header into the subset-hint metadata a real gateway would set.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from harness.bench.ports import free_ports
from harness.conformance.framework import CheckFailed, Level, Suite, expect
from harness.envoy import TEMPLATE, EnvoyProcess, render_bootstrap
from protocol.extproc import (
    DESTINATION_ENDPOINT_HEADER,
    FALLBACK_ENDPOINT_HEADERS,
    HEADER_ALIASES,
    MODEL_NAME_REWRITE_HEADER,
)

suite = Suite("GatewayDataPath")
MUST, SHOULD = Level.MUST, Level.SHOULD
SELECT = "test-epp-endpoint-selection"
SUBSET = "test-subset-hint"
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
HITS = web.AppKey("hits", list)  # every address an echo backend served from, in order
METRICS_PAGE = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"


async def _echo(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    served = f"127.0.0.1:{request.transport.get_extra_info('sockname')[1]}"
    request.app[HITS].append(served)
    info = {
        "served_by": served,
        "headers": dict(request.headers),
        "body_bytes": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
    }
    if request.query.get("stream"):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(int(request.query["stream"])):
            await response.write(f"data: {json.dumps({'i': i, 'served_by': served})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response
    return web.json_response(info)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=METRICS_PAGE)


async def _reset(request: web.Request) -> web.Response:
    """A model server that is down for inference but still scraped as healthy: the EPP keeps picking it, so only
    the gateway's fallback can save the request."""
    request.app[HITS].append(f"127.0.0.1:{request.transport.get_extra_info('sockname')[1]}")
    request.transport.abort()
    raise web.HTTPServiceUnavailable()


@dataclass
class Gateway:
    """Echo backends, our EPP in test mode, and two Envoys in front of them (FailClose and FailOpen)."""

    envoy_template: Path = TEMPLATE
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gateway-conformance-")))
    endpoints: list[str] = field(default_factory=list)  # "127.0.0.1:port"; the first two are ranks of one "pod"
    broken_endpoint: str = ""  # in the pool, scraped fine, resets every inference connection
    hits: list[str] = field(default_factory=list)
    gateway_url: str = ""
    fail_open_url: str = ""
    epp_metrics_url: str = ""
    session: aiohttp.ClientSession | None = None
    _runners: list = field(default_factory=list)
    _epp: subprocess.Popen | None = None
    _envoys: list[EnvoyProcess] = field(default_factory=list)

    async def start(self, backends: int = 4) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/metrics", _metrics)
        app.router.add_route("*", "/{tail:.*}", _echo)
        app[HITS] = self.hits
        broken = web.Application()
        broken.router.add_get("/metrics", _metrics)
        broken.router.add_route("*", "/{tail:.*}", _reset)
        broken[HITS] = self.hits
        ports = free_ports(backends + 9)
        for application, listen in ((app, ports[:backends]), (broken, ports[backends : backends + 1])):
            runner = web.AppRunner(application, access_log=None)
            await runner.setup()
            self._runners.append(runner)
            for port in listen:
                await web.TCPSite(runner, "127.0.0.1", port).start()
        self.endpoints = [f"127.0.0.1:{p}" for p in ports[:backends]]
        self.broken_endpoint = f"127.0.0.1:{ports[backends]}"
        grpc_port, health_port, metrics_port, close_port, close_admin, open_port, open_admin, _ = ports[backends + 1 :]
        pool = self.workdir / "pool.yaml"
        members = [
            {"name": f"pod-{0 if i < 2 else i - 1}-rank-{i if i < 2 else 0}", "address": "127.0.0.1", "port": p}
            for i, p in enumerate(ports[: backends + 1])
        ]
        members[-1]["name"] = "pod-broken"
        pool.write_text(yaml.safe_dump({"endpoints": members}))
        log = (self.workdir / "epp.log").open("ab")
        self._epp = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "epp",
                "--pool-file",
                str(pool),
                "--bind-address",
                "127.0.0.1",
                "--grpc-port",
                str(grpc_port),
                "--grpc-health-port",
                str(health_port),
                "--metrics-port",
                str(metrics_port),
                "--kv-events-port",
                "0",
                "--config-text",
                TEST_CONFIG,
                "--refresh-metrics-interval",
                "20ms",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.epp_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        for fail_open, listener, admin in ((False, close_port, close_admin), (True, open_port, open_admin)):
            text = render_bootstrap(
                epp_host="127.0.0.1",
                epp_port=grpc_port,
                fallback_endpoints=self.endpoints,
                listener_port=listener,
                admin_port=admin,
                fail_open=fail_open,
                template=self.envoy_template,
            )
            path = self.workdir / f"envoy-{'open' if fail_open else 'close'}.yaml"
            path.write_text(yaml.safe_dump(_with_subset_lua(yaml.safe_load(text)), sort_keys=False))
            envoy = EnvoyProcess(path, admin, self.workdir / f"envoy-{'open' if fail_open else 'close'}.log")
            envoy.start()
            self._envoys.append(envoy)
        self.gateway_url = f"http://127.0.0.1:{close_port}"
        self.fail_open_url = f"http://127.0.0.1:{open_port}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        await asyncio.gather(*(e.wait_ready() for e in self._envoys))
        for _ in range(200):  # the EPP is up and has scraped the backends
            try:
                status, _ = await self.send(headers={SELECT: self.endpoints[0]})
                if status == 200:
                    return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError(f"the gateway never routed a request; see {self.workdir}")

    async def send(
        self,
        body: bytes = b'{"model": "m", "prompt": "hi"}',
        headers: dict | None = None,
        url: str | None = None,
        path: str = "/v1/completions",
    ) -> tuple[int, dict]:
        async with self.session.post((url or self.gateway_url) + path, data=body, headers=headers or {}) as r:
            payload = await r.read()
            return r.status, json.loads(payload) if r.status == 200 and payload.startswith(b"{") else {}

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


async def _served(g: Gateway, designated: list[str], count: int = 6, url: str | None = None) -> set[str]:
    seen = set()
    for _ in range(count):
        status, echo = await g.send(headers={SELECT: ",".join(designated)}, url=url)
        expect(status == 200, f"request designating {designated} answered {status}")
        seen.add(echo["served_by"])
    return seen


@suite.check(
    "follows-pick-one",
    MUST,
    "a request goes to the one endpoint the EPP picked (FailClose and FailOpen "
    "gateways alike, so both are wired to the pool's EPP that the fail-* checks stop)",
)
async def follows_one(g: Gateway) -> None:
    for url in (g.gateway_url, g.fail_open_url):
        for endpoint in g.endpoints:
            served = await _served(g, [endpoint], 3, url)
            expect(served == {endpoint}, f"{url}: designated {endpoint}, served by {served}")


@suite.check("follows-pick-two-and-three", MUST, "with 2 or 3 designated endpoints, requests stay among them")
async def follows_many(g: Gateway) -> None:
    for designated in (g.endpoints[1:3], g.endpoints[:3]):
        served = await _served(g, designated, 12)
        expect(served <= set(designated), f"designated {designated}, served by {served}")


@suite.check("data-parallel-ranks", MUST, "several ports of one pod (data-parallel ranks) are routed per port")
async def ranks(g: Gateway) -> None:
    rank0, rank1 = g.endpoints[0], g.endpoints[1]  # one "pod", two ports
    expect(await _served(g, [rank1], 4) == {rank1}, "rank 1 was not served by its own port")
    expect(await _served(g, [rank0], 4) == {rank0}, "rank 0 was not served by its own port")


@suite.check("served-endpoint-reported", SHOULD, "the gateway reports the endpoint that served a request to the EPP")
async def served_reported(g: Gateway) -> None:
    async def reports() -> float:
        async with g.session.get(g.epp_metrics_url) as r:
            text = await r.text()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('inference_extension_served_endpoint_reports_total{result="pick"}')
        )

    before = await reports()
    await _served(g, [g.endpoints[2]], 3)
    # at the response headers, or in an access-log record within the gateway's flush interval (ours: 0.1 s)
    for _ in range(REPORT_WAIT_POLLS):
        if await reports() >= before + 3:
            return
        await asyncio.sleep(0.05)
    expect(False, "the EPP did not receive the served endpoint for each response")


@suite.check("subset-hint", MUST, "the EPP picks only inside the gateway's subset hint; an impossible hint is 503")
async def subset_hint(g: Gateway) -> None:
    for endpoint in g.endpoints[2:]:
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


@suite.check("large-body", MUST, "a 1 MB request body arrives intact at the picked endpoint")
async def large_body(g: Gateway) -> None:
    body = json.dumps({"model": "m", "prompt": "x" * 1_048_576}).encode()
    status, echo = await g.send(body, headers={SELECT: g.endpoints[2]})
    expect(status == 200, f"1 MB body answered {status}")
    expect(echo["body_bytes"] == len(body) and echo["sha256"] == hashlib.sha256(body).hexdigest(), "the body changed")
    expect(echo["served_by"] == g.endpoints[2], "the 1 MB request went elsewhere")


@suite.check("streamed-response", MUST, "a streamed (SSE) response passes through whole and in order")
async def streamed(g: Gateway) -> None:
    async with g.session.post(
        g.gateway_url + "/v1/completions?stream=200",
        data=b'{"model": "m", "prompt": "s"}',
        headers={SELECT: g.endpoints[1]},
    ) as r:
        expect(r.status == 200, f"streaming answered {r.status}")
        events = [line.decode().strip() for line in [line async for line in r.content] if line.strip()]
    expect(events[-1] == "data: [DONE]", "the stream was cut")
    indices = [json.loads(e[6:])["i"] for e in events[:-1]]
    expect(indices == list(range(200)), "chunks were lost or reordered")


@suite.check("fail-close", MUST, "FailClose: with the pool's EPP down, requests get a clean 5xx")
async def fail_close(g: Gateway) -> None:
    g.stop_epp()
    hits = len(g.hits)
    status, _ = await g.send(headers={DESTINATION_ENDPOINT_HEADER: g.endpoints[0]})
    expect(500 <= status < 600, f"FailClose answered {status}")
    expect(len(g.hits) == hits, f"FailClose still sent the request to {g.hits[hits:]}")


@suite.check("fail-open", MUST, "FailOpen: with the pool's EPP down, requests still succeed")
async def fail_open(g: Gateway) -> None:
    g.stop_epp()
    for _ in range(4):
        status, echo = await g.send(url=g.fail_open_url)
        expect(status == 200, f"FailOpen answered {status}")
        expect(echo["served_by"] in g.endpoints, "served outside the pool")


@suite.check("spoofed-header-epp-down", MUST, "with the EPP down, a client destination header still goes nowhere")
async def spoofed_down(g: Gateway) -> None:
    g.stop_epp()
    seen = set()
    for _ in range(8):
        status, echo = await g.send(url=g.fail_open_url, headers={DESTINATION_ENDPOINT_HEADER: "127.0.0.1:1"})
        expect(status == 200, f"answered {status}: the spoofed header steered the request")
        expect(DESTINATION_ENDPOINT_HEADER not in echo["headers"], "the spoofed header leaked to the backend")
        seen.add(echo["served_by"])
    expect(len(seen) > 1, "FailOpen did not balance over the pool")
