"""Batch invariance of the NumPy twins that mix rows: GEMM and paged attention.

DESIGN §4 promises bit-identical logits whether a prefix was computed fresh,
reused, chunked or batched. These tests hold the two ops that see many rows at
once to it, on fresh random inputs: every row of every call is compared, bit
for bit, with the same row computed alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from reprise.cuda import attention
from reprise.cuda.attention import paged_attention_ref
from reprise.cuda.dtypes import BF16, F32, to_bf16
from reprise.cuda.gemm import gemm_ref, grid_bits, grid_exponent, prepare_weight, to_grid
from reprise.cuda.kvcache import kv_cache_shape, kv_write_ref

SIZES = [1, 2, 3, 7, 8, 9, 31, 64, 100, 257, 600]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype == BF16 else np.uint32)


def misaligned(a: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `a` starting `offset` bytes past a 64-byte boundary."""
    buf = np.empty(a.nbytes + 64 + offset, dtype=np.uint8)
    start = -buf.ctypes.data % 64 + offset
    out = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == offset % 64
    return out


def activations(rng: np.random.Generator, num_rows: int, k: int) -> np.ndarray:
    """BF16 rows of mixed scale, some with elements far below their largest."""
    x = rng.standard_normal((num_rows, k)) * np.exp2(rng.integers(-6, 7, size=(num_rows, 1)))
    tiny = rng.random((num_rows, k)) < 0.05
    x[tiny] *= np.exp2(-rng.integers(10, 40, size=tiny.sum()))
    return x.astype(BF16)


@pytest.mark.parametrize("k, n", [(576, 960), (1536, 320), (4096, 48)])
def test_gemm_row_is_independent_of_its_batch(rng: np.random.Generator, k: int, n: int) -> None:
    """Each row of a GEMM is bit-identical to that row alone, for any M, offset,
    companions, memory alignment, and whichever way the weight was handed over."""
    weight = rng.standard_normal((n, k)).astype(BF16)
    w = prepare_weight(weight)  # as the NumPy backend holds it
    pool = activations(rng, 640, k)
    alone = np.concatenate([gemm_ref(pool[i : i + 1], w, out_f32=True) for i in range(len(pool))])
    for m in SIZES:
        offset = int(rng.integers(0, len(pool) - m + 1))
        rows = np.arange(offset, offset + m)
        y = gemm_ref(pool[rows], w, out_f32=True)
        assert np.array_equal(bits(y), bits(alone[rows])), ("contiguous", m, offset)

        rows = rng.integers(0, len(pool), size=m)  # random companions, repeats allowed
        y = gemm_ref(
            misaligned(pool[rows], 2 * int(rng.integers(1, 32))), misaligned(w, 8), out_f32=True
        )
        assert np.array_equal(bits(y), bits(alone[rows])), ("companions, misaligned", m)

        y = gemm_ref(pool[rows].T.copy().T, w)  # Fortran-ordered input, BF16 output
        assert np.array_equal(bits(y), bits(to_bf16(alone[rows]))), ("bf16 out", m)
    few = rng.choice(len(pool), size=9, replace=False)
    for handed in (weight, weight.astype(F32), misaligned(weight.astype(F32), 4)):
        assert np.array_equal(bits(gemm_ref(pool[few], handed, out_f32=True)), bits(alone[few]))


@pytest.mark.parametrize("k", [576, 14336])
def test_gemm_float64_sum_is_exact(rng: np.random.Generator, k: int) -> None:
    """The claim the invariance rests on: on the grids, BLAS's float64 sum equals the
    integer dot product, even where every product is as large as the grid allows."""
    x, w = activations(rng, 6, k), activations(rng, 10, k)
    x[0], w[0] = BF16.type(-1.9921875), BF16.type(-1.9921875)  # the largest mantissa, one sign
    x_exp, w_exp = grid_exponent(x), grid_exponent(w)
    b = grid_bits(k)
    x_grid, w_grid = to_grid(x.astype(np.float64), b, x_exp), prepare_weight(w)
    x_int = np.ldexp(x_grid, b - x_exp).astype(np.int64)  # integers |.| <= 2^b
    w_int = np.ldexp(w_grid, b - w_exp).astype(np.int64)
    assert np.array_equal(np.ldexp(x_int.astype(np.float64), x_exp - b), x_grid)
    exact = np.ldexp((x_int @ w_int.T).astype(np.float64), x_exp - b + (w_exp - b).T)
    assert np.array_equal(x_grid @ w_grid.T, exact)
    assert np.array_equal(bits(gemm_ref(x, w, out_f32=True)), bits(exact.astype(np.float32)))


