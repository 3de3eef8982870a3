"""Launcher of decode_block.cu: a decode layer's tail (o_proj, the residual add and the
MLP's norm, gate_up, silu * up, down_proj, the residual add and the next norm, and with
`head` the next layer's qkv projection and rope_kv_write) as one persistent launch whose
CTAs meet at grid barriers (issue 18; twin: decode_block.py). A cooperative launch of the
CTAs the device holds at once (the driver's occupancy calculator), one an SM.

`decode_layer` runs a layer with its attention first, `decode_layers` consecutive layers
(a step's, after its first head) in one launch.

`takes` says whether a call can run the tail; `decode_tail` runs it. `BY_DEFAULT` (off until a
GPU has timed it: bench/results/PENDING.md) makes CupyBackend.decode_tail and
decode_tail_qkv take it where `takes` allows; off, the backend runs the op-by-op path, to
the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from . import pdl
from .gemm_sm90_kernel import PackedWeight
from .kernels import BF16_BITS, check, kernel, launch_kernel, stream_counters

BY_DEFAULT = False
# Layers a decode_layers launch runs at most (CupyBackend.attention_layers); None: all of a
# step's (one launch a step), 1: a launch a layer (bench_gpu_e2e --layers-a-launch).
MAX_LAYERS_A_LAUNCH: int | None = None
# The weights read under L2's evict-first policy where the entry point has the registers
# (decode_block.cu's load_batch); True builds them with plain loads instead, for a
# benchmark's comparison in one run (set before the first launch: the module is built once).
WEIGHTS_EVICT_NORMAL = False
MAX_ROWS = 16  # decode_block.cu's DECODE_BLOCK_MAX_ROWS: one m16 fragment
THREADS = 256  # PERSIST_THREADS
TILE_N = 64  # DECODE_BLOCK_TILE_N: a work item's columns
MAX_SMEM = 200 * 1024  # what a CTA may ask (an H100 gives 227 KB; one CTA an SM)
COUNTERS = 4096  # a zero per tile of the widest projection, then the grid barrier's two words


class Rope(NamedTuple):
    """rope_kv_write's arguments after the product (gemm_rope_kv_write's after the weight).
    decode_layers: its first head's, layer l's head writing the cache's layer `layer` + l."""

    positions: Any
    cos: Any
    sin: Any
    cache: Any
    layer: int
    slot_mapping: Any
    num_heads: int


