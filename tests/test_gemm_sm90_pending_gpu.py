"""The Hopper GEMM's tiles built but not yet a default, forced, on an sm_90 GPU: the wide
FOLD (route "wide_fold": the 128 x 256 warp-specialized tile on split weights, its running
totals in an fp32 workspace, setmaxnreg 56 / 224; gemm_sm90_plan.WIDE_FOLD_BY_DEFAULT)
the decode tile (WS_DECODE: M <= 64, 64 columns a CTA, 2 CTAs an SM; route
"decode_split", DECODE_TILE_BY_DEFAULT) and the 64 x 128 tile (WS_M64: M <= 64, 2 CTAs an
SM; route "m64_split", M64_TILE_BY_DEFAULT). The two M <= 64 tiles are defaults since they
passed here on an H200 (2026-11-28); the wide FOLD is not (slower there). And the gated
(SwiGLU) epilogue (GATED_BY_DEFAULT, built 2026-11-28, not yet run on a GPU): its rows
against the plain product and silu_mul, and an engine with it against one without. And the
cluster entry points (CLUSTER_BY_DEFAULT, built 2026-11-28, not yet run on a GPU: two CTAs
along M multicasting each weight tile to both): their rows against the single-CTA launch's,
and an engine with them against one without. And the cluster split (CSPLIT_BY_DEFAULT,
built 2026-11-28, not yet run on a GPU: a tile's S splits one cluster launched with a
cluster attribute, their partials folded through its shared memory): its rows against
PARTIAL's, and an engine with it against one without. And the tall FOLD
(TALL_FOLD_BY_DEFAULT, built 2026-12-02, not yet run on a GPU: three consumers folding in
registers, 512 threads): its rows against WS's FOLD. And the row epilogues
(NORM_EPILOGUE_BY_DEFAULT and ROPE_EPILOGUE_BY_DEFAULT, built 2026-11-28, not yet run on a
GPU: a decode's o and down projection launches running the add_rmsnorm after them, its qkv
launches the rope_kv_write): their outputs against the two kernels', and an engine with
each against one without. A file of its
own, run last by scripts/gpu_followup.sh: the wide FOLD's first version hung (a
setmaxnreg budget over the CTA's register pool), and a hang must not cost the other tests. Skipped without a CUDA device of compute capability 9.0."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import dev, host, needs_gpu, poisoned
from test_gemm_sm90_gpu import fold_of_partials, hopper  # noqa: F401 (hopper: the fixture)
from test_gpu_gemm import activations, weights

from reprise.cuda.gemm_kernel import split_k

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
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
    from reprise.cuda.gemm_sm90_plan import launch_plan

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


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (14336, 4096)])
def test_tall_fold_gives_the_ws_fold_rows(rng, k: int, n: int) -> None:
    """The tall FOLD (route "tall_fold": three consumers of 64 x 128, setmaxnreg 56 / 152;
    gemm_sm90_plan.TALL_FOLD_BY_DEFAULT, off until this runs) on Llama-3.1-8B's split
    weights at M = 2,048 (10 whole m tiles and one of 128 rows: its third consumer idle) and
    M = 300: fp32 and BF16 rows bit-equal to WS's FOLD (the default there), every element
    written (into a poisoned output), and the gated output on the first shape."""
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
    from reprise.cuda.gemm_sm90_plan import launch_plan

    assert split_k(n, k) > 1
    w, pool = weights(rng, n, k), activations(rng, 2048, k)
    packed, x = prepare_weight(dev(w)), dev(pool)
    for m in (2048, 300):
        assert launch_plan(m, n, k, out_f32=False, packed=True, route="tall_fold").threads == 512
        for out_f32, dtype in ((False, np.uint16), (True, np.float32)):
            want = host(gemm_sm90(x[:m], packed, out_f32=out_f32, route="ws_fold"))
            got = host(gemm_sm90(x[:m], packed, out_f32=out_f32, route="tall_fold",
                                 out=poisoned((m, n), dtype)))  # fmt: skip
            assert np.array_equal(got.view(dtype), want.view(dtype)), (k, n, m, out_f32)
    if n == 6144:
        gated = prepare_weight(dev(w), gated=True)
        want = host(gemm_sm90(x, gated, gated=True, route="ws_fold"))
        got = host(gemm_sm90(x, gated, gated=True, route="tall_fold",
                             out=poisoned((2048, n // 2), np.uint16)))  # fmt: skip
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (14336, 4096), (128, 2048)])
def test_decode_tile_gives_the_default_rows(rng, k: int, n: int, monkeypatch) -> None:
    """The decode tile at M = 1, 7 and 64 (PARTIAL on the split weights, WHOLE on the
    unsplit one): rows bit-equal to the default tile's (WS) and, split, to the NumPy fold
    of the unsplit kernel's partials; every output element written."""
    assert_tile_gives_the_default_rows(rng, k, n, monkeypatch, "DECODE_TILE_BY_DEFAULT", "_decode")


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 28672), (14336, 4096), (128, 2048)])
def test_m64_tile_gives_the_default_rows(rng, k: int, n: int, monkeypatch) -> None:
    """The 64 x 128 tile (WS_M64, 2 CTAs an SM) at M = 1, 7 and 64, PARTIAL on the split
    weights and WHOLE on the unsplit ones (gate_up's shape among them): the same."""
    assert_tile_gives_the_default_rows(rng, k, n, monkeypatch, "M64_TILE_BY_DEFAULT", "_m64")


