"""Paged attention, one routine for prefill and decode queries.

For each sequence, its queries (the last `q_len` tokens of `seq_len`) attend
causally to keys read from the paged cache. The key range is cut into chunks of
KV_CHUNK keys at the absolute positions c * KV_CHUNK; each chunk a query sees gets
its own online softmax in fp32, over its pages (the key tiles, `block_size` keys
each) in ascending order, starting from m = -inf, denom = acc = 0:

    s = (q . k) * scale                 fp32 (BF16 operands)
    s = c * tanh(s * r)                 only with a soft cap c > 0 (softcap_scores)
    m' = max(m, max(s));  a = exp(m - m')
    denom = denom * a + sum(exp(s - m'))  fp32 probabilities summed
    acc = acc * a + bf16(exp(s - m')) . v   probabilities rounded to BF16 for the PV product

and the chunks' states are merged in ascending chunk order, the first chunk's
state taken as it is, then for each later chunk (m2, denom2, acc2):

    m' = max(m, m2);  a1 = exp(m - m');  a2 = exp(m2 - m')
    denom = denom * a1 + denom2 * a2    acc = acc * a1 + acc2 * a2   (fp32, each op rounded)

and finally out = bf16(acc / denom). The GPU kernels compute chunks in parallel at
decode (one CTA per chunk) and one after another in a prefill; fixing the chunk
boundaries and the merge order makes both give the same bits.

Soft-capping (Gemma 2's attn_logit_softcapping, `softcap` = c > 0): each score, already
scaled, becomes c * tanh(s / c) before the mask and the softmax, computed as
`softcap_scores` defines it in fp32: r = fp32(1 / c) once, then fp32(s * r), its tanh
(rounded to fp32), and fp32(c * tanh) (torch divides by a scalar as a product with its
reciprocal too). The kernels repeat the three steps with fp32 tanhf, whose last bit
need not be the rounded tanh: within a few fp32 ulps of a score, far inside BF16's
tolerance. c = 0: no cap, not one operation more.

Grouped-query heads are stacked as rows (query head h reads KV head
h // group), so each K/V page serves its whole group at once. Key tiles are
the cache pages (`block_size` keys) and always start at multiples of
`block_size`; KV_CHUNK is a multiple of every block size, so a chunk is whole pages.

Why a query's result does not depend on its batch
-------------------------------------------------
A query row's output must be bit-identical whether it runs with its whole
prompt, in a chunk of any size, alone as a decode step, or next to other
sequences. A batched fp32 matmul does not give that (its rounding depends on
the row's place in the BLAS tiles), so every value above is made a function of
the row's own query and the keys it sees:

- The three sums are exact in float64, whatever order a batched matmul or
  reduction takes, and then rounded once to fp32 (as in `gemm`):
  q . k: each cached K vector is rounded to its grid 2^(e_k - 22) (max|k| <
  2^e_k; BF16 elements within 2^-14 of the largest are already on it) and each
  q vector to 2^(e_q - b_q), b_q = 53 - ceil(log2 head_dim) - 22, so all
  products are multiples of one quantum and head_dim of them stay below 2^53.
  p . v: V vectors likewise, written 2^e_j * v^_j with |v^| <= 1; the 2^e_j
  moves onto p^_j = bf16(p_j) * 2^e_j (exact), and a row's p^ in one tile are
  rounded to a grid set by their largest, b_p = 53 - ceil(log2 block_size) - 22
  bits below it; only the row's visible keys count (masked ones have p = 0).
  sum(p): fp32 p on the fixed grid 2^-(52 - log2 block_size), exact for p < 2;
  the tile holding the running max adds exp(0) = 1, so denom >= 1 and the grid
  costs under 2^-40 of it.
- Everything else (scale, cap, mask, max, exp, the rescaling by a) is elementwise on
  fp32: the same operation for a value wherever it sits in an array. exp always
  gets a fresh contiguous array, which numpy evaluates with one SIMD routine
  whatever its length or offset.
- A tile whose keys are all in a row's future gives m' = m, a = 1, p = 0 and
  adds +0 to sums that are never -0: the row's chunk state is left exactly
  unchanged. A chunk wholly in a row's future is not merged into the row's state
  at all. So the op may cut its work any way: pages are gathered some KV chunks
  at a time, rows run in blocks over the tiles the block's last row sees, a row
  skips the tiles and chunks it does not see, and every cut gives the same bits.
- The chunk boundaries sit at absolute positions c * KV_CHUNK, a constant, and
  the merge is elementwise fp32 on the row's own states in ascending chunk
  order: neither depends on the batch, q_len or how the work is cut.
- Cache slots past seq_len (stale data from the page's earlier use) are zeroed
  after the gather, so nothing there, not even a NaN, reaches a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .dtypes import BF16, F32, to_bf16
from .gemm import F64, exact_to_f32, grid_exponent, to_grid

# Grid bits of cached K and V vectors, rounded in fp32 (whose `to_grid` holds up to 22
# bits); q and p take the rest of the 53 - log2(length) bits that keep their sums exact.
CACHE_GRID_BITS = 22
# Keys of one KV chunk: the key range is cut at multiples of it, each chunk's softmax
# starts afresh and the chunks' states merge in ascending order (see the docstring).
# A multiple of every block size (16, 32, 64). 256 keys give a decode CTA enough work
# (a 128-dim head reads 128 KiB of K and V per chunk) to pay for writing its partial
# state (head_dim + 2 floats per query head, under 2% of those bytes), and a prefill
# merges its accumulators once per 256 keys; a batch-1 decode still gets a wave of
# CTAs at 2K context by splitting the query-head group (attention_kernel.split_grid).
# attention.cu and attention_tc.cu repeat it as kKvChunk.
KV_CHUNK = 256
# The soft caps the kernels take: 0 (none) or c in this range, where c, its reciprocal
# and the products the cap forms stay normal fp32 numbers (the kernels flush subnormals).
SOFTCAP_RANGE = (2.0**-64, 2.0**64)
# Pages are gathered whole KV chunks at a time: about this many float64 elements of K.
_KV_BUDGET = 1 << 18
# Rows per block: [kv_heads, rows, keys] arrays of about this many elements stay in L2,
# but never fewer rows than this, which would spend the time on Python overhead.
_SCORE_BUDGET = 1 << 17
_MIN_BLOCK_ROWS = 64
# Up to this many rows (decode), p . v runs as one matmul over all tiles, else tile by tile.
_BATCHED_PV_ROWS = 16


def paged_attention_ref(
    q: np.ndarray,
    cache: np.ndarray,
    layer: int,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> np.ndarray:
    """
    q:               [T, num_heads, head_dim] BF16, roped
    cache:           [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] BF16
    block_tables:    [B, max_blocks_per_seq] int32
    seq_lens:        [B] keys visible to each sequence's last query
    query_start_loc: [B + 1] rows of q belonging to each sequence
    window:          a sliding window: the query at position p sees keys p - window + 1
                     to p; 0: keys 0 to p
    softcap:         c > 0: each scaled score s becomes c * tanh(s / c) (softcap_scores)
                     before the mask and the softmax; 0: no cap
    returns          [T, num_heads, head_dim] BF16
    """
    assert window >= 0, window
    assert softcap >= 0 and math.isfinite(softcap), softcap
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[3], cache.shape[4]
    group = num_heads // num_kv_heads
    out = np.empty((num_tokens, num_heads, head_dim), dtype=F32)
    q_grid = to_grid(q.astype(F64), _other_bits(head_dim), grid_exponent(q))  # [T, heads, dim]
    assert KV_CHUNK % block_size == 0, (KV_CHUNK, block_size)
    chunk_tiles = KV_CHUNK // block_size
    gather_tiles = chunk_tiles * max(1, _KV_BUDGET // (num_kv_heads * KV_CHUNK * head_dim))
    for b in range(len(seq_lens)):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, seq_len = end - start, int(seq_lens[b])
        if q_len == 0:
            continue
        num_rows = q_len * group
        # rows ordered (token, group member) within each KV head: [kv_heads, q_len * group, head_dim]
        rows = q_grid[start:end].reshape(q_len, num_kv_heads, group, head_dim)
        rows = rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_rows, head_dim)
        row_pos = np.repeat(np.arange(seq_len - q_len, seq_len), group)  # [q_len * group]
        # each row's first visible key: ascending with row_pos
        row_lo = np.maximum(row_pos - window + 1, 0) if window else np.zeros_like(row_pos)
        total = _RowState.start(num_kv_heads, num_rows, head_dim)
        # KV chunks before the first row's window are seen by no row
        start_tile = int(row_lo[0]) // KV_CHUNK * chunk_tiles
        for t0 in range(start_tile, -(-seq_len // block_size), gather_tiles):
            gathered = _Pages.gather(cache, layer, block_tables[b], t0, t0 + gather_tiles, seq_len)
            for c0 in range(0, gathered.num_tiles, chunk_tiles):
                pages = gathered.tiles(c0, c0 + chunk_tiles)  # one KV chunk
                # rows before `first` see none of this chunk (it is in their future), nor
                # rows from `last` on (it is before their window); the rest go in blocks
                first = int(np.searchsorted(row_pos, pages.first_key))
                last = int(np.searchsorted(row_lo, pages.end_key))
                if first >= last:
                    continue
                state = _RowState.start(num_kv_heads, last - first, head_dim)
                block_rows = max(_MIN_BLOCK_ROWS, _SCORE_BUDGET // pages.keys[..., 0].size)
                for r0 in range(first, last, block_rows):
                    r1 = min(r0 + block_rows, last)
                    chunk = state.rows(r0 - first, r1 - first)
                    _attend(
                        rows[:, r0:r1], row_pos[r0:r1], row_lo[r0:r1], pages, F32.type(scale),
                        F32.type(softcap), chunk,
                    )  # fmt: skip
                # the chunk holding a row's first visible key is the row's first chunk
                total.rows(first, last).merge(state, first=row_lo[first:last] >= pages.first_key)
        result = total.acc / total.denom[..., None]  # [kv_heads, q_len * group, head_dim]
        out[start:end] = (
            result.reshape(num_kv_heads, q_len, group, head_dim)
            .transpose(1, 0, 2, 3)
            .reshape(q_len, num_heads, head_dim)
        )
    return to_bf16(out)


def softcap_scores(s: np.ndarray, softcap: np.float32) -> np.ndarray:
    """Soft-capped scores, the definition the kernels follow step for step: with c =
    `softcap` (> 0) and r = fp32(1 / c), each fp32 score s (already scaled) becomes
    fp32(c * t), t = tanh(fp32(s * r)) rounded to fp32 (taken in float64 here: the
    rounded value; the kernels' tanhf is within a few fp32 ulps of it). Elementwise, on
    a fresh contiguous array: the same bits for a score wherever it sits."""
    c = F32.type(softcap)
    r = F32.type(1.0) / c
    t = np.tanh((s * r).astype(F64)).astype(F32)
    return t * c


def _other_bits(length: int) -> int:
    """Grid bits of the operand multiplied with cached vectors in a `length`-long sum."""
    bits = 53 - math.ceil(math.log2(length)) - CACHE_GRID_BITS
    assert bits >= 8, length  # at least BF16's own precision
    return bits


@dataclass(slots=True)
class _RowState:
    """The online softmax of some query rows, fp32; before the first tile m = -inf,
    denom = acc = 0, which the first tile's a = exp(-inf) = 0 turns into its own sums."""

    m: np.ndarray  # [kv_heads, R] running max
    denom: np.ndarray  # [kv_heads, R]
    acc: np.ndarray  # [kv_heads, R, head_dim]

    @classmethod
    def start(cls, num_kv_heads: int, num_rows: int, head_dim: int) -> _RowState:
        return cls(
            np.full((num_kv_heads, num_rows), -np.inf, dtype=F32),
            np.zeros((num_kv_heads, num_rows), dtype=F32),
            np.zeros((num_kv_heads, num_rows, head_dim), dtype=F32),
        )

    def rows(self, r0: int, r1: int) -> _RowState:
        """Views of rows [r0, r1): updating them updates this state."""
        return _RowState(self.m[:, r0:r1], self.denom[:, r0:r1], self.acc[:, r0:r1])

    def merge(self, chunk: _RowState, *, first: np.ndarray) -> None:
        """Fold the next KV chunk's state into this one (the rows' state over the chunks
        before it), elementwise in fp32; `first` ([R] bool): the chunk is that row's
        first, whose state is taken as it is. The kernels repeat this formula op for op."""
        m = np.maximum(self.m, chunk.m)
        a1, a2 = np.exp(self.m - m), np.exp(chunk.m - m)  # [kv_heads, R] each
        denom = self.denom * a1 + chunk.denom * a2
        acc = self.acc * a1[..., None] + chunk.acc * a2[..., None]
        self.denom[...] = np.where(first, chunk.denom, denom)
        self.acc[...] = np.where(first[:, None], chunk.acc, acc)
        self.m[...] = np.where(first, chunk.m, m)


@dataclass(slots=True)
class _Pages:
    """Consecutive K/V pages of one sequence, gathered in order and put on their grids."""

    first_key: int  # position of keys[:, 0]
    keys: np.ndarray  # [kv_heads, tiles * block_size, head_dim] float64 on grid
    values: np.ndarray  # [kv_heads, tiles * block_size, head_dim] float64 v^, |v^| <= 1
    value_scale: np.ndarray  # [kv_heads, tiles * block_size] 2^e_j of each value vector
    block_size: int

    @property
    def num_tiles(self) -> int:
        return self.keys.shape[1] // self.block_size

    @property
    def end_key(self) -> int:
        """The position after the last key gathered."""
        return self.first_key + self.keys.shape[1]

    def tiles(self, t0: int, t1: int) -> _Pages:
        """Views of this chunk's tiles [t0, t1) (cut at its end)."""
        k0, k1 = t0 * self.block_size, t1 * self.block_size
        return _Pages(self.first_key + k0, self.keys[:, k0:k1], self.values[:, k0:k1],
                      self.value_scale[:, k0:k1], self.block_size)  # fmt: skip

    @classmethod
    def gather(
        cls, cache: np.ndarray, layer: int, table: np.ndarray, t0: int, t1: int, seq_len: int
    ) -> _Pages:
        """Tiles [t0, t1) of the sequence with block table `table`, cut at seq_len."""
        num_kv_heads, block_size, head_dim = cache.shape[3:]
        t1 = min(t1, -(-seq_len // block_size))
        pages = cache[np.asarray(table[t0:t1], dtype=np.intp), layer]
        # [tiles, 2, kv_heads, block_size, head_dim] -> fp32 on each vector's grid, in place
        exponent = grid_exponent(pages)  # [tiles, 2, kv_heads, block_size, 1]
        kv = pages.astype(F32)
        to_grid(kv, CACHE_GRID_BITS, exponent, out=kv)
        shape = (num_kv_heads, t1 - t0, block_size, head_dim)
        keys: np.ndarray = np.empty(shape, dtype=F64)
        values: np.ndarray = np.empty(shape, dtype=F64)
        keys.transpose(1, 0, 2, 3)[...] = kv[:, 0]
        values.transpose(1, 0, 2, 3)[...] = kv[:, 1]
        # v^ = v / 2^e_j, exact; p_j takes the 2^e_j instead
        value_exponent = exponent[:, 1].transpose(1, 0, 2, 3)  # [kv_heads, tiles, block_size, 1]
        values *= np.ldexp(1.0, -value_exponent)
        keys = keys.reshape(num_kv_heads, -1, head_dim)
        values = values.reshape(num_kv_heads, -1, head_dim)
        # NOTE: slots past seq_len hold stale data from the page's earlier use; no row sees
        # them, and zeroed they cannot reach one through 0 * NaN.
        num_valid = seq_len - t0 * block_size
        keys[:, num_valid:] = 0.0
        values[:, num_valid:] = 0.0
        value_scale = np.ldexp(1.0, value_exponent.reshape(num_kv_heads, -1))
        value_scale[:, num_valid:] = 1.0
        return cls(t0 * block_size, keys, values, value_scale, block_size)


def _attend(
    rows: np.ndarray, row_pos: np.ndarray, row_lo: np.ndarray, pages: _Pages,
    scale: np.float32, softcap: np.float32, state: _RowState,
) -> None:  # fmt: skip
    """Run rows ([kv_heads, R, head_dim] float64 on grid, positions ascending, each
    seeing some key of the chunk: keys row_lo to row_pos) over the chunk's tiles up to
    the last row's, and update their state. A row skips the tiles it sees no key of
    (in its future, or before its window): its state is left exactly unchanged.
    `softcap` > 0 caps the scaled scores (softcap_scores) before the mask."""
    num_kv_heads, num_rows, head_dim = rows.shape
    block_size = pages.block_size
    num_tiles = min(
        (int(row_pos[-1]) - pages.first_key) // block_size + 1, pages.keys.shape[1] // block_size
    )
    num_keys = num_tiles * block_size
    tiled = (num_kv_heads, num_rows, num_tiles, block_size)

    keys = pages.keys[:, :num_keys].transpose(0, 2, 1)  # [kv_heads, head_dim, keys]
    s = exact_to_f32(rows @ keys) * scale  # [kv_heads, R, keys]
    if softcap > 0:
        s = softcap_scores(s, softcap)
    key_pos = pages.first_key + np.arange(num_keys)[None, :]
    visible = (key_pos <= row_pos[:, None]) & (key_pos >= row_lo[:, None])  # [R, keys]
    s = np.where(visible, s, F32.type(-np.inf)).reshape(tiled)
    # running max after each tile (from the state's), and the factor that rescales the
    # state entering each tile
    m = np.concatenate([state.m[..., None], s.max(axis=-1)], axis=-1)
    m = np.maximum.accumulate(m, axis=-1)  # [kv_heads, R, 1 + tiles]
    # a row's max is -inf until its window's first tile; such a tile is all -inf, so a
    # max of 0 there gives p = 0 and no NaN (the row skips the tile anyway)
    m_safe = np.where(m == -np.inf, F32.type(0.0), m)
    alpha = np.exp(m[..., :-1] - m_safe[..., 1:])  # [kv_heads, R, tiles]
    p = np.exp(s - m_safe[..., 1:, None])  # [kv_heads, R, tiles, block_size] fp32

    # sum(p): a fixed grid of 2^-sum_bits, exact below 2^53 quanta for p < 2; the tile
    # holding the running max has p = 1, so denom >= 1 and the grid costs < 2^-40 of it.
    sum_bits = 52 - math.ceil(math.log2(block_size))
    shift = F64.type(1.5 * 2.0 ** (52 - sum_bits))
    on_grid = np.add(p, shift)
    np.subtract(on_grid, shift, out=on_grid)
    p_sum = exact_to_f32(on_grid @ np.ones(block_size))  # [kv_heads, R, tiles]

    # p^_j = bf16(p_j) * 2^e_j (exact) on a grid per (row, tile), times v^_j on its grid
    value_scale = pages.value_scale[:, None, :num_keys].reshape(
        num_kv_heads, 1, num_tiles, block_size
    )
    p_hat = np.multiply(p.astype(BF16), value_scale, dtype=F64)
    largest = p_hat.max(axis=-1, keepdims=True)  # p^ >= 0: its max is its max |.|
    to_grid(p_hat, _other_bits(block_size), np.frexp(largest)[1], out=p_hat)
    values = pages.values[:, :num_keys].reshape(num_kv_heads, num_tiles, block_size, head_dim)
    if num_rows <= _BATCHED_PV_ROWS:  # decode: one matmul over every tile
        pv_all = np.matmul(p_hat.transpose(0, 2, 1, 3), values)  # [kv_heads, tiles, R, head_dim]
        pv_all = exact_to_f32(pv_all)

    # the recurrence, tile by tile; rows before `first` (tile t is in their future) and
    # from `last` on (it is before their window) do not see tile t and keep their state
    tile_keys = pages.first_key + np.arange(num_tiles) * block_size
    first_rows = np.searchsorted(row_pos, tile_keys).tolist()
    last_rows = np.searchsorted(row_lo, tile_keys + block_size).tolist()
    for t, (first, last) in enumerate(zip(first_rows, last_rows, strict=True)):
        if first >= last:
            continue
        if num_rows <= _BATCHED_PV_ROWS:
            pv = pv_all[:, t, first:last]
        else:  # tile by tile keeps the product in cache and skips the rows that do not see it
            pv = exact_to_f32(p_hat[:, first:last, t] @ values[:, t])  # [kv_heads, rows, head_dim]
        a = alpha[:, first:last, t]
        state.denom[:, first:last] = state.denom[:, first:last] * a + p_sum[:, first:last, t]
        state.acc[:, first:last] = state.acc[:, first:last] * a[..., None] + pv
    state.m[...] = m[..., -1]
