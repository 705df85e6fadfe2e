"""The EPP's exact prompt tokens: the model server's tokenizer and chat template, a per-prefix cache that never
changes the result, and a bound on what it keeps."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from epp.scheduling.prompt_tokens import PromptTokenizer, resumable
from protocol.openai import chat_messages
from protocol.tokenizer import Tokenizer, load_tokenizer, save_tokenizer

TEXT = st.lists(
    st.sampled_from([*"ab cd  \n\t,.'s!?1234-_", "é", "日本", "<|endoftext|>", "'ll", " 's", "  \n", "the "]),
    max_size=300,
).map("".join)


@pytest.fixture(scope="module")
def builtin() -> PromptTokenizer:
    return PromptTokenizer(load_tokenizer(None), segment_chars=48, head_chars=16)


def encode(tokenizer: PromptTokenizer, prompt: str | list[int]) -> list[int]:
    return [t for _, ids in tokenizer.pieces(prompt) for t in ids]


def token_ids(tokenizer: PromptTokenizer, payload: dict) -> list[int] | None:
    prompt = tokenizer.prompt(payload)
    return None if prompt is None else encode(tokenizer, prompt)


@settings(max_examples=400, deadline=None)
@given(first=TEXT, second=TEXT, third=TEXT)
def test_the_cached_segments_give_exactly_the_whole_text_s_tokens(builtin, first, second, third):
    whole = builtin.tokenizer.encode
    for text in (first + second, first + third, first + second + third, first + second):
        assert encode(builtin, text) == whole(text)


def test_a_shared_prefix_is_encoded_once(builtin):
    context = "You are a helpful assistant. Answer the question concisely and accurately. " * 40
    before = builtin.misses
    encode(builtin, context + "What is the capital of France?")
    encoded_once = builtin.misses - before
    hits = builtin.hits
    encode(builtin, context + "How many days are there in a year?")
    assert builtin.misses - before <= encoded_once + 1 and builtin.hits - hits >= encoded_once - 1


def test_pieces_are_encoded_only_when_read(builtin):
    text = "a new prompt that nobody has sent before, " * 40
    pieces = builtin.pieces(text)
    before = builtin.misses
    length, ids = next(pieces)
    assert builtin.misses == before + 1  # one segment encoded, not the whole text
    assert 0 < length <= builtin.head_chars < builtin.segment_chars  # the short first one
    assert list(ids) == builtin.tokenizer.encode(text[:length])
    assert sum(n for n, _ in builtin.pieces(text)) == len(text)


def test_chat_and_completions_are_tokenized_as_the_model_server_does(builtin):
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. " * 30},
            {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "Paris?"}]},
        ],
    }
    server = builtin.tokenizer  # modelserver/api/server.py: encode(apply_chat_template(parsed.messages))
    assert token_ids(builtin, chat) == server.encode(server.apply_chat_template(chat_messages(chat)))
    assert token_ids(builtin, {"model": "m", "prompt": "the quick brown fox " * 50}) == server.encode(
        "the quick brown fox " * 50
    )
    assert token_ids(builtin, {"model": "m", "prompt": [5, 6, 7]}) == [5, 6, 7]
    assert token_ids(builtin, {"model": "m", "prompt": ["first prompt", "second"]}) == server.encode("first prompt")
    assert token_ids(builtin, {"model": "m", "messages": "not a list"}) is None
    assert token_ids(builtin, {"model": "m"}) is None


def test_a_model_directory_s_tokenizer_and_chat_template_are_used(tmp_path):
    save_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = PromptTokenizer.from_directory(str(tmp_path))
    payload = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    assert tokenizer.prompt(payload) == "[user] hello there "
    with pytest.raises(FileNotFoundError):
        PromptTokenizer.from_directory(str(tmp_path / "missing"))


def test_tokenizers_that_may_merge_across_a_cut_are_encoded_whole():
    assert resumable(load_tokenizer(None))
    metaspace = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    assert not resumable(Tokenizer(metaspace))
    normalized = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    normalized.normalizer = normalizers.NFKC()
    normalized.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert not resumable(Tokenizer(normalized))
    prefix_space = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    prefix_space.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not resumable(Tokenizer(prefix_space))


def test_the_cache_is_bounded_in_tokens():
    tokenizer = PromptTokenizer(load_tokenizer(None), segment_chars=64, cache_tokens=200)
    for i in range(50):
        encode(tokenizer, f"conversation {i}: " + "the weather today is sunny with a light breeze " * 10)
    assert 0 < tokenizer.cached_tokens <= 200
