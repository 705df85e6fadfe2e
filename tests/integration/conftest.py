"""Real processes on loopback: sim model servers, the EPP and Envoy, started with free ports and always stopped."""

import re

import aiohttp
import pytest

from harness.local import LocalStack, StackConfig, ready_endpoints
from tests.conftest import free_port_block, free_ports

TESTING_CONFIG = """\
plugins:
- type: header-based-testing-filter
- type: queue-scorer
schedulingProfiles:
- name: testing
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: queue-scorer
"""
ADAPTERS = ("sql-lora", "chat-lora")
FAST_SIM = ["--sim-decode-base", "0.002", "--sim-prefill-time-per-token", "0.00001", "--sim-prefill-overhead", "0.001"]
# requests a server finished serving (stop or length); aborts are not served requests (a client gone, a
# request cancelled by the test), and counting them made routing checks depend on cancellation timing
_SUCCESS = re.compile(
    r'^vllm:request_success_total\{(?![^}]*finished_reason="abort")[^}]*\} ([0-9.e+]+)$', re.MULTILINE
)


def stack_config(tmp_path, servers=3, extra_modelserver_args=(), **overrides) -> StackConfig:
    base = free_port_block(servers)
    grpc, health, metrics, listener, admin = free_ports(5)
    lora_args = ["--enable-lora", "--max-loras", "1", "--lora-modules", *(f"{a}={tmp_path}/{a}" for a in ADAPTERS)]
    return StackConfig(
        **{
            "model_servers": servers,
            "base_port": base,
            "grpc_port": grpc,
            "grpc_health_port": health,
            "metrics_port": metrics,
            "listener_port": listener,
            "admin_port": admin,
            "workdir": tmp_path,
            "modelserver_args": [*FAST_SIM, *lora_args, "--disable-log-stats", *extra_modelserver_args],
            "epp_args": ["--refresh-metrics-interval", "20ms"],
            **overrides,
        }
    )


async def started(config: StackConfig) -> LocalStack:
    """The stack, once its EPP has read every server's metrics: a request sent at once sees the whole pool (a first
    request once saw one of two servers as a candidate, the other not read yet)."""
    stack = LocalStack(config)
    await stack.start(timeout=60)
    await ready_endpoints(stack, wait=30)
    return stack


@pytest.fixture
async def make_stack(tmp_path_factory):
    stacks = []

    async def make(**overrides) -> LocalStack:
        stack = await started(stack_config(tmp_path_factory.mktemp("stack"), **overrides))
        stacks.append(stack)
        return stack

    try:
        yield make
    finally:
        for stack in stacks:
            stack.stop()


async def served_counts(stack: LocalStack) -> list[int]:
    """Requests each model server finished serving (not aborted), from the servers' own metrics."""
    async with aiohttp.ClientSession() as session:
        counts = []
        for url in stack.model_server_urls:
            async with session.get(f"{url}/metrics") as r:
                counts.append(int(sum(float(v) for v in _SUCCESS.findall(await r.text()))))
        return counts
