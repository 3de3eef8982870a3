"""The Hopper GEMM's wide FOLD (route "wide_fold": the 128 x 256 warp-specialized tile on
split weights, its running totals in an fp32 workspace, setmaxnreg 56 / 224) on an sm_90
GPU, forced: launch_plan does not take it by default until this has passed on a GPU
(gemm_sm90_kernel.WIDE_FOLD_BY_DEFAULT). A file of its own, run last by the GPU scripts
(scripts/gpu_followup.sh): its first version hung (a setmaxnreg budget over the CTA's
register pool), and a hang must not cost the other tests. Skipped without a CUDA device
of compute capability 9.0."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import dev, host, needs_gpu, poisoned
from test_gemm_sm90_gpu import fold_of_partials, hopper  # noqa: F401 (hopper: the fixture)
from test_gpu_gemm import activations, weights

pytestmark = [pytest.mark.gpu, needs_gpu]
ROUTE = "wide_fold"


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (14336, 4096)])
def test_wide_fold_is_the_fold_of_its_partials(rng, k: int, n: int) -> None:
    """The wide FOLD (split weights at prefill sizes: running totals in an fp32
    workspace): fp32 out of M = 2,048 bit-equals the NumPy fold of the unsplit kernel's
    partials on each split's K range, BF16 out its one rounding, and its rows the same
    rows computed alone (M = 1: the PARTIAL route), on real tensor cores."""
    from reprise.cuda.dtypes import to_bf16
    from reprise.cuda.gemm_kernel import split_k
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, launch_plan, prepare_weight

    m = 2048
    assert split_k(n, k) > 1 and launch_plan(m, n, k, out_f32=True, packed=True, route=ROUTE).totals
    w, pool = weights(rng, n, k), activations(rng, m, k)
    want = fold_of_partials(w, pool)
    packed, x = prepare_weight(dev(w)), dev(pool)
    got = host(gemm_sm90(x, packed, out_f32=True, out=poisoned((m, n), np.float32), route=ROUTE))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    got16 = host(gemm_sm90(x, packed, out=poisoned((m, n), np.uint16), route=ROUTE))
    assert np.array_equal(got16.view(np.uint16), to_bf16(want).view(np.uint16))
    for i in range(0, m, 211):
        alone = host(gemm_sm90(x[i : i + 1], packed, out_f32=True))
        assert np.array_equal(alone.view(np.uint32), got[i : i + 1].view(np.uint32)), i
