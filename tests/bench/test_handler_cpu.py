"""`epp-bench handler-cpu`: Envoy's frames for each request drive the whole request path in process."""

import math
import os
import shutil
import sys

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from epp.predictor import predictor
from epp.scheduling.prompt_tokens import PromptTokenizer
from harness.bench import handler_cpu


def test_every_request_is_routed_answered_and_closed():
    result = handler_cpu.measure(requests=64, batch=1, rounds=2)
    assert result.requests == 64
    assert result.routed == 2 * 64  # every request of both rounds reached an endpoint
    assert result.open_streams == 0  # each stream ended at its RST_STREAM (the director heard the end)
    # one at a time, the one answer Envoy waits for in its own write (no response headers: the access log has them)
    assert result.writes_per_request == 1
    assert all(us > 0 for us in result.rounds)
    assert result.learnt == 0  # whole responses: their time to the first byte is not a TTFT
    assert "1.00 writes per request" in result.markdown()


def test_a_read_of_many_requests_is_answered_in_one_write():
    result = handler_cpu.measure(requests=64, batch=16, rounds=1)
    assert result.routed == 64 and result.open_streams == 0
    assert result.writes_per_request == 1 / 16  # a write per read: the 16 routings


@pytest.mark.slow  # a CPU comparison in process: 4 workers on 2 cores can invert it (make bench runs it)
def test_caches_evicted_before_each_read_make_the_same_path_cost_more():
    warm = handler_cpu.measure(requests=128, batch=4, rounds=3)
    cold = handler_cpu.measure(requests=128, batch=4, rounds=3, evict_mb=32)
    assert cold.routed == warm.routed and cold.open_streams == 0  # the same work
    assert cold.us_per_request > warm.us_per_request  # the writes are not timed; what they evicted is fetched again
    assert "4 per read after 32 MiB written" in cold.markdown()


def test_streamed_requests_access_log_records_teach_the_latency_predictor(monkeypatch):
    # the predictor learns from every record up to ~200 a second (a rate over LEARN_RATE_WINDOW): these 512 arrive
    # within it only on an idle machine, so the window is made endless to count every record matched
    monkeypatch.setattr(predictor, "LEARN_RATE_WINDOW", math.inf)
    result = handler_cpu.measure(requests=256, batch=16, rounds=2, streamed=True)
    assert result.routed == 2 * 256 and result.open_streams == 0
    assert result.learnt == 2 * 256  # every request's record, matched to its request by id
    assert "256 streamed requests" in result.markdown() and "learnt from 512 access-log records" in result.markdown()


def test_another_profile_is_measured_with_its_own_plugins(tmp_path, monkeypatch):
    """`--config-file`: the handler path with another EndpointPickerConfig (here one scorer), the rest the same."""
    from harness.bench import cli

    config = tmp_path / "queue-only.yaml"
    config.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- type: queue-scorer\n- type: max-score-picker\nschedulingProfiles:\n- name: default\n  plugins:\n"
        "  - pluginRef: queue-scorer\n  - pluginRef: max-score-picker\n"
    )
    made = []
    real = handler_cpu._director

    def recording(text, kv_events, tracing):
        made.append(real(text, kv_events, tracing))
        return made[-1]

    monkeypatch.setattr(handler_cpu, "_director", recording)
    cli.main(["handler-cpu", "--requests", "32", "--rounds", "1", "--config-file", str(config)])
    plugins = made[0].metrics.plugin_duration.children
    assert {key[2] for key in plugins} == {"queue-scorer", "max-score-picker"}
    assert sum(e.routed_total for e in made[0].datastore.endpoints) == 32


