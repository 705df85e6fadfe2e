"""Run the Model Server Protocol suite as pytest tests: one test per check.

    pytest -p harness.conformance.pytest_plugin --msp-url http://host:8000 [--msp-model M] [--msp-lora-adapter A]
           [--msp-engine vllm] [--msp-load-requests 32] [--msp-kv-events-endpoint tcp://host:5557 ...]
           --pyargs harness.conformance.test_msp

The KV event options are msp-conformance's with an --msp- prefix (--msp-kv-events-endpoint, --msp-kv-hash-seed, ...).

Without --msp-lora-adapter the adapters the server lists in /v1/models are used (a skipped LoRA check says so).

A SHOULD check that fails is reported as xfail, a skipped check as skipped.
"""

from __future__ import annotations

from harness.conformance.cli import kv_events_options


def pytest_addoption(parser):
    group = parser.getgroup("msp-conformance")
    group.addoption("--msp-url", help="base URL of the model server under test")
    group.addoption("--msp-model", default=None)
    group.addoption("--msp-lora-adapter", action="append", default=[])
    group.addoption("--msp-engine", default="vllm")
    group.addoption("--msp-load-requests", type=int, default=32, help="concurrent long requests of the load checks")
    kv_events_options(group.addoption, prefix="msp-")
