"""The tensor-core paged attention kernel (cuda/attention_tc.cu) against its NumPy
twin on fresh random inputs, with the output poisoned first, and held to DESIGN §4
bit for bit: a query's output is the same whether it runs with its whole prompt, in
a chunk of any size (unwritten future slots holding garbage, NaN included), alone
as a decode step, or batched with other sequences in any order. The same cases as
tests/test_gpu_attention.py (whose sequences and checks it reuses), plus a long
Llama-3.1-8B prefill. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import dev, host, poisoned
from test_gpu_attention import (
    BLOCK_SIZES,
    LAYER,
    MODEL_SHAPES,
    NUM_LAYERS,
    SHAPES,
    PagedSequences,
    bf16_close,
    bits,
    mixed_spans,
)

from reprise.cuda.attention_tc_kernel import ROWS_PER_CTA, paged_attention_tc
from reprise.cuda.backend import cuda_device_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_device_available(), reason="needs a CUDA device"),
]


class TcSequences(PagedSequences):
    """PagedSequences run through paged_attention_tc."""

    def gpu(self, spans: list[tuple[int, int, int]], cache=None, out=None):
        q, block_tables, seq_lens, query_start_loc = self.inputs(spans)
        return paged_attention_tc(
            dev(q),
            self.device_cache if cache is None else cache,
            LAYER,
            dev(block_tables),
            dev(seq_lens),
            dev(query_start_loc),
            1 / np.sqrt(self.head_dim),
            out=out,
        )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_tc_matches_its_twin(cp, rng, shape: str, block_size: int) -> None:
    """Decode rows, whole and partial prefills in one call, within BF16 rounding of
    paged_attention_ref; every element written; a second call gives the same bits."""
    seq_lens = [int(n) for n in rng.integers(1, 300, size=9)]
    # a one-key prompt, a prompt of exactly one page, one key into the third page
    seq_lens[1], seq_lens[3], seq_lens[5] = 1, block_size, 2 * block_size + 1
    seqs = TcSequences(rng, SHAPES[shape], block_size, seq_lens)
    spans = mixed_spans(rng, seq_lens)
    num_tokens = sum(last - first for _, first, last in spans)
    out = poisoned((num_tokens, seqs.num_heads, seqs.head_dim), np.uint16)
    assert seqs.gpu(spans, out=out) is out
    got = host(out)
    bf16_close(got, seqs.ref(spans))
    assert np.array_equal(bits(seqs.run(spans)), bits(got))  # out=None: a fresh array


@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_attention_tc_many_sequences_in_one_call(cp, rng, shape: str) -> None:
    """More sequences than a warp scans at once (the CTAs find their work in rounds of
    32): every row within BF16 rounding of the twin, and the bits each gets alone."""
    seq_lens = [int(n) for n in rng.integers(1, 100, size=75)]
    seqs = TcSequences(rng, SHAPES[shape], 32, seq_lens)
    spans = mixed_spans(rng, seq_lens)
    got = seqs.run(spans)
    bf16_close(got, seqs.ref(spans))
    starts = np.cumsum([0] + [last - first for _, first, last in spans])
    for i, span in enumerate(spans):
        alone = seqs.run([span])
        assert np.array_equal(bits(got[starts[i] : starts[i + 1]]), bits(alone)), span


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_attention_tc_query_independent_of_chunking(cp, rng, shape: str, block_size: int) -> None:
    """A query's output is bit-identical whether it runs with its whole prompt, in a
    chunk of any size (unwritten future slots holding garbage, NaN included), or alone
    as a decode step (chunks of 1)."""
    seq_len = int(rng.integers(150, 260))
    seqs = TcSequences(rng, SHAPES[shape], block_size, [seq_len])
    whole = seqs.run([(0, 0, seq_len)])
    bf16_close(whole, seqs.ref([(0, 0, seq_len)]))
    for chunk in (1, 7, 16, 33, 50):
        pieces = []
        for first in range(0, seq_len, chunk):
            last = min(first + chunk, seq_len)
            pieces.append(seqs.run([(0, first, last)], seqs.with_garbage_after(0, last)))
        assert np.array_equal(bits(np.concatenate(pieces)), bits(whole)), chunk


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_attention_tc_query_independent_of_other_sequences(
    cp, rng, shape: str, block_size: int
) -> None:
    """Seven sequences of random lengths batched in one call in random order, each with
    a decode step, a whole or a partial prefill, give every query the bits it gets in
    its span alone and alone as a decode step."""
    seq_lens = [int(n) for n in rng.integers(1, 200, size=7)]
    seqs = TcSequences(rng, SHAPES[shape], block_size, seq_lens)
    spans = []
    for b, seq_len in enumerate(seq_lens):
        q_len = int(rng.choice([1, seq_len, rng.integers(1, seq_len + 1)]))
        spans.append((b, seq_len - q_len, seq_len))
    order = rng.permutation(len(spans))
    batched = seqs.run([spans[i] for i in order])
    starts = np.cumsum([0] + [spans[i][2] - spans[i][1] for i in order])
    for row, i in enumerate(order):
        b, first, last = spans[i]
        got = batched[starts[row] : starts[row + 1]]
        assert np.array_equal(bits(got), bits(seqs.run([(b, first, last)]))), (b, "alone")
        for pos in range(first, last):
            alone = seqs.run([(b, pos, pos + 1)])
            assert np.array_equal(bits(alone), bits(got[pos - first : pos - first + 1])), (b, pos)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_tc_long_llama_prefill(cp, rng, block_size: int) -> None:
    """A 700-token prefill at Llama-3.1-8B shapes (many CTAs a sequence, the page ring
    wrapped many times): within BF16 rounding of the twin, and the same bits when cut
    in chunks of 256 and 333 (garbage past each), or run after another prefill."""
    seq_len = 700
    seqs = TcSequences(rng, SHAPES["llama-3.1-8b"], block_size, [seq_len, 300])
    whole = seqs.run([(0, 0, seq_len)])
    bf16_close(whole, seqs.ref([(0, 0, seq_len)]))
    for chunk in (256, 333):
        pieces = []
        for first in range(0, seq_len, chunk):
            last = min(first + chunk, seq_len)
            pieces.append(seqs.run([(0, first, last)], seqs.with_garbage_after(0, last)))
        assert np.array_equal(bits(np.concatenate(pieces)), bits(whole)), chunk
    batched = seqs.run([(1, 0, 300), (0, 0, seq_len)])
    assert np.array_equal(bits(batched[300:]), bits(whole))


def test_attention_tc_rejects_bad_inputs(cp, rng) -> None:
    num_heads, num_kv_heads, head_dim = SHAPES["smollm2-135m"]
    seqs = TcSequences(rng, (num_heads, num_kv_heads, head_dim), 16, [20, 5])
    q, block_tables, seq_lens, query_start_loc = (
        dev(x) for x in seqs.inputs([(0, 0, 20), (1, 4, 5)])
    )
    cache = seqs.device_cache
    good = dict(
        q=q,
        cache=cache,
        layer=LAYER,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        scale=0.125,
    )
    paged_attention_tc(**good)  # the baseline is accepted

    def rejects(match: str, **change) -> None:
        with pytest.raises(ValueError, match=match):
            paged_attention_tc(**{**good, **change})

    rejects("q must be a 3-d uint16", q=q.astype(np.float32))
    rejects("q must be C-contiguous", q=cp.asfortranarray(q))
    rejects("q must be a CuPy", q=host(q))
    rejects("cache must be a 6-d uint16", cache=cache[0])
    rejects("head_dim must be one of", q=cp.zeros((21, num_heads, 96), dtype=np.uint16))
    rejects("block_size must be one of", cache=cp.zeros((*cache.shape[:4], 8, 64), np.uint16))
    rejects("must be a multiple of num_kv_heads", q=cp.zeros((21, 10, head_dim), np.uint16))
    big_group = 3 * (ROWS_PER_CTA + 1)  # three KV heads
    rejects(f"must be at most {ROWS_PER_CTA}", q=cp.zeros((21, big_group, head_dim), np.uint16))
    rejects("layer must be in", layer=NUM_LAYERS)
    rejects("seq_lens must be", seq_lens=seq_lens[:1])
    rejects("holds no pages", block_tables=cp.zeros((2, 0), np.int32))
    rejects("out must have q's shape", out=cp.zeros((20, num_heads, head_dim), np.uint16))
    rejects(
        "q must start on a 16-byte boundary", q=cp.zeros(q.size + 1, np.uint16)[1:].reshape(q.shape)
    )