class NextHead(NamedTuple):
    """The next layer's bias-free qkv projection and its rope_kv_write, run in the same
    launch (CupyBackend.decode_tail_qkv)."""

    w_qkv: Any
    rope: Rope


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
    fn = kernel(
        "decode_block", name, ("REPRISE_WEIGHTS_EVICT_FIRST=0",) if WEIGHTS_EVICT_NORMAL else ()
    )
    if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def _tail_buffers(
    rows: int, w_o: Any, w_gate_up: Any, w_down: Any, w_qkv: Any, eps: float
) -> tuple[tuple[Any, ...], tuple[Any, Any, Any, Any, int], list[int]]:
    """What a launch of the tail allocates and passes alike: (the arguments from y_o to eps
    in DECODE_TAIL_ARGS' order, (summed, normed, qkv or None, the head's split length,
    qkv's columns), each projection's work items)."""
    import cupy

    from .gemm_kernel import _device_id, _split_k, split_length

    (hidden, q_size), (two_inter, _) = w_o.shape, w_gate_up.shape
    inter = two_inter // 2
    gated = _layout(w_gate_up)[1]  # type: ignore[index]
    weights = [w_o, w_gate_up, w_down] + ([] if w_qkv is None else [w_qkv])
    shapes = [tuple(w.shape) for w in weights]
    splits = [_split_k(n, k) for n, k in shapes]
    lengths = [split_length(k, s) for (_, k), s in zip(shapes, splits, strict=True)]
    items = [-(-n // TILE_N) * s for (n, _), s in zip(shapes, splits, strict=True)]
    assert max(-(-n // TILE_N) for n, _ in shapes) + 2 <= COUNTERS, "a counter a tile"
    bf16, f32, i32 = BF16_BITS, np.float32, np.int32
    y_o, y_down = cupy.empty((rows, hidden), bf16), cupy.empty((rows, hidden), bf16)
    gate_up = cupy.empty((rows, two_inter), bf16)
    summed, normed = cupy.empty((rows, hidden), f32), cupy.empty((rows, hidden), bf16)
    # the partials' two rooms (decode_block.cu's ws_a: o and down; ws_b: gate_up and qkv)
    room = [0 if s == 1 else s * rows * n for (n, _), s in zip(shapes, splits, strict=True)]
    head_room = room[3] if w_qkv is not None else 0
    ws = cupy.empty(max(1, max(room[0], room[2]) + max(room[1], head_room)), f32)
    counters = stream_counters("decode tail", COUNTERS, _device_id())
    qkv = None if w_qkv is None else cupy.empty((rows, shapes[3][0]), bf16)
    args = (y_o, gate_up, y_down, summed, normed, ws, counters, counters[COUNTERS - 2 :], i32(rows),
            i32(q_size), i32(hidden), i32(inter), *map(i32, lengths[:3]), i32(gated), f32(eps))  # fmt: skip
    head = (summed, normed, qkv, lengths[3] if w_qkv is not None else 0,
            shapes[3][0] if w_qkv is not None else 0)  # fmt: skip
    return args, head, items


def _launch(name: str, smem: int, items: int, num_ctas: int | None, args: tuple) -> None:
    """A cooperative launch of `name`: one CTA an SM the device holds (refused before any
    launch where it holds none), no more than `items` nor `num_ctas`."""
    from .gemm_kernel import _device_id

    fn = _kernel(name, smem)
    resident = _resident_ctas(name, smem, _device_id())
    if resident < 1:
        raise RuntimeError(
            f"{name}: no SM holds a CTA of {THREADS} threads and {smem} B of shared memory; "
            "turn decode_block_kernel.BY_DEFAULT off"
        )
    grid = grid_size(resident if num_ctas is None else min(num_ctas, resident), items)
    launch_kernel(fn, (grid,), (THREADS,), args, shared_mem=smem, cooperative=True)


def decode_tail(
    attn: Any, w_o: Any, w_gate_up: Any, w_down: Any, residual: Any, mlp_norm: Any,
    next_norm: Any, eps: float, *, head: NextHead | None = None, num_ctas: int | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """(summed, normed) of the layer's tail: as add_rmsnorm(add_rmsnorm(residual, attn @
    w_o^T, mlp_norm) ... ) computes them op by op (decode_block.py's twin), in one launch;
    with `head`, (summed, q): the next layer's rope_kv_write of normed @ w_qkv^T (the keys
    and values into the cache, the rotated queries returned), in the same launch.
    `num_ctas` (tests) caps the grid; by default one CTA an SM."""
    import cupy

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
    if attn.shape[1] != q_size or residual.shape != (rows, hidden):
        raise ValueError(
            f"attn must be [{rows}, {q_size}] and residual [{rows}, {hidden}]; got "
            f"{tuple(attn.shape)} and {tuple(residual.shape)}"
        )
    packed = _layout(w_o)[0] == "packed"  # type: ignore[index]
    tail, (summed, normed, qkv, split_qkv, qkv_cols), items = _tail_buffers(
        rows, w_o, w_gate_up, w_down, w_qkv, eps
    )
    i32 = np.int32
    if head is None:
        unused_slots = cupy.empty(1, np.int64)  # never read: the kernel runs no head
        head_args: tuple[Any, ...] = (i32(0), normed, normed, i32(1), summed, summed, summed, normed,
                                      unused_slots, normed, *(i32(0),) * 6)  # fmt: skip
    else:
        rope, w_qkv = head.rope, head.w_qkv
        head_dim = rope.cache.shape[-1]
        num_layers, kv_heads, block_size = check_rope_kv_write(
            (rows, qkv_cols // head_dim, head_dim), *rope
        )  # fmt: skip
        normed = cupy.empty((rows, rope.num_heads, head_dim), BF16_BITS)  # the rotated queries
        head_args = (i32(1), w_qkv.data if packed else w_qkv, qkv, i32(split_qkv), rope.positions,
                     rope.cos, rope.sin, normed, rope.slot_mapping, rope.cache, i32(rope.layer),
                     i32(num_layers), i32(rope.num_heads), i32(kv_heads), i32(block_size),
                     i32(head_dim))  # fmt: skip
    data = [w.data if packed else w for w in (w_o, w_gate_up, w_down)]
    args = (attn, *data, residual, mlp_norm, next_norm, *tail, *head_args)
    name = "decode_tail_packed" if packed else "decode_tail_plain"
    _launch(name, smem_bytes(rows, q_size, hidden, two_inter // 2), max(items), num_ctas, args)
    return summed, normed


# The (head_dim, block size) pairs decode_block.cu's decode_layer entry points take: the
# default model's head_dim 64 with 16- and 32-key blocks, Llama-3.1-8B's 128 with 32;
# LOOP_SHAPES those that run more than one layer a launch (decode_layers' LOOP: at 128,
# the loop's state would spill the attention's registers).
LAYER_SHAPES = ((64, 16), (64, 32), (128, 32))
LOOP_SHAPES = ((64, 16), (64, 32))


class Attention(NamedTuple):
    """paged_attention's arguments for the layer (attention_kernel.paged_attention)."""

    q: Any
    cache: Any
    layer: int
    block_tables: Any
    seq_lens: Any
    query_start_loc: Any
    scale: float
    window: int = 0  # a sliding window (the twin's): a query sees the last this many keys
    softcap: float = 0.0  # the scores' soft cap (the twin's): decode_layers takes none


class LayerWeights(NamedTuple):
    """A layer's weights in decode_layers' launch: its tail's, and w_qkv, the next layer's
    bias-free qkv projection where its head joins the launch (else None: the last layer's
    alone may lack it)."""

    w_o: Any
    w_gate_up: Any
    w_down: Any
    mlp_norm: Any
    next_norm: Any
    w_qkv: Any = None


def _attention_half_bytes(head_dim: int, block_size: int) -> int:
    """decode_block.cu's attention_half_bytes: the deep ring, then a CtaWork (32 bytes),
    each rounded to 16 bytes."""
    from .attention_tc_kernel import smem_bytes as ring_bytes

    return -(-ring_bytes(head_dim, block_size, deep=True) // 16) * 16 + 32


def layers_smem_bytes(rows: int, q_size: int, hidden: int, inter: int, head_dim: int,
                      block_size: int, layers: int) -> int:  # fmt: skip
    """decode_layers' shared memory: the tail's layout or the attention's two halves,
    whichever is larger; with more than one layer, then the carried residual rows (fp32,
    16-byte rows: decode_block.cu's carry)."""
    base = max(
        smem_bytes(rows, q_size, hidden, inter), 2 * _attention_half_bytes(head_dim, block_size)
    )
    if layers == 1:
        return base
    return -(-base // 16) * 16 + rows * 4 * (-(-hidden // 4) * 4)


def layer_plan(attention: Attention, rows: int) -> Any:
    """The attention's planned grid (attention_kernel.split_grid, as the standalone launch
    plans it), or None where decode_layer does not run it: a shape without an entry point,
    other rows, or a soft cap (decode_block.cu's attention runs none: Gemma 2's layers go
    op by op). A one-lane plan (a short block table, or many sequences) runs as the
    split kernel's body too, its lone lane merging its chunks through the workspace: the
    chunks and their merge order are the one-lane kernel's, so the same bits."""
    from .attention_kernel import split_grid
    from .attention_tc_kernel import ROWS_PER_CTA

    q, cache = attention.q, attention.cache
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[3], cache.shape[4]
    if num_tokens != rows or (head_dim, block_size) not in LAYER_SHAPES or attention.softcap:
        return None
    num_seqs, max_blocks = attention.block_tables.shape
    grid = split_grid(num_tokens, num_seqs, num_kv_heads, num_heads // num_kv_heads, max_blocks,
                      block_size, ROWS_PER_CTA)  # fmt: skip
    return grid if grid.num_work_items > 0 else None


def layers_take(attention: Attention, layers: Sequence[LayerWeights]) -> bool:
    """Whether decode_layers runs these layers in one launch (layer_plan aside): the tail's
    rule (`takes`) for the first, the others of its shapes and layouts, every layer but the
    last with its head, a (head_dim, block size) in LOOP_SHAPES for more than one, and the
    shared memory within MAX_SMEM."""
    first = layers[0]
    rows, _, head_dim = attention.q.shape
    if not takes(rows, first.w_o, first.w_gate_up, first.w_down, first.w_qkv):
        return False
    if len(layers) > 1 and (head_dim, attention.cache.shape[4]) not in LOOP_SHAPES:
        return False
    key = _signature(first)
    if any(w.w_qkv is None for w in layers[:-1]):
        return False
    if any(_signature(w) != key[: 3 + (w.w_qkv is not None)] for w in layers[1:]):
        return False
    (hidden, q_size), (two_inter, _) = first.w_o.shape, first.w_gate_up.shape
    smem = layers_smem_bytes(rows, q_size, hidden, two_inter // 2, head_dim, attention.cache.shape[4],
                             len(layers))  # fmt: skip
    return smem <= MAX_SMEM


def _signature(w: LayerWeights) -> tuple:
    """Each weight's (shape, layout): what one table's rows must share."""
    mats = [w.w_o, w.w_gate_up, w.w_down] + ([] if w.w_qkv is None else [w.w_qkv])
    return tuple((tuple(m.shape), _layout(m)) for m in mats)


def layer_table(layers: Sequence[LayerWeights]) -> Any:
    """decode_block.cu's table of the layers' weights: six device addresses a row (w_o,
    w_gate_up, w_down, w_qkv or 0, mlp_norm, next_norm: its Weight order). An upload, so a
    caller that launches in CUDA graphs makes it once, outside the capture, and keeps it
    as long as the weights (CupyBackend.attention_layers: the backend's, per layers)."""
    import cupy

    def address(x: Any) -> int:
        if x is None:
            return 0
        return int((x.data if isinstance(x, PackedWeight) else x).data.ptr)

    rows = [[address(w.w_o), address(w.w_gate_up), address(w.w_down), address(w.w_qkv),
             address(w.mlp_norm), address(w.next_norm)] for w in layers]  # fmt: skip
    return cupy.asarray(np.array(rows, dtype=np.int64))


def decode_layers(
    attention: Attention, layers: Sequence[LayerWeights], residual: Any, eps: float, *,
    rope: Rope | None = None, num_ctas: int | None = None, plan: Any = None, table: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """Consecutive decode layers in one launch: layer l (the cache's layer attention.layer
    + l) runs its attention (the tensor-core kernel's body on its planned split grid,
    `layer_plan`: the same for every layer of a step), then decode_tail's work with
    layers[l]'s weights, its next layer's head included where layers[l].w_qkv is given (its
    rope_kv_write into the cache's layer rope.layer + l). Returns the last layer's
    (summed, normed), or (summed, q) where its head ran. The same bits as the layers'
    attention and tail op by op, layer after layer (`layers_take` says what it runs).
    `table`: layer_table(layers), if the caller keeps it (else made here)."""
    import cupy

    from .attention_kernel import MAX_SPLIT_COUNTERS, check_inputs, kv_chunks, workspace_floats
    from .attention_tc_kernel import ROWS_PER_CTA
    from .gemm_kernel import _device_id
    from .launchers import check_rope_kv_write

    check("residual", residual, np.float32, 2)
    q, cache = attention.q, attention.cache
    rows, num_heads, head_dim = q.shape
    attn = check_inputs(*attention, out=None, max_group=ROWS_PER_CTA)  # [T, heads, head_dim]
    plan = layer_plan(attention, rows) if plan is None else plan  # the caller's, if it has it
    if plan is None or attention.softcap or not layers or not layers_take(attention, layers):
        raise ValueError(
            "decode_layers does not take these layers (decode_block_kernel.layer_plan, "
            "layers_take; no soft cap)"
        )
    first = layers[0]
    (hidden, q_size), (two_inter, _) = first.w_o.shape, first.w_gate_up.shape
    if residual.shape != (rows, hidden) or q_size != num_heads * head_dim:
        raise ValueError(
            f"residual must be [{rows}, {hidden}] and the queries {q_size} wide; got "
            f"{tuple(residual.shape)} and {num_heads} x {head_dim}"
        )
    num_layers, block_size, kv_heads = cache.shape[1], cache.shape[4], cache.shape[3]
    last = layers[-1].w_qkv is not None  # the last layer's head runs too
    heads = len(layers) - 1 + last
    if (rope is None) != (heads == 0) or attention.layer + len(layers) > num_layers:
        raise ValueError(
            f"decode_layers: {len(layers)} layers from {attention.layer} of {num_layers}, "
            f"{heads} heads, rope {'given' if rope else 'missing'}"
        )
    w_qkv = next((w.w_qkv for w in layers if w.w_qkv is not None), None)  # the heads' shape
    tail, (summed, normed, qkv, split_qkv, qkv_cols), items = _tail_buffers(
        rows, first.w_o, first.w_gate_up, first.w_down, w_qkv, eps
    )
    i32 = np.int32
    q_work = cupy.empty((rows, num_heads, head_dim), BF16_BITS)  # the later layers' queries
    if rope is None:  # never read: the kernel runs no head
        positions, angles = cupy.empty(1, np.int32), cupy.empty(1, np.float32)
        qkv = cupy.empty((1, 1), BF16_BITS)
        head_args: tuple[Any, ...] = (qkv, i32(1), positions, angles, angles, normed, q_work,
                                      cupy.empty(1, np.int64), cache, i32(0))  # fmt: skip
    else:
        if rope.cache is not cache or rope.num_heads != num_heads:
            raise ValueError("decode_layers: the heads write the attention's cache and heads")
        if rope.layer + heads > num_layers:
            raise ValueError(f"decode_layers: heads from layer {rope.layer} past {num_layers}")
        if len(layers) > 1 and rope.layer != attention.layer + 1:  # layer l's head feeds l + 1
            raise ValueError(
                f"decode_layers: the first head writes layer {rope.layer}, not the next "
                f"attention's {attention.layer + 1}"
            )
        check_rope_kv_write((rows, qkv_cols // head_dim, head_dim), *rope)
        if last:
            normed = cupy.empty((rows, num_heads, head_dim), BF16_BITS)  # the rotated queries
        head_args = (qkv, i32(split_qkv), rope.positions, rope.cos, rope.sin, normed, q_work,
                     rope.slot_mapping, cache, i32(rope.layer))  # fmt: skip
    num_seqs, max_blocks = attention.block_tables.shape
    workspace = cupy.empty(workspace_floats(rows, num_heads, head_dim, kv_chunks(max_blocks, block_size)),
                           dtype=np.float32)  # fmt: skip
    assert plan.num_ctas // plan.kv_lanes <= MAX_SPLIT_COUNTERS, "a counter a CTA group"
    packed = _layout(first.w_o)[0] == "packed"  # type: ignore[index]
    table = layer_table(layers) if table is None else table
    args = (
        table, i32(len(layers)), attn, residual, *tail, *head_args, i32(num_layers), i32(num_heads),
        i32(kv_heads), i32(block_size), i32(head_dim), q, attention.block_tables, attention.seq_lens,
        attention.query_start_loc, workspace,
        stream_counters("attention splits", MAX_SPLIT_COUNTERS, _device_id()), i32(num_seqs),
        i32(max_blocks), i32(attention.layer), i32(plan.head_parts), i32(plan.kv_lanes),
        i32(plan.grid[0]), i32(plan.grid[1]), np.float32(attention.scale), i32(attention.window),
    )  # fmt: skip
    name = f"decode_layer_{'packed' if packed else 'plain'}_d{head_dim}_b{block_size}"
    smem = layers_smem_bytes(
        rows, q_size, hidden, two_inter // 2, head_dim, block_size, len(layers)
    )
    grid_items = max(*items, -(-plan.num_ctas // 2))  # the attention's: two planned CTAs a CTA
    _launch(name, smem, grid_items, num_ctas, args)
    return summed, normed


def decode_layer(
    attention: Attention, w_o: Any, w_gate_up: Any, w_down: Any, residual: Any, mlp_norm: Any,
    next_norm: Any, eps: float, *, head: NextHead | None = None, num_ctas: int | None = None,
    plan: Any = None, table: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """A decode layer in one launch: its attention (the tensor-core kernel's body on its
    planned split grid, `layer_plan`), then decode_tail's work on its output, with `head`
    too. Returns decode_tail's (summed, normed or the next layer's queries):
    decode_layers of this one layer (`table`: its layer_table, if the caller keeps it)."""
    weights = LayerWeights(w_o, w_gate_up, w_down, mlp_norm, next_norm,
                           None if head is None else head.w_qkv)  # fmt: skip
    rope = None if head is None else head.rope
    return decode_layers(attention, [weights], residual, eps, rope=rope, num_ctas=num_ctas,
                         plan=plan, table=table)  # fmt: skip
