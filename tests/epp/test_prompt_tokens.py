"""The EPP's exact prompt tokens: the model server's tokenizer and chat template, a per-prefix cache that never
changes the result, and a bound on what it keeps."""

import gc
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from epp.scheduling.prompt_tokens import (
    MAX_CACHED_PIECE_CHARS,
    PieceEncoder,
    PromptTokenizer,
    ascii_split_pattern,
    resumable,
)
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


@settings(max_examples=400)
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


LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
SPECIAL = ["<|endoftext|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|im_start|>x"]
ASCII_TEXT = st.lists(
    st.one_of(
        st.text(st.characters(max_codepoint=127), max_size=12),
        st.sampled_from(
            ["'s", "'S", " 's", "'ll", "1234567", "  \n", "\r\n\r\n", " \t ", "the ", "é", "日本", *SPECIAL]
        ),
    ),
    max_size=60,
).map("".join)


def _trained(split: str | None, vocab_size: int = 600) -> Tokenizer:
    """A byte-level BPE trained on the built-in corpus with `split` as its pre-token pattern (None: GPT-2's, the
    ByteLevel pre-tokenizer's own), as Llama 3 and Qwen 2 configure theirs."""
    tokenizer = HFTokenizer(models.BPE())
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = json.dumps(load_tokenizer(None).backend.get_vocab()) + " don't we'll 12345 67 \r\n\r\n  x  "
    tokenizer.train_from_iterator([text] * 4, trainer)
    return Tokenizer(tokenizer)


PIPELINES = {"gpt2": _trained(None), "llama3": _trained(LLAMA3_SPLIT), "qwen2": _trained(QWEN2_SPLIT)}


@settings(max_examples=300)
@given(text=ASCII_TEXT, again=ASCII_TEXT)
def test_the_pre_token_cache_gives_the_tokenizer_s_ids_for_gpt2_llama3_and_qwen2_splits(text, again):
    for tokenizer in PIPELINES.values():
        encoder = PieceEncoder.of(tokenizer)
        assert encoder is not None
        for t in (text, again, text + again, text):  # the last one from the cache alone
            assert encoder.encode(t) == tokenizer.encode(t)


def test_the_pre_token_cache_is_used_and_bounded(monkeypatch):
    tokenizer = load_tokenizer(None)
    encoder = PieceEncoder.of(tokenizer)
    encoder._pieces.clear()  # (the self-check left some)
    calls = []
    original = tokenizer.encode_batch
    monkeypatch.setattr(tokenizer, "encode_batch", lambda texts: calls.append(texts) or original(texts))
    text = "the quick brown fox jumps over the lazy dog, " * 3 + "x" * (MAX_CACHED_PIECE_CHARS + 1)
    assert encoder.encode(text) == tokenizer.encode(text)
    assert calls == []  # all new: the whole text in one call, each piece's ids read from the tokenizer's numbering
    assert list(encoder._pieces[" quick"]) == tokenizer.encode(" quick") and list(
        encoder._pieces[","]
    ) == tokenizer.encode(",")
    assert " " + "x" * 33 not in encoder._pieces  # too long to keep
    gc.collect()
    assert not any(map(gc.is_tracked, encoder._pieces.values()))  # a full cache is nothing for collections to walk
    few_new = "the lazy fox, the quick dog jumps over the brown fox and the lazy dog" + " zebra"
    assert encoder.encode(few_new) == tokenizer.encode(few_new)
    assert calls == [[" and", " zebra"]]  # a few new: those alone, in one call
    calls.clear()
    assert encoder.encode("the lazy fox, the quick dog") == tokenizer.encode("the lazy fox, the quick dog")
    assert calls == []  # every pre-token from the cache
    monkeypatch.setattr("epp.scheduling.prompt_tokens.MAX_CACHED_PIECES", 20)
    words = " ".join(f"w{i}" for i in range(50))
    assert encoder.encode(words) == tokenizer.encode(words)
    assert len(encoder._pieces) <= 20
    for i in range(100):
        encoder.encode(f" v{i} u{i}")
        assert len(encoder._pieces) <= 20


def test_pipelines_the_pre_token_cache_cannot_reproduce_are_encoded_by_the_tokenizer():
    assert PromptTokenizer(load_tokenizer(None)).encoder.__class__ is PieceEncoder

    def with_pre(pre, normalizer=None):
        tokenizer = _trained(None, 300)
        tokenizer.backend.pre_tokenizer = pre
        if normalizer is not None:
            tokenizer.backend.normalizer = normalizer
        return tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    cannot = [
        with_pre(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFKC()),
        with_pre(pre_tokenizers.ByteLevel(add_prefix_space=True)),
        with_pre(pre_tokenizers.Metaspace()),
        with_pre(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{Lu}+|."), "isolated"), byte_level])),
        with_pre(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{L}+|."), "removed"), byte_level])),
        with_pre(pre_tokenizers.Sequence([pre_tokenizers.Digits(True), byte_level])),
    ]
    for tokenizer in cannot:
        assert PieceEncoder.of(tokenizer) is None
        assert PromptTokenizer(tokenizer).encoder is tokenizer
    single_word = _trained(None, 300)
    single_word.backend.add_tokens([AddedToken("word", single_word=True)])
    assert PieceEncoder.of(single_word) is None
    # a pattern that leaves text between its matches: that text is the tokenizer's to encode
    gaps = with_pre(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[0-9]+"), "isolated"), byte_level]))
    encoder = PieceEncoder.of(gaps)
    assert encoder is not None
    for text in ("abc 123 def", "123", "x", ""):
        assert encoder.encode(text) == gaps.encode(text)


def test_split_patterns_are_read_for_ascii_text_or_refused():
    assert ascii_split_pattern(r"\p{L}+|[^\s\p{L}\p{N}]").pattern == r"[A-Za-z]+|[^\sA-Za-z0-9]"
    assert ascii_split_pattern(r"(?i:'s)|\p{N}{1,3}").findall("'S12345") == ["'S", "123", "45"]
    assert (
        ascii_split_pattern(r"(?:a)(?=b)(?!c)(?<=a)(?<!c)(?>b)[^^$]").pattern
        == r"(?:a)(?=b)(?!c)(?<=a)(?<!c)(?>b)[^^$]"
    )
    for pattern in (
        r"\p{Lu}",
        r"\P{L}",
        r"[a[b]]",
        r"[a&&b]",
        r"\h+",
        r"(",
        r"a(?i)b",
        r"(a)|b",
        r"^a",
        r"a$",
        r"a\Z",
        r"(?m:.)",
        r"(?s:.)",
    ):
        assert ascii_split_pattern(pattern) is None, pattern
