"""Block hashes as vLLM v0.11.2 computes them (protocol/kv_events.py).

The pinned values were produced by vLLM v0.11.2's own code: `sha256`/`sha256_cbor` from the wheel's
vllm/utils/hashing.py and `init_none_hash`, `hash_block_tokens`, `maybe_convert_block_hash` extracted from its
vllm/v1/core/kv_cache_utils.py (run with cbor2 6.3 and CPython 3.11). The re-implementation below is the definition
written out again, independently of protocol/kv_events.py.
"""

import hashlib
import pickle

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.kv_events import BlockHasher, canonical_cbor, external_block_hash, request_block_hashes

PROMPT = list(range(1, 41))  # 2 full blocks of 16 + 8 tokens
ODD = [7, 100000, 3, 65535, 256, 1, 0, 24]  # ints of every CBOR/pickle width class

PINNED = [  # (algo, PYTHONHASHSEED, tokens, block size, lora name) -> vLLM v0.11.2's event ints
    ("sha256", "42", PROMPT, 16, None, [4508471921923631364, 13026579715664180657]),
    ("sha256", "42", PROMPT, 16, "sql-lora", [9718576833249948114, 171005550707354863]),
    ("sha256", "0", ODD, 4, None, [6452381012789897647, 7612377486083619451]),
    ("sha256_cbor", "42", PROMPT, 16, None, [16300212363532267629, 8671309795006503672]),
    ("sha256_cbor", "42", PROMPT, 16, "sql-lora", [10952387812627577495, 4191567149797714352]),
    ("sha256_cbor", "0", ODD, 4, None, [14307690771666813594, 7330059551548822610]),
]


def reference_chain(algo: str, seed: str, tokens: list[int], block_size: int, lora: str | None) -> list[int]:
    """vLLM's definition: NONE_HASH = H(seed); block = H((parent, tuple(tokens), extra)); event int = low 64 bits."""

    def h(obj) -> bytes:
        data = (
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            if algo == "sha256"
            else cbor2.dumps(obj, canonical=True)
        )
        return hashlib.sha256(data).digest()

    parent, out = h(seed), []
    extra = (lora,) if lora else None
    for i in range(len(tokens) // block_size):
        parent = h((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


@pytest.mark.parametrize(("algo", "seed", "tokens", "block_size", "lora", "expected"), PINNED)
def test_hashes_are_vllm_s(algo, seed, tokens, block_size, lora, expected):
    assert request_block_hashes(tokens, block_size, lora_name=lora, hash_seed=seed, algo=algo) == expected
    assert reference_chain(algo, seed, tokens, block_size, lora) == expected


def test_only_full_blocks_are_hashed_and_a_chain_continues_from_a_parent_digest():
    hasher = BlockHasher("sha256", "42")
    digests = hasher.chain(PROMPT, 16)
    assert [external_block_hash(d) for d in digests] == PINNED[0][-1]
    assert request_block_hashes(PROMPT[:15], 16, hash_seed="42") == []
    # the second block alone, chained to the first block's digest, is the same block
    assert request_block_hashes(PROMPT[16:32], 16, hash_seed="42", parent=digests[0]) == PINNED[0][-1][1:]


def test_the_seed_the_algorithm_and_the_adapter_each_change_every_hash():
    base = request_block_hashes(PROMPT, 16, hash_seed="42")
    for other in (
        request_block_hashes(PROMPT, 16, hash_seed="43"),
        request_block_hashes(PROMPT, 16, hash_seed="42", algo="sha256_cbor"),
        request_block_hashes(PROMPT, 16, hash_seed="42", lora_name="a"),
    ):
        assert not set(base) & set(other)


def test_unseeded_is_random_per_process_but_stable_within_it():
    assert request_block_hashes(PROMPT, 16) == request_block_hashes(PROMPT, 16)
    assert request_block_hashes(PROMPT, 16) != request_block_hashes(PROMPT, 16, hash_seed="42")


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="sha256_cbor"):
        BlockHasher("xxhash")


@given(
    st.recursive(
        st.none() | st.integers(-(2**64), 2**64 - 1) | st.text() | st.binary(),
        lambda inner: st.lists(inner, max_size=5) | st.lists(inner, max_size=5).map(tuple),
        max_leaves=20,
    )
)
def test_canonical_cbor_is_byte_for_byte_cbor2_s(obj):
    assert canonical_cbor(obj) == cbor2.dumps(obj, canonical=True)
