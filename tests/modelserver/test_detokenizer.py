"""The incremental detokenizer gives the text a full decode gives, finds stop strings across steps, and holds back
incomplete UTF-8 until the token that completes it."""

import random

import pytest

from modelserver.api.detokenizer import IncrementalDetokenizer
from protocol.tokenizer import Tokenizer, build_default_tokenizer

TOKENIZER = Tokenizer(build_default_tokenizer())
TEXT = "Héllo wörld! Ünïcode ✓ and emoji 🙂 mixed with plain ASCII words, numbers 12345 and  double  spaces.\n" * 8


def steps(ids: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        out.append(ids[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_equals_the_full_decode_at_every_complete_step(seed):
    ids = TOKENIZER.encode(TEXT)
    detokenizer = IncrementalDetokenizer(TOKENIZER.decode, [])
    chunks = steps(ids, seed)
    for n, chunk in enumerate(chunks):
        detokenizer.append(chunk, final=n == len(chunks) - 1)
        full = TOKENIZER.decode(detokenizer.token_ids)
        assert full.startswith(detokenizer.text)
        if not full.endswith("\ufffd"):
            assert detokenizer.text == full
    assert detokenizer.text == TOKENIZER.decode(ids) == TEXT


def test_a_split_multibyte_character_is_held_back_until_complete():
    ids = [b for b in TOKENIZER.encode("🙂")]
    if len(ids) < 2:
        pytest.skip("the tokenizer has the emoji as one token")
    detokenizer = IncrementalDetokenizer(TOKENIZER.decode, [])
    detokenizer.append(ids[:1])
    assert detokenizer.text == ""
    detokenizer.append(ids[1:])
    assert detokenizer.text == "🙂"


@pytest.mark.parametrize("seed", range(5))
def test_stop_strings_across_steps_cut_before_the_earliest_match(seed):
    ids = TOKENIZER.encode(TEXT)
    stops = ["plain ASCII", "emoji", "zzz"]
    detokenizer = IncrementalDetokenizer(TOKENIZER.decode, stops)
    for chunk in steps(ids, seed):
        if detokenizer.append(chunk):
            break
    assert detokenizer.text == TEXT[: TEXT.find("emoji")]
    assert detokenizer.stop_reason == "emoji"


def test_final_step_emits_a_trailing_incomplete_sequence_like_a_full_decode():
    ids = TOKENIZER.encode("ok 🙂")
    detokenizer = IncrementalDetokenizer(TOKENIZER.decode, [])
    detokenizer.append(ids[:-1], final=True)
    assert detokenizer.text == TOKENIZER.decode(ids[:-1])