def assert_tile_gives_the_default_rows(rng, k: int, n: int, monkeypatch, flag: str,
                                       marker: str) -> None:  # fmt: skip
    """With gemm_sm90_plan's `flag` on, M = 1, 7 and 64 launch a kernel named with
    `marker`, whose rows bit-equal WS's (fp32 and BF16 out, into poisoned outputs) and,
    for a split weight, the NumPy fold of the unsplit kernel's partials."""
    from reprise.cuda import gemm_sm90_plan as geometry
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
    from reprise.cuda.gemm_sm90_plan import launch_plan

    w, pool = weights(rng, n, k), activations(rng, 64, k)
    packed, x = prepare_weight(dev(w)), dev(pool)
    for off in ("DECODE_TILE_BY_DEFAULT", "M64_TILE_BY_DEFAULT"):
        monkeypatch.setattr(geometry, off, False)
    want = host(gemm_sm90(x, packed, out_f32=True))  # WS
    want16 = host(gemm_sm90(x, packed))
    monkeypatch.setattr(geometry, flag, True)
    for m in (1, 7, 64):
        assert marker in launch_plan(m, n, k, out_f32=True, packed=True).kernel, m
        got = host(gemm_sm90(x[:m], packed, out_f32=True, out=poisoned((m, n), np.float32)))
        assert np.array_equal(got.view(np.uint32), want[:m].view(np.uint32)), m
        got16 = host(gemm_sm90(x[:m], packed, out=poisoned((m, n), np.uint16)))
        assert np.array_equal(got16.view(np.uint16), want16[:m].view(np.uint16)), m
    if split_k(n, k) > 1:
        assert np.array_equal(want.view(np.uint32), fold_of_partials(w, pool).view(np.uint32))


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("k, n", [(4096, 28672), (576, 3072), (4096, 2 * 4096)])
def test_the_gated_epilogue_gives_silu_mul_of_the_plain_product(rng, k: int, n: int) -> None:
    """The gated (SwiGLU) epilogue (gemm_sm90_plan.GATED_BY_DEFAULT, off until this runs):
    on Llama-3.1-8B's gate/up shape (S = 1: the 64 x 128, WS and wide tiles), the default
    model's (S = 3: PARTIAL and FOLD) and a split 8B-like one, at M = 1, 7, 64, 100 and
    2,048, its [M, N / 2] output bit-equals the plain product followed by the silu_mul
    kernel, into a poisoned output."""
    from reprise.cuda import launchers
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight

    w, pool = weights(rng, n, k), activations(rng, 2048, k)
    plain, gated = prepare_weight(dev(w)), prepare_weight(dev(w), gated=True)
    x = dev(pool)
    for m in (1, 7, 64, 100, 2048):
        want = host(launchers.silu_mul(gemm_sm90(x[:m], plain)))
        got = host(gemm_sm90(x[:m], gated, gated=True, out=poisoned((m, n // 2), np.uint16)))
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (k, n, m)


@pytest.mark.usefixtures("hopper")
def test_the_gated_mlp_changes_no_logit(default_model_dir, monkeypatch) -> None:
    """The default model with its MLPs in the gated epilogue (the weights loaded with
    GATED_BY_DEFAULT on) against the default engine: the same tokens and logits bits,
    a prompt's prefill, its cached repeat and decode steps replayed as CUDA graphs."""
    from reprise.cuda import gemm_sm90_plan
    from reprise.cuda.gemm_sm90_kernel import PackedWeight
    from reprise.daemon import Engine, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, return_logits=True)
    prompt = np.random.default_rng(3).integers(100, 49000, size=150).tolist()
    outs = []
    for flag in (False, True):
        monkeypatch.setattr(gemm_sm90_plan, "GATED_BY_DEFAULT", flag)
        engine = Engine.from_pretrained(default_model_dir, backend="cupy", num_device_blocks=64)
        weight = engine.runner.model.layers[0].gate_up_proj
        assert (isinstance(weight, PackedWeight) and weight.gated) == flag
        outs.append([engine.generate(prompt, params) for _ in range(2)])
        del engine
    for got, want in zip(outs[1], outs[0], strict=True):
        assert got.token_ids == want.token_ids
        assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096),
                                  (576, 3072)])  # fmt: skip
