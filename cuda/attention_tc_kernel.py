"""Launcher of the tensor-core paged attention kernel (cuda/attention_tc.cu); twin:
`paged_attention_ref`.

The same op, arguments, checks and guarantees as `attention_kernel.paged_attention`
(the CUDA-core kernel), computed FlashAttention-2 style: Q.K^T and P.V run on
`mma.sync` BF16 tensor cores with fp32 accumulation, so a long prefill is bound by
the tensor cores rather than by fp32 FMAs. Results agree with the twin within BF16
rounding; they are not bitwise those of the CUDA-core kernel (its sums run in
another order), so one engine must use one kernel for all its steps.

Work: one CTA per (query tile, head slot, KV lane), on `attention_kernel.split_grid`'s
geometry and through its `launch` (the KV chunks, the split's workspace and counters),
with 64 (query, query head) rows a CTA: four warps, each one m16 tile of rows. K and V
pages stream through a ring of shared buffers (`num_stages`, `smem_bytes`), after
which each thread keeps its rows' merged state over the KV chunks (one lane). A split
launch (a grid under a wave) takes the deep ring, the same kernel with more pages in
flight (`launch_variant`): its CTAs are few, each walking its pages one after another
(6-7 % faster than the normal ring there, measured on an H200). Each
CTA finds its (sequence, tile) on the device from `query_start_loc`, so the grid is
planned from T, B and the block table's width alone: no device->host read, and the
launch can be captured in a CUDA graph.

Why a query's bits do not depend on its batch (DESIGN §4)
---------------------------------------------------------
attention_tc.cu's header states the argument in full. In short: the key range is
split only at the fixed positions c * KV_CHUNK, each chunk's softmax starts fresh
and the chunks merge in ascending order with the twin's formula, in shared memory
(one lane) or from the workspace (the last lane), the same fp32 ops either way; key
tiles are the cache pages, walked in ascending order within a chunk; each score and each P.V sum is
one accumulator register taking one mma per 16-wide slice in ascending order,
and an mma has no cross-row interaction; masking is by select (masked scores
-inf, their p +0), the softmax runs on the row's own values with explicitly
rounded intrinsics and one exponential (in base 2: ex2.approx, a function of its
input alone on a device; the rescale skipped only where it multiplies by exactly 1)
and its sums have a shape fixed by block_size; a page wholly
in a row's future leaves the row's state exactly as it was (selects for m and
denom; acc takes only exact zero terms), so a row runs exactly the pages up to
its own last key whatever its neighbours do; key
slots past seq_len are zero-filled when staged, so stale NaN never meets a zero
p; an exactly zero output is written as +0.
"""

from __future__ import annotations

import functools
from typing import Any

from .attention_kernel import SplitGrid, check_inputs, launch
from .gemm_kernel import MAX_STATIC_SMEM_BYTES
from .kernels import kernel

ROWS_PER_CTA = 64  # kRowsPerCta in attention_tc.cu: four m16 tiles of (query, group member) rows
THREADS_PER_CTA = 128  # kNumThreads in attention_tc.cu
# The head sizes attention_tc.cu has entry points for, and the page sizes of each: head_dim
# 256 (Gemma's) with 16- and 32-key pages on the normal ring alone (its 64-key pages are
# over sm_80's shared memory, and its deep ring spills), at one CTA an SM
TC_BLOCK_SIZES = {64: (16, 32, 64), 128: (16, 32, 64), 256: (16, 32)}
TC_HEAD_DIMS = tuple(TC_BLOCK_SIZES)
DEEP_HEAD_DIMS = (64, 128)
# Whether CupyBackend's "tensor-cores" attention takes this kernel for head_dim 256 too
# (attention_tc.cu's d256 entry points; else the CUDA-core kernel runs those heads, as
# before). The same invariance argument and emulated tests as 64 and 128; off until a GPU
# has run its tests and gpu_followup's `gemma_tc` part has timed it against `gemma`.
# NOTE: its bits are not the CUDA-core kernel's, so CupyBackend.kernel_choice (which keys
# the disk tier's files) says "tensor-cores+d256" while it is on.
D256_BY_DEFAULT = False


def takes(head_dim: int, block_size: int) -> bool:
    """Whether attention_tc.cu has an entry point for these heads and pages."""
    return block_size in TC_BLOCK_SIZES.get(head_dim, ())


