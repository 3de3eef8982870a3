"""Launcher of decode_block.cu: a decode layer's tail (o_proj, the residual add and the
MLP's norm, gate_up, silu * up, down_proj, the residual add and the next norm, and with
`head` the next layer's qkv projection and rope_kv_write) as one persistent launch whose
CTAs meet at grid barriers (issue 18; twin: decode_block.py). A cooperative launch of the
CTAs the device holds at once (the driver's occupancy calculator), one an SM.

`takes` says whether a call can run it; `decode_tail` runs it. `BY_DEFAULT` (off until a
GPU has timed it: bench/results/PENDING.md) makes CupyBackend.decode_tail and
decode_tail_qkv take it where `takes` allows; off, the backend runs the op-by-op path, to
the same bits.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from . import pdl
from .kernels import BF16_BITS, check, kernel, launch_kernel, stream_counters

BY_DEFAULT = False
MAX_ROWS = 16  # decode_block.cu's DECODE_BLOCK_MAX_ROWS: one m16 fragment
THREADS = 256  # PERSIST_THREADS
TILE_N = 64  # DECODE_BLOCK_TILE_N: a work item's columns
MAX_SMEM = 200 * 1024  # what a CTA may ask (an H100 gives 227 KB; one CTA an SM)
COUNTERS = 4096  # a zero per tile of the widest projection, then the grid barrier's two words


class NextHead(NamedTuple):
    """The next layer's bias-free qkv projection and its rope_kv_write, run in the same
    launch (CupyBackend.decode_tail_qkv): rope_kv_write's arguments, the weight first."""

    w_qkv: Any
    positions: Any
    cos: Any
    sin: Any
    cache: Any
    layer: int
    slot_mapping: Any
    num_heads: int


