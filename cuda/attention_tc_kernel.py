"""Launcher of the tensor-core paged attention kernel (cuda/attention_tc.cu); twin:
`paged_attention_ref`.

The same op, arguments, checks and guarantees as `attention_kernel.paged_attention`
(the CUDA-core kernel), computed FlashAttention-2 style: Q.K^T and P.V run on
`mma.sync` BF16 tensor cores with fp32 accumulation, so a long prefill is bound by
the tensor cores rather than by fp32 FMAs. Results agree with the twin within BF16
rounding; they are not bitwise those of the CUDA-core kernel (its sums run in
another order), so one engine must use one kernel for all its steps.

Work: one CTA per (query tile, KV head), as in `attention_kernel`, with 64
(query, group member) rows a CTA: four warps, each one m16 tile of rows. K and V
pages stream through a ring of shared buffers (`num_stages`, `smem_bytes`). Each
CTA finds its (sequence, tile) on the device from `query_start_loc`, so the grid
is planned from T and B alone: no device->host read, and the launch can be
captured in a CUDA graph.

Why a query's bits do not depend on its batch (DESIGN §4)
---------------------------------------------------------
attention_tc.cu's header states the argument in full. In short: key tiles are the
cache pages, walked in ascending order by one CTA; each score and each P.V sum is
one accumulator register taking one mma per 16-wide slice in ascending order,
and an mma has no cross-row interaction; masking is by select (masked scores
-inf, their p +0), the softmax runs on the row's own values with explicitly
rounded intrinsics and its sums have a shape fixed by block_size; a page wholly
in a row's future leaves the row's state exactly as it was (selects), so a row
runs exactly the pages up to its own last key whatever its neighbours do; key
slots past seq_len are zero-filled when staged, so stale NaN never meets a zero
p; an exactly zero output is written as +0.
"""

from __future__ import annotations

import functools
from typing import Any

from .attention_kernel import check_inputs, kernel_args, num_work_items
from .gemm_kernel import MAX_STATIC_SMEM_BYTES
from .kernels import kernel

ROWS_PER_CTA = 64  # kRowsPerCta in attention_tc.cu: four m16 tiles of (query, group member) rows
THREADS_PER_CTA = 128  # kNumThreads in attention_tc.cu


def kernel_name(head_dim: int, block_size: int) -> str:
    return f"paged_attention_tc_d{head_dim}_b{block_size}"


def num_stages(block_size: int) -> int:
    """Pages in the kernel's shared ring (Config::kStages): at least 64 keys' worth."""
    return max(2, 64 // block_size)


def smem_bytes(head_dim: int, block_size: int) -> int:
    """Dynamic shared memory of a CTA (Config::kSmemBytes): the ring of K and V pages,
    rows of head_dim + 8 BF16 values."""
    return num_stages(block_size) * 2 * block_size * (head_dim + 8) * 2


def paged_attention_tc(
    q: Any,
    cache: Any,
    layer: int,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: float,
    *,
    out: Any = None,
) -> Any:
    """`attention_kernel.paged_attention` (the same arguments, checks and result) on the
    tensor-core kernel; a KV head may have up to ROWS_PER_CTA query heads."""
    args = (q, cache, layer, block_tables, seq_lens, query_start_loc, scale)
    out = check_inputs(*args, out=out, max_group=ROWS_PER_CTA)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[3], cache.shape[4]
    group = num_heads // num_kv_heads
    work = num_work_items(num_tokens, block_tables.shape[0], group, ROWS_PER_CTA)
    if work == 0:
        return out
    import cupy

    fn = _kernel(head_dim, block_size, int(cupy.cuda.runtime.getDevice()))
    fn(
        (work, num_kv_heads),
        (THREADS_PER_CTA,),
        kernel_args(out, *args),
        shared_mem=smem_bytes(head_dim, block_size),
    )
    return out


@functools.cache
def _kernel(head_dim: int, block_size: int, device_id: int) -> Any:
    """The compiled entry point, with its shared-memory opt-in set on this device.

    `device_id` keys the cache: the opt-in is a per-device function attribute.
    NOTE: the kernel traps when launched with other than THREADS_PER_CTA threads or
    less than `smem_bytes` of dynamic shared memory, so a drift between the two
    files fails loudly on the first launch.
    """
    fn = kernel("attention_tc", kernel_name(head_dim, block_size))
    if smem_bytes(head_dim, block_size) > MAX_STATIC_SMEM_BYTES:
        fn.max_dynamic_shared_size_bytes = smem_bytes(head_dim, block_size)
    return fn
