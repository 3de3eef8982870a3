"""Launcher of the tensor-core GEMM in gemm.cu: y = x @ w.T (twin: gemm.gemm_ref).

x is [M, K] and w is [N, K] (Hugging Face layout), both BF16 held as uint16 CuPy
arrays; y is [M, N] BF16 (round to nearest even of the fp32 accumulator) or fp32.

What it guarantees (DESIGN §4): every y[m, n] is one fp32 accumulation over K in one
fixed order, starting from +0 and taking the K slices [0, 16), [16, 32), ... in
ascending order, one mma.m16n8k16 per slice. There is no split-K and no reduction
across threads, warps or CTAs; rows past M and columns past N are zero padding that
never enters another element's sum and is never written; the K tail is skipped,
not padded. The tile configuration, picked by M for speed (`tile_config`), only
regroups that sequence, and unaligned pointers only change how bytes reach shared
memory. So y[m, n] depends on x[m, :], w[n, :] and K alone: bit-identical for any
M, row offset, companion rows and configuration. gemm.cu states the argument in
full. Against the NumPy twin, which rounds an exact sum once, results agree within
BF16 rounding, not bitwise.

Nothing is allocated except the output when `out` is None. CuPy is imported lazily.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from reprise.cuda.kernels import BF16_BITS, check, kernel

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
    TileConfig("skinny", 16, 32, 64, num_stages=4, num_warps=2, max_rows=16),  # decode
    TileConfig("mid", 64, 64, 32, num_stages=4, num_warps=4, max_rows=64),
    TileConfig("big", 128, 128, 32, num_stages=4, num_warps=8, max_rows=None),  # prefill
)


def tile_config(num_rows: int) -> TileConfig:
    """The tile configuration `gemm` runs for an M of `num_rows`."""
    for config in CONFIGS:
        if config.max_rows is None or num_rows <= config.max_rows:
            return config
    raise AssertionError("the last config takes any M")


def gemm(x: Any, w: Any, *, out_f32: bool = False, out: Any = None) -> Any:
    """x: [M, K] uint16 CuPy array holding BF16 bits; w: [N, K] same; -> [M, N] uint16
    (BF16) or float32 with `out_f32`. `out`, when given, is written and returned."""
    num_rows, num_cols, k = _check_operands(x, w)
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
    config = tile_config(num_rows)
    grid = (-(-num_rows // config.block_m), -(-num_cols // config.block_n))
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"N must be at most {MAX_GRID_Y * config.block_n}; got {num_cols}")
    args = (x, w, out, np.int32(num_rows), np.int32(num_cols), np.int32(k))
    _kernel(config, out_f32, _device_id())(
        grid, (config.num_threads,), args, shared_mem=config.smem_bytes
    )
    return out


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
def _kernel(config: TileConfig, out_f32: bool, device_id: int) -> Any:
    """The compiled entry point, with its shared-memory opt-in set on this device.

    `device_id` keys the cache: the opt-in is a per-device function attribute.
    """
    fn = kernel("gemm", config.kernel_name(out_f32))
    if config.smem_bytes > MAX_STATIC_SMEM_BYTES:
        fn.max_dynamic_shared_size_bytes = config.smem_bytes
    return fn
