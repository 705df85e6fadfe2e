"""Our model server publishing KV events, started for a test (sim or torch backend), and the whole Model Server
Protocol suite run against it from its console entry point, as a user runs it."""

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.envoy import terminate
from tests.conftest import free_ports

FAST = ["--sim-decode-base", "0.002", "--sim-prefill-time-per-token", "0.00001", "--sim-prefill-overhead", "0.001"]
SERVER = ["--disable-log-stats", "--enable-lora", "--max-loras", "1", "--max-num-seqs", "8"]
HASH_SEED = "7"  # the servers' PYTHONHASHSEED, which the suite needs to check block hashes exactly


@dataclass
class Served:
    url: str
    kv_options: list[str]  # msp-conformance's options for the server's KV events

    def plugin_options(self) -> list[str]:
        return [option.replace("--", "--msp-", 1) if option.startswith("--") else option for option in self.kv_options]


@contextlib.contextmanager
def model_server(*args: str):
    """Our server publishing vLLM KV events: it connects to the suite's bound SUB socket (as llm-d points vLLM at
    its EPP) and binds its replay socket."""
    port, events, replay = free_ports(3)
    kv_config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{events}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "modelserver",
            "--port",
            str(port),
            *SERVER,
            "--kv-events-config",
            json.dumps(kv_config),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONHASHSEED": HASH_SEED},
    )
    try:
        lines = []
        while not (line := process.stdout.readline().decode()).startswith("ready on"):
            assert line, "the server exited: " + "".join(lines)
            lines.append(line)
        kv_options = ["--kv-events-bind", kv_config["endpoint"], "--kv-replay-endpoint", kv_config["replay_endpoint"]]
        yield Served(f"http://127.0.0.1:{port}", [*kv_options, "--kv-hash-seed", HASH_SEED])
    finally:
        terminate(process, timeout=30)  # SIGTERM, then SIGKILL: torch's exit is slow on a loaded machine


def run_the_whole_suite(served: Served, report: Path) -> None:
    """Every check (`python -m harness.conformance`, the adapters sql and chat), each passed, and its report."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.conformance",
            "--url",
            served.url,
            *served.kv_options,
            "--lora-adapter",
            "sql",
            "--lora-adapter",
            "chat",
            "--load-requests",
            "8",
            "--report",
            str(report),
            "--project",
            "llm-routing-reference",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert len(lines) == 26 and all(line.startswith("PASS") for line in lines), result.stdout
    parsed = yaml.safe_load(report.read_text())
    assert parsed["kind"] == "ConformanceReport" and parsed["GatewayAPIInferenceExtensionVersion"].startswith("v")
    assert parsed["implementation"]["project"] == "llm-routing-reference"
    profile = parsed["profiles"][0]
    assert profile["name"] == "ModelServerProtocol"
    assert profile["core"] == {"result": "success", "statistics": {"Failed": 0, "Passed": 14, "Skipped": 0}}
    assert profile["extended"]["statistics"]["Passed"] == 12
