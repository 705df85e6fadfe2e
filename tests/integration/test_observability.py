"""Traces and scores through real Envoy: one trace holds Envoy's request, the EPP's decision and the model server's
phases (a real OTLP receiver: the collector's TraceService/Export over gRPC, harness/otlp.py); with
--emit-endpoint-scores, Envoy's access log shows every candidate's score from the EPP's dynamic metadata."""

import asyncio
import json
import time

import aiohttp
import pytest

from harness.envoy import EnvoyProcess
from harness.otlp import TraceCollector
from protocol.tracing import GenAI
from tests.conftest import free_ports

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (OpenTelemetry SDK) is not installed")

COMPLETION = {"model": "sim-llama-8b", "prompt": "trace me through the gateway", "max_tokens": 4}


async def wait_for(condition, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError("timed out")


async def test_one_trace_spans_envoy_the_epp_and_the_model_server(make_stack):
    (port,) = free_ports(1)
    collector = TraceCollector(f"127.0.0.1:{port}")
    await collector.start()
    endpoint = f"127.0.0.1:{port}"
    stack = None
    try:
        stack = await make_stack(
            servers=2,
            otlp_traces_endpoint=endpoint,
            epp_args=["--refresh-metrics-interval", "20ms", "--otlp-traces-endpoint", endpoint],
            extra_modelserver_args=["--otlp-traces-endpoint", endpoint],
        )
        async with aiohttp.ClientSession() as session:
            url = f"{stack.gateway_url}/v1/completions"
            async with session.post(url, json=COMPLETION, headers={"x-request-id": "traced-1"}) as r:
                assert r.status == 200
                await r.read()
            # a client's own trace is continued: the EPP's span is a child of the client's span
            client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
            headers = {"x-request-id": "traced-2", "traceparent": f"00-{client_trace}-{client_span}-01"}
            async with session.post(url, json=COMPLETION, headers=headers) as r:
                assert r.status == 200
                await r.read()

        def whole_trace():
            for spans in collector.traces().values():
                names = {(s.service, s.name) for s in spans}
                request = [s for s in spans if s.name == "gateway.request"]
                if (
                    request
                    and request[0].attributes.get("gateway.request_id") == "traced-1"
                    and {("epp", "gateway.scheduling"), ("modelserver", "llm_request")} <= names
                    and {("modelserver", phase) for phase in ("queue", "prefill", "decode")} <= names
                    and any(s.service == "gateway" for s in spans)
                ):
                    return spans
            return None

        try:
            spans = await wait_for(whole_trace)
        except AssertionError:
            raise AssertionError(
                f"no whole trace among {[(s.service, s.name, s.trace_id[:8], s.span_id[:8], s.parent_id[:8]) for s in collector.spans]}"
            ) from None
        by_id = {s.span_id: s for s in spans}
        request = next(s for s in spans if s.name == "gateway.request")
        # Envoy's trace: the EPP's request span continues the context Envoy's ext_proc call carried
        assert by_id[request.parent_id].service == "gateway"
        scheduling = next(s for s in spans if s.name == "gateway.scheduling")
        assert scheduling.parent_id == request.span_id
        attributes = scheduling.attributes
        assert (
            len(attributes["gateway.candidates"]) == 2
            and attributes["gateway.pick"] in attributes["gateway.candidates"]
        )
        assert len(attributes["gateway.scorer.queue-scorer.scores"]) == 2  # each scorer's scores, per candidate
        assert attributes["gateway.fallbacks"] == [
            c for c in attributes["gateway.candidates"] if c != attributes["gateway.pick"]
        ]
        server = next(s for s in spans if s.name == "llm_request")
        assert by_id[server.parent_id].service == "gateway"  # Envoy's upstream call to the pick
        assert server.attributes[GenAI.USAGE_COMPLETION_TOKENS] == 4
        assert server.attributes[GenAI.LATENCY_TIME_TO_FIRST_TOKEN] > 0
        phases = {s.name: s for s in spans if s.parent_id == server.span_id}
        assert (
            phases["queue"].end <= phases["prefill"].start + 1 and phases["prefill"].end <= phases["decode"].start + 1
        )
        assert request.start <= scheduling.start <= scheduling.end <= server.start

        def continued():
            return [s for s in collector.traces().get(client_trace, ()) if s.name == "gateway.request"]

        (request_2,) = await wait_for(continued)
        assert request_2.parent_id == client_span
    finally:
        if stack is not None:
            stack.stop()  # before the collector: the servers' last exports find it (else they retry to their timeout)
        await collector.stop()


SCORES_LOG = """
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {path}
              log_format:
                json_format:
                  request_id: "%REQ(X-REQUEST-ID)%"
                  pick: "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%"
                  scores: "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint-scores)%"
                  upstream: "%UPSTREAM_HOST%\""""


async def test_envoy_logs_the_endpoint_scores(make_stack, tmp_path):
    log = tmp_path / "access.log"
    stack = await make_stack(
        servers=3,
        access_log_percent=0,  # our file access log in its place
        epp_args=["--refresh-metrics-interval", "20ms", "--emit-endpoint-scores"],
    )
    # the stack's Envoy again, with a file access log that writes the EPP's dynamic metadata
    idle = "stream_idle_timeout: 600s"
    edited = (stack.workdir / "envoy.yaml").read_text().replace(idle, idle + SCORES_LOG.format(path=log), 1)
    stack.envoy.stop()
    stack.envoy = await EnvoyProcess.launch(edited, stack.config.admin_port, stack.workdir, "envoy-scores")
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.gateway_url}/v1/completions", json=COMPLETION, headers={"x-request-id": "scored"}) as r,
    ):
        assert r.status == 200
        await r.read()
    line = await wait_for(lambda: log.exists() and log.read_text().strip())
    record = json.loads(line.splitlines()[-1])
    assert record["request_id"] == "scored"
    scores = record["scores"]
    assert set(scores) == {u.removeprefix("http://") for u in stack.model_server_urls}  # every candidate
    pick = record["pick"].split(",")[0]
    assert record["upstream"] == pick and scores[pick] == max(scores.values())
