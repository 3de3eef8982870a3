"""Block keys: a typed, length-prefixed, chained encoding that never aliases."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reprise.blockpool.hashing import (
    Namespace,
    encode_block,
    encode_ids,
    hash_block,
    hash_encoded_blocks,
    hash_token_blocks,
)
from reprise.daemon.engine.params import SamplingParams
from reprise.daemon.engine.sequence import RequestId, Sequence

FP = b"test-model"
BS = 4


def test_digest_is_sha256_of_the_encoding_and_pinned() -> None:
    digest = hash_block(None, [1, 2, 3, 4], model_fingerprint=FP)
    assert digest == hashlib.sha256(encode_block(None, [1, 2, 3, 4], model_fingerprint=FP)).digest()
    assert len(digest) == 32
    # Pins the format: change it only together with FORMAT_VERSION.
    assert digest.hex()[:16] == "387877a3ef61fa18"


def test_chained_keys_cover_every_full_block_and_share_prefixes() -> None:
    a = hash_token_blocks(list(range(10)), BS, model_fingerprint=FP)
    assert len(a) == 2  # tokens 8, 9 are a partial block: no key
    b = hash_token_blocks([*range(4), 99, *range(5, 12)], BS, model_fingerprint=FP)
    assert len(b) == 3 and b[0] == a[0] and b[1] != a[1]
    assert a[1] == hash_block(a[0], [4, 5, 6, 7], model_fingerprint=FP)


def test_equal_blocks_under_different_parents_differ() -> None:
    x = hash_block(None, [1, 2, 3, 4], model_fingerprint=FP)
    y = hash_block(None, [5, 6, 7, 8], model_fingerprint=FP)
    assert hash_block(x, [9, 9, 9, 9], model_fingerprint=FP) != hash_block(
        y, [9, 9, 9, 9], model_fingerprint=FP
    )
    assert hash_block(None, [9] * 4, model_fingerprint=FP) != hash_block(
        x, [9] * 4, model_fingerprint=FP
    )


def test_model_fingerprint_separates_keys() -> None:
    assert hash_block(None, [1], model_fingerprint=b"m1") != hash_block(
        None, [1], model_fingerprint=b"m2"
    )


ADVERSARIAL_NAMESPACES = [
    None,
    Namespace(""),
    Namespace(b""),
    Namespace("a"),
    Namespace(b"a"),
    Namespace("a", "bc"),
    Namespace("ab", "c"),
    Namespace("abc"),
    Namespace(None, "abc"),
    Namespace(None, ""),
    Namespace("", ""),
    # A salt that spells out what an adapter field would encode as after "a".
    Namespace("aA\x00\x00\x00\x00\x00\x00\x00\x02bc"),
    Namespace(b"a" + b"A" + (2).to_bytes(8, "big") + b"bc"),
    Namespace("\u00e9"),
    Namespace("\u00e9".encode()),
]


def test_adversarial_namespaces_never_alias() -> None:
    encodings = [
        encode_block(None, [1, 2], namespace=ns, model_fingerprint=FP)
        for ns in ADVERSARIAL_NAMESPACES
    ]
    digests = [
        hash_block(None, [1, 2], namespace=ns, model_fingerprint=FP)
        for ns in ADVERSARIAL_NAMESPACES
    ]
    # None and Namespace() are the same namespace; every other pair differs.
    assert ADVERSARIAL_NAMESPACES[0] is None
    assert len(set(encodings)) == len(set(digests)) == len(ADVERSARIAL_NAMESPACES)
    assert encode_block(None, [1, 2], model_fingerprint=FP) == encode_block(
        None, [1, 2], namespace=Namespace(), model_fingerprint=FP
    )


def test_namespace_reaches_later_blocks_through_the_chain_only() -> None:
    tokens = list(range(8))
    salted = hash_token_blocks(tokens, BS, namespace=Namespace("s"), model_fingerprint=FP)
    plain = hash_token_blocks(tokens, BS, model_fingerprint=FP)
    assert salted[0] != plain[0] and salted[1] != plain[1]
    # With a parent, the namespace is already in the parent's digest.
    assert (
        hash_block(plain[0], tokens[4:], namespace=Namespace("s"), model_fingerprint=FP) == plain[1]
    )


def test_extra_ids_separate_equal_tokens() -> None:
    tokens = [7, 7, 7, 7]
    none = hash_block(None, tokens, model_fingerprint=FP)
    zeros = hash_block(None, tokens, extra_ids=[0, 0, 0, 0], model_fingerprint=FP)
    ones = hash_block(None, tokens, extra_ids=[0, 0, 0, 1], model_fingerprint=FP)
    assert len({none, zeros, ones}) == 3
    blocks = hash_token_blocks(tokens * 2, BS, extra_ids=[0] * 4 + [1] * 4, model_fingerprint=FP)
    assert blocks[0] == zeros and blocks[1] != hash_block(
        zeros, tokens, extra_ids=[0] * 4, model_fingerprint=FP
    )


def test_numpy_ids_hash_like_python_ints() -> None:
    assert hash_block(None, np.arange(4, dtype=np.int64), model_fingerprint=FP) == hash_block(
        None, [0, 1, 2, 3], model_fingerprint=FP
    )


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "3"])
def test_bad_token_ids_are_value_errors_naming_the_value(bad) -> None:
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        hash_block(None, [1, bad], model_fingerprint=FP)


def test_bad_arguments_are_errors() -> None:
    with pytest.raises(ValueError, match="one id per token: 1 for 2 tokens"):
        hash_block(None, [1, 2], extra_ids=[0], model_fingerprint=FP)
    with pytest.raises(ValueError, match="one id per token"):
        hash_token_blocks([1, 2], 2, extra_ids=[0], model_fingerprint=FP)
    with pytest.raises(ValueError, match="block_size must be >= 1; got 0"):
        hash_token_blocks([1, 2], 0, model_fingerprint=FP)
    with pytest.raises(TypeError, match="cache_salt must be str, bytes or None; got int"):
        Namespace(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="adapter_id must be str or None; got bytes"):
        Namespace(None, b"x")  # type: ignore[arg-type]


def test_injected_hasher_is_used() -> None:
    seen: list[bytes] = []

    def hasher(data: bytes) -> bytes:
        seen.append(data)
        return b"\x01" * 32

    hashes = hash_token_blocks(list(range(8)), BS, model_fingerprint=FP, hasher=hasher)
    assert hashes == [b"\x01" * 32] * 2 and len(seen) == 2
    assert seen[1] == encode_block(b"\x01" * 32, [4, 5, 6, 7], model_fingerprint=FP)


salts = st.one_of(st.none(), st.text(max_size=4), st.binary(max_size=4))
namespaces = st.builds(Namespace, salts, st.one_of(st.none(), st.text(max_size=4)))
small_ids = st.lists(st.integers(0, 3), max_size=4)
block_inputs = st.tuples(
    st.one_of(st.none(), st.binary(min_size=1, max_size=3)),  # parent
    small_ids,  # tokens
    st.one_of(st.none(), small_ids),  # extra ids (length fixed below)
    namespaces,
    st.sampled_from([b"", b"m", b"mm"]),  # fingerprint
)


def _normalized(inputs):
    parent, tokens, extra, namespace, fingerprint = inputs
    if extra is not None:
        extra = (extra + [0] * len(tokens))[: len(tokens)]
    if parent is not None:
        namespace = None  # not encoded below a parent
    return parent, tokens, extra, namespace or Namespace(), fingerprint


@given(block_inputs, block_inputs)
def test_encoding_is_injective(a, b) -> None:
    a, b = _normalized(a), _normalized(b)

    def encode(inputs) -> bytes:
        parent, tokens, extra, namespace, fingerprint = inputs
        return encode_block(
            parent, tokens, extra_ids=extra, namespace=namespace, model_fingerprint=fingerprint
        )

    # Compare namespaces by field type too: "a" and b"a" are different salts.
    def typed(inputs):
        parent, tokens, extra, ns, fingerprint = inputs
        salt = ns.cache_salt
        return parent, tokens, extra, (type(salt), salt, ns.adapter_id), fingerprint

    assert (encode(a) == encode(b)) == (typed(a) == typed(b))


def test_distinct_small_inputs_have_distinct_encodings() -> None:
    # Exhaustive over a small space: token lists of length <= 3 over {0, 1}, with and without extras.
    seen: dict[bytes, object] = {}
    for n in range(4):
        for tokens in itertools.product([0, 1], repeat=n):
            for extra in [None, *itertools.product([0, 1], repeat=n)]:
                data = encode_block(None, tokens, extra_ids=extra, model_fingerprint=FP)
                assert data not in seen, (tokens, extra, seen.get(data))
                seen[data] = (tokens, extra)


def _chain_one_by_one(parent, tokens, bs, extra, namespace):
    """The reference: hash_block per block, each block's ids packed on their own."""
    out = []
    for idx in range(len(tokens) // bs):
        block_extra = None if extra is None else extra[idx]
        parent = hash_block(parent, tokens[idx * bs : (idx + 1) * bs], extra_ids=block_extra,
                            namespace=namespace, model_fingerprint=FP)  # fmt: skip
        out.append(parent)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_encoded_chain_is_hash_block_bit_for_bit(seed) -> None:
    """The engine's chain (ids encoded once, sliced per block) against hash_block per
    block, on fresh random ids, parents, extra ids and namespaces."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 3, 16, 32]))
    num_blocks = int(rng.integers(1, 12))
    tokens = rng.integers(0, 2**63, size=num_blocks * bs, dtype=np.int64).tolist()
    parent = None if seed % 2 else bytes(rng.integers(0, 256, 32, dtype=np.uint8))
    namespace = [None, Namespace("salt"), Namespace(b"salt", "lora")][seed % 3]
    extra = None
    if seed % 3 == 1:  # some blocks with extra ids, some without
        extra = [rng.integers(0, 5, bs).tolist() if rng.random() < 0.5 else None
                 for _ in range(num_blocks)]  # fmt: skip
    got = hash_encoded_blocks(parent, encode_ids(tokens), bs, extra_ids_per_block=extra,
                              namespace=namespace, model_fingerprint=FP)  # fmt: skip
    assert got == _chain_one_by_one(parent, tokens, bs, extra, namespace)
    if extra is None and parent is None:
        assert got == hash_token_blocks(tokens, bs, namespace=namespace, model_fingerprint=FP)


def test_encoded_chain_refuses_a_partial_block_and_bad_extra_ids() -> None:
    with pytest.raises(ValueError, match="no whole number"):
        hash_encoded_blocks(None, encode_ids([1, 2, 3]), 2, model_fingerprint=FP)
    with pytest.raises(ValueError, match="extra-id blocks"):
        hash_encoded_blocks(None, encode_ids([1, 2]), 2, extra_ids_per_block=[], model_fingerprint=FP)
    with pytest.raises(ValueError, match="one id per token"):
        hash_encoded_blocks(None, encode_ids([1, 2]), 2, extra_ids_per_block=[[1]], model_fingerprint=FP)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*64\); got -1"):
        encode_ids([1, -1])


def test_sequence_encodes_prompt_and_generated_ids_as_keys_do() -> None:
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 50_000, 37).tolist()
    seq = Sequence(RequestId(1), prompt, SamplingParams(), seed=0)
    seq.output_token_ids = rng.integers(0, 50_000, 11).tolist()
    for start, end in [(0, 37), (5, 30), (30, 45), (37, 48), (40, 44), (0, 48), (36, 37)]:
        assert seq.encoded_ids(start, end) == encode_ids(seq.token_ids(start, end)), (start, end)


@pytest.mark.parametrize("with_extra", [False, True])
def test_engine_chain_grows_in_steps_as_hash_block_per_block(with_extra) -> None:
    """KVCacheManager.hash_chain, grown a few blocks at a time over prompt and generated
    tokens, against hash_block per block with the sequence's own extra ids."""
    from reprise.blockpool.pool import BlockPool
    from reprise.daemon.engine.kvmanager import KVCacheManager

    bs, rng = 4, np.random.default_rng(3)
    prompt = rng.integers(0, 1000, 26).tolist()
    extra = None
    if with_extra:  # a prompt-table stretch in the middle: blocks 2-3 carry extra ids
        extra = [0] * 26
        extra[9:14] = rng.integers(1, 2**63, 5).tolist()
    seq = Sequence(RequestId(1), prompt, SamplingParams(), seed=0,
                   namespace=Namespace("tenant"), prompt_extra_ids=extra)  # fmt: skip
    seq.output_token_ids = rng.integers(0, 1000, 10).tolist()
    kv = KVCacheManager(BlockPool(16, bs), FP)
    for num_blocks in (1, 3, 6, 9):
        kv.hash_chain(seq, num_blocks)
    want, parent = [], None
    for idx in range(9):
        parent = hash_block(parent, seq.token_ids(idx * bs, (idx + 1) * bs),
                            extra_ids=seq.extra_ids(idx * bs, (idx + 1) * bs),
                            namespace=seq.namespace, model_fingerprint=FP)  # fmt: skip
        want.append(parent)
    assert seq.hash_chain == want
    assert (seq.extra_ids(8, 12) is not None) == with_extra


def test_an_id_array_encodes_as_its_list_does() -> None:
    """The engine hands its checked int64 array over: the same bytes as the list."""
    ids = np.random.default_rng(11).integers(0, 2**62, 50)
    assert encode_ids(ids) == encode_ids(ids.tolist()) == encode_ids(ids.astype(np.uint64))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*64\); got -3"):
        encode_ids(np.array([4, -3, 5]))
