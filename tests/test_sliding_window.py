"""Sliding-window attention in the twin (paged_attention_ref's `window`).

A query at position p sees keys p - window + 1 to p (transformers'
sliding_window_overlay). The KV chunks keep their fixed boundaries; a row skips the
tiles and chunks it sees no key of, and the chunk holding its first visible key is its
first (taken as it is). Here: it matches float64 windowed attention at windows around
the tile and chunk sizes, a window no shorter than the sequence changes no bit, the
window reaches the bits, and a query's bits still depend on nothing but its own keys:
not its batch, its chunk of the prompt, its path (prefill or decode) or how the op cuts
its work.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_invariance_ops import PagedSequences, bits
from test_ops import _dense_attention, _fill_sequences, rel_l2

from reprise.cuda import attention
from reprise.cuda.attention import KV_CHUNK, paged_attention_ref

S = KV_CHUNK


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [1, 15, 16, 17, S - 1, S, S + 1, 2 * S + 3])
def test_twin_matches_dense_windowed_float64(
    rng: np.random.Generator, block_size: int, window: int
) -> None:
    """Decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys, a prefill over 2S + 5 keys and
    a chunk of 40 queries ending at 3S + 2."""
    specs = [(1, 1), (S - 1, 1), (S, 1), (S + 1, 1), (3 * S + 7, 1), (2 * S + 5, 2 * S + 5),
             (3 * S + 2, 40)]  # fmt: skip
    cache, block_tables, keys, values, qs = _fill_sequences(rng, block_size, specs)
    q = np.concatenate(qs)
    starts = np.cumsum([0] + [ql for _, ql in specs]).astype(np.int32)
    seq_lens = np.array([s for s, _ in specs], dtype=np.int32)
    out = paged_attention_ref(q, cache, 1, block_tables, seq_lens, starts, 1 / np.sqrt(32), window)
    for b, (seq_len, q_len) in enumerate(specs):
        want = _dense_attention(
            qs[b].astype(np.float64),
            keys[b].astype(np.float64),
            values[b].astype(np.float64),
            np.arange(seq_len - q_len, seq_len),
            window,
        )
        assert rel_l2(out[starts[b] : starts[b + 1]], want) < 1e-2, b


def test_a_window_of_one_returns_each_querys_own_value(rng: np.random.Generator) -> None:
    """Window 1: each row sees only its own key, so its output is its value (but for the
    elements far below a vector's largest, which the cache's grid rounds)."""
    seq_len = 2 * S + 9
    cache, block_tables, _, values, qs = _fill_sequences(rng, 16, [(seq_len, seq_len)])
    out = paged_attention_ref(qs[0], cache, 1, block_tables, np.array([seq_len], np.int32),
                              np.array([0, seq_len], np.int32), 1 / np.sqrt(32), 1)  # fmt: skip
    want = np.repeat(values[0], 3, axis=1)
    assert np.mean(bits(out) != bits(want)) < 0.01 and rel_l2(out, want) < 1e-4


def test_a_window_no_shorter_than_the_sequence_changes_no_bit(rng: np.random.Generator) -> None:
    seq_lens = [int(n) for n in rng.integers(1, 3 * S, size=5)]
    seqs = PagedSequences(rng, 16, seq_lens)
    spans = [(b, int(rng.integers(0, n)), n) for b, n in enumerate(seq_lens)]
    full = seqs.run(spans)
    assert np.array_equal(bits(seqs.run(spans, window=max(seq_lens))), bits(full))
    windowed = seqs.run(spans, window=S // 2)
    long = [i for i, (_, first, last) in enumerate(spans) if last > S // 2]
    assert long and not np.array_equal(bits(windowed), bits(full))  # the window binds


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """KV_CHUNK of 32 keys, so that the tests' short sequences span many chunks."""
    monkeypatch.setattr(attention, "KV_CHUNK", 32)
    return 32


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [5, 32, 33, 70])
def test_windowed_query_independent_of_chunking(
    rng: np.random.Generator, block_size: int, window: int, small_chunks: int
) -> None:
    """A query's bits are the same in its whole prompt, in prefill chunks of any size
    (garbage past each), and as a decode step."""
    seq_len = 5 * small_chunks + int(rng.integers(1, small_chunks))
    seqs = PagedSequences(rng, block_size, [seq_len])
    whole = seqs.run([(0, 0, seq_len)], window=window)
    for chunk in (1, 7, small_chunks, 50):
        pieces = [
            seqs.run(
                [(0, s, min(s + chunk, seq_len))],
                seqs.with_garbage_after(0, min(s + chunk, seq_len)),
                window=window,
            )
            for s in range(0, seq_len, chunk)
        ]
        assert np.array_equal(bits(np.concatenate(pieces)), bits(whole)), chunk


@pytest.mark.parametrize("window", [9, 48])
def test_windowed_query_independent_of_its_batch(
    rng: np.random.Generator, window: int, small_chunks: int
) -> None:
    """Batch 7 (decodes, partial and whole prefills, in a random order) against each span
    alone and each query alone as a decode step."""
    seq_lens = [int(n) for n in rng.integers(1, 8 * small_chunks, size=7)]
    seqs = PagedSequences(rng, 16, seq_lens)
    spans = []
    for b, seq_len in enumerate(seq_lens):
        q_len = int(rng.choice([1, seq_len, rng.integers(1, seq_len + 1)]))
        spans.append((b, seq_len - q_len, seq_len))
    order = rng.permutation(len(spans))
    batched = seqs.run([spans[i] for i in order], window=window)
    starts = np.cumsum([0] + [spans[i][2] - spans[i][1] for i in order])
    for row, i in enumerate(order):
        b, first, last = spans[i]
        got = batched[starts[row] : starts[row + 1]]
        assert np.array_equal(bits(seqs.run([(b, first, last)], window=window)), bits(got)), b
        for pos in range(first, last, 5):
            alone = seqs.run([(b, pos, pos + 1)], window=window)
            assert np.array_equal(bits(alone), bits(got[pos - first : pos - first + 1])), pos


@pytest.mark.parametrize("block_size", [16, 32])
def test_windowed_bits_do_not_depend_on_how_the_op_blocks_its_work(
    rng: np.random.Generator, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seq_lens = [int(n) for n in rng.integers(1, 600, size=4)]
    seqs = PagedSequences(rng, block_size, seq_lens)
    spans = [(b, int(rng.integers(0, n)), n) for b, n in enumerate(seq_lens)]
    default = seqs.run(spans, window=100)
    for kv_budget, min_rows, batched_rows in [(1, 1, 0), (1 << 12, 5, 1 << 20), (1 << 30, 1000, 3)]:
        monkeypatch.setattr(attention, "_KV_BUDGET", kv_budget)
        monkeypatch.setattr(attention, "_MIN_BLOCK_ROWS", min_rows)
        monkeypatch.setattr(attention, "_SCORE_BUDGET", 1)
        monkeypatch.setattr(attention, "_BATCHED_PV_ROWS", batched_rows)
        assert np.array_equal(bits(seqs.run(spans, window=100)), bits(default)), kv_budget
