"""The GEMM's split-K and launch geometry (gemm_kernel.py): plain arithmetic, no device.

The kernels' own behaviour under these plans is tested on the emulator
(tests/test_kernels_emulated.py) and on a GPU (tests/test_gpu_gemm.py); the compiled
resources behind SKINNY_CTAS_PER_SM in tests/test_kernels_compile.py.
"""

from __future__ import annotations

import pytest

from reprise.cuda.gemm_kernel import (
    CONFIGS,
    MIN_SPLIT_LENGTH,
    REFERENCE_SMS,
    SKINNY,
    SKINNY_CTAS_PER_SM,
    SPLIT_GRANULE,
    ctas_per_sm,
    launch_plan,
    num_splits,
    split_k,
    split_length,
)

# Llama-3.1-8B's projections as the model runs them: (N, K)
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336), "lm_head": (128256, 4096)}  # fmt: skip
OTHER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),  # smollm2-135m
                (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),  # llama-3.2-1b
                (37, 16), (5, 48), (257, 64), (100, 4112)]  # fmt: skip


def test_every_tile_walks_whole_k_tiles_of_a_split() -> None:
    assert all(SPLIT_GRANULE % c.block_k == 0 for c in CONFIGS)
    assert MIN_SPLIT_LENGTH % SPLIT_GRANULE == 0


@pytest.mark.parametrize("n, k", [*LLAMA_8B.values(), *OTHER_SHAPES])
def test_split_k_cuts_k_exactly_into_granules(n: int, k: int) -> None:
    splits = split_k(n, k)
    length = split_length(k, splits)
    assert splits >= 1 and length % SPLIT_GRANULE == 0
    assert num_splits(k, length) == splits  # S splits, the last one non-empty
    assert (splits - 1) * length < k <= splits * length
    assert splits == 1 or length >= MIN_SPLIT_LENGTH
    assert split_k(n, k) == splits  # a function of the shape alone


@pytest.mark.parametrize("name", LLAMA_8B)
def test_the_8b_skinny_grid_fills_one_wave_at_m_1(name: str) -> None:
    """At M = 1 the launch (the skinny split route, or the skinny kernel when S = 1) fits
    in one wave of REFERENCE_SMS * SKINNY_CTAS_PER_SM CTAs, more than half full, and one
    more split would spill into a second wave (an unsplit grid may exceed a wave: it
    cannot be cut finer than its column tiles)."""
    n, k = LLAMA_8B[name]
    splits = split_k(n, k)
    plan = launch_plan(1, n, k, splits, out_f32=name == "lm_head")
    ctas = plan.grid[0] * plan.grid[1]
    wave = REFERENCE_SMS * SKINNY_CTAS_PER_SM
    tiles = -(-n // SKINNY.block_n)
    assert plan.threads == SKINNY.num_threads and plan.smem_bytes == SKINNY.smem_bytes
    assert plan.split_workspace == (splits > 1)
    assert ctas == tiles * splits
    assert ctas <= wave or splits == 1, (name, splits, ctas)
    assert ctas > wave // 2, (name, splits, ctas)
    assert tiles * (splits + 1) > wave, (name, splits, ctas)


def test_the_8b_splits_are_these() -> None:
    """Pinned: a change of a weight's split changes its bits (and the logits of every
    model that holds it), so it must be deliberate."""
    assert {name: split_k(*shape) for name, shape in LLAMA_8B.items()} == {
        "qkv": 2, "o": 4, "gate_up": 1, "down": 4, "lm_head": 1
    }  # fmt: skip


def test_launch_plan_routes() -> None:
    """S = 1: the WHOLE kernel of the tile M picks; S > 1: the skinny split route
    (M <= 16; one CTA per split and tile) or the FOLD kernel (mid, big)."""
    whole = launch_plan(1, 100, 256, 1, out_f32=False)
    assert (whole.kernel, whole.grid, whole.split_workspace) == ("gemm_bf16_skinny", (1, 2), False)
    split = launch_plan(3, 100, 1024, 4, out_f32=True)
    assert (split.kernel, split.grid, split.split_workspace) == (
        "gemm_f32_skinny_split",
        (4, 2),
        True,
    )
    fold = launch_plan(17, 100, 1024, 4, out_f32=False)
    assert (fold.kernel, fold.grid, fold.split_workspace) == ("gemm_bf16_mid_fold", (1, 2), False)
    fold = launch_plan(300, 100, 1024, 4, out_f32=True)
    assert (fold.kernel, fold.grid) == ("gemm_f32_big_fold", (3, 1))
    split = launch_plan(40, 100, 1024, 4, out_f32=True, config=SKINNY)
    assert split.grid == (3 * 4, 2)  # blockIdx.x = split * m tiles + m tile


def test_launch_plan_refuses_an_n_past_the_grid() -> None:
    with pytest.raises(ValueError, match="N must be at most"):
        launch_plan(1, 65536 * 64, 256, 1, out_f32=False)


def test_split_length_refuses_nonpositive_counts() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        split_length(256, 0)
    with pytest.raises(ValueError, match="must be positive"):
        split_k(0, 256)


def test_ctas_per_sm_takes_the_tightest_limit() -> None:
    assert ctas_per_sm(128, 96, SKINNY.smem_bytes, "sm_90") == 2  # shared memory: 2 x 88 KiB
    assert ctas_per_sm(128, 96, SKINNY.smem_bytes, "sm_80") == 1
    assert ctas_per_sm(256, 165, 0) == 1  # registers: 168 x 256 = 43,008 of 65,536
    assert ctas_per_sm(256, 128, 0) == 2
    assert ctas_per_sm(1024, 32, 0) == 2  # threads
    assert ctas_per_sm(32, 16, 0) == 32  # the CTA cap
    with pytest.raises(ValueError, match="arch must be one of"):
        ctas_per_sm(128, 32, 0, "sm_70")
