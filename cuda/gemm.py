"""Linear layers: y = x @ w.T with BF16 operands and one rounding of an exact sum.

`w` is stored as `[out_features, in_features]` (Hugging Face layout). The
result is rounded to fp32 (kept for logits) and from there to BF16 for hidden
activations, as a kernel that accumulates in fp32 would round it.

Why a row's result does not depend on the call it is in
-------------------------------------------------------
No BLAS promises that row m of `X @ W.T` is independent of the number of rows,
the row's offset or the other rows, and OpenBLAS does not deliver it: its sgemm
micro-kernels unroll K differently by the row's place in its tiles (one row
measured against M = 2..300 took 4 different bit patterns). Rather than fix an
accumulation order, this twin makes the order irrelevant:

1. Each operand row is put on a fixed-point grid of its own (`to_grid`):
   x[m] is rounded to multiples of 2^(e_m - b), where max|x[m]| < 2^e_m, and
   w[n] likewise with its own e_n; b = `grid_bits(K)`. A BF16 element within a
   factor 2^(b - 8) of its row's largest is on the grid already (BF16 has 8
   significant bits); a smaller one moves by at most 2^-b of the row's largest.
2. In float64 each product x~[m, k] * w~[n, k] is then an integer multiple of
   q = 2^(e_m - b + e_n - b), at most 2^(2b) q in magnitude, so every partial
   sum, in any order, grouping, blocking or threading, is an integer multiple
   of q below K * 2^(2b) q <= 2^53 q: exactly representable. Whatever kernel
   numpy's float64 matmul ends up in returns the exact sum.
3. The exact sum is rounded once to fp32 (zero canonicalised to +0, whose sign
   would otherwise depend on how the kernel seeds its accumulator).

So y[m, n] = fp32(sum_k x~[m, k] w~[n, k]) is a function of x[m] and w[n] alone,
the same on every CPU, BLAS build and thread count. Its error is one rounding of
the exact sum (on model-like data 4x closer to float64 than an fp32 matmul) plus
the grid's perturbation, each moved element by at most 2^-b (b >= 19 for
K <= 2^15) of its row's largest: on rows spanning 2^30 and more, about what an
fp32 accumulation loses. The price is float64: about 2x the time of an fp32
matmul, and weights held as float64 (`prepare_weight`), twice an fp32 copy.

The CUDA GEMM (gemm_kernel.py) does not reproduce these bits: it accumulates in fp32
in a fixed order of its own, split over K by a count fixed per weight shape
(`gemm_kernel.split_k`), and keeps its rows M-independent by that order; it agrees
with this twin within BF16 rounding plus its fp32 accumulation error, whatever the split.
"""

from __future__ import annotations

import math

import numpy as np

from .dtypes import BF16, F32, to_bf16

F64 = np.dtype(np.float64)


def grid_bits(length: int) -> int:
    """Grid resolution b for two operands whose products are summed `length` times.

    Operands on grids of b bits give products below 2^(2b) grid quanta, and
    `length` of them sum below 2^53 quanta, where float64 is exact.
    """
    assert length >= 1, length
    return (53 - math.ceil(math.log2(length))) // 2


def to_grid(
    a: np.ndarray, bits: int, exponent: np.ndarray | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """Round each vector along the last axis to multiples of 2^(e - bits), where the
    vector's max |element| < 2^e (`grid_exponent`, or given). Works in a's precision
    when it is float32 or float64 (anything else is widened to float64); values
    already on the grid, as BF16 elements near their vector's largest are, stay put.

    NOTE: (a + c) - c with c = 1.5 * 2^(e - bits + mantissa bits) rounds a to the
    nearest multiple of 2^(e - bits), ties to even: |a| < 2^e keeps a + c in c's
    binade, whose spacing is exactly that multiple, and the subtraction is exact.
    """
    if a.dtype not in (F32, F64):
        a = a.astype(F64)
    mantissa_bits = np.finfo(a.dtype).nmant
    assert 0 < bits < mantissa_bits, (bits, a.dtype)
    if exponent is None:
        exponent = grid_exponent(a)
    shift = np.ldexp(a.dtype.type(1.5), exponent - bits + mantissa_bits)
    out = np.add(a, shift, out=out)
    return np.subtract(out, shift, out=out)


def grid_exponent(a: np.ndarray) -> np.ndarray:
    """e with max|element| < 2^e for each vector along the last axis (kept as a size-1 axis)."""
    if a.dtype == BF16:  # |x| orders like its bit pattern without the sign: compare 2-byte ints
        largest = (a.view(np.uint16) & np.uint16(0x7FFF)).max(axis=-1, keepdims=True)
        return np.frexp(largest.view(BF16).astype(F32))[1]
    largest = np.maximum(a.max(axis=-1, keepdims=True), -a.min(axis=-1, keepdims=True))
    return np.frexp(largest)[1]


def exact_to_f32(y: np.ndarray) -> np.ndarray:
    """Round an exact float64 result to fp32, with zero always +0."""
    out = np.empty(y.shape, dtype=F32)
    np.add(y, 0.0, out=out, casting="same_kind")  # -0 + 0 = +0, every other value unchanged
    return out


def prepare_weight(w: np.ndarray) -> np.ndarray:
    """[N, K] BF16 (or fp32 holding BF16 values) -> float64 on the grid `gemm_ref` uses.

    Done once per weight by the NumPy backend; `gemm_ref` takes the result as is.
    """
    assert w.ndim == 2 and w.dtype in (BF16, F32), (w.shape, w.dtype)
    return to_grid(w.astype(F64), grid_bits(w.shape[1]), grid_exponent(w))


def gemm_ref(x: np.ndarray, w: np.ndarray, *, out_f32: bool = False) -> np.ndarray:
    """x: [M, K] BF16; w: [N, K] BF16, fp32 holding BF16 values, or float64 from
    `prepare_weight` -> [M, N] BF16 (fp32 with `out_f32`)."""
    assert x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    if w.dtype != F64:
        w = prepare_weight(w)
    x_grid = to_grid(x.astype(F64), grid_bits(x.shape[1]), grid_exponent(x))  # [M, K]
    y = exact_to_f32(x_grid @ w.T)  # [M, N]
    return y if out_f32 else to_bf16(y)


def split_bounds(k: int, length: int) -> list[tuple[int, int]]:
    """The K ranges [start, end) of the splits of `length` elements that cut K (the last
    one shorter): the fixed ranges of gemm.cu's and gemm_sm90.cu's split-K."""
    assert k >= 1 and length >= 1, (k, length)
    return [(start, min(k, start + length)) for start in range(0, k, length)]


def fold_partials(partials: np.ndarray) -> np.ndarray:
    """[S, ...] fp32 split partials -> fp32 (((+0 + P_0) + P_1) + ...) + P_{S-1}: the
    split-K fold of the CUDA GEMMs (gemm.cu, gemm_sm90.cu), one IEEE fp32 add an
    element in ascending split order, which is what every route of theirs computes
    (the last CTA's fold from the workspace, and the running total in registers).

    NOTE: the twin of the fold only; each partial is the kernel's own accumulation over
    its split (in the tests, the unsplit kernel run on that K range), so a split
    kernel's fp32 output must equal this bit for bit."""
    assert partials.dtype == F32 and partials.ndim >= 1, (partials.dtype, partials.shape)
    total = np.zeros(partials.shape[1:], dtype=F32)
    for partial in partials:
        np.add(total, partial, out=total)
    return total