def test_cluster_entry_points_give_the_single_cta_rows(rng, k: int, n: int) -> None:
    """The cluster entry points (two CTAs along M sharing each weight tile by multicast;
    gemm_sm90_plan.CLUSTER_BY_DEFAULT, off until this runs) on Llama-3.1-8B's shapes (FOLD on
    the split qkv, o and down; the wide WHOLE on gate_up) and the default model's gate/up
    (FOLD, S = 3), at M = 256, 512 and 2,048, BF16 and fp32 out: bit-equal to the same
    launch without the cluster, every element written (into a poisoned output); and a
    row of M = 2,048 equal to the same row computed alone (M = 1)."""
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
    from reprise.cuda.gemm_sm90_plan import launch_plan

    w, pool = weights(rng, n, k), activations(rng, 2048, k)
    packed, x = prepare_weight(dev(w)), dev(pool)
    for m in (256, 512, 2048):
        assert launch_plan(m, n, k, out_f32=False, packed=True, cluster=True).cluster == 2
        for out_f32, dtype in ((False, np.uint16), (True, np.float32)):
            want = host(gemm_sm90(x[:m], packed, out_f32=out_f32, cluster=False))
            got = host(gemm_sm90(x[:m], packed, out_f32=out_f32, cluster=True,
                                 out=poisoned((m, n), dtype)))  # fmt: skip
            assert np.array_equal(got.view(dtype), want.view(dtype)), (k, n, m, out_f32)
    alone = host(gemm_sm90(x[2047:2048], packed, out_f32=True))
    assert np.array_equal(alone.view(np.uint32), got[2047:2048].view(np.uint32))


