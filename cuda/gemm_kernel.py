"""Launcher of the tensor-core GEMM in gemm.cu: y = x @ w.T (twin: gemm.gemm_ref).

x is [M, K] and w is [N, K] (Hugging Face layout), both BF16 held as uint16 CuPy
arrays; y is [M, N] BF16 (round to nearest even of the fp32 accumulator) or fp32.

What it guarantees (DESIGN §4): every y[m, n] is one fp32 computation over K in one
fixed order that depends on the weight's shape (N, K) and nothing else:

- The weight's split count S = `split_k(N, K)` is a pure function of its shape, fixed
  when the weight loads (never of M, the device or the call) and cuts K into S
  contiguous splits of `split_length(K, S)` elements (the last one shorter).
- Each split's partial is one accumulator starting from +0 that takes the K slices
  [16s, 16s + 16) of that split in ascending order, one mma.m16n8k16 per slice, and
  y = (((0 + P_0) + P_1) + ...) + P_{S-1} in fp32, then one rounding to BF16. With
  S = 1 that is the plain chain from +0 over all of K (no fold, no merge).
- Every route computes exactly that sequence: the skinny tile (M <= 16) writes the
  partials to an fp32 workspace, one CTA per (split, tile), and the tile's last CTA
  (counted with an integer atomic) folds them in ascending split order; the mid and big
  tiles walk all of K in one CTA and fold each finished partial into a running total at
  the split boundary. No float atomics; rows past M and columns past N are padding that never enters another
  element's sum and is never written; the K tail is skipped, not padded.

Why the threshold between routes cannot change a row: the route (and the tile
configuration, picked by M for speed, `tile_config`) only regroups who computes which
partial and where it waits (a register or the workspace); the mma per slice, the
order of slices inside a partial, the split boundaries and the fold order are the
same on every route, because S comes from (N, K) alone. Had the skinny route split K
while the large-M route did not, an M = 1 row would differ from the same row inside
M = 300 (a fold of partials is not the one long chain); so the large-M route splits
exactly as the skinny one does, keeping its running total in local memory (touched only
between splits, so the fold kernels take the registers and CTAs per SM of the unsplit ones).
So y[m, n] depends on x[m, :], w[n, :] and (N, K) alone: bit-identical for any M, row
offset, companion rows, configuration and pointer alignment. gemm.cu states the
argument in full. Against the NumPy twin, which rounds an exact sum once, results
agree within BF16 rounding, not bitwise (any S).

Nothing is allocated except the output when `out` is None (and, for S > 1 at M <= 16,
the [S, M, N] fp32 workspace, plus once per stream its tile counters). CuPy is imported
lazily.

`grouped_gemm` is the mixture-of-experts GEMM (twin: moe.moe_gemm_ref): each expert's
grouped rows times its own weight, one launch for all experts, every CTA running the
unsplit (WHOLE) tile on one m tile of its expert's rows (the routing numbered them); a
row's bits are a function of the row and its expert's weight alone (gemm.cu's header),
the grid a function of R = T * k, N, E and the tile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .kernels import BF16_BITS, check, kernel, launch_kernel, stream_counters

MAX_STATIC_SMEM_BYTES = 48 * 1024  # more needs the per-kernel opt-in attribute
MAX_GRID_Y = 65535
INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One instantiation of gemm.cu's kernel; the numbers repeat its `Tile<...>`.

    NOTE: the kernel traps when launched with other than `num_threads` threads or
    less than `smem_bytes` of dynamic shared memory, so a drift between the two
    files fails loudly on the first launch.
    """

    name: str
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    max_rows: int | None  # the largest M this config is picked for; None: any

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        """Shared memory of the x and w tile ring: rows of block_k + 8 BF16 values."""
        return self.num_stages * (self.block_m + self.block_n) * (self.block_k + 8) * 2

    def kernel_name(self, out_f32: bool) -> str:
        return f"gemm_{'f32' if out_f32 else 'bf16'}_{self.name}"


# Ascending max_rows; the last takes any M.
CONFIGS: tuple[TileConfig, ...] = (
    TileConfig("skinny", 16, 64, 128, num_stages=4, num_warps=4, max_rows=16),  # decode
    TileConfig("mid", 64, 64, 32, num_stages=4, num_warps=4, max_rows=64),
    TileConfig("big", 128, 128, 32, num_stages=4, num_warps=8, max_rows=None),  # prefill
)
SKINNY = CONFIGS[0]

# x rows past M (gemm.cu, zero_rows_past_m): zeros written once (True), or, built apart for
# bench_gemm_sm90's same-run baseline, zero-filled by every k-tile's copies (False). The
# same bits either way (tests/test_kernels_emulated.py).
PAD_ONCE = True

