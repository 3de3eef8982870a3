"""The Hopper GEMM (cuda/gemm_sm90.cu) on an sm_90 GPU: against the twin and the float64
product on Llama-3.1-8B's shapes, every output element written; every row bit-identical
to the same row computed alone, whatever M, offset, companion rows or tile configuration
(DESIGN §4), on the split-K routes (S = split_k(N, K) > 1: PARTIAL at small M, FOLD at
large M) as on the unsplit ones; a split result equals the fold of its splits' partials
(gemm.fold_partials over the unsplit kernel on each K range) on real tensor cores.
Skipped without a CUDA device of compute capability 9.0.

It also records, without asserting, whether this kernel's rows bit-equal gemm.cu's
(mma.sync) rows: the dispatch rule (gemm_sm90_kernel's docstring) assumes they may not."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import NO_GPU, dev, host, needs_gpu, poisoned
from test_gpu_gemm import activations, assert_matches_reference, checked_cols, weights

from reprise.cuda.dtypes import BF16, F32

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.fixture(scope="module")
def hopper(cp):
    """CuPy, on a device this kernel supports."""
    from reprise.cuda.gemm_sm90_kernel import supported

    arch = str(cp.cuda.Device().compute_capability)
    if NO_GPU is None and not supported(arch, 1, 128, 64):
        pytest.skip(f"needs compute capability 9.0; this device is {arch}")
    return cp


# (K, N, fp32 output): Llama-3.1-8B's qkv, o, gate+up, down, lm_head, then an N tail.
SHAPES = [
    (4096, 6144, False),
    (4096, 4096, False),
    (4096, 28672, False),
    (14336, 4096, False),
    (4096, 128256, True),
    (576, 963, False),
]
NUM_ROWS = [1, 7, 64, 65, 300, 2048]


@pytest.mark.parametrize("packed", [False, True], ids=["cp-async", "warp-specialized"])
@pytest.mark.parametrize("k, n, out_f32", SHAPES)
def test_matches_its_twin(hopper, rng, k: int, n: int, out_f32: bool, packed: bool) -> None:
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight

    w = weights(rng, n, k)
    w_dev = prepare_weight(dev(w)) if packed else dev(w)
    cols = checked_cols(rng, n)
    for m in NUM_ROWS:
        x = activations(rng, m, k)
        out = poisoned((m, n), np.float32 if out_f32 else np.uint16)
        y = gemm_sm90(dev(x), w_dev, out_f32=out_f32, out=out)
        assert y is out
        got = host(y)
        assert got.dtype == (F32 if out_f32 else BF16)
        assert not np.isnan(got.astype(np.float32)).any(), ("unwritten or NaN elements", m)
        rows = np.unique(np.concatenate([np.arange(min(m, 64)), np.arange(max(0, m - 64), m)]))
        assert_matches_reference(got[np.ix_(rows, cols)], x[rows], w[cols], out_f32)


def bits(cp, a):
    return a.view(cp.uint32 if a.dtype == cp.float32 else cp.uint16)


@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096), (576, 963)])
def test_row_is_independent_of_its_batch(hopper, rng, k: int, n: int) -> None:
    """Rows of calls of many M (each tile configuration, and the warp-specialized kernel
    on the packed weight), at random offsets and with random companions, bit-equal the
    rows computed alone (M = 1)."""
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
    from reprise.cuda.gemm_sm90_plan import tile_config

    cp = hopper
    pool_rows = 2048
    sizes = [1, 2, 7, 63, 64, 65, 127, 128, 129, 300, 511, 512, 1024, 2048]
    assert {tile_config(m, n).name for m in sizes} >= {"wg1", "wg2"}
    w = dev(weights(rng, n, k))
    packed = prepare_weight(w)
    pool = dev(activations(rng, pool_rows, k))
    for out_f32 in (False, True):
        alone = bits(cp, cp.concatenate(
            [gemm_sm90(pool[i : i + 1], w, out_f32=out_f32) for i in range(pool_rows)]
        ))  # fmt: skip
        for weight in (w, packed):
            kind = "packed" if weight is packed else "plain"
            for m in sizes:
                offset = int(rng.integers(0, pool_rows - m + 1))
                y = bits(cp, gemm_sm90(pool[offset : offset + m], weight, out_f32=out_f32))
                same = cp.array_equal(y, alone[offset : offset + m])
                assert bool(same), ("contiguous", kind, m, offset, out_f32)
                rows = cp.asarray(rng.integers(0, pool_rows, size=m))
                y = bits(cp, gemm_sm90(pool[rows], weight, out_f32=out_f32))
                assert bool(cp.array_equal(y, alone[rows])), ("companions", kind, m, out_f32)


def test_mma_sync_agreement_is_recorded(hopper, rng, record_property) -> None:
    """How many fp32 elements differ from gemm.cu's for the same rows (information for
    the dispatch rule; not asserted)."""
    from reprise.cuda.gemm_kernel import gemm
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90

    x, w = dev(activations(rng, 256, 4096)), dev(weights(rng, 4096, 4096))
    ours, theirs = host(gemm_sm90(x, w, out_f32=True)), host(gemm(x, w, out_f32=True))
    differ = int(np.count_nonzero(ours.view(np.uint32) != theirs.view(np.uint32)))
    record_property("elements_differing_from_mma_sync", differ)
    print(f"gemm_sm90 vs gemm.cu, fp32 out, 256 x 4096 x 4096: {differ} of {ours.size} differ")


def fold_of_partials(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The split rule computed another way, for x @ w.T on the device: the unsplit kernel
    (splits=1) on each of split_k(N, K)'s K ranges gives that split's partial, folded
    (((0 + P_0) + P_1) + ...) in NumPy (gemm.fold_partials); fp32."""
    from reprise.cuda.gemm import fold_partials, split_bounds
    from reprise.cuda.gemm_kernel import split_k, split_length
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90

    (n, k), partials = w.shape, []
    for a, b in split_bounds(k, split_length(k, split_k(n, k))):
        w_part = dev(np.ascontiguousarray(w[:, a:b]))
        part = gemm_sm90(dev(np.ascontiguousarray(x[:, a:b])), w_part, out_f32=True, splits=1)
        partials.append(host(part))
    return fold_partials(np.stack(partials).view(F32))


