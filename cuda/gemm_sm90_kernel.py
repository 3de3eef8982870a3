"""Launcher of the Hopper GEMM in gemm_sm90.cu: y = x @ w.T with warpgroup MMA (twin:
gemm.gemm_ref).

x is [M, K] BF16 held as uint16 CuPy arrays; y is [M, N] BF16 (round to nearest even
of the fp32 accumulator) or fp32. The weight comes either as is, [N, K] (Hugging Face
layout): the cp.async kernels, every thread loading and then issuing MMAs; or packed
once by `prepare_weight` (a PackedWeight): the warp-specialized kernel, whose
producer warpgroup brings the weight's tiles by 1-D bulk copies and x by cp.async
through an mbarrier ring to one or two consumer warpgroups. Packing replaces TMA tensor maps
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
offset, companion rows, configuration, route or kernel (gemm_sm90_plan.launch_plan
picks one by M and N for occupancy; that only regroups the sequence). The wide cp.async tile (128
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
than half the SMs busy, o and down 128 of 132 on WS (gemm_sm90_plan.decode_waves); the
decode tile, the default there since 2026-11-28, doubles those CTAs at 2 an SM.

Row epilogues (`gemm_sm90_add_rmsnorm`, `gemm_sm90_rope_kv_write`): a decode's o and
down products feed add_rmsnorm and nothing else, its bias-free qkv product rope_kv_write.
Where the flag or the caller asks and `gemm_sm90_plan.epilogue_launch` has an entry point
(M <= EPILOGUE_MAX_ROWS on the two 256-thread tiles), the product's launch runs that
kernel's own device function after its last tile (gemm_sm90.cu's row_epilogue): one
launch, the same bits as the two; elsewhere the two launches.

Nothing is allocated except the output when `out` is None (and, on the PARTIAL route,
the [S, M, N] fp32 workspace, plus once per stream its tile counters; on the wide FOLD,
the [M, N] fp32 totals; a row epilogue's product y and its outputs). CuPy is imported
lazily.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import gemm_sm90_plan, nvrtc
from .families import family
from .gemm_sm90_plan import (
    BLOCK_K,
    INT32_MAX,
    MAX_COUNTERS,
    MAX_GRID_Y,
    WG1,
    Sm90Launch,
    epilogue_launch,
    launch_plan,
)
from .kernels import BF16_BITS, check, launch_kernel, stream_counters

ARCH = "sm_90a"  # wgmma and the rest of the arch-specific Hopper instructions
SOURCE = family("gemm_sm90").source


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight laid out for the warp-specialized kernel's bulk copies (`prepare_weight`):
    `data` is 1-d uint16, rows padded with zeros to a multiple of PACK_ROWS, in 64-row
    panels of 64 x 64 tiles, each tile 8,192 contiguous bytes in the stage layout."""

    data: Any
    num_cols: int  # N: the weight's rows before padding
    k: int
    swizzled: bool = True  # the 128-byte swizzle (prepare_weight); the kernel is built to match
    # rows interleaved gate, up, gate, up (prepare_weight's `gated`): only the gated
    # epilogue takes it, whose [M, N / 2] output is silu(gate) * up
    gated: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_cols, self.k

    @property
    def nbytes(self) -> int:
        """Bytes it holds on the device, padding included (as an array's nbytes, which
        the model's weight accounting reads)."""
        return int(self.data.nbytes)


PACK_ROWS = 256  # weight rows are padded to a multiple: every CTA's panels exist