@pytest.mark.parametrize(
    ("tracing", "names"), [("on", {"gateway.request", "gateway.scheduling"}), ("bare", {"gateway.request"})]
)
def test_traced_requests_have_their_spans_encoded_as_the_exporter_sends_them(monkeypatch, tracing, names):
    """`--tracing on`: every request's spans, each batch encoded into an Export request as the exporter's thread
    does; `bare` (tracing's floor): one span a request, without attributes."""
    exported = []
    real = handler_cpu.request_tracing.export_request

    def parsed(spans, service_name):
        encoded = real(spans, service_name)
        exported.append(trace_service_pb2.ExportTraceServiceRequest.FromString(encoded))
        return encoded

    monkeypatch.setattr(handler_cpu.request_tracing, "export_request", parsed)
    batch = handler_cpu.request_tracing.EXPORT_BATCH_REQUESTS
    result = handler_cpu.measure(requests=batch, batch=16, rounds=1, tracing=tracing)
    assert result.routed == batch and f"tracing {tracing}" in result.markdown()
    ((resource_spans,),) = [request.resource_spans for request in exported]
    spans = resource_spans.scope_spans[0].spans
    assert {s.name for s in spans} == names and len(spans) == batch * len(names)
    assert all(bool(s.attributes) == (tracing == "on") for s in spans)


def test_with_kv_events_the_precise_scorer_tokenizes_every_prompt_as_live(monkeypatch):
    """`--kv-events`: the endpoints publish KV events, so precise-prefix-cache-scorer reads each prompt's tokens (as
    in a live EPP whose servers publish; without them it abstains untouched)."""
    tokenized = []
    real = PromptTokenizer.pieces

    def counting(self, prompt):
        tokenized.append(prompt)
        return real(self, prompt)

    monkeypatch.setattr(PromptTokenizer, "pieces", counting)
    quiet = handler_cpu.measure(requests=32, batch=16, rounds=1)
    assert quiet.routed == 32 and not tokenized and "KV events" not in quiet.markdown()
    publishing = handler_cpu.measure(requests=32, batch=16, rounds=2, kv_events=True)
    assert publishing.routed == 64 and publishing.open_streams == 0
    assert tokenized == [handler_cpu.REQUEST["prompt"]] * 64  # every request's prompt, once
    assert "endpoints publishing KV events" in publishing.markdown()


# A stand-in for valgrind: runs the command natively and reports as callgrind does, with counts that the script's
# requests decide (a delivered request 3,000 instructions, building one 1,000, start-up a million; each further
# event a tenth of the one before), so that the figures per request the harness derives are known exactly.
FAKE_VALGRIND = """\
import re, subprocess, sys
args = sys.argv[1:]
command = args[next(i for i, a in enumerate(args) if not a.startswith("--")):]
subprocess.run(command, check=True)
count, deliver = re.search(r"measure\\((\\d+), .* (True|False), '\\w+'\\)", command[-1]).groups()
ir = 1_000_000 + int(count) * (3_000 if deliver == "True" else 1_000)
events = ["Ir", "ILmr", "DLmr", "DLmw"] if "--cache-sim=yes" in args else ["Ir"]
print("==1== Events    : " + " ".join(events), file=sys.stderr)
print("==1== Collected : " + " ".join(str(ir // 10**i) for i in range(len(events))), file=sys.stderr)
"""


def test_instructions_per_request_take_off_the_warm_up_and_the_harness_s_own_work(tmp_path, monkeypatch):
    """What `instructions` makes of callgrind's counts, with each of its four scripts run for real (natively); the
    real valgrind runs in the `slow` test below (`make bench`)."""
    valgrind = tmp_path / "valgrind"
    valgrind.write_text(f"#!{sys.executable}\n{FAKE_VALGRIND}")
    valgrind.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    per_request = handler_cpu.instructions(requests=16, batch=1, evict_mb=2)  # the cache simulation's events too
    assert per_request == {"Ir": 2_000, "ILmr": 200, "DLmr": 20, "DLmw": 2}


@pytest.mark.slow  # four processes under callgrind's cache simulation: about four minutes of one core's time
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.timeout(600)
def test_instructions_per_request_are_counted_under_callgrind():
    # one request a read, its code and data evicted before each (2 MiB written, the simulated last level 1 MiB)
    per_request = handler_cpu.instructions(requests=16, batch=1, evict_mb=2)
    assert per_request.keys() == {"Ir", "ILmr", "DLmr", "DLmw"}
    # ~0.33 M instructions on x86-64 with the default profile, the harness's own building of the requests taken off;
    # every line it touches comes from beyond the cache: ~6-7 thousand lines of code a request
    assert 100_000 < per_request["Ir"] < 2_000_000
    assert 1_000 < per_request["ILmr"] < per_request["Ir"] / 10, per_request