@pytest.mark.usefixtures("hopper")
def test_the_clustered_engine_changes_no_logit(default_model_dir, monkeypatch) -> None:
    """The default model with CLUSTER_BY_DEFAULT on against the default engine: the same
    tokens and logits bits for a prompt long enough that its prefill's projections run
    clustered (M = 300: three m tiles, so unpaired; 600: five; 1,024: eight, paired), its
    cached repeat and decode steps (never clustered: one m tile)."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(100, 49000, size=size).tolist() for size in (300, 600, 1024)]
    assert_flag_changes_no_logit(default_model_dir, monkeypatch, "CLUSTER_BY_DEFAULT", prompts,
                                 max_tokens=8, num_device_blocks=256,
                                 max_num_batched_tokens=1024)  # fmt: skip


def assert_flag_changes_no_logit(default_model_dir, monkeypatch, flag: str, prompts: list,
                                 *, max_tokens: int, **engine_settings) -> None:  # fmt: skip
    """The default model's engine with gemm_sm90_plan's `flag` on against one with it off:
    the same tokens and logits bits for each prompt and its cached repeat, decode steps
    replayed as CUDA graphs."""
    from reprise.cuda import gemm_sm90_plan
    from reprise.daemon import Engine, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            return_logits=True)  # fmt: skip
    outs = []
    for on in (False, True):
        monkeypatch.setattr(gemm_sm90_plan, flag, on)
        engine = Engine.from_pretrained(default_model_dir, backend="cupy", **engine_settings)
        outs.append([engine.generate(p, params) for p in prompts for _ in range(2)])
        del engine
    for got, want in zip(outs[1], outs[0], strict=True):
        assert got.token_ids == want.token_ids
        assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (14336, 4096), (576, 960),
                                  (1536, 576), (576, 3072)])  # fmt: skip
def test_the_cluster_split_gives_the_partial_rows(rng, k: int, n: int) -> None:
    """The cluster split (routes *_csplit; gemm_sm90_plan.CSPLIT_BY_DEFAULT, off until this
    runs) on Llama-3.1-8B's split weights and the default model's (S = 2, 3, 4, 6), on each
    tile that takes M <= 64 (the decode tile, 64 x 128, WS) at M = 1, 7 and 64: BF16 and fp32
    rows bit-equal to the same tile's PARTIAL route, and the gated output on the gate/up
    shape, every element written (into a poisoned output)."""
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
    from reprise.cuda.gemm_sm90_plan import launch_plan

    assert split_k(n, k) > 1
    w, pool = weights(rng, n, k), activations(rng, 64, k)
    packed, gated, x = prepare_weight(dev(w)), prepare_weight(dev(w), gated=True), dev(pool)
    for m in (1, 7, 64):
        for tile in ("decode", "m64", "ws"):
            plan = launch_plan(m, n, k, out_f32=False, packed=True, route=f"{tile}_csplit")
            assert plan.cluster == split_k(n, k) and not plan.workspace
            for out_f32, dtype in ((False, np.uint16), (True, np.float32)):
                want = host(gemm_sm90(x[:m], packed, out_f32=out_f32, route=f"{tile}_split"))
                got = host(gemm_sm90(x[:m], packed, out_f32=out_f32, route=f"{tile}_csplit",
                                     out=poisoned((m, n), dtype)))  # fmt: skip
                assert np.array_equal(got.view(dtype), want.view(dtype)), (k, n, m, tile, out_f32)
            if n == 3072:
                want = host(gemm_sm90(x[:m], gated, gated=True, route=f"{tile}_split"))
                got = host(gemm_sm90(x[:m], gated, gated=True, route=f"{tile}_csplit",
                                     out=poisoned((m, n // 2), np.uint16)))  # fmt: skip
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (m, tile)


@pytest.mark.usefixtures("hopper")
def test_the_cluster_split_engine_changes_no_logit(default_model_dir, monkeypatch) -> None:
    """The default model (every projection split: S = 3 and 6) with CSPLIT_BY_DEFAULT on
    against the default engine: the same tokens and logits bits for a prompt, its cached
    repeat and decode steps replayed as CUDA graphs (the cluster launches captured)."""
    prompt = np.random.default_rng(5).integers(100, 49000, size=150).tolist()
    assert_flag_changes_no_logit(default_model_dir, monkeypatch, "CSPLIT_BY_DEFAULT", [prompt],
                                 max_tokens=24, num_device_blocks=64)  # fmt: skip


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("k, n", [(576, 576), (1536, 576), (4096, 4096), (14336, 4096),
                                  (128, 576)])  # fmt: skip
def test_the_norm_epilogue_gives_add_rmsnorm_of_the_plain_product(rng, k: int, n: int) -> None:
    """The norm epilogue (gemm_sm90_plan.NORM_EPILOGUE_BY_DEFAULT, off until this runs) on
    the default model's o and down (S = 3, 6), Llama-3.1-8B's (split) and an unsplit weight
    (WHOLE), on the decode tile and the 64 x 128 tile, at M = 1 to EPILOGUE_MAX_ROWS:
    (summed, normed) bit-equal to the plain product followed by the add_rmsnorm kernel,
    then again (its counters left zero: a second launch on the same stream normalizes)."""
    from reprise.cuda import launchers
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, gemm_sm90_add_rmsnorm, prepare_weight
    from reprise.cuda.gemm_sm90_plan import EPILOGUE_MAX_ROWS

    w, pool = weights(rng, n, k), activations(rng, EPILOGUE_MAX_ROWS, k)
    residual = dev((rng.standard_normal((EPILOGUE_MAX_ROWS, n)) * 4).astype(np.float32))
    norm_weight = dev((1 + 0.25 * rng.standard_normal(n)).astype(np.float32).astype(w.dtype))
    packed, x = prepare_weight(dev(w)), dev(pool)
    routes = [None] if split_k(n, k) == 1 else ["decode_split", "m64_split"]
    for m in range(1, EPILOGUE_MAX_ROWS + 1):
        for route in routes:
            y = gemm_sm90(x[:m], packed, route=route)
            want = [host(a) for a in launchers.add_rmsnorm(residual[:m], y, norm_weight, 1e-5)]
            for _ in range(2):
                got = gemm_sm90_add_rmsnorm(x[:m], packed, residual[:m], norm_weight, 1e-5,
                                            route=route, fused=True)  # fmt: skip
                for g, wnt in zip((host(a) for a in got), want, strict=True):
                    dtype = np.uint32 if wnt.dtype == np.float32 else np.uint16
                    assert np.array_equal(g.view(dtype), wnt.view(dtype)), (k, n, m, route)


@pytest.mark.usefixtures("hopper")
def test_the_norm_epilogue_engine_changes_no_logit(default_model_dir, monkeypatch) -> None:
    """The default model with NORM_EPILOGUE_BY_DEFAULT on (its o and down projections each
    one launch with the add_rmsnorm after it, at decode) against the default engine: the
    same tokens and logits bits for a prompt, its cached repeat and decode steps replayed
    as CUDA graphs (the fused launches captured)."""
    prompt = np.random.default_rng(7).integers(100, 49000, size=150).tolist()
    assert_flag_changes_no_logit(default_model_dir, monkeypatch, "NORM_EPILOGUE_BY_DEFAULT",
                                 [prompt], max_tokens=24, num_device_blocks=64)  # fmt: skip


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("layout", [(9, 3, 64, 576), (32, 8, 128, 4096), (4, 2, 128, 128)],
                         ids=["default", "8b", "d128_S1"])  # fmt: skip
def test_the_rope_epilogue_gives_rope_kv_write_of_the_plain_product(rng, layout) -> None:
    """The rope epilogue (gemm_sm90_plan.ROPE_EPILOGUE_BY_DEFAULT, off until this runs) on
    the default model's qkv (S = 3), Llama-3.1-8B's (split) and an unsplit one (WHOLE), on
    the decode tile and the 64 x 128 tile, at M = 1 to EPILOGUE_MAX_ROWS: the queries and
    every byte of the cache bit-equal to the plain product followed by the rope_kv_write
    kernel, then again (its counters left zero)."""
    from reprise.cuda import launchers
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90, gemm_sm90_rope_kv_write, prepare_weight
    from reprise.cuda.gemm_sm90_plan import EPILOGUE_MAX_ROWS
    from reprise.cuda.kvcache import kv_cache_shape
    from reprise.cuda.rope import rope_table

    heads, kv_heads, head_dim, k = layout
    n = (heads + 2 * kv_heads) * head_dim
    w, pool = weights(rng, n, k), activations(rng, EPILOGUE_MAX_ROWS, k)
    packed, x = prepare_weight(dev(w)), dev(pool)
    cos, sin = (dev(t) for t in rope_table(head_dim, 4096, 500000.0))
    shape = kv_cache_shape(4, 3, kv_heads, 16, head_dim)
    start = rng.integers(0, 2**16, shape, dtype=np.uint16)
    routes = [None] if split_k(n, k) == 1 else ["decode_split", "m64_split"]
    for m in range(1, EPILOGUE_MAX_ROWS + 1):
        positions = dev(rng.integers(0, 4096, m).astype(np.int32))
        slots = dev(rng.choice(64, m, replace=False).astype(np.int64))
        for route in routes:
            want_cache = dev(start)
            qkv = gemm_sm90(x[:m], packed, route=route).reshape(m, -1, head_dim)
            want = host(launchers.rope_kv_write(qkv, positions, cos, sin, want_cache, 1, slots, heads))
            for _ in range(2):
                got_cache = dev(start)
                got = gemm_sm90_rope_kv_write(x[:m], packed, positions, cos, sin, got_cache, 1,
                                              slots, heads, route=route, fused=True)  # fmt: skip
                assert np.array_equal(host(got).view(np.uint16), want.view(np.uint16)), (m, route)
                assert np.array_equal(host(got_cache).view(np.uint16), host(want_cache).view(np.uint16))


@pytest.mark.usefixtures("hopper")
def test_the_rope_epilogue_engine_changes_no_logit(default_model_dir, monkeypatch) -> None:
    """The default model with ROPE_EPILOGUE_BY_DEFAULT on (its qkv projections writing the
    cache in their own launch at decode) against the default engine: the same tokens and
    logits bits for a prompt, its cached repeat and decode steps replayed as CUDA graphs."""
    prompt = np.random.default_rng(9).integers(100, 49000, size=150).tolist()
    assert_flag_changes_no_logit(default_model_dir, monkeypatch, "ROPE_EPILOGUE_BY_DEFAULT",
                                 [prompt], max_tokens=24, num_device_blocks=64)  # fmt: skip