def prepare_weight(w: Any, *, swizzle: bool = True, gated: bool = False) -> PackedWeight:
    """[N, K] uint16 BF16 bits (CuPy on a device, NumPy for the emulation) -> the packed
    layout the warp-specialized kernel copies from: 64-row panels (rows padded with zeros
    to a multiple of PACK_ROWS), each 64 x 64 tile (panel p = n // 64, k-tile t = k // 64)
    8,192 contiguous bytes at ((p * (K / 64)) + t) * 8,192 in the kernel's stage layout:
    with `swizzle` (the default, gemm_sm90.cu's REPRISE_WS_SWIZZLE) row n % 64 at byte
    128 (n % 64), its 16-byte chunk j = (k % 64) // 8 at position j ^ (n % 8), element
    k % 8 within; without, the no-swizzle core-matrix layout (chunk j of row r = n % 64 at
    byte 1,024 (r // 8) + 128 j + 16 (r % 8)). Done once per weight, at load.

    `gated`: w is a fused gate/up projection, [2I, K] with the gate's I rows first (as the
    model loads it and silu_mul reads its output); its rows are interleaved first (row 2j
    gate j, row 2j + 1 up j), for the gated epilogue (`gemm_sm90(..., gated=True)`), which
    pairs the two columns of each thread's accumulators into silu(gate) * up."""
    xp = _array_module(w)
    num_cols, k = w.shape
    if w.dtype != BF16_BITS or w.ndim != 2 or k <= 0 or k % BLOCK_K:
        raise ValueError(
            f"w must be [N, K] uint16 with K a positive multiple of {BLOCK_K}; got {w.dtype} {w.shape}"
        )
    if gated:
        if num_cols % 2:
            raise ValueError(f"a gated weight has 2 x I rows (gate, then up); got N = {num_cols}")
        half = num_cols // 2
        w = xp.stack([w[:half], w[half:]], axis=1).reshape(num_cols, k)  # gate j, up j, ...
    rows = -(-num_cols // PACK_ROWS) * PACK_ROWS
    padded = xp.zeros((rows, k), dtype=w.dtype)
    padded[:num_cols] = w
    if swizzle:  # [panel, row, t, chunk, element] -> [panel, t, row, chunk ^ row % 8, element]
        tiles = padded.reshape(rows // 64, 64, k // 64, 8, 8).transpose(0, 2, 1, 3, 4)
        row = xp.arange(64).reshape(64, 1)
        tiles = tiles[:, :, row, xp.arange(8).reshape(1, 8) ^ (row % 8), :]
    else:  # [panel, row group, row, t, chunk, element] -> [panel, t, row group, chunk, row, element]
        tiles = padded.reshape(rows // 64, 8, 8, k // 64, 8, 8).transpose(0, 3, 1, 4, 2, 5)
    return PackedWeight(xp.ascontiguousarray(tiles).reshape(-1), num_cols, k, swizzle, gated)


def _array_module(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


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
# The warp-specialized kernel's rows past M (gemm_sm90.cu, "Rows past M"): zeros written
# once and consumers without a row idle (True), or, built apart for bench_gemm_sm90's
# same-run baseline, zero-filled every k-tile by the producer and computed by every
# consumer (False). The same bits either way (tests/test_gemm_sm90.py).
PAD_ONCE = True
# The warp-specialized kernel's ablation build (gemm_sm90.cu's REPRISE_GEMM_ABLATE), set by
# bench_gemm_sm90's `--ablate` columns alone: 0, the kernel as it is; 1 PARTIAL's tail left
# out, 2 the MMAs left out. WRONG OUTPUT but for 0: a measure of a part by its absence.
ABLATE = 0


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
    route: str | None = None, gated: bool = False, cluster: bool | None = None,
) -> Any:  # fmt: skip
    """x: [M, K] uint16 CuPy array holding BF16 bits; w: the [N, K] weight as gemm.gemm
    takes it (the cp.async kernels) or a PackedWeight from `prepare_weight` (the
    warp-specialized kernel; the same bits); -> [M, N] uint16 (BF16) or float32 with
    `out_f32`. `out`, when given, is written and returned. `splits` and `route` as
    `launch_plan`'s (leave them None but to measure or test a split count or route), and
    `cluster` (None: gemm_sm90_plan.CLUSTER_BY_DEFAULT) too.
    `gated` (a weight `prepare_weight` packed with `gated`, and only such a weight):
    -> [M, N / 2] BF16, silu(gate) * up, the bits of `activation.silu_mul_ref` (the
    silu_mul kernel) of the plain product of the un-interleaved weight.
    Needs a device `supported` accepts."""
    num_rows, num_cols, k = check_operands(x, w)
    if gated != (isinstance(w, PackedWeight) and w.gated):
        raise ValueError(
            "gated=True takes a weight packed with prepare_weight(..., gated=True), and such a "
            f"weight only gated=True; got gated={gated} and a weight of gated="
            f"{isinstance(w, PackedWeight) and w.gated}"
        )
    if gated and out_f32:
        raise ValueError("the gated epilogue writes BF16: out_f32 must be False")
    out_dtype = np.dtype(np.float32) if out_f32 else BF16_BITS
    out_cols = num_cols // 2 if gated else num_cols
    if out is None:
        import cupy

        out = cupy.empty((num_rows, out_cols), dtype=out_dtype)
    else:
        check("out", out, out_dtype, 2)
        if out.shape != (num_rows, out_cols):
            raise ValueError(f"out must have shape {(num_rows, out_cols)}; got {out.shape}")
    if num_rows == 0 or num_cols == 0:
        return out
    arch = device_arch()
    if not supported(arch, num_rows, num_cols, k):
        raise ValueError(f"gemm_sm90 needs compute capability 9.0 (sm_90a); this device is {arch}")
    packed = isinstance(w, PackedWeight)
    plan = launch_plan(
        num_rows, num_cols, k, out_f32=out_f32, packed=packed, num_sms=_num_sms(), route=route,
        splits=splits, gated=gated, cluster=cluster,
    )  # fmt: skip
    weight = w.data if packed else w
    dims = (np.int32(num_rows), np.int32(num_cols), np.int32(k))
    args: tuple[Any, ...]
    if plan.workspace:
        import cupy

        counters = stream_counters("sm90 tiles", MAX_COUNTERS, _device_id())
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
    swizzled = w.swizzled if packed else True
    fn = _kernel(plan.kernel, plan.smem_bytes, _device_id(), swizzled, PAD_ONCE, ABLATE)
    # the cluster split's clusters are a launch attribute; the _c2 entry points declare
    # theirs themselves (__cluster_dims__), so they launch as any kernel
    attribute = plan.cluster if plan.kernel.endswith("_csplit") else 1
    launch_kernel(fn, plan.grid, (plan.threads,), args, shared_mem=plan.smem_bytes,
                  cluster=attribute)  # fmt: skip
    return out


def _plain_packed(x: Any, w: Any, caller: str) -> tuple[int, int, int]:
    """(M, N, K) of a row epilogue's product: a plain (not gated) PackedWeight only."""
    if not isinstance(w, PackedWeight) or w.gated:
        raise ValueError(f"{caller} takes a plain PackedWeight (prepare_weight, not gated)")
    return check_operands(x, w)


def _epilogue_wanted(flag: bool, fused: bool | None, x: Any) -> bool:
    """Whether a row epilogue is asked for (`fused`, None: the flag) on a product of x's
    rows, at most EPILOGUE_MAX_ROWS of them. Checked first and cheaply: where it is not,
    the wrapper goes straight to the two launches, whose launchers check everything."""
    rows = x.shape[0] if getattr(x, "ndim", 0) == 2 else 0
    return (flag if fused is None else fused) and 0 < rows <= gemm_sm90_plan.EPILOGUE_MAX_ROWS


def _epilogue_plan(
    epilogue: str, m: int, n: int, k: int, splits: int | None, route: str | None
) -> Sm90Launch | None:
    """The row epilogue's launch of an [M, K] x [N, K] product where the device takes the
    kernel and the plan has one; else None (the caller runs the product and the epilogue's
    kernel apart)."""
    if not supported(device_arch(), m, n, k):
        return None
    plain = launch_plan(m, n, k, out_f32=False, packed=True, num_sms=_num_sms(), route=route,
                        splits=splits)  # fmt: skip
    return epilogue_launch(plain, m, epilogue)


def _launch_epilogue(plan: Sm90Launch, x: Any, w: PackedWeight, tail: tuple[Any, ...]) -> None:
    """`plan`'s launch: the product into a BF16 [M, N] y (PARTIAL: through its fp32
    partials) on the stream's tile counters, then the epilogue on `tail`, its arguments."""
    import cupy

    (m, k), n = x.shape, w.num_cols
    y = cupy.empty((m, n), dtype=BF16_BITS)
    counters = stream_counters("sm90 tiles", MAX_COUNTERS, _device_id())
    # PARTIAL's fp32 partials; WHOLE reads none (any fp32 pointer stands in)
    ws = cupy.empty((plan.splits, m, n) if plan.workspace else 1, np.float32)
    args = (x, w.data, ws, y, counters, np.int32(m), np.int32(n), np.int32(k),
            np.int32(plan.split_len), *tail)  # fmt: skip
    fn = _kernel(plan.kernel, plan.smem_bytes, _device_id(), w.swizzled, PAD_ONCE)
    launch_kernel(fn, plan.grid, (plan.threads,), args, shared_mem=plan.smem_bytes)


def gemm_sm90_add_rmsnorm(
    x: Any, w: PackedWeight, residual: Any, weight: Any, eps: float, *,
    splits: int | None = None, route: str | None = None, fused: bool | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """add_rmsnorm(residual, gemm_sm90(x, w), weight, eps) -> (summed fp32, normed BF16),
    both [M, N]: a projection whose output only feeds the residual add and the next norm
    (a layer's o and down). Where `epilogue_launch` has a norm entry point and `fused` (None:
    gemm_sm90_plan.NORM_EPILOGUE_BY_DEFAULT) asks for it, one launch (gemm_sm90.cu's norm
    epilogue); else the product and the add_rmsnorm kernel. The same bits either way.
    `splits` and `route` as `gemm_sm90`'s."""
    from .launchers import add_rmsnorm

    if not _epilogue_wanted(gemm_sm90_plan.NORM_EPILOGUE_BY_DEFAULT, fused, x):
        return add_rmsnorm(residual, gemm_sm90(x, w, splits=splits, route=route), weight, eps)
    num_rows, num_cols, k = _plain_packed(x, w, "gemm_sm90_add_rmsnorm")
    check("residual", residual, np.float32, 2)
    check("weight", weight, BF16_BITS, 1)
    if residual.shape != (num_rows, num_cols) or weight.shape != (num_cols,):
        raise ValueError(
            f"residual must be [M, N] = {[num_rows, num_cols]} and weight [N]; got "
            f"{list(residual.shape)} and {list(weight.shape)}"
        )
    plan = _epilogue_plan("norm", num_rows, num_cols, k, splits, route)
    if plan is None:
        return add_rmsnorm(residual, gemm_sm90(x, w, splits=splits, route=route), weight, eps)
    import cupy

    summed = cupy.empty_like(residual)
    normed = cupy.empty((num_rows, num_cols), dtype=BF16_BITS)
    _launch_epilogue(plan, x, w, (residual, weight, summed, normed, np.float32(eps)))
    return summed, normed


def gemm_sm90_rope_kv_write(
    x: Any, w: PackedWeight, positions: Any, cos: Any, sin: Any, cache: Any, layer: int,
    slot_mapping: Any, num_heads: int, *, splits: int | None = None, route: str | None = None,
    fused: bool | None = None,
) -> Any:  # fmt: skip
    """rope_kv_write(gemm_sm90(x, w) as [M, num_heads + 2 * kv_heads, head_dim], positions,
    cos, sin, cache, layer, slot_mapping, num_heads) -> the rotated queries [M, num_heads,
    head_dim]; the keys (rotated) and values into their cache slots: a bias-free qkv
    projection. Where `epilogue_launch` has a rope entry point and `fused` (None:
    gemm_sm90_plan.ROPE_EPILOGUE_BY_DEFAULT) asks for it, one launch (gemm_sm90.cu's rope
    epilogue); else the product and the rope_kv_write kernel. The same bits either way.
    `splits` and `route` as `gemm_sm90`'s."""
    from .launchers import check_rope_kv_write, rope_kv_write

    rope = (positions, cos, sin, cache, layer, slot_mapping, num_heads)
    if not _epilogue_wanted(gemm_sm90_plan.ROPE_EPILOGUE_BY_DEFAULT, fused, x):
        qkv = gemm_sm90(x, w, splits=splits, route=route)
        return rope_kv_write(qkv.reshape(qkv.shape[0], -1, cache.shape[-1]), *rope)
    num_rows, num_cols, k = _plain_packed(x, w, "gemm_sm90_rope_kv_write")
    head_dim = cache.shape[-1] if getattr(cache, "ndim", 0) == 6 else 0
    if head_dim <= 0 or num_cols % head_dim:
        raise ValueError(
            f"the product's {num_cols} columns must be whole heads of the cache's head_dim; got "
            f"a cache of shape {tuple(getattr(cache, 'shape', ()))}"
        )
    heads_shape = (num_rows, num_cols // head_dim, head_dim)
    num_layers, kv_heads, block_size = check_rope_kv_write(
        heads_shape, positions, cos, sin, cache, layer, slot_mapping, num_heads
    )
    plan = _epilogue_plan("rope", num_rows, num_cols, k, splits, route)
    if plan is None:
        return rope_kv_write(
            gemm_sm90(x, w, splits=splits, route=route).reshape(heads_shape), *rope
        )
    import cupy

    q = cupy.empty((num_rows, num_heads, head_dim), dtype=BF16_BITS)
    tail = (positions, cos, sin, q, slot_mapping, cache, np.int32(layer), np.int32(num_layers),
            np.int32(num_heads), np.int32(kv_heads), np.int32(block_size), np.int32(head_dim))  # fmt: skip
    _launch_epilogue(plan, x, w, tail)
    return q


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
def _cubin_path(swizzle: bool = True, pad_once: bool = True, ablate: int = 0) -> Path:
    """gemm_sm90.cu compiled for sm_90a, once per layout (REPRISE_WS_SWIZZLE, which the
    packed weight's layout must match), padding (REPRISE_WS_PAD_ONCE) and ablation
    (REPRISE_GEMM_ABLATE, ABLATE: the benchmark's alone), in a file CuPy can load:
    nvrtc.cubin_file's, kept on disk for later processes."""
    source = (
        f"#define REPRISE_WS_SWIZZLE {int(swizzle)}\n#define REPRISE_WS_PAD_ONCE {int(pad_once)}\n"
        + (f"#define REPRISE_GEMM_ABLATE {int(ablate)}\n" if ablate else "")
        + nvrtc.kernel_source(SOURCE)
    )
    return nvrtc.cubin_file(source, SOURCE.name, ARCH)


@functools.cache
def _module(device_id: int, swizzle: bool = True, pad_once: bool = True, ablate: int = 0) -> Any:
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawModule(path=str(_cubin_path(swizzle, pad_once, ablate)))


@functools.cache
def _kernel(
    name: str, smem_bytes: int, device_id: int, swizzle: bool = True, pad_once: bool = True,
    ablate: int = 0,
) -> Any:  # fmt: skip
    """The entry point, with its shared-memory opt-in set on this device (all configs
    need more than the default 48 KB); `swizzle` the ws kernels' stage layout (that of
    the packed weight they take), `pad_once` their rows past M (PAD_ONCE), `ablate` the
    benchmark's ablation build (ABLATE; 0 for every other launch)."""
    fn = _module(device_id, swizzle, pad_once, ablate).get_function(name)
    fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn
