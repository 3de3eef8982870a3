"""Launcher of the Hopper GEMM in gemm_sm90.cu: y = x @ w.T with warpgroup MMA (twin:
gemm.gemm_ref).

x is [M, K] BF16 held as uint16 CuPy arrays; y is [M, N] BF16 (round to nearest even
of the fp32 accumulator) or fp32. The weight comes either as is, [N, K] (Hugging Face
layout): the cp.async kernels, every thread loading and then issuing MMAs; or packed
once by `prepare_weight` (a PackedWeight): the warp-specialized kernel, whose
producer warpgroup brings the weight's tiles by 1-D bulk copies and x by cp.async
through an mbarrier ring to two consumer warpgroups. Packing replaces TMA tensor maps
(which need a driver call and a 128-byte by-value kernel argument CuPy cannot be shown
to pass without a GPU): the bulk copy engine still moves the weight, and the only host
work is one reshape at load. Compiled for sm_90a (wgmma exists on no other target) by
our own NVRTC call (nvrtc.compile_source) and loaded from the cubin: CuPy's RawModule
would name the plain sm_90 target.

What it guarantees (DESIGN §4): every y[m, n] is one fp32 computation over K in one
fixed order that depends on the weight's shape (N, K) and nothing else, gemm.cu's rule:

- S = `split_k(N, K)` (gemm_kernel's function, the same count gemm.cu uses) cuts K
  into S contiguous splits of `split_length(K, S)` elements, a multiple of 128 and so
  of this kernel's BK = 64: no k-tile straddles two splits.
- Each split's partial P_s is one accumulator from +0 taking that split's K slices
  [16j, 16j + 16) in ascending order, one wgmma.m64n128k16 a slice; with S > 1,
  y = (((0 + P_0) + P_1) + ...) + P_{S-1} in fp32 (gemm.fold_partials is the twin of
  these adds), then one rounding to BF16. S = 1 is the plain chain over all of K.
- Every route computes exactly that: WHOLE (S = 1; any tile), PARTIAL (S > 1 at
  M <= the tile's BM: one CTA per (split, tile) writes P_s to an fp32 workspace
  [S, M, N]; the tile's last CTA, counted with an integer atomic, folds in ascending
  split order) and FOLD (S > 1 at larger M: one CTA walks all of K and adds each
  finished partial into a running total at the split boundary: in registers, or, on
  the wide ws tile, in an [M, N] fp32 workspace word that only its own thread reads
  and writes). No float atomics; rows past M and columns past N are zero padding that never enters
  another element's sum and is never written.

So y[m, n] depends on x[m, :], w[n, :] and (N, K) alone: bit-identical for any M, row
offset, companion rows, configuration, route or kernel (`launch_plan` picks one by M
and N for occupancy; that only regroups the sequence). The wide cp.async tile (128
accumulators a thread) has no FOLD (a second set would not fit in 255 registers), so it
runs only weights with S = 1; the wide ws tile folds through the workspace instead.
gemm_sm90.cu states the argument in full.

The dispatch rule. This kernel's rows need NOT bit-equal gemm.cu's (mma.sync
m16n8k16 is another instruction; the ISA does not tie their in-slice summation), so
a device must never pick between the two by M: a prefill row and the same row in a
decode step would differ. The rule: **`supported(arch, m, n, k)` decides from the
device's architecture, N and K only; where it holds, every M of that (N, K) runs
here, M = 1 included.** It holds on compute capability 9.0 (H100, H200) with
K % 64 == 0 (every Llama shape) and N within the grid limit. `m` is taken so that a
caller can pass what it has, and is not consulted. `gemm_family(arch, N, K, requested)`
is the one decision between the families built on it: the requested one where
`supported` holds, mma.sync elsewhere, and for no request WGMMA_BY_DEFAULT (on: the
engine end to end on an H100 is faster with it, see its comment).

Why the split: at M = 1 the grid is ceil(N / 128) CTAs without it, 32 for an 8B o or
down projection, a quarter of an H100's 132 SMs; with S from `split_k` (the count that
fills one wave of gemm.cu's skinny grid) every 8B projection's M = 1 grid keeps more
than half the SMs busy, o and down 128 of 132 (`decode_waves`).

Nothing is allocated except the output when `out` is None (and, on the PARTIAL route,
the [S, M, N] fp32 workspace, plus once per stream its tile counters; on the wide FOLD,
the [M, N] fp32 totals). CuPy is imported
lazily.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import nvrtc
from .families import family
from .gemm_kernel import num_splits, split_k, split_length
from .kernels import BF16_BITS, check, launch_kernel

ARCH = "sm_90a"  # wgmma and the rest of the arch-specific Hopper instructions
SOURCE = family("gemm_sm90").source
BLOCK_K = 64  # K must be a multiple: no K tail, no branch among a k-tile's MMAs
MAX_GRID_Y = 65535
INT32_MAX = 2**31 - 1
H100_SMS = 132  # multiprocessors of an H100 SXM (the geometry functions' default)


@dataclass(frozen=True, slots=True)
class Sm90Config:
    """One instantiation of gemm_sm90.cu's kernel; the numbers repeat its `Sm90Tile<...>`.

    NOTE: the kernel traps when launched with other than `num_threads` threads or
    less than `smem_bytes` of dynamic shared memory, so a drift between the two
    files fails loudly on the first launch.
    """

    name: str
    block_m: int  # 64 rows per warpgroup
    block_n: int  # 128 columns per wgmma.m64n128k16
    num_stages: int

    @property
    def num_threads(self) -> int:
        return 128 * (self.block_m // 64)

    @property
    def smem_bytes(self) -> int:
        """The x and w tile ring: BLOCK_K BF16 values per row, no padding."""
        return self.num_stages * (self.block_m + self.block_n) * BLOCK_K * 2

    def kernel_name(self, out_f32: bool) -> str:
        return f"gemm_sm90_{'f32' if out_f32 else 'bf16'}_{self.name}"


@dataclass(frozen=True, slots=True)
class Sm90WsConfig:
    """gemm_sm90.cu's warp-specialized kernel (`Sm90WsTile<BN, STAGES>`, BM = 128): one
    producer warpgroup and two consumers, the ring's stages guarded by mbarriers (2 a
    stage, 8 bytes each, after the tiles)."""

    name: str
    block_m: int
    block_n: int
    num_stages: int

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.block_m // 64)

    @property
    def smem_bytes(self) -> int:
        """The ring (x tile, then a w tile of max(block_n, 128) rows: whole m64n128
        instructions), then its mbarriers."""
        rows = self.block_m + max(self.block_n, 128)
        return self.num_stages * rows * BLOCK_K * 2 + 2 * 8 * self.num_stages

    def kernel_name(self, out_f32: bool) -> str:
        tile = self.name.removeprefix("ws")  # "", "_wide", "_decode"
        return f"gemm_sm90_ws_{'f32' if out_f32 else 'bf16'}{tile}"


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight laid out for the warp-specialized kernel's bulk copies (`prepare_weight`):
    `data` is 1-d uint16, rows padded with zeros to a multiple of PACK_ROWS, in 64-row
    panels of 64 x 64 tiles, each tile 8,192 contiguous bytes in the stage layout."""

    data: Any
    num_cols: int  # N: the weight's rows before padding
    k: int
    swizzled: bool = True  # the 128-byte swizzle (prepare_weight); the kernel is built to match

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_cols, self.k

    @property
    def nbytes(self) -> int:
        """Bytes it holds on the device, padding included (as an array's nbytes, which
        the model's weight accounting reads)."""
        return int(self.data.nbytes)


