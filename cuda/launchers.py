"""Launchers of the small kernel families: embedding, RMSNorm, RoPE, KV write,
SiLU- and GELU-and-multiply, bias, argmax and the Philox uniforms.

Each checks its inputs (`kernels.check`), allocates its output unless one is
given, and launches one kernel of `cuda/<family>.cu`; each computes what its
NumPy twin computes, within BF16 rounding (the twins are named per function).
BF16 arrays are uint16 CuPy arrays holding the bit patterns. CuPy is imported
lazily. The GEMM and attention launchers live in gemm_kernel.py and
attention_kernel.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .embedding import bf16_scale
from .kernels import BF16_BITS, check, kernel, launch_kernel, stream_counters

RMSNORM_THREADS = 256  # as in rmsnorm.cu
QK_RMSNORM_MAX_WIDTH = 12288  # as in rmsnorm.cu: qk_rmsnorm's fp32 row in shared memory
RMSNORM_STATIC_SMEM_BYTES = 4 * RMSNORM_THREADS // 32  # rmsnorm.cu's block_sum scratch
# what a kernel may take in shared memory without its opt-in (static and dynamic together)
DEFAULT_SMEM_BYTES = 48 * 1024
ARGMAX_THREADS = 1024  # as in sampling.cu
ARGMAX_SPLIT_THREADS = 256  # as in sampling.cu
# argmax_split: launches of at most this many rows spread each row over CTAs of
# ARGMAX_SLICE ids (a decode step's few rows; more rows fill the GPU a CTA a row)
ARGMAX_SPLIT_MAX_ROWS = 8
ARGMAX_SLICE = 4096
ELEMENTWISE_THREADS = 256
SAMPLE_THREADS = 256


def _empty(shape: tuple[int, ...], dtype: Any, out: Any) -> Any:
    import cupy

    if out is None:
        return cupy.empty(shape, dtype=dtype)
    check("out", out, dtype, len(shape))
    if out.shape != shape:
        raise ValueError(f"out must have shape {shape}; got {out.shape}")
    return out


def _row_stride(name: str, x: Any, ndim: int) -> int:
    """Elements between consecutive rows of a [rows, ...] view whose inner part is contiguous."""
    if x.dtype != BF16_BITS or x.ndim != ndim:
        raise ValueError(
            f"{name} must be a {ndim}-d uint16 (BF16) device array; got {x.dtype} {x.shape}"
        )
    itemsize = x.dtype.itemsize
    inner = int(np.prod(x.shape[1:]))
    expected = itemsize
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.strides[1:]), strict=True):
        if size > 1 and stride != expected:
            raise ValueError(f"{name} must be contiguous within a row; got strides {x.strides}")
        expected *= size
    if x.shape[0] > 1 and x.strides[0] < inner * itemsize:
        raise ValueError(f"{name} rows overlap; got strides {x.strides}")
    return x.strides[0] // itemsize if x.shape[0] > 1 else inner


def embed(
    table: Any,
    token_ids: Any,
    prompt_rows: Any = None,
    scale: float | None = None,
    *,
    out: Any = None,
) -> Any:
    """Twin: embed_ref. table [vocab, hidden] BF16, token_ids [T] int32 (an id >= vocab
    selects row id - vocab of prompt_rows, [P, hidden] BF16), scale: the table rows'
    factor (rounded to BF16) or None -> [T, hidden] fp32. The ids are not read here (no
    device sync): the caller keeps them below vocab + P."""
    check("table", table, BF16_BITS, 2)
    check("token_ids", token_ids, np.int32, 1)
    num_tokens, hidden = token_ids.shape[0], table.shape[1]
    if prompt_rows is None:
        prompt_rows = table  # never read: every id is below vocab
    else:
        check("prompt_rows", prompt_rows, BF16_BITS, 2)
        if prompt_rows.shape[1] != hidden:
            raise ValueError(
                f"prompt_rows must have the table's width {hidden}; got {prompt_rows.shape}"
            )
    out = _empty((num_tokens, hidden), np.float32, out)
    if num_tokens:
        factor = np.float32(1.0) if scale is None else bf16_scale(scale)  # 1: copied as is
        args = (table, token_ids, prompt_rows, out, np.int32(hidden), np.int32(table.shape[0]),
                factor)  # fmt: skip
        launch_kernel(kernel("embedding", "embed"), (num_tokens,), (256,), args)
    return out


def rmsnorm(x: Any, weight: Any, eps: float, *, out: Any = None) -> Any:
    """Twin: rmsnorm_ref. x [T, hidden] fp32, weight [hidden] BF16 -> [T, hidden] BF16."""
    check("x", x, np.float32, 2)
    check("weight", weight, BF16_BITS, 1)
    _same_hidden(x, weight)
    out = _empty(x.shape, BF16_BITS, out)
    if x.shape[0]:
        args = (x, weight, out, np.int32(x.shape[1]), np.float32(eps))
        launch_kernel(kernel("rmsnorm", "rmsnorm"), (x.shape[0],), (RMSNORM_THREADS,), args)
    return out


def add_rmsnorm(residual: Any, delta: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """Twin: add_rmsnorm_ref. Returns (residual + delta in fp32, its rmsnorm in BF16)."""
    import cupy

    check("residual", residual, np.float32, 2)
    check("delta", delta, BF16_BITS, 2)
    check("weight", weight, BF16_BITS, 1)
    if delta.shape != residual.shape:
        raise ValueError(f"delta must have residual's shape {residual.shape}; got {delta.shape}")
    _same_hidden(residual, weight)
    summed = cupy.empty_like(residual)
    out = cupy.empty(residual.shape, dtype=BF16_BITS)
    if residual.shape[0]:
        args = (residual, delta, weight, summed, out, np.int32(residual.shape[1]), np.float32(eps))
        launch_kernel(
            kernel("rmsnorm", "add_rmsnorm"), (residual.shape[0],), (RMSNORM_THREADS,), args
        )
    return summed, out


def norm_add_rmsnorm(
    residual: Any, delta: Any, delta_weight: Any, weight: Any, eps: float
) -> tuple[Any, Any]:
    """Twin: norm_add_rmsnorm_ref. Returns (residual + rmsnorm(delta, delta_weight) in fp32,
    its rmsnorm by weight in BF16)."""
    import cupy

    check("residual", residual, np.float32, 2)
    check("delta", delta, BF16_BITS, 2)
    check("delta_weight", delta_weight, BF16_BITS, 1)
    check("weight", weight, BF16_BITS, 1)
    if delta.shape != residual.shape:
        raise ValueError(f"delta must have residual's shape {residual.shape}; got {delta.shape}")
    _same_hidden(residual, weight)
    _same_hidden(residual, delta_weight)
    summed = cupy.empty_like(residual)
    normed_delta = cupy.empty(residual.shape, dtype=BF16_BITS)
    out = cupy.empty(residual.shape, dtype=BF16_BITS)
    if residual.shape[0]:
        args = (residual, delta, delta_weight, weight, normed_delta, summed, out,
                np.int32(residual.shape[1]), np.float32(eps))  # fmt: skip
        launch_kernel(
            kernel("rmsnorm", "norm_add_rmsnorm"), (residual.shape[0],), (RMSNORM_THREADS,), args
        )
    return summed, out


def norm_add(
    residual: Any, delta: Any | None, delta_weight: Any | None, eps: float
) -> tuple[Any, Any]:
    """Twin: norm_add_ref. Returns (residual + rmsnorm(delta, delta_weight) in fp32, that
    sum in BF16); delta and delta_weight None: (a copy of residual, residual in BF16)."""
    import cupy

    check("residual", residual, np.float32, 2)
    summed = cupy.empty_like(residual)
    out = cupy.empty(residual.shape, dtype=BF16_BITS)
    if (delta is None) != (delta_weight is None):
        raise ValueError("delta and delta_weight must be given together or both be None")
    with_delta = delta is not None
    if delta is None:
        delta = delta_weight = out  # never read: with_delta 0
    else:
        check("delta", delta, BF16_BITS, 2)
        check("delta_weight", delta_weight, BF16_BITS, 1)
        if delta.shape != residual.shape:
            raise ValueError(
                f"delta must have residual's shape {residual.shape}; got {delta.shape}"
            )
        _same_hidden(residual, delta_weight)
    if residual.shape[0]:
        args = (residual, delta, delta_weight, summed, out, np.int32(residual.shape[1]),
                np.float32(eps), np.int32(with_delta))  # fmt: skip
        launch_kernel(kernel("rmsnorm", "norm_add"), (residual.shape[0],), (RMSNORM_THREADS,), args)
    return summed, out


def rope(x: Any, positions: Any, cos: Any, sin: Any, *, out: Any = None) -> Any:
    """Twin: rope_ref. x [T, heads, head_dim] BF16 (rows may be strided, as slices of the
    fused QKV output); positions [T] int32; cos, sin [max_positions, head_dim / 2] fp32."""
    stride = _row_stride("x", x, 3)
    check("positions", positions, np.int32, 1)
    check("cos", cos, np.float32, 2)
    check("sin", sin, np.float32, 2)
    num_tokens, heads, head_dim = x.shape
    if positions.shape[0] != num_tokens or head_dim % 2 or cos.shape[1] != head_dim // 2:
        raise ValueError(
            f"rope needs positions [{num_tokens}] and tables [*, {head_dim // 2}], even head_dim; "
            f"got positions {positions.shape}, tables {cos.shape}, head_dim {head_dim}"
        )
    out = _empty((num_tokens, heads, head_dim), BF16_BITS, out)
    if num_tokens:
        args = (x, np.int64(stride), positions, cos, sin, out, np.int32(heads), np.int32(head_dim))
        launch_kernel(kernel("rope", "rope"), (num_tokens, heads), (head_dim // 2,), args)
    return out


def check_rope_kv_write(
    qkv_shape: tuple[int, ...], positions: Any, cos: Any, sin: Any, cache: Any, layer: int,
    slot_mapping: Any, num_heads: int,
) -> tuple[int, int, int]:  # fmt: skip
    """rope_kv_write's checks of everything but qkv's own array (`qkv_shape`: [T, num_heads
    + 2 * kv_heads, head_dim]): ValueError naming what is wrong; else the cache's
    (num_layers, kv_heads, block_size)."""
    check("positions", positions, np.int32, 1)
    check("cos", cos, np.float32, 2)
    check("sin", sin, np.float32, 2)
    check("cache", cache, BF16_BITS, 6)
    check("slot_mapping", slot_mapping, np.int64, 1)
    num_tokens, width, head_dim = qkv_shape
    _, num_layers, _, kv_heads, block_size, cache_head_dim = cache.shape
    if width != num_heads + 2 * kv_heads or cache_head_dim != head_dim or head_dim % 2:
        raise ValueError(
            f"qkv must be [T, {num_heads} + 2 * {kv_heads}, {cache_head_dim}] (the cache's KV "
            f"heads and even head_dim); got {tuple(qkv_shape)}"
        )
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"positions and slot_mapping need {num_tokens} entries; got {positions.shape}, "
            f"{slot_mapping.shape}"
        )
    if cos.shape[1] != head_dim // 2 or sin.shape != cos.shape:
        raise ValueError(f"rope tables must be [*, {head_dim // 2}]; got {cos.shape}, {sin.shape}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}); got {layer}")
    return num_layers, kv_heads, block_size


def rope_kv_write(
    qkv: Any,
    positions: Any,
    cos: Any,
    sin: Any,
    cache: Any,
    layer: int,
    slot_mapping: Any,
    num_heads: int,
) -> Any:
    """Twin: rope_kv_write_ref. rope then kv_write in one launch: qkv [T, num_heads + 2 *
    kv_heads, head_dim] BF16 (rows may be strided); the keys, rotated, and the values go
    into the cache slots [T] int64, in place; returns the rotated queries [T, num_heads,
    head_dim], contiguous."""
    stride = _row_stride("qkv", qkv, 3)
    num_tokens, _, head_dim = qkv.shape
    num_layers, kv_heads, block_size = check_rope_kv_write(
        qkv.shape, positions, cos, sin, cache, layer, slot_mapping, num_heads
    )
    q = _empty((num_tokens, num_heads, head_dim), BF16_BITS, None)
    if num_tokens:
        args = (qkv, np.int64(stride), positions, cos, sin, q, slot_mapping, cache,
                np.int32(layer), np.int32(num_layers), np.int32(num_heads), np.int32(kv_heads),
                np.int32(block_size), np.int32(head_dim))  # fmt: skip
        launch_kernel(
            kernel("kvcache", "rope_kv_write"),
            (num_tokens, num_heads + kv_heads),
            (head_dim // 2,),
            args,
        )
    return q


def kv_write(cache: Any, layer: int, k: Any, v: Any, slot_mapping: Any) -> None:
    """Twin: kv_write_ref. Writes k, v [T, kv_heads, head_dim] BF16 (rows may be strided,
    as slices of the fused QKV output) into the cache slots [T] int64, in place."""
    check("cache", cache, BF16_BITS, 6)
    check("slot_mapping", slot_mapping, np.int64, 1)
    k_stride, v_stride = _row_stride("k", k, 3), _row_stride("v", v, 3)
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape; got {k.shape}, {v.shape}")
    _, num_layers, _, kv_heads, block_size, head_dim = cache.shape
    if k.shape[1:] != (kv_heads, head_dim) or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"k must be [T, {kv_heads}, {head_dim}] with T slots; got {k.shape}, {slot_mapping.shape}"
        )
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}); got {layer}")
    if k.shape[0]:
        args = (k, v, np.int64(k_stride), np.int64(v_stride), slot_mapping, cache, np.int32(layer), np.int32(num_layers),
                np.int32(kv_heads), np.int32(block_size), np.int32(head_dim))  # fmt: skip
        launch_kernel(
            kernel("kvcache", "kv_write"), (k.shape[0], kv_heads), (min(head_dim, 128),), args
        )


def silu_mul(gate_up: Any, *, out: Any = None) -> Any:
    """Twin: silu_mul_ref. gate_up [T, 2 * inter] BF16 -> [T, inter] BF16."""
    return _gated(gate_up, out, lambda: kernel("activation", "silu_mul"))


def gelu_tanh_mul(gate_up: Any, *, out: Any = None) -> Any:
    """Twin: gelu_tanh_mul_ref. gate_up [T, 2 * inter] BF16 -> [T, inter] BF16."""
    return _gated(gate_up, out, lambda: kernel("activation", "gelu_tanh_mul"))


def softcap(logits: Any, cap: float) -> Any:
    """Twin: softcap_ref. logits [R, vocab] fp32, capped in place (and returned)."""
    check("logits", logits, np.float32, 2)
    total = logits.shape[0] * logits.shape[1]
    if total:
        blocks = min(-(-total // ELEMENTWISE_THREADS), 65535)
        args = (logits, np.int64(total), np.float32(cap))
        launch_kernel(
            kernel("activation", "logit_softcap"), (blocks,), (ELEMENTWISE_THREADS,), args
        )
    return logits


def _gated(gate_up: Any, out: Any, gated_kernel: Callable[[], Any]) -> Any:
    """Check, then launch one of activation.cu's kernels (`gated_kernel()` compiles it on
    the first launch): [T, 2 * inter] BF16 (gate, then up) -> [T, inter] BF16."""
    check("gate_up", gate_up, BF16_BITS, 2)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even width; got {width}")
    out = _empty((num_tokens, width // 2), BF16_BITS, out)
    total = num_tokens * (width // 2)
    if total:
        blocks = min(-(-total // ELEMENTWISE_THREADS), 65535)
        args = (gate_up, out, np.int64(num_tokens), np.int32(width // 2))
        launch_kernel(gated_kernel(), (blocks,), (ELEMENTWISE_THREADS,), args)
    return out


def add_bias(y: Any, bias: Any, *, out: Any = None) -> Any:
    """Twin: add_bias_ref. y [T, N] fp32 (a GEMM's output), bias [N] BF16 -> [T, N] BF16."""
    check("y", y, np.float32, 2)
    check("bias", bias, BF16_BITS, 1)
    num_tokens, width = y.shape
    if bias.shape[0] != width:
        raise ValueError(f"bias must have {width} elements; got {bias.shape[0]}")
    out = _empty((num_tokens, width), BF16_BITS, out)
    total = num_tokens * width
    if total:
        blocks = min(-(-total // ELEMENTWISE_THREADS), 65535)
        args = (y, bias, out, np.int64(num_tokens), np.int32(width))
        launch_kernel(kernel("bias", "add_bias"), (blocks,), (ELEMENTWISE_THREADS,), args)
    return out


def head_rmsnorm(qkv: Any, q_weight: Any, k_weight: Any, num_heads: int, eps: float) -> Any:
    """Twin: head_rmsnorm_ref. qkv [T, num_heads + 2 * kv_heads, head_dim] BF16, normalized
    in place and returned: each query and key head with [head_dim] weights (Qwen3's q_norm
    and k_norm), or each token's queries and its keys as one row each with weights as long
    as all the query heads and all the key heads (OLMo 2's; at most QK_RMSNORM_MAX_WIDTH)."""
    check("qkv", qkv, BF16_BITS, 3)
    check("q_weight", q_weight, BF16_BITS, 1)
    check("k_weight", k_weight, BF16_BITS, 1)
    tokens, heads, head_dim = qkv.shape
    kv_heads = (heads - num_heads) // 2
    if heads != num_heads + 2 * kv_heads or kv_heads < 1:
        raise ValueError(f"qkv must have num_heads ({num_heads}) + 2 * kv_heads heads; got {heads}")
    widths = (q_weight.shape[0], k_weight.shape[0])
    if widths == (num_heads * head_dim, kv_heads * head_dim) and widths != (head_dim, head_dim):
        return _qk_rmsnorm(qkv, q_weight, k_weight, num_heads, kv_heads, eps)
    if widths != (head_dim, head_dim):
        raise ValueError(
            f"q_weight and k_weight must have {head_dim} elements each (head_dim), or "
            f"{num_heads * head_dim} and {kv_heads * head_dim} (all the query heads, all the "
            f"key heads); got {widths[0]} and {widths[1]}"
        )
    if not 0 < head_dim <= RMSNORM_THREADS:
        raise ValueError(f"head_dim must be in [1, {RMSNORM_THREADS}]; got {head_dim}")
    if tokens:
        args = (qkv, q_weight, k_weight, np.int32(num_heads), np.int32(kv_heads),
                np.int32(head_dim), np.float32(eps))  # fmt: skip
        grid = (tokens * (num_heads + kv_heads),)
        launch_kernel(kernel("rmsnorm", "head_rmsnorm"), grid, (RMSNORM_THREADS,), args)
    return qkv


def _qk_rmsnorm(
    qkv: Any, q_weight: Any, k_weight: Any, num_heads: int, kv_heads: int, eps: float
) -> Any:
    """head_rmsnorm's full-width form: qk_rmsnorm, a CTA per token's queries and per its
    keys, the (longer) query row staged in fp32 in dynamic shared memory."""
    tokens, _, head_dim = qkv.shape
    width = num_heads * head_dim
    if width > QK_RMSNORM_MAX_WIDTH:
        raise ValueError(
            f"num_heads * head_dim must be at most {QK_RMSNORM_MAX_WIDTH}; got {width}"
        )
    if tokens:
        smem = 4 * width
        fn = kernel("rmsnorm", "qk_rmsnorm")
        over = smem + RMSNORM_STATIC_SMEM_BYTES > DEFAULT_SMEM_BYTES
        if over and fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem
        args = (qkv, q_weight, k_weight, np.int32(num_heads), np.int32(kv_heads),
                np.int32(head_dim), np.float32(eps))  # fmt: skip
        launch_kernel(fn, (tokens * 2,), (RMSNORM_THREADS,), args, shared_mem=smem)
    return qkv


def argmax(logits: Any, *, out: Any = None) -> Any:
    """Twin: argmax_ref per row. logits [R, vocab] fp32 -> [R] int32, ties to the lowest id.

    Up to ARGMAX_SPLIT_MAX_ROWS rows (a decode step's) go to argmax_split, each row over
    ceil(vocab / ARGMAX_SLICE) CTAs whose bests the last one combines: the same ids as
    argmax's CTA a row, by construction (sampling.cu)."""
    check("logits", logits, np.float32, 2)
    rows, vocab = logits.shape
    out = _empty((rows,), np.int32, out)
    slices = argmax_slices(rows, vocab)
    if rows and slices > 1:
        import cupy

        part_v = cupy.empty(rows * slices, dtype=np.float32)
        part_i = cupy.empty(rows * slices, dtype=np.int32)
        device = cupy.cuda.runtime.getDevice()
        counters = stream_counters("argmax rows", ARGMAX_SPLIT_MAX_ROWS, device)
        args: tuple = (logits, np.int64(vocab), np.int32(vocab), np.int32(ARGMAX_SLICE), part_v,
                       part_i, counters, out)  # fmt: skip
        launch_kernel(kernel("sampling", "argmax_split"), (rows, slices), (ARGMAX_SPLIT_THREADS,),
                      args)  # fmt: skip
    elif rows:
        args = (logits, np.int64(vocab), np.int32(vocab), out)
        launch_kernel(kernel("sampling", "argmax"), (rows,), (ARGMAX_THREADS,), args)
    return out


def argmax_slices(rows: int, vocab: int) -> int:
    """CTAs a row of `argmax`'s launch: 1 (argmax, a CTA a row) past ARGMAX_SPLIT_MAX_ROWS
    rows or for a vocabulary of one slice."""
    return -(-vocab // ARGMAX_SLICE) if rows <= ARGMAX_SPLIT_MAX_ROWS else 1


def sample(
    logits: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    seeds: Any,
    positions: Any,
    min_p: Any = None,
) -> Any:
    """Twin: sampling.sample_ref per row. logits [R, vocab] fp32; temperature, top_p and
    min_p (None: 0, no cut) [R] fp32; top_k [R] int32 (vocab or more for none); seeds [R]
    uint64; positions [R] int64 -> [R] int32 tokens, on the device (no host read).

    Ranking: each score keyed by a 64-bit integer, its order-preserving bits (negated,
    so higher scores come first; -0 made +0 first, as the twin's sort ties them) above
    its id; a row's keys are distinct, so their sort has one result, whatever the sort
    algorithm or the other rows. Then `sample_sorted` (sampling.cu) walks the ranks as
    the twin does."""
    import cupy

    check("logits", logits, np.float32, 2)
    rows, vocab = logits.shape
    if min_p is None:
        min_p = cupy.zeros((rows,), dtype=np.float32)
    for name, x, dtype in [("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                           ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                           ("seeds", seeds, np.uint64), ("positions", positions, np.int64)]:  # fmt: skip
        check(name, x, dtype, 1)
        if x.shape[0] != rows:
            raise ValueError(f"{name} must have one value per row ({rows}); got {x.shape[0]}")
    out = cupy.empty((rows,), dtype=np.int32)
    if rows == 0:
        return out
    scaled = logits / temperature[:, None]
    scaled += np.float32(0.0)  # -0 + 0 = +0; every other value unchanged
    bits = scaled.view(np.uint32)
    ascending = cupy.where(bits >= np.uint32(1 << 31), ~bits, bits | np.uint32(1 << 31))
    keys = (~ascending).astype(np.uint64) << np.uint64(32)
    keys |= cupy.arange(vocab, dtype=np.uint64)
    keys.sort(axis=1)
    ids = (keys & np.uint64(0xFFFFFFFF)).astype(np.int32)
    ranked = cupy.take_along_axis(scaled, ids, axis=1)
    uniforms = philox_uniform(seeds, positions)
    cum = cupy.empty_like(ranked)
    args = (ranked, ids, top_k, top_p, min_p, uniforms, cum, np.int32(vocab), out)
    launch_kernel(kernel("sampling", "sample_sorted"), (rows,), (SAMPLE_THREADS,), args)
    return out


def philox_uniform(seeds: Any, positions: Any) -> Any:
    """Twin: sampling.uniform per element. seeds [n] uint64, positions [n] int64 -> [n] fp32."""
    import cupy

    check("seeds", seeds, np.uint64, 1)
    check("positions", positions, np.int64, 1)
    if seeds.shape != positions.shape:
        raise ValueError(f"seeds and positions must match; got {seeds.shape}, {positions.shape}")
    n = seeds.shape[0]
    out = cupy.empty((n,), dtype=np.float32)
    if n:
        launch_kernel(
            kernel("sampling", "philox_uniform"),
            (-(-n // 256),),
            (256,),
            (seeds, positions, out, np.int32(n)),
        )
    return out


def _same_hidden(x: Any, weight: Any) -> None:
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must have {x.shape[1]} elements; got {weight.shape[0]}")