def test_gemm_stays_within_fp32_accumulation_error_on_wide_ranges(rng: np.random.Generator) -> None:
    """The per-row grid moves elements far below their row's largest by at most 2^-b of
    it; the result stays as close to the exact product as an fp32 accumulation's."""
    k = 1536
    x, w = activations(rng, 64, k), activations(rng, 200, k)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    exact = x64 @ w64.T
    err = np.abs(gemm_ref(x, w, out_f32=True) - exact)
    grid = 2.0 ** -grid_bits(k)
    row_max_x, row_max_w = np.abs(x64).max(1)[:, None], np.abs(w64).max(1)[None, :]
    moved = grid * (
        row_max_x * np.abs(w64).sum(1)[None, :] + np.abs(x64).sum(1)[:, None] * row_max_w
    )
    assert np.all(err <= 2.0**-24 * np.abs(exact) + moved)
    fp32 = x.astype(np.float32) @ w.astype(np.float32).T
    assert rel_l2(gemm_ref(x, w, out_f32=True), exact) < 2 * rel_l2(fp32, exact)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --- paged attention ---------------------------------------------------------------------

NUM_HEADS, NUM_KV, HEAD_DIM, NUM_LAYERS, LAYER = 9, 3, 64, 2, 1


def test_exp_gives_each_value_the_same_bits_in_any_array(rng: np.random.Generator) -> None:
    """Attention's one non-exact elementwise op: numpy must compute each float32 the
    same way whatever the array's length, offset or strides (one SIMD routine)."""
    values = -np.abs(rng.standard_normal(4096) * 30).astype(np.float32)  # s - m <= 0
    values[:4] = [0.0, -0.0, -np.inf, -1e-30]
    want = np.exp(values)
    assert np.array_equal(bits(want[:2]), bits(np.ones(2, np.float32))) and want[2] == 0.0
    for length in (1, 2, 3, 7, 8, 9, 15, 16, 17, 33, 100):
        for start in (0, 1, 5):
            piece = values[start : start + length]
            assert np.array_equal(bits(np.exp(piece)), bits(want[start : start + length]))
            assert np.array_equal(
                bits(np.exp(piece.reshape(-1, 1))[:, 0]), bits(want[start : start + length])
            )
    assert np.array_equal(bits(np.exp(values[::3])), bits(want[::3]))
    assert np.array_equal(bits(np.exp(values.reshape(64, 64).T)), bits(want.reshape(64, 64).T))


