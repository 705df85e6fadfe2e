"""The Model Server Protocol holds in torch mode exactly as in sim mode: the same conformance checks, against
`modelserver --backend torch` serving the tiny model and its adapters."""

import subprocess
import sys

import pytest

from modelserver.torch.tiny import make_tiny_model
from tests.conftest import free_ports

pytestmark = pytest.mark.torch
CHECKS = [
    "completions",
    "completions-streaming",
    "chat-completions",
    "chat-completions-streaming",
    "error-shape",
    "unknown-model",
    "metrics-gauges",
    "metrics-under-load",
    "cache-config-info",
    "lora-served",
    "lora-info-metric",
    "lora-running-adapters",
    "lora-waiting-adapters",
    "lora-names-clean",
    "prefix-cache",
]


def test_msp_conformance_in_torch_mode(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", lora_names=["sql", "chat"])
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "modelserver",
            "--backend",
            "torch",
            "--model",
            str(model),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-num-seqs",
            "4",
            "--lora-modules",
            f"sql={model}/loras/sql",
            f"chat={model}/loras/chat",
            "--disable-log-stats",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        while not (line := server.stdout.readline().decode()).startswith("ready on"):
            assert line, "the torch server exited before it was ready"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "harness.conformance",
                "--url",
                f"http://127.0.0.1:{port}",
                "--lora-adapter",
                "sql",
                "--lora-adapter",
                "chat",
                "--load-requests",
                "4",
                "--only",
                *CHECKS,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{len(CHECKS)} passed, 0 failed" in result.stdout, result.stdout
    finally:
        server.terminate()
        server.wait(10)


def test_logprobs_over_http(tmp_path):
    import asyncio

    from openai import AsyncOpenAI

    model = make_tiny_model(tmp_path / "tiny")
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "modelserver",
            "--backend",
            "torch",
            "--model",
            str(model),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--disable-log-stats",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        while not (line := server.stdout.readline().decode()).startswith("ready on"):
            assert line, "the torch server exited before it was ready"

        async def ask():
            client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            completion = await client.completions.create(
                model="tiny", prompt="hello", max_tokens=4, logprobs=2, temperature=0
            )
            chat = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                logprobs=True,
                top_logprobs=2,
                temperature=0,
            )
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                logprobs=True,
                temperature=0,
                stream=True,
            )
            streamed = [c.choices[0].logprobs for c in [c async for c in stream] if c.choices and c.choices[0].logprobs]
            return completion, chat, streamed

        completion, chat, streamed = asyncio.run(ask())
        lp = completion.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(len(top) in (2, 3) for top in lp.top_logprobs)  # the top 2, plus the sampled token if not among them
        assert max(lp.top_logprobs[0].values()) == lp.token_logprobs[0]  # temperature 0 samples the most likely
        content = chat.choices[0].logprobs.content
        assert len(content) == 3 and all(len(c.top_logprobs) <= 2 for c in content)
        assert sum(len(s.content) for s in streamed) == 3
    finally:
        server.terminate()
        server.wait(10)
