"""The Model Server Protocol holds in torch mode exactly as in sim mode: the whole conformance suite against
`modelserver --backend torch` serving the tiny model and its adapters; and the torch executor's answers over HTTP
(logprobs, one conversation through Chat, Responses and Messages). One server for the module: a torch server's start
is most of each test's CPU."""

import asyncio

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from modelserver.torch.tiny import make_tiny_model
from tests.conformance.helpers import model_server, run_the_whole_suite

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), lora_names=["sql", "chat"])
    with model_server(
        "--backend",
        "torch",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "512",
        "--lora-modules",
        f"sql={model}/loras/sql",
        f"chat={model}/loras/chat",
    ) as served:
        yield served


def test_msp_conformance_in_torch_mode(torch_server, tmp_path):
    run_the_whole_suite(torch_server, tmp_path / "report.yaml")


def test_logprobs_over_http(torch_server):
    async def ask():
        client = AsyncOpenAI(base_url=f"{torch_server.url}/v1", api_key="x")
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


def test_responses_and_messages_answer_like_chat_on_the_torch_executor(torch_server):
    """One conversation with a system prompt through Chat, Responses and Messages: greedy decoding gives the same
    text (one chat template, one engine), and a Responses follow-up continues the stored conversation."""

    async def ask():
        oai = AsyncOpenAI(base_url=f"{torch_server.url}/v1", api_key="x")
        claude = AsyncAnthropic(base_url=torch_server.url, api_key="x")
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