PACK_ROWS = 256  # weight rows are padded to a multiple: every CTA's panels exist

WG1 = Sm90Config("wg1", 64, 128, num_stages=8)  # M <= 64: one warpgroup, deep ring
WG2 = Sm90Config("wg2", 128, 128, num_stages=6)
WG2_WIDE = Sm90Config("wg2wide", 128, 256, num_stages=4)  # when its grid fills the device
CONFIGS: tuple[Sm90Config, ...] = (WG1, WG2, WG2_WIDE)
WS = Sm90WsConfig("ws", 128, 128, num_stages=6)  # any M, on a PackedWeight
# Past one m tile where its grid fills the device: two consumers of 64 x 256 (128
# accumulators a thread: a FOLD keeps its totals in a workspace, not registers), half the
# x tile's loads and barrier waits per product of WS.
WS_WIDE = Sm90WsConfig("ws_wide", 128, 256, num_stages=4)
# M <= 64 (decode): one consumer, 64 columns owned of the m64n128 instruction's 128 (the
# rest padding), 2 CTAs an SM: twice WS's CTAs, where WS's decode grid is under a wave
# (o and down at M = 1: 128 CTAs on 132 SMs, 1 an SM; this: 256, one round).
WS_DECODE = Sm90WsConfig("ws_decode", 64, 64, num_stages=4)


