"""The Model Server Protocol holds in torch mode exactly as in sim mode: the same conformance checks, against
`modelserver --backend torch` serving the tiny model and its adapters."""

import subprocess
import sys

import pytest

from modelserver.torch.tiny import make_tiny_model
from tests.conftest import free_ports

pytestmark = pytest.mark.torch
CHECKS = ["completions", "completions-streaming", "chat-completions", "chat-completions-streaming", "error-shape",
          "unknown-model", "metrics-gauges", "metrics-under-load", "cache-config-info", "lora-served",
          "lora-info-metric", "lora-running-adapters", "lora-waiting-adapters", "lora-names-clean", "prefix-cache"]  # fmt: skip


def test_msp_conformance_in_torch_mode(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", lora_names=["sql", "chat"])
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "modelserver", "--backend", "torch", "--model", str(model), "--port", str(port),
         "--served-model-name", "tiny", "--enable-lora", "--max-loras", "1", "--max-num-seqs", "4",
         "--lora-modules", f"sql={model}/loras/sql", f"chat={model}/loras/chat", "--disable-log-stats"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        while not (line := server.stdout.readline().decode()).startswith("ready on"):
            assert line, "the torch server exited before it was ready"
        result = subprocess.run(
            [sys.executable, "-m", "protocol.conformance", "--url", f"http://127.0.0.1:{port}", "--lora-adapter", "sql",
             "--lora-adapter", "chat", "--load-requests", "4", "--only", *CHECKS],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{len(CHECKS)} passed, 0 failed" in result.stdout, result.stdout
    finally:
        server.terminate()
        server.wait(10)
