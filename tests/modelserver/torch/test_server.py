"""The Model Server Protocol holds in torch mode exactly as in sim mode: the same conformance checks, against
`modelserver --backend torch` serving the tiny model and its adapters."""

import subprocess
import sys

import pytest

from harness.envoy import terminate
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
        terminate(server, timeout=30)  # SIGTERM, then SIGKILL: torch's exit is slow on a loaded machine


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
        terminate(server, timeout=30)  # SIGTERM, then SIGKILL: torch's exit is slow on a loaded machine


def test_responses_and_messages_answer_like_chat_on_the_torch_executor(tmp_path):
    """One conversation with a system prompt through Chat, Responses and Messages: greedy decoding gives the same
    text (one chat template, one engine), and a Responses follow-up continues the stored conversation."""
    import asyncio

    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    model = make_tiny_model(tmp_path / "tiny")
    (port,) = free_ports(1)
    command = [sys.executable, "-m", "modelserver", "--backend", "torch", "--model", str(model), "--port", str(port)]
    server = subprocess.Popen(
        [*command, "--served-model-name", "tiny", "--disable-log-stats"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        while not (line := server.stdout.readline().decode()).startswith("ready on"):
            assert line, "the torch server exited before it was ready"

        async def ask():
            oai = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            claude = AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="x")
            system, user = "You are terse.", "Say hi."
            chat = await oai.chat.completions.create(
                model="tiny",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                max_tokens=4,
                temperature=0,
            )
            first = await oai.responses.create(
                model="tiny", instructions=system, input=user, max_output_tokens=4, temperature=0
            )
            message = await claude.messages.create(
                model="tiny",
                system=system,
                messages=[{"role": "user", "content": user}],
                max_tokens=4,
                extra_body={"temperature": 0},  # (this SDK's create no longer takes it)
            )
            follow_up = await oai.responses.create(
                model="tiny", previous_response_id=first.id, input="Again.", max_output_tokens=2, temperature=0
            )
            return chat, first, message, follow_up

        chat, first, message, follow_up = asyncio.run(ask())
        assert first.output_text == chat.choices[0].message.content == message.content[0].text
        assert follow_up.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    finally:
        terminate(server, timeout=30)  # SIGTERM, then SIGKILL: torch's exit is slow on a loaded machine