def prepare_weight(w: Any, *, swizzle: bool = True) -> PackedWeight:
    """[N, K] uint16 BF16 bits (CuPy on a device, NumPy for the emulation) -> the packed
    layout the warp-specialized kernel copies from: 64-row panels (rows padded with zeros
    to a multiple of PACK_ROWS), each 64 x 64 tile (panel p = n // 64, k-tile t = k // 64)
    8,192 contiguous bytes at ((p * (K / 64)) + t) * 8,192 in the kernel's stage layout:
    with `swizzle` (the default, gemm_sm90.cu's REPRISE_WS_SWIZZLE) row n % 64 at byte
    128 (n % 64), its 16-byte chunk j = (k % 64) // 8 at position j ^ (n % 8), element
    k % 8 within; without, the no-swizzle core-matrix layout (chunk j of row r = n % 64 at
    byte 1,024 (r // 8) + 128 j + 16 (r % 8)). Done once per weight, at load."""
    xp = _array_module(w)
    num_cols, k = w.shape
    if w.dtype != BF16_BITS or w.ndim != 2 or k <= 0 or k % BLOCK_K:
        raise ValueError(
            f"w must be [N, K] uint16 with K a positive multiple of {BLOCK_K}; got {w.dtype} {w.shape}"
        )
    rows = -(-num_cols // PACK_ROWS) * PACK_ROWS
    padded = xp.zeros((rows, k), dtype=w.dtype)
    padded[:num_cols] = w
    if swizzle:  # [panel, row, t, chunk, element] -> [panel, t, row, chunk ^ row % 8, element]
        tiles = padded.reshape(rows // 64, 64, k // 64, 8, 8).transpose(0, 2, 1, 3, 4)
        row = xp.arange(64).reshape(64, 1)
        tiles = tiles[:, :, row, xp.arange(8).reshape(1, 8) ^ (row % 8), :]
    else:  # [panel, row group, row, t, chunk, element] -> [panel, t, row group, chunk, row, element]
        tiles = padded.reshape(rows // 64, 8, 8, k // 64, 8, 8).transpose(0, 3, 1, 4, 2, 5)
    return PackedWeight(xp.ascontiguousarray(tiles).reshape(-1), num_cols, k, swizzle)


def _array_module(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def grid(config: Sm90Config | Sm90WsConfig, num_rows: int, num_cols: int) -> tuple[int, int]:
    """(CTAs along M, CTAs along N) of a launch."""
    return -(-num_rows // config.block_m), -(-num_cols // config.block_n)


def waves(
    config: Sm90Config | Sm90WsConfig, num_rows: int, num_cols: int, num_sms: int = H100_SMS
) -> float:
    """CTAs over multiprocessors: each CTA's ~192 KB of shared memory fits one a multiprocessor."""
    gx, gy = grid(config, num_rows, num_cols)
    return gx * gy / num_sms


def tile_config(num_rows: int, num_cols: int, num_sms: int = H100_SMS) -> Sm90Config:
    """The configuration `gemm_sm90` runs: every one issues the same instruction per
    element, so choosing by M changes speed only, never a bit of the result."""
    if num_rows <= WG1.block_m:
        return WG1
    return WG2_WIDE if waves(WG2_WIDE, num_rows, num_cols, num_sms) >= 1 else WG2


def ws_config(num_rows: int, num_cols: int, num_sms: int = H100_SMS) -> Sm90WsConfig:
    """The warp-specialized tile of an unsplit product: the wide one past one m tile when
    its grid fills the device (a prefill); at M <= 64 the decode tile where WS's grid is
    under a wave (with DECODE_TILE_BY_DEFAULT); else WS. As for `tile_config`, the choice
    changes speed only: every tile issues the same wgmma per element."""
    if num_rows > WS.block_m and waves(WS_WIDE, num_rows, num_cols, num_sms) >= 1:
        return WS_WIDE
    if decode_tile(num_rows, num_cols, 1, num_sms):
        return WS_DECODE
    return WS


def decode_tile(num_rows: int, num_cols: int, splits: int, num_sms: int = H100_SMS) -> bool:
    """Whether a product of M <= 64 rows takes WS_DECODE (WHOLE or PARTIAL): where WS's
    grid (`splits` CTAs a tile) is under a wave, so twice the CTAs help, with
    DECODE_TILE_BY_DEFAULT on and its grid within the launch limit."""
    if not DECODE_TILE_BY_DEFAULT or num_rows > WS_DECODE.block_m:
        return False
    gx, gy = grid(WS, num_rows, num_cols)
    return gx * gy * splits < num_sms and grid(WS_DECODE, num_rows, num_cols)[1] <= MAX_GRID_Y


@dataclass(frozen=True, slots=True)
class Sm90Launch:
    """The one kernel launch of a product: entry point, grid, threads, dynamic shared
    memory, the split length it is passed (0: WHOLE, no split) and whether it takes the
    fp32 workspace and tile counters (PARTIAL)."""

    kernel: str
    grid: tuple[int, int]
    threads: int
    smem_bytes: int
    splits: int
    split_len: int
    workspace: bool  # PARTIAL: the [S, M, N] fp32 partials and the tile counters
    totals: bool = False  # the wide FOLD: the [M, N] fp32 running totals


# The split routes (S > 1) by the kernel they run: (config, route).
SPLIT_ROUTES: dict[str, tuple[Sm90Config | Sm90WsConfig, str]] = {
    "wg1_split": (WG1, "split"),
    "wg2_fold": (WG2, "fold"),
    "ws_split": (WS, "split"),
    "ws_fold": (WS, "fold"),
    "wide_fold": (WS_WIDE, "fold"),  # FOLD_WS: the running totals in an [M, N] fp32 workspace
    "decode_split": (WS_DECODE, "split"),  # M <= 64
}
WIDE_FOLD_MAX_SPLITS = 4  # gemm_sm90.cu's FOLD_WS_MAX_SPLITS: its split loop is unrolled
# Whether launch_plan takes the wide FOLD (route "wide_fold") for split weights past one m
# tile. Off until a GPU has run it: its first run (H200, 2026-11-27) hung every wide
# launch on a setmaxnreg budget over the CTA's register pool, since fixed (gemm_sm90.cu,
# Sm90WsTile) and held by a static_assert, but not yet run. `route="wide_fold"` forces it
# (tests/test_gemm_sm90_pending_gpu.py, bench_gemm_sm90 --wide-fold).
WIDE_FOLD_BY_DEFAULT = False
# Whether launch_plan takes the decode tile (WS_DECODE, routes "decode_split" and WHOLE)
# at M <= 64 where WS's grid is under a wave (`decode_tile`). Off until a GPU has run it
# (built 2026-11-27 with no device time left): forced by `route="decode_split"` (tests,
# bench_gemm_sm90 --decode-tile). The same bits as WS either way.
DECODE_TILE_BY_DEFAULT = False
MAX_COUNTERS = MAX_GRID_Y + 1  # tile counters a stream holds: one per (n tile, m tile)


def launch_plan(
    m: int, n: int, k: int, *, out_f32: bool, packed: bool, num_sms: int = H100_SMS,
    route: str | None = None, splits: int | None = None,
) -> Sm90Launch:  # fmt: skip
    """The launch `gemm_sm90` makes for an [M, K] x [N, K] product, M, N > 0: with
    S = split_k(N, K) = 1, WHOLE on `tile_config` (or the warp-specialized kernel for a
    packed weight); with S > 1, PARTIAL up to the tile's BM rows (one m tile: the
    decode grid S * ceil(N / 128)) and FOLD past it. `route` (a SPLIT_ROUTES key)
    forces a split route at any M, for tests: every route gives every M the same bits.
    `splits` (default split_k(N, K), what every caller should use: a weight's rows are
    only comparable across calls that split it alike) must cut K exactly; 1 forces WHOLE."""
    if splits is None:
        splits = split_k(n, k)
    elif splits < 1 or num_splits(k, split_length(k, splits)) != splits:
        raise ValueError(
            f"splits must be a count that split_length cuts K = {k} into exactly; got {splits}"
        )
    if splits == 1 and route is None:
        config: Sm90Config | Sm90WsConfig = (
            ws_config(m, n, num_sms) if packed else tile_config(m, n, num_sms)
        )
        return Sm90Launch(
            config.kernel_name(out_f32), grid(config, m, n), config.num_threads,
            config.smem_bytes, 1, 0, False,
        )  # fmt: skip
    if route is None:
        small = m <= (WS.block_m if packed else WG1.block_m)
        if not packed:
            route = "wg1_split" if small else "wg2_fold"
        elif small:
            route = "decode_split" if decode_tile(m, n, splits, num_sms) else "ws_split"
        else:
            wide = ws_config(m, n, num_sms) is WS_WIDE and splits <= WIDE_FOLD_MAX_SPLITS
            route = "wide_fold" if wide and WIDE_FOLD_BY_DEFAULT else "ws_fold"
    if route not in SPLIT_ROUTES:
        raise ValueError(f"route must be one of {', '.join(SPLIT_ROUTES)}; got {route!r}")
    config, kind = SPLIT_ROUTES[route]
    if isinstance(config, Sm90WsConfig) != packed:
        needs = "packed" if isinstance(config, Sm90WsConfig) else "plain"
        raise ValueError(f"route {route} needs a {needs} weight")
    if route == "wide_fold" and splits > WIDE_FOLD_MAX_SPLITS:
        raise ValueError(f"route wide_fold takes at most {WIDE_FOLD_MAX_SPLITS} splits; got {splits}")
    length = split_length(k, splits)
    tiles = grid(config, m, n)
    name = f"{config.kernel_name(out_f32)}_{kind}"
    if kind == "fold":
        wide = config is WS_WIDE
        if wide and m * n > INT32_MAX:
            raise ValueError(f"M * N must fit in int32; got {m} * {n}")
        return Sm90Launch(
            name, tiles, config.num_threads, config.smem_bytes, splits, length, False, wide
        )
    if splits * m * n > INT32_MAX or tiles[0] * splits > INT32_MAX:
        raise ValueError(f"S * M * N must fit in int32; got {splits} * {m} * {n}")
    if tiles[0] * tiles[1] > MAX_COUNTERS:
        raise ValueError(
            f"the split route takes at most {MAX_COUNTERS} tiles; got {tiles[0] * tiles[1]}"
        )
    return Sm90Launch(
        name, (tiles[0] * splits, tiles[1]), config.num_threads, config.smem_bytes, splits,
        length, True,
    )  # fmt: skip


def decode_waves(n: int, k: int, *, packed: bool, num_sms: int = H100_SMS) -> float:
    """CTAs of the M = 1 launch of an (N, K) weight over multiprocessors (each CTA's
    ~192 KB of shared memory fits one a multiprocessor)."""
    plan = launch_plan(1, n, k, out_f32=False, packed=packed)
    return plan.grid[0] * plan.grid[1] / num_sms


def supported(device_arch: str | int, m: int, n: int, k: int) -> bool:
    """Whether this kernel takes the products of an (N, K) weight on a device of
    compute capability `device_arch` ("90", "sm_90" or 90, as CuPy's
    Device.compute_capability gives it). NOTE: `m` is not consulted (module docstring:
    the dispatch never depends on M)."""
    del m
    arch = str(device_arch).removeprefix("sm_")
    fits_grid = 0 < n <= MAX_GRID_Y * WG1.block_n and n <= INT32_MAX
    return arch in ("90", "90a") and 0 < k <= INT32_MAX and k % BLOCK_K == 0 and fits_grid


# Whether a weight `supported` takes runs here when the caller names no family. True
# since the H100 runs of 2026-11-26 (bench/results/2026-11-26-h100-run2): the engine on
# 8B shapes with every weight here against every weight on gemm.cu, in the same run:
# decode b=64 13.6 vs 23.9 ms, prefill 2,048 134 vs 142 ms, decode b=1 8.35 vs 8.10 ms.
# Per kernel it does not win everywhere (bench_gemm_sm90's verdict: slower at M = 1 on
# qkv and o), but a weight takes one family for every M, and over the whole step this
# one is faster where the batch is large and within a few percent at batch 1.
WGMMA_BY_DEFAULT = True


def gemm_family(device_arch: str | int, n: int, k: int, requested: str | None = None) -> str:
    """The one decision between the GEMM families for an (N, K) weight on a device:
    "wgmma" (this kernel) or "mma" (gemm.cu). `requested` "mma" or "wgmma" is the
    caller's choice (CupyBackend's `gemm`), None the default (WGMMA_BY_DEFAULT). A
    weight `supported` does not take stays on "mma". Taken once, when the weight loads,
    from the device and (N, K) alone: never from M (the module docstring's rule)."""
    if requested not in (None, "mma", "wgmma"):
        raise ValueError(f"gemm must be one of mma, wgmma; got {requested!r}")
    wants = requested == "wgmma" or (requested is None and WGMMA_BY_DEFAULT)
    return "wgmma" if wants and supported(device_arch, 0, n, k) else "mma"


def gemm_sm90(
    x: Any, w: Any, *, out_f32: bool = False, out: Any = None, splits: int | None = None,
    route: str | None = None,
) -> Any:  # fmt: skip
    """x: [M, K] uint16 CuPy array holding BF16 bits; w: the [N, K] weight as gemm.gemm
    takes it (the cp.async kernels) or a PackedWeight from `prepare_weight` (the
    warp-specialized kernel; the same bits); -> [M, N] uint16 (BF16) or float32 with
    `out_f32`. `out`, when given, is written and returned. `splits` and `route` as
    `launch_plan`'s (leave them None but to measure or test a split count or route).
    Needs a device `supported` accepts."""
    num_rows, num_cols, k = check_operands(x, w)
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
    arch = device_arch()
    if not supported(arch, num_rows, num_cols, k):
        raise ValueError(f"gemm_sm90 needs compute capability 9.0 (sm_90a); this device is {arch}")
    packed = isinstance(w, PackedWeight)
    plan = launch_plan(
        num_rows, num_cols, k, out_f32=out_f32, packed=packed, num_sms=_num_sms(), route=route,
        splits=splits,
    )  # fmt: skip
    weight = w.data if packed else w
    dims = (np.int32(num_rows), np.int32(num_cols), np.int32(k))
    args: tuple[Any, ...]
    if plan.workspace:
        import cupy

        counters = _tile_counters(_device_id(), cupy.cuda.get_current_stream().ptr)
        workspace = cupy.empty((plan.splits, num_rows, num_cols), dtype=np.float32)
        args = (x, weight, workspace, out, counters, *dims, np.int32(plan.split_len))
    elif plan.totals:
        import cupy

        totals = cupy.empty((num_rows, num_cols), dtype=np.float32)
        args = (x, weight, totals, out, *dims, np.int32(plan.split_len))
    elif plan.split_len:
        args = (x, weight, out, *dims, np.int32(plan.split_len))
    else:
        args = (x, weight, out, *dims)
    fn = _kernel(plan.kernel, plan.smem_bytes, _device_id(), w.swizzled if packed else True)
    launch_kernel(fn, plan.grid, (plan.threads,), args, shared_mem=plan.smem_bytes)
    return out


@functools.cache
def _tile_counters(device_id: int, stream_ptr: int) -> Any:
    """The PARTIAL route's tile counters for launches on one stream: MAX_COUNTERS zeros,
    which every launch leaves zero. NOTE: as gemm_kernel's, one array per (device,
    stream), never freed, so launches that may overlap never share one and a captured
    CUDA graph keeps it valid."""
    import cupy

    return cupy.zeros(MAX_COUNTERS, dtype=np.uint32)


def check_operands(x: Any, w: Any) -> tuple[int, int, int]:
    """(M, N, K) of operands this kernel takes; ValueError naming the problem otherwise."""
    check("x", x, BF16_BITS, 2)
    if isinstance(w, PackedWeight):
        check("w.data", w.data, BF16_BITS, 1)
        rows = -(-w.num_cols // PACK_ROWS) * PACK_ROWS
        if w.data.shape != (rows * w.k,):
            raise ValueError(
                f"w.data must hold {rows} x {w.k} packed values; got {w.data.shape} (use prepare_weight)"
            )
    else:
        check("w", w, BF16_BITS, 2)
    (num_rows, k), (num_cols, w_k) = x.shape, w.shape
    if w_k != k:
        raise ValueError(
            f"x and w must have the same K (in_features); got x {tuple(x.shape)}, w {tuple(w.shape)}"
        )
    if k <= 0 or k % BLOCK_K:
        raise ValueError(f"K must be a positive multiple of {BLOCK_K} for gemm_sm90; got K = {k}")
    if num_cols > MAX_GRID_Y * WG1.block_n:
        raise ValueError(f"N must be at most {MAX_GRID_Y * WG1.block_n}; got {num_cols}")
    if max(num_rows, num_cols, k) > INT32_MAX:
        raise ValueError(f"M, N and K must fit in int32; got {num_rows}, {num_cols}, {k}")
    return num_rows, num_cols, k


def _device_id() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def device_arch() -> str:
    """The current device's compute capability as CuPy gives it ("90" on an H100)."""
    import cupy

    return str(cupy.cuda.Device().compute_capability)


def _num_sms() -> int:
    import cupy

    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


@functools.cache
def _cubin_path(swizzle: bool = True) -> Path:
    """gemm_sm90.cu compiled for sm_90a, once per process and layout (REPRISE_WS_SWIZZLE,
    which the packed weight's layout must match), in a file CuPy can load."""
    source = f"#define REPRISE_WS_SWIZZLE {int(swizzle)}\n" + nvrtc.kernel_source(SOURCE)
    compiled = nvrtc.compile_source(source, SOURCE.name, ARCH)
    path = Path(tempfile.mkdtemp(prefix="reprise-sm90-")) / "gemm_sm90.cubin"
    path.write_bytes(compiled.cubin)
    return path


@functools.cache
def _module(device_id: int, swizzle: bool = True) -> Any:
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawModule(path=str(_cubin_path(swizzle)))


@functools.cache
def _kernel(name: str, smem_bytes: int, device_id: int, swizzle: bool = True) -> Any:
    """The entry point, with its shared-memory opt-in set on this device (all configs
    need more than the default 48 KB); `swizzle` the ws kernels' stage layout (that of
    the packed weight they take)."""
    fn = _module(device_id, swizzle).get_function(name)
    fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn
