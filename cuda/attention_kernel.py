"""Launcher of the paged attention kernel (cuda/attention.cu); twin: `paged_attention_ref`.

One kernel serves prefill and decode: each sequence's queries are the last
`q_len` of its `seq_len` positions and attend causally (within a sliding window,
where one is given: keys p - window + 1 to p) to K/V read from the paged cache, page by
page in ascending order, with an online softmax in fp32
(probabilities rounded to BF16 for the P.V product), exactly the recurrence the
twin's docstring writes down; with a soft cap c > 0 (Gemma 2's), each scaled score
becomes c * tanh(s / c) first, as the twin's `softcap_scores` defines it. Results agree
with the twin within BF16 rounding.

Work (`split_grid`): one CTA per (query tile, head slot, KV lane). A head slot is a
KV head, or a part of its query-head group (`head_parts`), so a batch-1 decode still
gets a wave of CTAs; a query tile is up to `ROWS_PER_CTA // (group // head_parts)`
consecutive queries of one sequence, its rows the (query, query head) pairs, so a K/V
page is read once for all the slot's heads. The key range is cut into KV chunks of
KV_CHUNK keys at fixed positions; a (query tile, head slot) spreads its chunks over
`kv_lanes` CTAs (chunk c0 + i to lane i % kv_lanes, c0 the chunk holding the tile's
first visible key: 0 without a window). Each CTA finds its (sequence, tile) on the device from
`query_start_loc`, so the grid is planned from T, B and the block table's width alone:
no device->host read, no metadata to build or copy, and the launch can be captured in
a CUDA graph. The grid is an upper bound (sum of ceil(q_len / tile) <= (T + B * (tile -
1)) // tile; KV lanes past a CTA group's last chunk); the CTAs with no work exit at
once. This relies on query_start_loc[B] == T, as the model runner builds it.

With one lane a CTA runs all its chunks and merges them in registers. With more, each
chunk's state (m, denom, acc[head_dim], fp32) goes to a workspace of
`workspace_floats` elements, and the lane that finishes last (an integer counter per
CTA group, kernels.stream_counters, left zero) merges them. The workspace comes from CuPy's
pool per call unless the caller passes one (under a CUDA graph capture, the graph's
pool: the pointer is then fixed for the replays); the counters are one array per
stream, allocated once.

Why a query's bits do not depend on its batch (DESIGN §4)
---------------------------------------------------------
A query row's output is bit-identical whether it runs with its whole prompt, in
a prefill chunk of any size, alone as a decode step, or next to any other
sequences, because each value it is built from is a function of the row's own
query, position and keys, computed in an order fixed by head_dim, block_size and
KV_CHUNK:

- The key range is split only at the positions c * KV_CHUNK. Each chunk's online
  softmax starts fresh (m = -inf, denom = acc = 0) and walks the chunk's pages in
  ascending order; the chunks' states are merged in ascending order with one fp32
  formula (the twin's `_RowState.merge`), in registers or from the workspace (exact
  fp32 copies), so the lane count, the head parts and which CTA merges never reach a
  row. A chunk a row sees no key of (wholly in its future or before its window) is
  neither merged nor stored; the chunk holding the row's first visible key is its
  first, taken as it is. A CTA starts at the chunk holding its first row's first
  visible key (c0), its lanes counted from there.
- A score is one thread's sequential fp32 FMA chain over head_dim; which
  thread, warp or slot of the CTA computes it does not change it. The tile max
  is exact in any order. The tile's probability sum runs over the key lanes in
  a butterfly whose shape depends only on block_size (key j always in lane
  j % min(block_size, 32) of the row's lane group). P.V is one thread's
  sequential FMA chain over the row's visible keys in ascending order. Every
  operation is an explicitly rounded intrinsic the compiler cannot contract,
  and exp is the accurate `expf` (no fast math).
- A tile a row sees no key of (wholly in its future or before its window) is
  skipped for that row: its state (m, denom, acc) is left exactly as it was. So a CTA
  may run its rows over the tiles from its first row's window to its last row's
  position, and a row gets the same bits whoever shares its CTA.
- A row's state stays m = -inf, denom = acc = 0 until the first tile it sees a key
  of; there m' is finite and a = exp(-inf - m') = 0: no (-inf) - (-inf). The
  denominator ends >= 1.
- Masked keys (a row's future, and stale slots past seq_len that may hold NaN)
  never reach a row: their scores are replaced by -inf and their
  probabilities by +0 with selects, and the P.V loop stops at each row's last
  visible key, so no 0 * NaN is ever formed.

Prefill and decode rows run the same code; only the number of rows per CTA and
where the chunk states wait (registers or the workspace) differ, and neither
reaches a row's arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .attention import KV_CHUNK, SOFTCAP_RANGE
from .gemm_kernel import REFERENCE_SMS
from .kernels import BF16_BITS, check, kernel, launch_kernel, stream_counters

ROWS_PER_CTA = 32  # kRowsPerCta in attention.cu: (query, group member) rows of one CTA
THREADS_PER_CTA = 128  # kNumThreads in attention.cu
# head_dim 256 (Gemma's) stages a page in two 128-dim parts (attention.cu); the
# tensor-core kernel takes it in 16- and 32-key pages (attention_tc_kernel.TC_BLOCK_SIZES)
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64)
_ALIGN = 16  # bytes: the kernel moves q, the cache pages and out in 16-byte vectors
# The split aims at this many CTAs an SM of REFERENCE_SMS (a constant, not the device's
# count: the grid then is the same on every device, though only the chunking reaches bits).
SPLIT_CTAS_PER_SM = 2
# The context the head split plans for: the host cannot read seq_lens, and a table as
# wide as max_model_len says nothing of the lengths actually in it.
PLANNED_CONTEXT = 2048
MAX_SPLIT_COUNTERS = 1 << 16  # (query tile, head slot) pairs a split launch may count in


def kernel_name(head_dim: int, block_size: int) -> str:
    return f"paged_attention_d{head_dim}_b{block_size}"


def tokens_per_cta(group: int, rows_per_cta: int = ROWS_PER_CTA) -> int:
    """Queries of one sequence a CTA takes: its rows are (query, group member) pairs."""
    return rows_per_cta // group


def num_work_items(
    num_tokens: int, num_seqs: int, group: int, rows_per_cta: int = ROWS_PER_CTA
) -> int:
    """CTAs along the grid's x axis: an upper bound on sum(ceil(q_len / tile)) over the
    sequences, from T = sum(q_len) and B alone."""
    tile = tokens_per_cta(group, rows_per_cta)
    return (num_tokens + num_seqs * (tile - 1)) // tile


def kv_chunks(max_blocks: int, block_size: int) -> int:
    """KV chunks a block table of `max_blocks` pages can hold (the workspace's slots a row)."""
    return -(-max_blocks * block_size // KV_CHUNK)


@dataclass(frozen=True, slots=True)
class SplitGrid:
    """How a launch spreads its (query tile, KV head, KV chunk) work over CTAs.

    The grid is (num_work_items, num_kv_heads * head_parts * kv_lanes); blockIdx.y =
    (kv_head * head_parts + part) * kv_lanes + lane. A KV head's query-head group is cut
    into `head_parts` CTAs of group / head_parts heads each; a (query tile, head part)
    spreads its KV chunks over `kv_lanes` CTAs, chunk c0 + i to lane i % kv_lanes (c0: the
    chunk holding its first row's first visible key, 0 without a window). With one
    lane a CTA walks all its chunks and merges them in registers; with more, each chunk's
    state goes to the fp32 workspace and the last lane to finish (an integer counter)
    merges them. Neither number reaches a row's bits: the chunk boundaries (KV_CHUNK) and
    the merge order are the same on every grid.
    """

    num_work_items: int
    num_kv_heads: int
    head_parts: int
    kv_lanes: int

    @property
    def grid(self) -> tuple[int, int]:
        return self.num_work_items, self.num_kv_heads * self.head_parts * self.kv_lanes

    @property
    def num_ctas(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def splits(self) -> bool:
        """Whether chunk states go through the workspace."""
        return self.kv_lanes > 1

    def busy_ctas(self, seq_len: int) -> int:
        """CTAs with work when every work item's rows see `seq_len` keys (a decode step
        of sequences that long): lanes past the last chunk exit at once."""
        lanes = min(self.kv_lanes, -(-seq_len // KV_CHUNK))
        return self.num_work_items * self.num_kv_heads * self.head_parts * lanes


def split_grid(
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    max_blocks: int,
    block_size: int,
    rows_per_cta: int = ROWS_PER_CTA,
    num_sms: int = REFERENCE_SMS,
) -> SplitGrid:
    """The launch geometry, from what the host knows (T, B, the heads, the block table's
    width; never seq_lens, which live on the device).

    Head parts: the fewest (a divisor of group) that give `num_sms` busy CTAs at a
    context of PLANNED_CONTEXT keys (8 KV chunks), so a batch-1 decode of an 8-KV-head
    model splits its groups down to single query heads. Lanes: when the (query tile,
    head part) CTAs are fewer than `num_sms`, as many as keep the grid within
    SPLIT_CTAS_PER_SM CTAs an SM (so it runs in one round where the deep ring's kernels
    hold that many: 256 CTAs for a batch-1 8-KV-head decode, not 288), at most one a KV
    chunk the table can hold; otherwise
    (a batch of 17 or more 8-KV-head decodes, a prefill) one lane, and no workspace.
    """
    max_chunks = kv_chunks(max_blocks, block_size)
    planned_chunks = max(1, min(max_chunks, PLANNED_CONTEXT // KV_CHUNK))
    parts = [p for p in range(1, group + 1) if group % p == 0]
    for head_parts in parts:
        work = num_work_items(num_tokens, num_seqs, group // head_parts, rows_per_cta)
        if work * num_kv_heads * head_parts * planned_chunks >= num_sms:
            break
    base = work * num_kv_heads * head_parts
    lanes = 1
    if 0 < base < num_sms:  # under a wave: spread the chunks
        lanes = max(1, min(max_chunks, SPLIT_CTAS_PER_SM * num_sms // base))
    return SplitGrid(work, num_kv_heads, head_parts, lanes)


def workspace_floats(num_tokens: int, num_heads: int, head_dim: int, max_chunks: int) -> int:
    """fp32 elements of a split launch's workspace: a state (acc[head_dim], then m and
    denom in a second region) for every (query token, head, KV chunk)."""
    return num_tokens * num_heads * max_chunks * (head_dim + 2)


def paged_attention(
    q: Any,
    cache: Any,
    layer: int,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    out: Any = None,
    workspace: Any = None,
) -> Any:
    """
    q:               [T, num_heads, head_dim] uint16 (BF16 bits), roped
    cache:           [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] uint16
    block_tables:    [B, max_blocks] int32
    seq_lens:        [B] int32, keys visible to each sequence after this step
    query_start_loc: [B + 1] int32, rows of q belonging to each sequence; [B] must be T
    window:          a sliding window (the twin's): the query at position p sees keys
                     p - window + 1 to p; 0: keys 0 to p
    softcap:         c > 0: each scaled score s becomes c * tanh(s / c) (the twin's
                     softcap_scores) before the mask and the softmax; 0: no cap
    out:             [T, num_heads, head_dim] uint16, written in place, or None
    workspace:       float32, at least `workspace_floats` elements, for a launch that
                     splits (small batches); None: taken from CuPy's pool when needed
    returns          out (a new array when None): [T, num_heads, head_dim] uint16

    All arrays are C-contiguous CuPy arrays on the current device. Values are not
    checked (that would need a device->host read): block ids must lie in the cache,
    seq_len <= max_blocks * block_size, and seq_len >= q_len.
    """
    args = (q, cache, layer, block_tables, seq_lens, query_start_loc, scale, window, softcap)
    out = check_inputs(*args, out=out, max_group=ROWS_PER_CTA)
    fn = kernel("attention", kernel_name(q.shape[2], cache.shape[4]))
    return launch(lambda grid: (fn, 0), ROWS_PER_CTA, out, *args, workspace=workspace)


def launch(
    kernel_for: Callable[[SplitGrid], tuple[Any, int]],
    rows_per_cta: int,
    out: Any,
    q: Any,
    cache: Any,
    layer: int,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    workspace: Any,
) -> Any:
    """Launch an attention kernel (checked inputs) on split_grid's geometry, with the
    split's workspace and counters when it splits. `kernel_for(grid)` gives the entry
    point for that grid and the dynamic shared memory it needs; the window and the soft
    cap are the kernel's last two arguments. Returns out."""
    import cupy

    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[3], cache.shape[4]
    num_seqs, max_blocks = block_tables.shape
    grid = split_grid(num_tokens, num_seqs, num_kv_heads, num_heads // num_kv_heads, max_blocks,
                      block_size, rows_per_cta)  # fmt: skip
    if grid.num_work_items == 0:
        return out
    fn, smem_bytes = kernel_for(grid)
    device = int(cupy.cuda.runtime.getDevice())
    # a counter a (query tile, head slot)
    counters = stream_counters("attention splits", MAX_SPLIT_COUNTERS, device)
    if grid.splits:
        assert grid.num_ctas // grid.kv_lanes <= MAX_SPLIT_COUNTERS, "a counter a CTA group"
        need = workspace_floats(num_tokens, num_heads, head_dim, kv_chunks(max_blocks, block_size))
        if workspace is None:
            workspace = cupy.empty(need, dtype=np.float32)
        else:
            check("workspace", workspace, np.float32, 1)
            if workspace.size < need:
                raise ValueError(f"workspace must hold {need} floats; got {workspace.size}")
    else:
        workspace = _no_workspace(device)
    kernel_args = (
        out, q, cache, block_tables, seq_lens, query_start_loc, workspace, counters,
        np.int32(num_tokens), np.int32(num_seqs), np.int32(max_blocks), np.int32(num_heads),
        np.int32(num_kv_heads), np.int32(cache.shape[1]), np.int32(layer),
        np.int32(grid.head_parts), np.int32(grid.kv_lanes), np.float32(scale), np.int32(window),
        np.float32(softcap),
    )  # fmt: skip
    launch_kernel(fn, grid.grid, (THREADS_PER_CTA,), kernel_args, shared_mem=smem_bytes)
    return out


def check_softcap(softcap: float) -> None:
    """A soft cap the kernels take: 0 (none), or a number in SOFTCAP_RANGE (ValueError)."""
    low, high = SOFTCAP_RANGE
    if not isinstance(softcap, int | float | np.integer | np.floating) or not (
        softcap == 0 or low <= softcap <= high
    ):
        raise ValueError(
            f"softcap must be 0 (no cap) or a number from {low} to {high}; got {softcap!r}"
        )


@functools.cache
def _no_workspace(device_id: int) -> Any:
    """What a launch that does not split passes as its (unread) workspace."""
    import cupy

    return cupy.zeros(4, dtype=np.float32)


def check_inputs(
    q: Any,
    cache: Any,
    layer: int,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    out: Any,
    max_group: int,
    head_dims: tuple[int, ...] = HEAD_DIMS,
) -> Any:
    """The launchers' checks of `paged_attention`'s arguments (ValueError naming the
    problem); `max_group` is the most query heads a KV head may have (a CTA's rows),
    `head_dims` the head sizes the launcher's kernel has entry points for.
    Returns out, a new array when None."""
    import cupy

    for name, x in [
        ("q", q),
        ("cache", cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ]:
        if not isinstance(x, cupy.ndarray):
            raise ValueError(f"{name} must be a CuPy (device) array; got {type(x).__name__}")
    check("q", q, BF16_BITS, 3)
    check("cache", cache, BF16_BITS, 6)
    check("block_tables", block_tables, np.int32, 2)
    check("seq_lens", seq_lens, np.int32, 1)
    check("query_start_loc", query_start_loc, np.int32, 1)
    num_tokens, num_heads, head_dim = q.shape
    _, num_layers, kv, num_kv_heads, block_size, cache_head_dim = cache.shape
    num_seqs, max_blocks = block_tables.shape
    if head_dim not in head_dims:
        raise ValueError(f"head_dim must be one of {head_dims}; got {head_dim}")
    if kv != 2 or cache_head_dim != head_dim:
        raise ValueError(
            f"cache must be [num_blocks, num_layers, 2, num_kv_heads, block_size, {head_dim}]; "
            f"got {cache.shape}"
        )
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}; got {block_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if not isinstance(window, int | np.integer) or not 0 <= window < 2**31:
        raise ValueError(f"window must be an integer >= 0 (0: no window); got {window!r}")
    check_softcap(softcap)
    group = num_heads // num_kv_heads
    if group > max_group:
        raise ValueError(f"num_heads / num_kv_heads must be at most {max_group}; got {group}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}); got {layer}")
    if seq_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"block_tables {block_tables.shape} has {num_seqs} sequences: seq_lens must be "
            f"[{num_seqs}] and query_start_loc [{num_seqs + 1}]; got {seq_lens.shape} and "
            f"{query_start_loc.shape}"
        )
    if num_tokens and (num_seqs == 0 or max_blocks == 0):
        raise ValueError(
            f"q has {num_tokens} rows but block_tables {block_tables.shape} holds no pages"
        )
    if out is None:
        out = cupy.empty_like(q)
    else:
        check("out", out, BF16_BITS, 3)
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {q.shape}; got {out.shape}")
    for name, x in [("q", q), ("cache", cache), ("out", out)]:
        if x.data.ptr % _ALIGN:
            raise ValueError(f"{name} must start on a {_ALIGN}-byte boundary; got {x.data.ptr:#x}")
    return out
