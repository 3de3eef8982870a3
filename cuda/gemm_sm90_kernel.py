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

What it guarantees (DESIGN §4): every y[m, n] is one fp32 accumulation over K in one
fixed order, starting from +0 and taking the K slices [0, 16), [16, 32), ... in
ascending order, one wgmma.m64n128k16 per slice, in every tile configuration. No
split-K, no reduction across threads or CTAs; rows past M and columns past N are zero
padding that never enters another element's sum and is never written. So y[m, n]
depends on x[m, :], w[n, :] and K alone: bit-identical for any M, row offset,
companion rows, configuration or kernel (`tile_config` picks one by M and N for
occupancy; that only regroups the sequence). gemm_sm90.cu states the argument in full.

The dispatch rule. This kernel's rows need NOT bit-equal gemm.cu's (mma.sync
m16n8k16 is another instruction; the ISA does not tie their in-slice summation), so
a device must never pick between the two by M: a prefill row and the same row in a
decode step would differ. The rule: **`supported(arch, m, n, k)` decides from the
device's architecture, N and K only; where it holds, every M of that (N, K) runs
here, M = 1 included.** It holds on compute capability 9.0 (H100, H200) with
K % 64 == 0 (every Llama shape) and N within the grid limit. `m` is taken so that a
caller can pass what it has, and is not consulted.

Nothing is allocated except the output when `out` is None. CuPy is imported lazily.
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
from .kernels import BF16_BITS, check

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
        return (
            self.num_stages * (self.block_m + self.block_n) * BLOCK_K * 2 + 2 * 8 * self.num_stages
        )

    def kernel_name(self, out_f32: bool) -> str:
        return f"gemm_sm90_ws_{'f32' if out_f32 else 'bf16'}"


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight laid out for the warp-specialized kernel's bulk copies (`prepare_weight`):
    `data` is 1-d uint16, rows padded with zeros to a multiple of PACK_ROWS, in 64-row
    panels of 64 x 64 tiles, each tile 8,192 contiguous bytes in the stage layout."""

    data: Any
    num_cols: int  # N: the weight's rows before padding
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_cols, self.k


PACK_ROWS = 256  # weight rows are padded to a multiple: every CTA's panels exist

WG1 = Sm90Config("wg1", 64, 128, num_stages=8)  # M <= 64: one warpgroup, deep ring
WG2 = Sm90Config("wg2", 128, 128, num_stages=6)
WG2_WIDE = Sm90Config("wg2wide", 128, 256, num_stages=4)  # when its grid fills the device
CONFIGS: tuple[Sm90Config, ...] = (WG1, WG2, WG2_WIDE)
WS = Sm90WsConfig("ws", 128, 128, num_stages=6)  # any M, on a PackedWeight


def prepare_weight(w: Any) -> PackedWeight:
    """[N, K] uint16 BF16 bits (CuPy on a device, NumPy for the emulation) -> the packed
    layout the warp-specialized kernel copies from: element (n, k) of panel p = n // 64,
    k-tile t = k // 64 sits at 16-byte chunk 64 g + 8 j + r of tile (p, t), element e,
    with n % 64 = 8 g + r and k % 64 = 8 j + e. Done once per weight, at load."""
    xp = _array_module(w)
    num_cols, k = w.shape
    if w.dtype != BF16_BITS or w.ndim != 2 or k <= 0 or k % BLOCK_K:
        raise ValueError(
            f"w must be [N, K] uint16 with K a positive multiple of {BLOCK_K}; got {w.dtype} {w.shape}"
        )
    rows = -(-num_cols // PACK_ROWS) * PACK_ROWS
    padded = xp.zeros((rows, k), dtype=w.dtype)
    padded[:num_cols] = w
    tiles = padded.reshape(rows // 64, 8, 8, k // 64, 8, 8).transpose(0, 3, 1, 4, 2, 5)
    return PackedWeight(xp.ascontiguousarray(tiles).reshape(-1), num_cols, k)


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


def supported(device_arch: str | int, m: int, n: int, k: int) -> bool:
    """Whether this kernel takes the products of an (N, K) weight on a device of
    compute capability `device_arch` ("90", "sm_90" or 90, as CuPy's
    Device.compute_capability gives it). NOTE: `m` is not consulted (module docstring:
    the dispatch never depends on M)."""
    del m
    arch = str(device_arch).removeprefix("sm_")
    fits_grid = 0 < n <= MAX_GRID_Y * WG1.block_n and n <= INT32_MAX
    return arch in ("90", "90a") and 0 < k <= INT32_MAX and k % BLOCK_K == 0 and fits_grid


def gemm_sm90(x: Any, w: Any, *, out_f32: bool = False, out: Any = None) -> Any:
    """x: [M, K] uint16 CuPy array holding BF16 bits; w: the [N, K] weight as gemm.gemm
    takes it (the cp.async kernels) or a PackedWeight from `prepare_weight` (the
    warp-specialized kernel; the same bits); -> [M, N] uint16 (BF16) or float32 with
    `out_f32`. `out`, when given, is written and returned. Needs a device `supported`
    accepts."""
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
    config: Sm90Config | Sm90WsConfig
    if isinstance(w, PackedWeight):
        config, w = WS, w.data
    else:
        config = tile_config(num_rows, num_cols, _num_sms())
    args = (x, w, out, np.int32(num_rows), np.int32(num_cols), np.int32(k))
    _kernel(config, out_f32, _device_id())(
        grid(config, num_rows, num_cols), (config.num_threads,), args, shared_mem=config.smem_bytes
    )
    return out


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
def _cubin_path() -> Path:
    """gemm_sm90.cu compiled for sm_90a, once per process, in a file CuPy can load."""
    compiled = nvrtc.compile_source(nvrtc.kernel_source(SOURCE), SOURCE.name, ARCH)
    path = Path(tempfile.mkdtemp(prefix="reprise-sm90-")) / "gemm_sm90.cubin"
    path.write_bytes(compiled.cubin)
    return path


@functools.cache
def _module(device_id: int) -> Any:
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawModule(path=str(_cubin_path()))


@functools.cache
def _kernel(config: Sm90Config | Sm90WsConfig, out_f32: bool, device_id: int) -> Any:
    """The entry point, with its shared-memory opt-in set on this device (all configs
    need more than the default 48 KB)."""
    fn = _module(device_id).get_function(config.kernel_name(out_f32))
    fn.max_dynamic_shared_size_bytes = config.smem_bytes
    return fn