def smem_bytes(rows: int, q_size: int, hidden: int, inter: int) -> int:
    """decode_block.cu's layout: the flag and block_sum's scratch (64 bytes), a row of
    fp32 no one reads and `rows` rows of fp32 (summed1), `rows` BF16 rows of a folded
    product, then `rows` BF16 rows of the widest input, 8 halves more each."""
    lda = max(q_size, hidden, inter) + 8
    return (
        64
        + 4 * (-(-hidden // 4) * 4) * (rows + 1)
        + 2 * (-(-hidden // 8) * 8) * rows
        + rows * lda * 2
    )


def grid_size(num_sms: int, items: int) -> int:
    """CTAs of the launch: one an SM (every CTA resident at once, as the grid barriers
    need), no more than the largest projection has work items."""
    return max(1, min(num_sms, items))


def _layout(w: Any) -> tuple[str, bool] | None:
    """("packed" | "plain", rows interleaved gate/up) of a weight the kernel reads."""
    from .gemm_sm90_kernel import PackedWeight

    if isinstance(w, PackedWeight):
        return ("packed", w.gated) if w.swizzled else None
    return ("plain", False)


def takes(rows: int, w_o: Any, w_gate_up: Any, w_down: Any, w_qkv: Any = None) -> bool:
    """Whether decode_tail runs this call: a decode's few rows, every K a multiple of 64
    (the packed layout's tiles; the splits' granule), even widths, one layout for all the
    weights (w_qkv: the next layer's, if its head joins), and its shared memory within
    MAX_SMEM."""
    if not 1 <= rows <= MAX_ROWS:  # first: a prefill is refused at once
        return False
    weights = [w_o, w_gate_up, w_down] + ([] if w_qkv is None else [w_qkv])
    layouts = [_layout(w) for w in weights]
    if any(x is None for x in layouts) or len({x[0] for x in layouts}) != 1:  # type: ignore[index]
        return False
    if any(x[1] for i, x in enumerate(layouts) if i != 1):  # type: ignore[index]
        return False  # only gate_up may be interleaved
    (hidden, q_size), (two_inter, h2), (h3, inter) = w_o.shape, w_gate_up.shape, w_down.shape
    if h2 != hidden or h3 != hidden or two_inter != 2 * inter:
        return False
    if w_qkv is not None and w_qkv.shape[1] != hidden:
        return False
    if any(k % 64 for k in (q_size, hidden, inter)) or hidden % 2:
        return False
    return smem_bytes(rows, q_size, hidden, inter) <= MAX_SMEM


@functools.cache
def _num_sms(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


@functools.cache
def _resident_ctas(name: str, smem: int, device_id: int) -> int:
    """CTAs of entry point `name` with `smem` bytes of shared memory the device holds at
    once (the cooperative launch's bound): one an SM, where the occupancy calculator says
    an SM holds one (the kernel's registers and `smem`); asked once."""
    return _num_sms(device_id) * min(1, pdl.occupancy(_kernel(name, smem), THREADS, smem))


def _kernel(name: str, smem: int) -> Any:
    """The entry point, its shared-memory opt-in raised to `smem` where needed."""
    fn = kernel("decode_block", name)
    if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def decode_tail(
    attn: Any, w_o: Any, w_gate_up: Any, w_down: Any, residual: Any, mlp_norm: Any,
    next_norm: Any, eps: float, *, head: NextHead | None = None, num_ctas: int | None = None,
    layer: tuple[str, int, int, tuple[Any, ...]] | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """(summed, normed) of the layer's tail: as add_rmsnorm(add_rmsnorm(residual, attn @
    w_o^T, mlp_norm) ... ) computes them op by op (decode_block.py's twin), in one launch;
    with `head`, (summed, q): the next layer's rope_kv_write of normed @ w_qkv^T (the keys
    and values into the cache, the rotated queries returned), in the same launch.
    `num_ctas` (tests) caps the grid; by default one CTA an SM. `layer` (decode_layer's):
    the entry point that runs the layer's attention first, its shared memory for that, the
    CTAs its planned grid has, and its attention arguments after the tail's; attn is then
    that attention's output."""
    import cupy

    from .gemm_kernel import _device_id, _split_k, split_length
    from .launchers import check_rope_kv_write

    check("attn", attn, BF16_BITS, 2)
    check("residual", residual, np.float32, 2)
    rows = attn.shape[0]
    w_qkv = None if head is None else head.w_qkv
    if not takes(rows, w_o, w_gate_up, w_down, w_qkv):
        raise ValueError(
            f"decode_tail does not take {rows} rows of these weights (decode_block_kernel.takes)"
        )
    (hidden, q_size), (two_inter, _) = w_o.shape, w_gate_up.shape
    inter = two_inter // 2
    if attn.shape[1] != q_size or residual.shape != (rows, hidden):
        raise ValueError(
            f"attn must be [{rows}, {q_size}] and residual [{rows}, {hidden}]; got "
            f"{tuple(attn.shape)} and {tuple(residual.shape)}"
        )
    packed = _layout(w_o)[0] == "packed"  # type: ignore[index]
    gated = _layout(w_gate_up)[1]  # type: ignore[index]
    weights = [w_o, w_gate_up, w_down] + ([] if w_qkv is None else [w_qkv])
    shapes = [tuple(w.shape) for w in weights]
    splits = [_split_k(n, k) for n, k in shapes]
    lengths = [split_length(k, s) for (_, k), s in zip(shapes, splits, strict=True)]
    items = [-(-n // TILE_N) * s for (n, _), s in zip(shapes, splits, strict=True)]
    assert max(-(-n // TILE_N) for n, _ in shapes) + 2 <= COUNTERS, "a counter a tile"
    device = _device_id()
    bf16, f32, i32 = BF16_BITS, np.float32, np.int32
    y_o, y_down = cupy.empty((rows, hidden), bf16), cupy.empty((rows, hidden), bf16)
    gate_up = cupy.empty((rows, two_inter), bf16)
    summed = cupy.empty((rows, hidden), f32)
    # the partials' two rooms (decode_block.cu's ws_a: o and down; ws_b: gate_up and qkv)
    room = [0 if s == 1 else s * rows * n for (n, _), s in zip(shapes, splits, strict=True)]
    ws = cupy.empty(max(1, max(room[0], room[2]) + max(room[1], room[3] if head else 0)), f32)
    counters = stream_counters("decode tail", COUNTERS, device)
    bar = counters[COUNTERS - 2 :]
    if head is None:
        normed = cupy.empty((rows, hidden), bf16)
        unused_slots = cupy.empty(1, np.int64)  # never read: the kernel runs no head
        head_args: tuple[Any, ...] = (i32(0), y_o, y_o, i32(1), counters, residual, residual, y_o,
                                      unused_slots, y_o, *(i32(0),) * 6)  # fmt: skip
    else:
        qkv_cols = shapes[3][0]
        head_dim = head.cache.shape[-1]
        num_layers, kv_heads, block_size = check_rope_kv_write(
            (rows, qkv_cols // head_dim, head_dim), head.positions, head.cos, head.sin, head.cache,
            head.layer, head.slot_mapping, head.num_heads,
        )  # fmt: skip
        normed = cupy.empty((rows, head.num_heads, head_dim), bf16)  # the rotated queries
        qkv = cupy.empty((rows, qkv_cols), bf16)
        head_args = (i32(1), w_qkv.data if packed else w_qkv, qkv, i32(lengths[3]), head.positions,
                     head.cos, head.sin, normed, head.slot_mapping, head.cache, i32(head.layer),
                     i32(num_layers), i32(head.num_heads), i32(kv_heads), i32(block_size),
                     i32(head_dim))  # fmt: skip
    smem = smem_bytes(rows, q_size, hidden, inter)
    name = "decode_tail_packed" if packed else "decode_tail_plain"
    if layer is not None:
        name, attention_smem, attention_ctas, attention_args = layer
        smem = max(smem, attention_smem)
        items.append(-(-attention_ctas // 2))  # two planned CTAs a CTA at once
    else:
        attention_args = ()
    fn = _kernel(name, smem)
    resident = _resident_ctas(name, smem, device)
    if resident < 1:
        raise RuntimeError(
            f"decode_tail: no SM holds a CTA of {THREADS} threads and {smem} B of shared memory; "
            "turn decode_block_kernel.BY_DEFAULT off"
        )
    grid = grid_size(resident if num_ctas is None else min(num_ctas, resident), max(items))
    data = [w.data if packed else w for w in (w_o, w_gate_up, w_down)]
    args = (attn, *data, residual, mlp_norm, next_norm, y_o, gate_up, y_down, summed, normed, ws,
            counters, bar, i32(rows), i32(q_size), i32(hidden), i32(inter), *map(i32, lengths[:3]),
            i32(gated), f32(eps), *head_args, *attention_args)  # fmt: skip
    launch_kernel(fn, (grid,), (THREADS,), args, shared_mem=smem, cooperative=True)
    return summed, normed


# The (head_dim, block size) pairs decode_block.cu's decode_layer entry points take: the
# default model's head_dim 64 with 16- and 32-key blocks, Llama-3.1-8B's 128 with 32.
LAYER_SHAPES = ((64, 16), (64, 32), (128, 32))


class Attention(NamedTuple):
    """paged_attention's arguments for the layer (attention_kernel.paged_attention)."""

    q: Any
    cache: Any
    layer: int
    block_tables: Any
    seq_lens: Any
    query_start_loc: Any
    scale: float


def _attention_half_bytes(head_dim: int, block_size: int) -> int:
    """decode_block.cu's attention_half_bytes: the deep ring, then a CtaWork (32 bytes),
    each rounded to 16 bytes."""
    from .attention_tc_kernel import smem_bytes as ring_bytes

    return -(-ring_bytes(head_dim, block_size, deep=True) // 16) * 16 + 32


def layer_plan(attention: Attention, rows: int) -> Any:
    """The attention's planned split grid (attention_kernel.split_grid, as the standalone
    launch plans it), or None where decode_layer does not run it: a grid that does not
    split (its deep ring is the split's), a shape without an entry point, or other rows."""
    from .attention_kernel import split_grid
    from .attention_tc_kernel import ROWS_PER_CTA

    q, cache = attention.q, attention.cache
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[3], cache.shape[4]
    if num_tokens != rows or (head_dim, block_size) not in LAYER_SHAPES:
        return None
    num_seqs, max_blocks = attention.block_tables.shape
    grid = split_grid(num_tokens, num_seqs, num_kv_heads, num_heads // num_kv_heads, max_blocks,
                      block_size, ROWS_PER_CTA)  # fmt: skip
    return grid if grid.splits and grid.num_work_items > 0 else None


def decode_layer(
    attention: Attention, w_o: Any, w_gate_up: Any, w_down: Any, residual: Any, mlp_norm: Any,
    next_norm: Any, eps: float, *, head: NextHead | None = None, num_ctas: int | None = None,
    plan: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """A decode layer in one launch: its attention (the tensor-core kernel's body on its
    planned split grid, `layer_plan`), then decode_tail's work on its output, with `head`
    too. Returns decode_tail's (summed, normed or the next layer's queries)."""
    import cupy

    from .attention_kernel import MAX_SPLIT_COUNTERS, check_inputs, kv_chunks, workspace_floats
    from .attention_tc_kernel import ROWS_PER_CTA
    from .gemm_kernel import _device_id

    q, cache = attention.q, attention.cache
    rows, num_heads, head_dim = q.shape
    attn = check_inputs(*attention, out=None, max_group=ROWS_PER_CTA)  # [T, heads, head_dim]
    plan = layer_plan(attention, rows) if plan is None else plan  # the caller's, if it has it
    if plan is None:
        raise ValueError(
            "decode_layer does not take this attention (decode_block_kernel.layer_plan)"
        )
    num_seqs, max_blocks = attention.block_tables.shape
    block_size = cache.shape[4]
    device = _device_id()
    workspace = cupy.empty(workspace_floats(rows, num_heads, head_dim, kv_chunks(max_blocks, block_size)),
                           dtype=np.float32)  # fmt: skip
    assert plan.num_ctas // plan.kv_lanes <= MAX_SPLIT_COUNTERS, "a counter a CTA group"
    i32 = np.int32
    extra = (
        q, cache, attention.block_tables, attention.seq_lens, attention.query_start_loc, workspace,
        stream_counters("attention splits", MAX_SPLIT_COUNTERS, device), i32(num_seqs),
        i32(max_blocks), i32(attention.layer), i32(cache.shape[1]), i32(num_heads), i32(cache.shape[3]),
        i32(plan.head_parts), i32(plan.kv_lanes), i32(plan.grid[0]), i32(plan.grid[1]),
        np.float32(attention.scale),
    )  # fmt: skip
    layout = "packed" if _layout(w_o)[0] == "packed" else "plain"  # type: ignore[index]
    layer = (f"decode_layer_{layout}_d{head_dim}_b{block_size}",
             2 * _attention_half_bytes(head_dim, block_size), plan.num_ctas, extra)  # fmt: skip
    return decode_tail(attn.reshape(rows, num_heads * head_dim), w_o, w_gate_up, w_down, residual,
                       mlp_norm, next_norm, eps, head=head, num_ctas=num_ctas, layer=layer)  # fmt: skip
