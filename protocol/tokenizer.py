"""Tokenizers: a Hugging Face `tokenizer.json` from a model directory, or a built-in byte-level BPE.

Nothing is fetched from a hub. The built-in tokenizer is trained deterministically, in milliseconds, on a small
English corpus that ships here, so the `sim` backend needs no files and `make-tiny-model` writes the same one.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from protocol import json_text

EOS_TOKEN = "<|endoftext|>"
# Tools first (the long part agents share), then each message with its tool calls: protocol.openai.chat_transcript
# writes the same text without the generation prompt (tests/protocol/test_agent_apis.py holds them equal).
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool['function'] | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% for call in message['tool_calls'] or [] %}<|tool_call|>{{ call['function']['name'] }} "
    "{{ call['function']['arguments'] }}\n{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
You are a helpful assistant. Answer the question concisely and accurately, and explain your reasoning.
The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence.
In the beginning of the project we wrote down what the system should do, then we measured what it did.
Large language models generate text one token at a time, and each new token depends on all the tokens before it.
A model server keeps the attention keys and values of every running request in a paged cache on the GPU.
When two requests share a prefix, the server can reuse the cached blocks instead of computing them again.
The gateway routes each request to the server where it will be served fastest, with a short queue and free memory.
Please summarize the following document in three sentences, keeping the most important facts and numbers.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
How many days are there in a year? There are three hundred and sixty five days in a common year.
Translate the sentence into German, then into Spanish, and finally back into English to compare the meaning.
Write a short poem about the sea, the wind, the morning light, and the sound of the waves on the shore.
The weather today is sunny with a light breeze from the west, and the temperature will reach twenty degrees.
Customer support: my order has not arrived yet, could you please check the status and tell me when it will ship?
def add(a, b): return a + b  # a small function that adds two numbers and returns the result
SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY count DESC;
The report shows that revenue grew by twelve percent in the third quarter, driven by new customers in Europe.
Machine learning systems need careful evaluation: define the metric, hold out data, and check for regressions.
She opened the window, looked at the garden, and decided that it was a good day to plant the tomatoes.
Every request has a model name, a prompt or a list of messages, and optional sampling parameters.
"""


@functools.cache
def build_default_tokenizer(vocab_size: int = 2048) -> HFTokenizer:
    """The built-in byte-level BPE (every byte is a token, so any text round-trips)."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    return tokenizer


def save_tokenizer(directory: Path) -> None:
    """The built-in tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json with the chat template),
    loadable by `transformers.AutoTokenizer` from a local directory: clients such as inference-perf count tokens
    with it."""
    directory.mkdir(parents=True, exist_ok=True)
    build_default_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS_TOKEN,
                "chat_template": DEFAULT_CHAT_TEMPLATE,
                "model_max_length": 4096,
            },
            indent=2,
        )
    )


class Tokenizer:
    """encode / decode / chat template over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None = None, eos_token: str = EOS_TOKEN):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.token_to_id(eos_token)
        self.vocab_size = tokenizer.get_vocab_size()
        env = jinja2.Environment(autoescape=False, trim_blocks=False, keep_trailing_newline=True)
        env.policies["json.dumps_function"] = json_text.dumps  # an agent's tools, serialised once (its docstring)
        self._template = env.from_string(chat_template or DEFAULT_CHAT_TEMPLATE)
        self._eos_token = eos_token
        # No token decodes to more characters than its vocabulary entry has (byte-level BPE: one symbol per byte),
        # so a text longer than max_model_len * this is over the limit without tokenizing it.
        self.max_chars_per_token = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str) -> list[int]:
        """The text's token ids, through the batch API that computes no character offsets (none is read): 5.9 / 47 /
        143 against 6.6 / 59 / 195 us for 27 / 300 / 1,000 characters with the built-in tokenizer; it releases the
        GIL, so a worker thread may encode a long text while the event loop runs."""
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Several texts in one call (the same API: no offsets, the GIL released)."""
        return [e.ids for e in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    @property
    def backend(self) -> HFTokenizer:
        return self._tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text of chat messages and the request's tools (OpenAI Chat's shape: `{"type": "function",
        "function": {...}}`), as Hugging Face's apply_chat_template passes them to the template."""
        return self._template.render(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            eos_token=self._eos_token,
            bos_token="",
        )

    def filler_token_ids(self, count: int = 256) -> list[int]:
        """Ids of ordinary word tokens (a space then letters), for deterministic filler text."""
        vocab = self._tokenizer.get_vocab()
        words = sorted(i for t, i in vocab.items() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 2)
        return words[:count] or sorted(vocab.values())[:count]


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer of a local model directory (tokenizer.json + tokenizer_config.json), or the built-in one."""
    if path is None:
        return Tokenizer(build_default_tokenizer())
    directory = Path(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} not found (no tokenizer is downloaded; pass a local model dir)")
    config: dict[str, Any] = {}
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
    eos = config.get("eos_token", EOS_TOKEN)
    if isinstance(eos, dict):
        eos = eos.get("content", EOS_TOKEN)
    return Tokenizer(HFTokenizer.from_file(str(tokenizer_file)), config.get("chat_template"), eos)
