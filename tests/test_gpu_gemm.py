"""The tensor-core GEMM (cuda/gemm.cu) on the GPU: against its NumPy twin and the
float64 product on fresh random inputs of the default model's and Llama-3.1-8B's
shapes, every output element written (outputs are poisoned first); every row
bit-identical to the same row computed alone, whatever M, offset, companion rows,
tile configuration, route (split-K partials and merge, or the in-register fold) or
pointer alignment (DESIGN §4); bad inputs refused with a
message naming the problem. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import dev, host, needs_gpu, poisoned

from reprise.cuda.dtypes import BF16, F32, to_bf16
from reprise.cuda.gemm import gemm_ref

pytestmark = [
    pytest.mark.gpu,
    needs_gpu,
]

# (K, N, fp32 output): the default model's q/k/v/o, gate/up, down and lm_head, then
# Llama-3.1-8B's qkv, o, gate+up, down and lm_head; last, shapes with an N tail (odd
# N: the unpaired stores) and a K tail (K % 32 and K % 64 != 0: skipped slices).
MODEL_SHAPES = [
    (576, 960, False),
    (576, 3072, False),
    (1536, 576, False),
    (576, 49152, True),
    (4096, 6144, False),
    (4096, 4096, False),
    (4096, 28672, False),
    (14336, 4096, False),
    (4096, 128256, True),
]
EDGE_SHAPES = [(16, 5, False), (208, 963, False), (48, 1001, True)]
NUM_ROWS = [1, 7, 64, 300]
POOL_ROWS = 512


def misaligned(cp, a, offset_elems: int = 1):
    """A C-contiguous copy of device array `a` whose data starts `offset_elems`
    elements past an aligned allocation: 2 bytes for BF16, 4 for fp32."""
    buf = cp.empty(a.size + 16, dtype=a.dtype)
    view = buf[offset_elems : offset_elems + a.size].reshape(a.shape)
    view[...] = a
    assert view.flags.c_contiguous and view.data.ptr % 16 != 0
    return view


def activations(rng: np.random.Generator, num_rows: int, k: int) -> np.ndarray:
    """BF16 rows of mixed scale, some elements far below their row's largest."""
    x = rng.standard_normal((num_rows, k)) * np.exp2(rng.integers(-6, 7, size=(num_rows, 1)))
    tiny = rng.random((num_rows, k)) < 0.05
    x[tiny] *= np.exp2(-rng.integers(10, 40, size=int(tiny.sum())))
    return x.astype(BF16)


def weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    return (rng.standard_normal((n, k), dtype=np.float32) * F32.type(0.05)).astype(BF16)


def checked_cols(rng: np.random.Generator, n: int) -> np.ndarray:
    """The output columns compared against the reference: all of a small N; for a
    large one both ends (tile tails) and a random sample between."""
    if n <= 4096:
        return np.arange(n)
    middle = rng.choice(n, size=2048, replace=False)
    return np.unique(np.concatenate([np.arange(64), middle, np.arange(n - 64, n)]))


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bf16_ulp(a: np.ndarray) -> np.ndarray:
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(a), 1e-38))) - 7)


def assert_matches_reference(got: np.ndarray, x: np.ndarray, w: np.ndarray, out_f32: bool) -> None:
    """got: [M, len(w)] from the GPU for rows x and weight rows w.

    Tolerances. Tensor cores add a slice's 16 products and the accumulator with
    truncation, not round to nearest (Fasi et al. 2021 measured this on V100-A100), so
    after K/16 slices an element may be off by more than an fp32 sum would be: a
    model of truncating accumulation gives a relative L2 error of 2e-5 at K = 14336
    and at most 1.2e-6 of sum_k |x_k w_k| per element. The bounds below, (K/16 + 16)
    steps of 2^-23 (relative L2) and of 2^-22 (per element, `accumulated`), leave 5x
    and more on that, and are still 50x below what one wrong index or a lost slice
    does to an element (about |y| ~ sum |x_k w_k| / sqrt(K)). BF16 output may differ
    from the twin by one BF16 ulp (both round once) plus `accumulated`."""
    k = x.shape[1]
    steps = k // 16 + 16
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    exact = x64 @ w64.T
    accumulated = steps * 2.0**-22 * (np.abs(x64) @ np.abs(w64).T)
    g = got.astype(np.float64)
    assert np.isfinite(g).all()
    if out_f32:
        assert rel_l2(g, exact) < steps * 2.0**-23
        err = np.abs(g - exact)
        assert np.all(err <= accumulated), float(np.max(err / np.maximum(accumulated, 1e-300)))
    else:
        want = gemm_ref(x, w).astype(np.float64)
        err = np.abs(g - want)
        bound = bf16_ulp(np.maximum(np.abs(g), np.abs(want))) + accumulated
        assert np.all(err <= bound), float(np.max(err / bound))
        assert rel_l2(g, exact) < 4e-3