@pytest.mark.parametrize("packed", [False, True], ids=["cp-async", "warp-specialized"])
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (14336, 4096), (1024, 272)])
def test_split_is_the_fold_of_its_partials(hopper, rng, k: int, n: int, packed: bool) -> None:
    """fp32 out of every M (PARTIAL and FOLD routes) bit-equals (((0 + P_0) + P_1) + ...)
    folded in NumPy from the unsplit kernel (splits=1) on each split's K range; BF16
    out its one rounding. The same on every M, so the route never reaches a bit."""
    from reprise.cuda.dtypes import to_bf16
    from reprise.cuda.gemm_kernel import split_k
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
    from reprise.cuda.gemm_sm90_plan import launch_plan

    cp = hopper
    assert split_k(n, k) > 1
    w = weights(rng, n, k)
    pool = activations(rng, 300, k)
    want = fold_of_partials(w, pool)
    w_dev = prepare_weight(dev(w)) if packed else dev(w)
    routes = set()
    for m, start in ((1, 0), (1, 299), (7, 50), (64, 3), (65, 100), (129, 0), (300, 0)):
        routes.add(launch_plan(m, n, k, out_f32=True, packed=packed).kernel)
        x = dev(pool[start : start + m])
        got = host(gemm_sm90(x, w_dev, out_f32=True, out=poisoned((m, n), np.float32)))
        assert np.array_equal(got.view(np.uint32), want[start : start + m].view(np.uint32)), (
            m,
            start,
        )
        got16 = host(gemm_sm90(x, w_dev, out=poisoned((m, n), np.uint16)))
        assert np.array_equal(
            got16.view(np.uint16), to_bf16(want[start : start + m]).view(np.uint16)
        )
    assert any(r.endswith("_split") for r in routes) and any(r.endswith("_fold") for r in routes)
    cp.cuda.Device().synchronize()


def test_wide_tile_and_both_layouts_give_the_rows_computed_alone(hopper, rng) -> None:
    """An S = 1 weight (gate+up) at prefill sizes runs the wide warp-specialized tile
    (128 x 256); its rows, and those of the no-swizzle stage layout (a weight packed with
    swizzle=False, the kernel built to match), bit-equal the same rows computed alone on
    the default kernel (M = 1: the 64 x 128 tile), on real tensor cores."""
    from reprise.cuda.gemm_kernel import split_k
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
    from reprise.cuda.gemm_sm90_plan import launch_plan

    cp = hopper
    k, n = 4096, 28672
    assert split_k(n, k) == 1
    w = dev(weights(rng, n, k))
    swizzled, interleaved = prepare_weight(w), prepare_weight(w, swizzle=False)
    pool = dev(activations(rng, 2048, k))
    for out_f32 in (False, True):
        picks = [launch_plan(m, n, k, out_f32=out_f32, packed=True).kernel for m in (1, 300, 2048)]
        # M = 1 takes the 64 x 128 tile (WS_M64, on by default since 2026-11-28), whose
        # rows are the WS tile's (the same K order); a 2026-11-30 H200 run caught this line
        # still expecting the 128 x 128 one
        assert picks[0].endswith(("_bf16_m64", "_f32_m64")) and picks[2].endswith("_wide"), picks
        alone = bits(cp, cp.concatenate(
            [gemm_sm90(pool[i : i + 1], swizzled, out_f32=out_f32) for i in range(0, 2048, 37)]
        ))  # fmt: skip
        for weight, kind in ((swizzled, "swizzled"), (interleaved, "interleaved")):
            for m in (1, 300, 2048):
                y = bits(cp, gemm_sm90(pool[:m], weight, out_f32=out_f32))
                want = alone[: len(range(0, m, 37))]
                assert bool(cp.array_equal(y[::37], want)), (kind, m, out_f32)