# The build the launcher compiles: attention_tc.cu's defines ("NAME=VALUE"), none by
# default. bench_gpu_kernels builds its same-run baselines with them:
# REPRISE_ATTN_EXPF=1, the page step before base 2 (the accurate expf of natural-unit
# scores, acc rescaled and the masks applied on every page: other bits); with
# REPRISE_ATTN_EXP_SELECT=1 too, a select around each expf, as before 2026-11-27 (the
# same bits as without it).
BUILD: tuple[str, ...] = ()
# The shared page (attention_tc.cu, REPRISE_ATTN_COOP): a split launch's CTA whose rows fit
# one m16 tile (a decode's) runs each page on all four warps instead of warp 0 alone. The
# same bits (tests/test_attention_tc_emulated.py); off until a GPU run shows it faster
# (bench/results/PENDING.md).
COOP = False


def kernel_name(head_dim: int, block_size: int, *, deep: bool = False) -> str:
    return f"paged_attention_tc_d{head_dim}_b{block_size}" + ("_deep" if deep else "")


def num_stages(block_size: int, *, deep: bool = False) -> int:
    """Pages in the kernel's shared ring (ring_stages and deep_ring_stages in
    attention_tc.cu): at least 64 keys' worth; the deep ring at least 128 keys and 3 pages."""
    return max(3, 128 // block_size) if deep else max(2, 64 // block_size)


def smem_bytes(head_dim: int, block_size: int, *, deep: bool = False) -> int:
    """Dynamic shared memory of a CTA (Ring::kSmemBytes): the ring of K and V pages,
    rows of head_dim + 8 BF16 values, then each thread's merged state over the KV chunks
    (head_dim / 2 acc values, and m, denom of its two rows: fp32), which the deep ring's
    kernels (split launches only: they merge from the workspace) do not have."""
    ring = num_stages(block_size, deep=deep) * 2 * block_size * (head_dim + 8) * 2
    return ring + (0 if deep else THREADS_PER_CTA * (head_dim // 2 + 4) * 4)


def launch_variant(head_dim: int, block_size: int, grid: SplitGrid) -> tuple[str, int]:
    """The entry point for a launch on `grid`, and its dynamic shared memory: the deep
    ring exactly when the launch splits (kv_lanes > 1, the (query tile, head slot) CTAs
    under a wave), where a CTA walks its few pages one after another with little to hide
    their loads' latency; else the normal ring, which fits more CTAs an SM. The ring depth
    reaches no bits (attention_tc.cu, "The deep ring"). Head_dim 256 has the normal ring
    alone."""
    deep = grid.splits and head_dim in DEEP_HEAD_DIMS
    return kernel_name(head_dim, block_size, deep=deep), smem_bytes(head_dim, block_size, deep=deep)


def paged_attention_tc(
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
    """`attention_kernel.paged_attention` (the same arguments, checks, geometry and result)
    on the tensor-core kernel; a KV head may have up to ROWS_PER_CTA query heads."""
    args = (q, cache, layer, block_tables, seq_lens, query_start_loc, scale, window, softcap)
    out = check_inputs(*args, out=out, max_group=ROWS_PER_CTA, head_dims=TC_HEAD_DIMS)
    import cupy

    head_dim, block_size = q.shape[2], cache.shape[4]
    if not takes(head_dim, block_size):
        raise ValueError(
            f"block_size must be one of {TC_BLOCK_SIZES[head_dim]} for head_dim {head_dim} on the "
            f"tensor-core kernel; got {block_size}"
        )
    device_id = int(cupy.cuda.runtime.getDevice())

    def kernel_for(grid: SplitGrid) -> tuple[Any, int]:
        name, smem = launch_variant(head_dim, block_size, grid)
        return _kernel(
            name, smem, device_id, (*BUILD, *(("REPRISE_ATTN_COOP=1",) if COOP else ()))
        ), smem

    return launch(kernel_for, ROWS_PER_CTA, out, *args, workspace=workspace)


@functools.cache
def _kernel(name: str, smem: int, device_id: int, build: tuple[str, ...] = ()) -> Any:
    """Entry point `name`, compiled with the defines `build` (BUILD), with its opt-in to
    `smem` bytes of dynamic shared memory set on this device.

    `device_id` keys the cache: the opt-in is a per-device function attribute.
    NOTE: the kernel traps when launched with other than THREADS_PER_CTA threads or
    less than `smem_bytes` of dynamic shared memory, so a drift between the two
    files fails loudly on the first launch.
    """
    fn = kernel("attention_tc", name, build)
    if smem > MAX_STATIC_SMEM_BYTES:
        fn.max_dynamic_shared_size_bytes = smem
    return fn