# --- 1. against the twin ---------------------------------------------------------------


@pytest.mark.parametrize("k, n, out_f32", MODEL_SHAPES + EDGE_SHAPES)
def test_gemm_matches_its_twin(cp, rng, k: int, n: int, out_f32: bool) -> None:
    from reprise.cuda.gemm_kernel import gemm

    w = weights(rng, n, k)
    w_dev = dev(w)
    cols = checked_cols(rng, n)
    for m in NUM_ROWS:
        x = activations(rng, m, k)
        out = poisoned((m, n), np.float32 if out_f32 else np.uint16)
        y = gemm(dev(x), w_dev, out_f32=out_f32, out=out)
        assert y is out
        got = host(y)
        assert got.dtype == (F32 if out_f32 else BF16)
        assert not np.isnan(got.astype(np.float32)).any(), ("unwritten or NaN elements", m)
        assert_matches_reference(got[:, cols], x, w[cols], out_f32)
        fresh = host(gemm(dev(x), w_dev, out_f32=out_f32))  # allocated by the launcher
        assert np.array_equal(fresh.view(np.uint8), got.view(np.uint8)), m


# --- 2. row invariance -------------------------------------------------------------------

EVERY_M = list(range(1, POOL_ROWS + 1))
# around each config's limit (16, 64) and each tile's edge (16, 64, 128, 256, 512 rows)
SOME_M = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100]
SOME_M += [127, 128, 129, 255, 256, 257, 300, 511, 512]


def bits(cp, a):
    return a.view(cp.uint32 if a.dtype == cp.float32 else cp.uint16)


@pytest.mark.parametrize(
    "k, n, sizes",
    [(576, 960, EVERY_M), (208, 963, EVERY_M), (4096, 6144, SOME_M), (14336, 4096, SOME_M)],
    ids=["576x960-every-M", "208x963-every-M", "4096x6144", "14336x4096"],
)
def test_gemm_row_is_independent_of_its_batch(cp, rng, k: int, n: int, sizes: list[int]) -> None:
    """Every row of every call equals, bit for bit, the row computed alone (M = 1, the
    skinny tiles), for contiguous slices of a pool at random offsets and for random
    companions, in both output types; the sizes cover every tile configuration."""
    from reprise.cuda.gemm_kernel import CONFIGS, gemm, tile_config

    assert {tile_config(m).name for m in sizes} == {c.name for c in CONFIGS}
    w = dev(weights(rng, n, k))
    pool_host = activations(rng, POOL_ROWS, k)
    pool_host[17] = 0  # a zero row: +0 everywhere
    pool = dev(pool_host)
    alone = {
        out_f32: cp.concatenate(
            [gemm(pool[i : i + 1], w, out_f32=out_f32) for i in range(POOL_ROWS)]
        )
        for out_f32 in (False, True)
    }
    alone_bf16, alone_f32 = host(alone[False]), host(alone[True])
    assert not np.isnan(alone_bf16.astype(np.float32)).any() and not np.isnan(alone_f32).any()
    assert np.array_equal(alone_f32[17].view(np.uint32), np.zeros(n, np.uint32))  # +0, as the twin
    # the BF16 output is the fp32 accumulator rounded to nearest even
    assert np.array_equal(alone_bf16.view(np.uint16), to_bf16(alone_f32).view(np.uint16))
    for out_f32 in (False, True):
        for m in sizes:
            offset = int(rng.integers(0, POOL_ROWS - m + 1))
            y = gemm(pool[offset : offset + m], w, out_f32=out_f32)
            same = cp.array_equal(bits(cp, y), bits(cp, alone[out_f32][offset : offset + m]))
            assert bool(same), ("contiguous", m, offset, out_f32)

            rows = cp.asarray(rng.integers(0, POOL_ROWS, size=m))  # repeats allowed
            y = gemm(
                pool[rows],
                w,
                out_f32=out_f32,
                out=poisoned((m, n), np.float32 if out_f32 else np.uint16),
            )
            same = cp.array_equal(bits(cp, y), bits(cp, alone[out_f32][rows]))
            assert bool(same), ("companions", m, out_f32)


@pytest.mark.parametrize("m", [5, 40, 200])
def test_gemm_alignment_does_not_change_bits(cp, rng, m: int) -> None:
    """Unaligned x, w and out take the plain-load and unpaired-store paths; the bits
    are those of the aligned call, in every tile configuration (M = 5, 40, 200)."""
    from reprise.cuda.gemm_kernel import gemm

    k, n = 576, 200
    x, w = dev(activations(rng, m, k)), dev(weights(rng, n, k))
    for out_f32 in (False, True):
        want = bits(cp, gemm(x, w, out_f32=out_f32))
        for x_in, w_in in ((misaligned(cp, x), w), (x, misaligned(cp, w))):
            got = gemm(x_in, w_in, out_f32=out_f32)
            assert bool(cp.array_equal(bits(cp, got), want)), (m, out_f32)
        out = misaligned(cp, poisoned((m, n), np.float32 if out_f32 else np.uint16))
        got = gemm(misaligned(cp, x), misaligned(cp, w), out_f32=out_f32, out=out)
        assert got is out and bool(cp.array_equal(bits(cp, got), want)), (m, out_f32)


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
def test_gemm_any_split_count_matches_the_twin_and_keeps_rows(cp, rng, splits: int) -> None:
    """Forced split counts on one weight (K = 1552: splits of 1664, 896, 640 and 512
    elements, ragged last ones): every M against the reference, and every row of every M
    bit-equal to the row alone under the same count (the skinny partials and merge at
    M <= 16, the mid and big tiles folding in registers above)."""
    from reprise.cuda.gemm_kernel import gemm

    k, n = 1552, 333
    w_host = weights(rng, n, k)
    w = dev(w_host)
    pool_host = activations(rng, 300, k)
    pool = dev(pool_host)
    for out_f32 in (False, True):
        alone = cp.concatenate(
            [gemm(pool[i : i + 1], w, out_f32=out_f32, splits=splits) for i in range(300)]
        )
        for m in (1, 7, 16, 17, 64, 65, 300):
            out = poisoned((m, n), np.float32 if out_f32 else np.uint16)
            y = gemm(pool[:m], w, out_f32=out_f32, out=out, splits=splits)
            assert_matches_reference(host(y), pool_host[:m], w_host, out_f32)
            assert bool(cp.array_equal(bits(cp, y), bits(cp, alone[:m]))), (m, out_f32)


# --- 3. bad inputs -----------------------------------------------------------------------


def test_gemm_refuses_bad_inputs(cp) -> None:
    from reprise.cuda.gemm_kernel import gemm

    x, w = cp.zeros((3, 64), dtype=cp.uint16), cp.zeros((8, 64), dtype=cp.uint16)
    with pytest.raises(ValueError, match="x must be a 2-d uint16"):
        gemm(x.astype(cp.float32), w)
    with pytest.raises(ValueError, match="w must be a 2-d uint16"):
        gemm(x, w.reshape(-1))
    with pytest.raises(ValueError, match="same K"):
        gemm(x, cp.zeros((8, 48), dtype=cp.uint16))
    with pytest.raises(ValueError, match="multiple of 16; got K = 40"):
        gemm(cp.zeros((3, 40), dtype=cp.uint16), cp.zeros((8, 40), dtype=cp.uint16))
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        gemm(cp.zeros((3, 128), dtype=cp.uint16)[:, ::2], w)
    with pytest.raises(ValueError, match="w must be C-contiguous"):
        gemm(x, cp.zeros((64, 8), dtype=cp.uint16).T)
    with pytest.raises(ValueError, match=r"out must have shape \(3, 8\)"):
        gemm(x, w, out=cp.zeros((3, 9), dtype=cp.uint16))
    with pytest.raises(ValueError, match="out must be a 2-d float32"):
        gemm(x, w, out_f32=True, out=cp.zeros((3, 8), dtype=cp.uint16))
    assert gemm(x[:0], w).shape == (0, 8)  # no rows: nothing to launch
    with pytest.raises(ValueError, match="splits must be a count"):
        gemm(x, w, splits=0)
    with pytest.raises(ValueError, match="splits must be a count"):
        gemm(cp.zeros((3, 640), dtype=cp.uint16), cp.zeros((8, 640), dtype=cp.uint16), splits=4)