class PagedSequences:
    """Sequences of random K/V in a shuffled block pool; free slots hold stale garbage."""

    def __init__(self, rng: np.random.Generator, block_size: int, seq_lens: list[int]) -> None:
        self.rng, self.block_size = rng, block_size
        num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
        shape = kv_cache_shape(num_blocks, NUM_LAYERS, NUM_KV, block_size, HEAD_DIM)
        self.cache = (rng.standard_normal(shape) * 3).astype(BF16)  # stale data everywhere
        free = list(rng.permutation(num_blocks))
        self.tables = [[int(free.pop()) for _ in range(-(-s // block_size))] for s in seq_lens]
        self.queries = []
        for table, seq_len in zip(self.tables, seq_lens, strict=True):
            scale = np.exp2(rng.integers(-3, 3, size=(seq_len, NUM_KV, 1)))
            k = (rng.standard_normal((seq_len, NUM_KV, HEAD_DIM)) * scale).astype(BF16)
            v = (rng.standard_normal((seq_len, NUM_KV, HEAD_DIM)) * scale).astype(BF16)
            kv_write_ref(self.cache, LAYER, k, v, self.slots(table, 0, seq_len))
            self.queries.append(
                (rng.standard_normal((seq_len, NUM_HEADS, HEAD_DIM)) * 2).astype(BF16)
            )

    def slots(self, table: list[int], first: int, last: int) -> np.ndarray:
        pos = np.arange(first, last)
        return np.asarray(table)[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(
        self, spans: list[tuple[int, int, int]], cache: np.ndarray | None = None, window: int = 0
    ) -> np.ndarray:
        """Attention for (sequence, first, last) query spans batched in one call."""
        tables = [self.tables[b] for b, _, _ in spans]
        width = max(len(t) for t in tables)
        block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
        lens = [last - first for _, first, last in spans]
        return paged_attention_ref(
            np.concatenate([self.queries[b][first:last] for b, first, last in spans]),
            self.cache if cache is None else cache,
            LAYER,
            block_tables,
            np.array([last for _, _, last in spans], dtype=np.int32),
            np.cumsum([0, *lens]).astype(np.int32),
            1 / np.sqrt(HEAD_DIM),
            window,
        )

    def with_garbage_after(self, b: int, last: int) -> np.ndarray:
        """The cache as a chunked prefill sees it: slots past `last` not yet written."""
        cache = self.cache.copy()
        end = len(self.tables[b]) * self.block_size
        garbage = (self.rng.standard_normal((end - last, NUM_KV, HEAD_DIM)) * 50).astype(BF16)
        garbage[::3, 0, :5] = np.nan  # what a page's earlier use may leave behind
        kv_write_ref(cache, LAYER, garbage, garbage, self.slots(self.tables[b], last, end))
        return cache


@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_query_independent_of_chunking(rng: np.random.Generator, block_size: int) -> None:
    """A query's output is bit-identical whether it runs with its whole prompt, in a
    chunk of any size (unwritten future slots holding garbage), or alone as a decode step."""
    seq_len = int(rng.integers(90, 140))
    seqs = PagedSequences(rng, block_size, [seq_len])
    whole = seqs.run([(0, 0, seq_len)])
    for chunk in (1, 7, 16, 32, 50):
        pieces = [
            seqs.run(
                [(0, s, min(s + chunk, seq_len))],
                seqs.with_garbage_after(0, min(s + chunk, seq_len)),
            )
            for s in range(0, seq_len, chunk)
        ]
        assert np.array_equal(bits(np.concatenate(pieces)), bits(whole)), chunk


@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_query_independent_of_other_sequences(
    rng: np.random.Generator, block_size: int
) -> None:
    """Sequences of random lengths batched in one call, each with a random number of
    queries (decode, partial and whole prefills), give every query the bits it gets alone."""
    seq_lens = [int(n) for n in rng.integers(1, 200, size=7)]
    seqs = PagedSequences(rng, block_size, seq_lens)
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
        for pos in range(first, last):  # each query alone as a decode step
            assert np.array_equal(
                bits(seqs.run([(b, pos, pos + 1)])), bits(got[pos - first : pos - first + 1])
            ), (b, pos)


@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_bits_do_not_depend_on_how_the_op_blocks_its_work(
    rng: np.random.Generator, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of pages, blocks of rows, one p . v matmul or one per tile: the sums are
    exact, so every way of cutting the work gives the same bits."""
    seq_lens = [int(n) for n in rng.integers(1, 300, size=4)]
    seqs = PagedSequences(rng, block_size, seq_lens)
    spans = [(b, int(rng.integers(0, n)), n) for b, n in enumerate(seq_lens)]
    default = seqs.run(spans)
    for kv_budget, min_rows, batched_rows in [(1, 1, 0), (1 << 12, 5, 1 << 20), (1 << 30, 1000, 3)]:
        monkeypatch.setattr(attention, "_KV_BUDGET", kv_budget)
        monkeypatch.setattr(attention, "_MIN_BLOCK_ROWS", min_rows)
        monkeypatch.setattr(attention, "_SCORE_BUDGET", 1)
        monkeypatch.setattr(attention, "_BATCHED_PV_ROWS", batched_rows)
        assert np.array_equal(bits(seqs.run(spans)), bits(default)), (kv_budget, min_rows)