# Split-K: split lengths are multiples of SPLIT_GRANULE (every config's BK divides it,
# so no k-tile straddles a split), at least MIN_SPLIT_LENGTH long. The split count
# fills one wave of REFERENCE_SMS SMs running SKINNY_CTAS_PER_SM skinny CTAs each: an
# H100's 132 SMs, 2 skinny CTAs each (its shared memory: 2 x 87,040 B of 228 KiB).
# They are constants, not the device's figures, so that a weight's split, and so its
# bits, are the same on every device (tests/test_kernels_compile.py checks the CTA count
# against the compiled kernel's registers and shared memory).
SPLIT_GRANULE = 128
MIN_SPLIT_LENGTH = 256
MAX_SPLITS = 32
REFERENCE_SMS = 132
SKINNY_CTAS_PER_SM = 2


def split_length(k: int, splits: int) -> int:
    """Elements of K in each split but the last: ceil(K / S) rounded up to SPLIT_GRANULE."""
    if k <= 0 or splits <= 0:
        raise ValueError(f"K and the split count must be positive; got K = {k}, splits = {splits}")
    per_split = -(-k // splits)
    return -(-per_split // SPLIT_GRANULE) * SPLIT_GRANULE


def num_splits(k: int, length: int) -> int:
    """How many splits of `length` cover K."""
    return -(-k // length)


def split_k(n: int, k: int) -> int:
    """The split count S of a [N, K] weight: a function of its shape alone (never of M).

    The largest S whose skinny grid (M <= 16: ceil(N / 64) * S CTAs) still fits in one
    wave of the reference device (REFERENCE_SMS * SKINNY_CTAS_PER_SM CTAs resident at
    once), among the counts that `split_length` realises exactly, with splits at least
    MIN_SPLIT_LENGTH long; 1 when the unsplit grid already fills a wave or K is short.
    Measured on an H100 (bench/bench_split_sweep.py, bench/results/2026-11-26-h100-run2):
    the fastest count at M = 1 and 16 is the one that fills a single wave, since a few
    CTAs spilled into a second wave stream alone at the end (qkv: S = 2 26.7 us, S = 3
    37.4, S = 5 28.7), and every split costs the large-M FOLD route time, so fewer is
    better once the wave is full.
    """
    if n <= 0 or k <= 0:
        raise ValueError(f"N and K must be positive; got N = {n}, K = {k}")
    tiles = -(-n // SKINNY.block_n)
    best = 1
    for splits in range(2, MAX_SPLITS + 1):
        if tiles * splits > REFERENCE_SMS * SKINNY_CTAS_PER_SM:
            break
        length = split_length(k, splits)
        if length < MIN_SPLIT_LENGTH:
            break
        if num_splits(k, length) == splits:  # else rounding merged it into fewer splits
            best = splits
    return best


def tile_config(num_rows: int) -> TileConfig:
    """The tile configuration `gemm` runs for an M of `num_rows`."""
    for config in CONFIGS:
        if config.max_rows is None or num_rows <= config.max_rows:
            return config
    raise AssertionError("the last config takes any M")


@dataclass(frozen=True, slots=True)
class SmLimits:
    """Per-SM resources of an architecture (CUDA programming guide, compute capabilities)."""

    registers: int = 65536
    threads: int = 2048
    ctas: int = 32
    shared_bytes: int = 233472  # sm_90: 228 KiB
    reserved_shared_per_cta: int = 1024  # the runtime's share of each CTA's shared memory


SM_LIMITS = {"sm_80": SmLimits(shared_bytes=167936), "sm_90": SmLimits()}


def ctas_per_sm(threads: int, registers: int, shared_bytes: int, arch: str = "sm_90") -> int:
    """Resident CTAs an SM holds of a kernel taking `registers` a thread (the compiled
    figure, nvrtc.kernel_resources) and `shared_bytes` a CTA (static + dynamic).

    Registers are allocated per warp in units of 256, shared memory in units of 128 bytes
    plus the runtime's reserved 1 KiB a CTA; the least of the four limits wins."""
    if arch not in SM_LIMITS:
        raise ValueError(f"arch must be one of {', '.join(SM_LIMITS)}; got {arch!r}")
    limits = SM_LIMITS[arch]
    warps = -(-threads // 32)
    regs_per_cta = warps * (-(-registers * 32 // 256) * 256)
    smem_per_cta = -(-shared_bytes // 128) * 128 + limits.reserved_shared_per_cta
    return min(
        limits.ctas,
        limits.threads // (warps * 32),
        limits.registers // regs_per_cta if regs_per_cta else limits.ctas,
        limits.shared_bytes // smem_per_cta,
    )


@dataclass(frozen=True, slots=True)
class Launch:
    """The one kernel launch of a GEMM: name, grid, threads, dynamic shared memory, and
    whether it takes the split workspace and tile counters (the skinny split route)."""

    kernel: str
    grid: tuple[int, ...]  # (x, y)
    threads: int
    smem_bytes: int
    split_workspace: bool = False


def launch_plan(
    m: int, n: int, k: int, splits: int, *, out_f32: bool, config: TileConfig | None = None
) -> Launch:
    """The launch `gemm` makes for an [M, K] x [N, K] product with S = `splits`: WHOLE
    (S = 1), FOLD (S > 1 on the mid or big tile) or the skinny split route (S > 1 on the
    skinny tile: partials into the [S, M, N] workspace, folded by each tile's last CTA).
    M, N > 0. `config` (default `tile_config(M)`) forces a tile; every tile takes every
    M, with equal bits."""
    config = tile_config(m) if config is None else config
    tiles = (-(-m // config.block_m), -(-n // config.block_n))
    if tiles[1] > MAX_GRID_Y:
        raise ValueError(f"N must be at most {MAX_GRID_Y * config.block_n}; got {n}")
    name = config.kernel_name(out_f32)
    if splits == 1:
        return Launch(name, tiles, config.num_threads, config.smem_bytes)
    if config is not SKINNY:
        return Launch(name + "_fold", tiles, config.num_threads, config.smem_bytes)
    if splits * m * n > INT32_MAX or tiles[0] * splits > INT32_MAX:
        raise ValueError(f"S * M * N must fit in int32; got {splits} * {m} * {n}")
    grid = (tiles[0] * splits, tiles[1])  # blockIdx.x = split * m tiles + m tile
    return Launch(name + "_split", grid, config.num_threads, config.smem_bytes, True)


def gemm(
    x: Any, w: Any, *, out_f32: bool = False, out: Any = None, splits: int | None = None
) -> Any:
    """x: [M, K] uint16 CuPy array holding BF16 bits; w: [N, K] same; -> [M, N] uint16
    (BF16) or float32 with `out_f32`. `out`, when given, is written and returned.
    `splits` (default `split_k(N, K)`, what every caller should use: a weight's rows are
    only comparable across calls that split it alike) must cut K exactly."""
    num_rows, num_cols, k = _check_operands(x, w)
    if splits is None:
        splits = _split_k(num_cols, k)
    elif splits < 1 or num_splits(k, split_length(k, splits)) != splits:
        raise ValueError(
            f"splits must be a count that split_length cuts K = {k} into exactly; got {splits}"
        )
    out_dtype = np.dtype(np.float32) if out_f32 else BF16_BITS
    if out is None:
        import cupy

        out = cupy.empty((num_rows, num_cols), dtype=out_dtype)
    else:
        check("out", out, out_dtype, 2)
        if out.shape != (num_rows, num_cols):
            raise ValueError(f"out must have shape {(num_rows, num_cols)}; got {out.shape}")
    if num_rows == 0 or num_cols == 0:
        return out
    plan = launch_plan(num_rows, num_cols, k, splits, out_f32=out_f32)
    dims = (np.int32(num_rows), np.int32(num_cols), np.int32(k), np.int32(split_length(k, splits)))
    device = _device_id()
    fn = _kernel(plan.kernel, plan.smem_bytes, device, PAD_ONCE)
    if plan.split_workspace:
        import cupy

        # a counter a tile (M <= 16 is one m tile)
        counters = stream_counters("gemm tiles", MAX_GRID_Y + 1, device)
        assert plan.grid[0] // splits * plan.grid[1] <= counters.size, "a counter a tile"
        workspace = cupy.empty((splits, num_rows, num_cols), dtype=np.float32)
        args: tuple = (x, w, workspace, out, counters)
    else:
        args = (x, w, out)
    launch_kernel(fn, plan.grid, (plan.threads,), (*args, *dims), shared_mem=plan.smem_bytes)
    return out


def grouped_tile_config(num_tokens: int, top_k: int, num_experts: int) -> TileConfig:
    """The tile the grouped GEMMs of a step take: `tile_config` of the mean rows of an
    expert that has any (T * k rows over at most min(E, T * k) experts), so a decode
    step's few rows an expert take the skinny tile however many tokens there are. The
    routing numbers the experts' m tiles of its rows (moe_kernel.moe_route); the bits do
    not depend on the choice (gemm.cu: the unsplit tile)."""
    num_rows = num_tokens * top_k
    return tile_config(max(1, -(-num_rows // max(1, min(num_experts, num_rows)))))


def grouped_launch_plan(num_rows: int, n: int, num_experts: int, tile_rows: int) -> Launch:
    """The launch `grouped_gemm` makes for R = `num_rows` grouped rows, N output columns,
    E experts and the routing's tile of `tile_rows` rows: grid (floor((R + min(E, R)
    (BM - 1)) / BM), ceil(N / BN)), a bound on the experts' m tiles (sum of ceil(rows_e /
    BM) over at most min(E, R) experts with rows), unsplit. A function of (R, N, E, BM)
    alone, never of the routing, so a CUDA graph captured with it replays for any.
    R, N > 0."""
    config = next((c for c in CONFIGS if c.block_m == tile_rows), None)
    if config is None:
        raise ValueError(
            f"tile_rows must be a tile's rows ({sorted(c.block_m for c in CONFIGS)}); got {tile_rows}"
        )
    bound = (num_rows + min(num_experts, num_rows) * (tile_rows - 1)) // tile_rows
    tiles = (bound, -(-n // config.block_n))
    if tiles[1] > MAX_GRID_Y:
        raise ValueError(f"N must be at most {MAX_GRID_Y * config.block_n}; got {n}")
    return Launch(f"moe_{config.kernel_name(False)}", tiles, config.num_threads, config.smem_bytes)


def grouped_gemm(xs: Any, experts: Any, offsets: Any, tile_starts: Any, tile_rows: int) -> Any:
    """xs: [R, K] grouped rows (BF16 bits), experts: [E, N, K] (BF16 bits, contiguous),
    offsets and tile_starts: [E + 1] int32 on the device (expert e's rows are offsets[e] ..
    offsets[e + 1], offsets[E] = R, and its m tiles of `tile_rows` rows tile_starts[e] ..
    tile_starts[e + 1]: moe_kernel.moe_route's) -> [R, N] BF16 bits, rows of expert e
    times experts[e]^T. Neither is read here (no device sync)."""
    check("xs", xs, BF16_BITS, 2)
    check("experts", experts, BF16_BITS, 3)
    check("offsets", offsets, np.int32, 1)
    check("tile_starts", tile_starts, np.int32, 1)
    (num_rows, k), (num_experts, num_cols, w_k) = xs.shape, experts.shape
    if w_k != k:
        raise ValueError(
            f"xs and experts must have the same K (in_features); got xs {tuple(xs.shape)}, "
            f"experts {tuple(experts.shape)}"
        )
    if k <= 0 or k % 16:
        raise ValueError(f"K must be a positive multiple of 16; got K = {k}")
    for name, array in (("offsets", offsets), ("tile_starts", tile_starts)):
        if array.shape != (num_experts + 1,):
            raise ValueError(f"{name} must have shape {(num_experts + 1,)}; got {array.shape}")
    if max(num_rows, num_cols, k) > INT32_MAX:
        raise ValueError(f"R, N and K must fit in int32; got {num_rows}, {num_cols}, {k}")
    import cupy

    out = cupy.empty((num_rows, num_cols), dtype=BF16_BITS)
    if num_rows == 0 or num_cols == 0:
        return out
    plan = grouped_launch_plan(num_rows, num_cols, num_experts, tile_rows)
    fn = _kernel(plan.kernel, plan.smem_bytes, _device_id())
    i32 = np.int32
    args = (xs, experts, out, offsets, tile_starts, i32(num_experts), i32(tile_rows),
            i32(num_cols), i32(k))  # fmt: skip
    launch_kernel(fn, plan.grid, (plan.threads,), args, shared_mem=plan.smem_bytes)
    return out


@functools.cache
def _split_k(n: int, k: int) -> int:
    return split_k(n, k)


def _check_operands(x: Any, w: Any) -> tuple[int, int, int]:
    """(M, N, K) of valid operands; ValueError naming the problem otherwise."""
    check("x", x, BF16_BITS, 2)
    check("w", w, BF16_BITS, 2)
    (num_rows, k), (num_cols, w_k) = x.shape, w.shape
    if w_k != k:
        raise ValueError(
            f"x and w must have the same K (in_features); got x {tuple(x.shape)}, w {tuple(w.shape)}"
        )
    if k <= 0 or k % 16:
        raise ValueError(f"K must be a positive multiple of 16; got K = {k}")
    if max(num_rows, num_cols, k) > INT32_MAX:
        raise ValueError(f"M, N and K must fit in int32; got {num_rows}, {num_cols}, {k}")
    return num_rows, num_cols, k


def _device_id() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


@functools.cache
def _kernel(name: str, smem_bytes: int, device_id: int, pad_once: bool = True) -> Any:
    """The compiled entry point, with its shared-memory opt-in set on this device;
    `pad_once` False: the baseline build (PAD_ONCE).

    `device_id` keys the cache: the opt-in is a per-device function attribute.
    """
    fn = kernel("gemm", name, () if pad_once else ("REPRISE_GEMM_PAD_ONCE=0",))
    if smem_bytes > MAX_STATIC_SMEM_BYTES:
        fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn
