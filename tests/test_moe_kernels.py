"""The mixture-of-experts kernels (cuda/moe.cu, gemm.cu's moe_gemm_*) through their
launchers (cuda/moe_kernel.py) against their twins (cuda/moe.py), bit for bit, under the
emulated CuPy (tests/kernel_emu/emucupy.py: the `.cu` sources compiled for the host), on
fresh random inputs with every output allocated poisoned: the routing with exact ties
and special values, the gather, the combine with and without a shared expert, the
grouped GEMM's rows against the unsplit GEMM of each row alone (and within BF16 rounding
of the twin) whatever the step's other tokens; launch grids that do not depend on the
routing, so a captured MoE layer replays for any. The `gpu` tests run the same on a
device (its double exp, -ftz=true), or emulated with REPRISE_EMULATE_GPU=1.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gpu_support import needs_gpu
from kernel_emu import emucupy
from test_kernels_emulated import max_row_ulps

from reprise.cuda import gemm_kernel, kernels, moe_kernel, nvrtc, pdl
from reprise.cuda.dtypes import BF16, F32
from reprise.cuda.kernels import to_device, to_host
from reprise.cuda.moe import (
    MoeRoute,
    moe_combine_ref,
    moe_gather_ref,
    moe_gemm_ref,
    moe_route_ref,
    moe_tile_starts_ref,
)

pytestmark = pytest.mark.kernels

ROUTE_FIELDS = ("expert_ids", "weights", "offsets", "token_of_row", "row_of_slot")
# BF16 values drawn for exact ties (-0 and +0 among them: a tie too)
TIE_VALUES = np.array([-3.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0], dtype=F32)


def poison_empty(mp: pytest.MonkeyPatch) -> None:
    """From now on `cupy.empty` (what the launchers allocate their outputs with) hands out
    all-ones bytes (NaN for BF16 and fp32, -1 for ints): an element left unwritten shows."""
    import cupy

    real = cupy.empty

    def empty(shape: Any, dtype: Any = np.float64, order: str = "C") -> Any:
        out = real(shape, dtype=dtype)
        out.view(np.uint8).fill(0xFF)
        return out

    mp.setattr(cupy, "empty", empty)


@pytest.fixture
def emulated(emu_lib: ctypes.CDLL) -> Iterator[None]:
    """`import cupy` is the emulation for the test (as test_gemma_ops' fixture; kernels a
    real CuPy compiled are forgotten before and after)."""
    with pytest.MonkeyPatch.context() as mp:
        kernels.module.cache_clear()
        gemm_kernel._kernel.cache_clear()
        emucupy.install(emu_lib, mp.setitem)
        yield
        kernels.module.cache_clear()
        gemm_kernel._kernel.cache_clear()


@pytest.fixture
def poisoned(emulated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulation, its outputs allocated poisoned."""
    poison_empty(monkeypatch)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]) if a.dtype != np.int32 else a


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bits, but any NaN for a NaN (payloads differ between CPUs and GPUs)."""
    if got.shape != want.shape:
        return False
    if got.dtype.kind == "f" or got.dtype == BF16:
        nan = np.isnan(want.astype(F32))
        return bool(np.array_equal(np.isnan(got.astype(F32)), nan)) and bool(
            np.array_equal(bits(got)[~nan], bits(want)[~nan])
        )
    return bool(np.array_equal(got, want))


def host_route(route: MoeRoute) -> MoeRoute:
    fields = (to_host(getattr(route, f)) for f in ROUTE_FIELDS)
    return MoeRoute(*fields, tile_starts=to_host(route.tile_starts), tile_rows=route.tile_rows)


def assert_same_route(got: MoeRoute, want: MoeRoute) -> None:
    """The twin's five arrays, and the device's m tiles numbered as moe_tile_starts_ref
    numbers them for the route's tile."""
    assert got.tile_rows in (16, 64, 128)
    tiles = moe_tile_starts_ref(want.offsets, got.tile_rows)
    assert np.array_equal(got.tile_starts, tiles), (got.tile_starts, tiles)
    for field in ROUTE_FIELDS:
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == w.dtype, (field, g.dtype, w.dtype)
        assert same_bits(g, w), (field, g, w)


def random_logits(
    rng: np.random.Generator, num_tokens: int, num_experts: int, ties: bool
) -> np.ndarray:
    if ties:
        return rng.choice(TIE_VALUES, (num_tokens, num_experts)).astype(BF16)
    scale = np.exp2(rng.integers(-2, 3, (num_tokens, 1)))
    return (rng.standard_normal((num_tokens, num_experts)) * scale).astype(BF16)


def activations(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return (rng.standard_normal((rows, width)) * np.exp2(rng.integers(-4, 5, (rows, 1)))).astype(
        BF16
    )


def expert_stack(rng: np.random.Generator, num_experts: int, n: int, k: int) -> np.ndarray:
    return (rng.standard_normal((num_experts, n, k)) * 0.25).astype(BF16)


# ---- routing --------------------------------------------------------------------------

# and T * k past one chunk of moe_route_rows' (1,024 pairs): 2,400 and 1,200 pairs
ROUTE_SHAPES = [(t, e, k) for t in (1, 7, 33) for e in (8, 60, 128) for k in (1, 2, 8)]
ROUTE_SHAPES += [(300, 60, 8), (300, 8, 4)]


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k", ROUTE_SHAPES, ids=lambda v: str(v)
)  # fmt: skip
def test_route_is_its_twin_bit_for_bit(
    poisoned: None, rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int
) -> None:
    """All five arrays, exactly: continuous logits (their BF16 values collide now and
    then) and logits drawn from eight values (ties everywhere, -0 beside +0), both
    softmaxes."""
    for ties in (False, True):
        logits = random_logits(rng, num_tokens, num_experts, ties)
        for normalize in (False, True):
            got = moe_kernel.moe_route(to_device(logits), top_k, normalize)
            assert_same_route(host_route(got), moe_route_ref(logits, top_k, normalize))


@pytest.mark.parametrize("order", [1, 2])
def test_route_does_not_depend_on_the_thread_schedule(
    poisoned: None, emu_lib: ctypes.CDLL, rng: np.random.Generator, order: int
) -> None:
    """Each warp run alone as far as it goes (first to last, last to first: a schedule a
    GPU may run), CTAs last to first: the same route; a scratch word reused without a
    barrier between (moe_route_rows' chunks) gives another."""
    logits = random_logits(rng, 300, 60, ties=True)
    emu_lib.set_warp_major(order)
    emu_lib.set_reversed_ctas(1)
    try:
        got = host_route(moe_kernel.moe_route(to_device(logits), 8, False))
    finally:
        emu_lib.set_warp_major(0)
        emu_lib.set_reversed_ctas(0)
    assert_same_route(got, moe_route_ref(logits, 8, False))


def test_route_orders_special_values_as_the_twin(poisoned: None) -> None:
    """NaN below -inf (and a NaN row's weights NaN), +inf first, subnormal logits by
    value (an fp32 compare under -ftz=true would tie them), -0 tied with +0, and weights
    that are fp32 subnormals (a 100 logit gap) kept, not flushed."""
    f = np.float32
    tiny = f(2.0**-130)  # a BF16 subnormal
    rows = [
        [np.nan, 1.0, 2.0, np.nan, -np.inf, 0.5, -1.0, 3.0],
        [-np.inf, -np.inf, 0.5, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf],
        [np.inf, 3.0, 1.0, 0.0, -1.0, 2.0, np.inf, 0.0],
        [tiny, 2 * tiny, -tiny, 0.0, -0.0, 3 * tiny, -2 * tiny, tiny],
        [-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0],
        [0.0, -100.0, -90.0, -200.0, 1.0, -95.0, -1000.0, -0.0],
        [np.nan] * 8,
    ]
    logits = np.array(rows, dtype=F32).astype(BF16)
    for top_k in (1, 3, 8):
        for normalize in (False, True):
            with np.errstate(invalid="ignore"):  # inf - inf: the twin's NaN weights
                want = moe_route_ref(logits, top_k, normalize)
            got = moe_kernel.moe_route(to_device(logits), top_k, normalize)
            assert_same_route(host_route(got), want)
    with np.errstate(invalid="ignore"):
        want = moe_route_ref(logits, 8, False)
    subnormal = want.weights[5, 3:6]  # logits 90, 95 and 100 below the top one
    assert np.all((subnormal > 0) & (subnormal < np.finfo(F32).tiny)), subnormal
    assert list(want.expert_ids[3, :3]) == [5, 1, 0]  # 3, 2, 1 times the least subnormal


# ---- gather and combine ---------------------------------------------------------------


def misaligned(a: np.ndarray) -> Any:
    """A C-contiguous device copy of `a` starting 2 bytes past a 16-byte boundary."""
    import cupy

    buf = cupy.empty(a.size + 8, dtype=np.uint16)
    view = buf[1 : 1 + a.size].reshape(a.shape)
    view[...] = to_device(a)
    assert view.flags.c_contiguous and view.data.ptr % 16 != 0
    return view


@pytest.mark.parametrize("hidden", [96, 100])  # 16-byte copies, and one element at a time
def test_gather_is_its_twin(poisoned: None, rng: np.random.Generator, hidden: int) -> None:
    num_tokens, num_experts, top_k = 7, 8, 2
    logits = random_logits(rng, num_tokens, num_experts, ties=False)
    route = moe_kernel.moe_route(to_device(logits), top_k, True)
    want = moe_gather_ref(
        x := activations(rng, num_tokens, hidden), moe_route_ref(logits, top_k, True)
    )
    for device_x in (to_device(x), misaligned(x)):
        got = to_host(moe_kernel.moe_gather(device_x, route))
        assert np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("hidden", [96, 100])
@pytest.mark.parametrize("top_k", [2, 8])
def test_combine_is_its_twin_bit_for_bit(
    poisoned: None, rng: np.random.Generator, hidden: int, top_k: int
) -> None:
    """The weighted sum in slot order, with and without the gated shared expert (gate
    logits far out on both sides among them), on aligned and misaligned outputs of the
    experts. The first three tokens' three best experts tie, and their second slot's row
    is the first's negated: w * y - w * y is +0 with each product rounded (the twin's),
    the first product's rounding error with a fused multiply-add (w = 1/3, not exact)."""
    num_tokens, num_experts = 9, 8
    for normalize in (False, True):
        logits = random_logits(rng, num_tokens, num_experts, ties=False)
        logits[:3, 2:5] = 100.0  # three tied above the rest: weights 1/3 without normalize
        route = moe_kernel.moe_route(to_device(logits), top_k, normalize)
        ref_route = moe_route_ref(logits, top_k, normalize)
        ys = activations(rng, num_tokens * top_k, hidden)
        rows = ref_route.row_of_slot.reshape(num_tokens, top_k)
        ys[rows[:3, 1]] = -ys[rows[:3, 0]]
        shared = activations(rng, num_tokens, hidden)
        gate = (rng.standard_normal((num_tokens, 1)) * 4).astype(BF16)
        gate[:3, 0] = [-100.0, 100.0, 0.0]
        for device_ys in (to_device(ys), misaligned(ys)):
            got = to_host(moe_kernel.moe_combine(device_ys, route))
            want = moe_combine_ref(ys, ref_route)
            assert top_k > 2 or not want[:3].astype(F32).any()  # cancelled exactly
            assert np.array_equal(bits(got), bits(want))
            got = moe_kernel.moe_combine(device_ys, route, to_device(shared), to_device(gate))
            want = moe_combine_ref(ys, ref_route, shared, gate)
            assert np.array_equal(bits(to_host(got)), bits(want))


# ---- the grouped GEMM -----------------------------------------------------------------

N, K = 72, 80  # tails: N past a 64-wide tile, K not a whole 128- or 32-wide k-tile


def lopsided_logits(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    """4 experts: 0 every token's first, 3 never chosen (k = 2), 1 and 2 sharing the rest."""
    logits = rng.standard_normal((num_tokens, 4)).astype(F32)
    logits[:, 0] = 10.0
    logits[:, 3] = -10.0
    return logits.astype(BF16)


def row_experts(offsets: np.ndarray) -> np.ndarray:
    """The expert of each grouped row."""
    return np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))


def test_grouped_gemm_rows_are_the_unsplit_gemm_of_each_row_alone(
    poisoned: None, rng: np.random.Generator
) -> None:
    """Every grouped row bit-equals gemm.cu's unsplit GEMM of that row alone (M = 1, the
    launcher's tile for it) against its expert's weight, and lies within BF16 rounding of
    the twin; an expert with every token's row and one with none among them."""
    num_tokens, top_k = 9, 2
    logits = lopsided_logits(rng, num_tokens)
    route = moe_kernel.moe_route(to_device(logits), top_k, True)
    offsets = to_host(route.offsets)
    counts = np.diff(offsets)
    assert counts[0] == num_tokens and counts[3] == 0 and counts.sum() == num_tokens * top_k
    x = activations(rng, num_tokens, K)
    w = expert_stack(rng, 4, N, K)
    xs = moe_kernel.moe_gather(to_device(x), route)
    got = to_host(moe_kernel.moe_gemm(xs, to_device(w), route))
    host_xs = to_host(xs)
    assert max_row_ulps(got, moe_gemm_ref(host_xs, list(w), offsets)) <= 1
    for row, expert in enumerate(row_experts(offsets)):
        alone = gemm_kernel.gemm(to_device(host_xs[row : row + 1]), to_device(w[expert]), splits=1)
        assert np.array_equal(bits(got[row]), bits(to_host(alone)[0])), row


@pytest.mark.parametrize("normalize", [False, True])
def test_a_tokens_rows_do_not_depend_on_the_other_tokens(
    poisoned: None, rng: np.random.Generator, normalize: bool
) -> None:
    """One token's expert outputs, alone and last among 1, 40, 69 and 129 others (the
    steps take every tile: skinny, mid, and big with an expert's rows past its first m
    tile), so at other row offsets among other rows of its experts: the unsplit GEMM's
    bits of its row alone, every time; and its output row of the combine likewise."""
    top_k = 2
    x0 = activations(rng, 1, K)
    l0 = lopsided_logits(rng, 1)
    w = expert_stack(rng, 4, N, K)
    device_w = to_device(w)
    alone = [
        bits(to_host(gemm_kernel.gemm(to_device(x0), to_device(w[e]), splits=1))[0])
        for e in moe_route_ref(l0, top_k, normalize).expert_ids[0]
    ]
    places, outs = set(), []
    for num_tokens in (1, 2, 41, 70, 130):
        at = num_tokens - 1  # the token's place in the step
        x = activations(rng, num_tokens, K)
        logits = lopsided_logits(rng, num_tokens)
        x[at], logits[at] = x0[0], l0[0]
        route = moe_kernel.moe_route(to_device(logits), top_k, normalize)
        ys = moe_kernel.moe_gemm(moe_kernel.moe_gather(to_device(x), route), device_w, route)
        rows = to_host(route.row_of_slot)[at * top_k : (at + 1) * top_k]
        places.add(tuple(rows))
        for slot, row in enumerate(rows):
            assert np.array_equal(bits(to_host(ys)[row]), alone[slot]), (num_tokens, slot)
        outs.append(bits(to_host(moe_kernel.moe_combine(ys, route))[at]))
    assert len(places) == 5
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])


# ---- launches: what a CUDA graph captures ---------------------------------------------


def moe_layer(
    ops: Any, logits: Any, x: Any, gate_up: Any, down: Any, shared: Any, gate: Any
) -> Any:
    """A Qwen2-MoE-like layer's expert part on `ops`: route, gather, gate/up, SwiGLU,
    down, combine with the shared expert's output."""
    route = ops.moe_route(logits, 2, False)
    h = ops.silu_mul(ops.moe_gemm(ops.moe_gather(x, route), gate_up, route))
    return ops.moe_combine(ops.moe_gemm(h, down, route), route, shared, gate)


def test_launch_grids_depend_on_the_shapes_alone(
    emulated: None, rng: np.random.Generator, monkeypatch
) -> None:
    """The same kernels, grids, blocks and shared memory for two routings of one step's
    shapes (every token to the same experts, and spread): (ceil(T / 4)), (E), (T * k),
    the GEMMs' (floor((R + min(E, R) (BM - 1)) / BM), ceil(N / BN)) for R = T * k rows and
    the skinny tile (BM 16: 6 rows an expert at most), (T)."""
    launches: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = []

    def record(fn: Any, grid: Any, block: Any, args: Any, *, shared_mem: int = 0) -> None:
        launches.append((fn.name, tuple(grid), tuple(block), shared_mem))
        kernels.launch_kernel(fn, grid, block, args, shared_mem=shared_mem)

    monkeypatch.setattr(moe_kernel, "launch_kernel", record)
    monkeypatch.setattr(gemm_kernel, "launch_kernel", record)
    from reprise.cuda.cupy_backend import CupyBackend

    ops = CupyBackend()
    num_tokens, num_experts, hidden, inter = 21, 8, 64, 48
    weights = [to_device(expert_stack(rng, num_experts, 2 * inter, hidden)),
               to_device(expert_stack(rng, num_experts, hidden, inter))]  # fmt: skip
    x, shared = (to_device(activations(rng, num_tokens, hidden)) for _ in range(2))
    gate = to_device(activations(rng, num_tokens, 1))
    seen = []
    for spread in (False, True):
        logits = random_logits(rng, num_tokens, num_experts, ties=False)
        if not spread:
            logits[:, :2] = 8.0
        launches.clear()
        moe_layer(ops, to_device(logits), x, *weights, shared, gate)
        seen.append([launch for launch in launches if launch[0].startswith("moe")])
    assert seen[0] == seen[1]
    skinny = gemm_kernel.SKINNY
    tiles = (num_tokens * 2 + num_experts * 15) // 16  # 10
    assert seen[0] == [
        ("moe_route_topk", (6,), (128,), 0),
        ("moe_route_rows", (num_experts,), (256,), 0),
        ("moe_gather", (num_tokens * 2,), (128,), 0),
        ("moe_gemm_bf16_skinny", (tiles, 2), (128,), skinny.smem_bytes),
        ("moe_gemm_bf16_skinny", (tiles, 1), (128,), skinny.smem_bytes),
        ("moe_combine", (num_tokens,), (128,), 0),
    ]


def test_a_captured_moe_layer_replays_for_any_routing(
    emulated: None, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer captured once into a CUDA graph (as programmatic dependents: every thread
    enters through pdl_enter before it reads what the kernel before it wrote), replayed on
    new logits and activations uploaded into its static buffers: the eager launches' bits,
    whose routing is the twin's."""
    from reprise.cuda.cupy_backend import CupyBackend

    monkeypatch.setattr(pdl, "active", lambda: "graphs")
    monkeypatch.setattr(pdl, "_driver", emucupy.PdlDriver())
    emucupy.watch_early_reads(monkeypatch)
    ops = CupyBackend()
    num_tokens, num_experts, hidden, inter = 5, 8, 64, 32
    weights = [ops.expert_weights(expert_stack(rng, num_experts, 2 * inter, hidden)),
               ops.expert_weights(expert_stack(rng, num_experts, hidden, inter))]  # fmt: skip
    buffers = {"logits": ops.zeros((num_tokens, num_experts), np.uint16),
               "x": ops.zeros((num_tokens, hidden), np.uint16),
               "shared": ops.zeros((num_tokens, hidden), np.uint16),
               "gate": ops.zeros((num_tokens, 1), np.uint16)}  # fmt: skip
    replay = ops.capture(lambda: moe_layer(ops, buffers["logits"], buffers["x"], *weights,
                                           buffers["shared"], buffers["gate"]))  # fmt: skip
    for _ in range(2):
        inputs = {"logits": random_logits(rng, num_tokens, num_experts, ties=False),
                  "x": activations(rng, num_tokens, hidden),
                  "shared": activations(rng, num_tokens, hidden),
                  "gate": activations(rng, num_tokens, 1)}  # fmt: skip
        for name, value in inputs.items():
            ops.upload(buffers[name], value.view(np.uint16))
        dependents = emucupy.pdl_launches()
        got = to_host(replay())
        assert emucupy.pdl_launches() - dependents == 7  # every launch of the layer
        eager = moe_layer(ops, *(to_device(inputs[n]) for n in ("logits", "x")), *weights,
                          to_device(inputs["shared"]), to_device(inputs["gate"]))  # fmt: skip
        assert np.array_equal(bits(got), bits(to_host(eager)))
        route = host_route(ops.moe_route(to_device(inputs["logits"]), 2, False))
        assert_same_route(route, moe_route_ref(inputs["logits"], 2, False))


def test_no_tokens_launch_nothing(emulated: None) -> None:
    """T = 0: empty outputs of the right shapes (offsets all zero), no kernel run."""
    before = emucupy.launches()
    route = moe_kernel.moe_route(to_device(np.zeros((0, 8), BF16)), 2, True)
    assert [getattr(route, f).shape for f in ROUTE_FIELDS] == [(0, 2), (0, 2), (9,), (0,), (0,)]
    assert not to_host(route.offsets).any()
    xs = moe_kernel.moe_gather(to_device(np.zeros((0, 32), BF16)), route)
    ys = moe_kernel.moe_gemm(xs, to_device(np.zeros((8, 48, 32), BF16)), route)
    out = moe_kernel.moe_combine(ys, route)
    assert (xs.shape, ys.shape, out.shape) == ((0, 32), (0, 48), (0, 48))
    assert emucupy.launches() == before


def test_bad_inputs_are_refused_with_the_reason(emulated: None) -> None:
    logits = to_device(np.zeros((3, 8), BF16))
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\] for 8 experts; got 9"):
        moe_kernel.moe_route(logits, 9, True)
    with pytest.raises(
        ValueError, match=r"expert count \(logits' columns\) must be in \[1, 256\]; got 300"
    ):
        moe_kernel.moe_route(to_device(np.zeros((3, 300), BF16)), 2, True)
    with pytest.raises(ValueError, match="logits must be a 2-d uint16 device array; got float32"):
        moe_kernel.moe_route(to_device(np.zeros((3, 8), F32)), 2, True)
    route = moe_kernel.moe_route(logits, 2, True)
    with pytest.raises(ValueError, match=r"x must have the route's 3 rows; got \(4, 16\)"):
        moe_kernel.moe_gather(to_device(np.zeros((4, 16), BF16)), route)
    xs = to_device(np.zeros((6, 24), BF16))
    with pytest.raises(ValueError, match="K must be a positive multiple of 16; got K = 24"):
        moe_kernel.moe_gemm(xs, to_device(np.zeros((8, 16, 24), BF16)), route)
    with pytest.raises(
        ValueError, match=r"experts must hold the route's 8 experts; got \(4, 16, 32\)"
    ):
        moe_kernel.moe_gemm(
            to_device(np.zeros((6, 32), BF16)), to_device(np.zeros((4, 16, 32), BF16)), route
        )
    with pytest.raises(ValueError, match="shared and shared_gate come together"):
        moe_kernel.moe_combine(xs, route, shared=to_device(np.zeros((3, 24), BF16)))
    with pytest.raises(ValueError, match=r"shared_gate must have shape \(3, 1\); got \(3, 2\)"):
        moe_kernel.moe_combine(
            xs, route, to_device(np.zeros((3, 24), BF16)), to_device(np.zeros((3, 2), BF16))
        )
    route.weights = route.weights[:, :1]
    with pytest.raises(ValueError, match=r"route\.weights must be C-contiguous"):
        moe_kernel.moe_combine(xs, route)


# ---- what the compiler made of them ----------------------------------------------------


@pytest.mark.parametrize("arch", nvrtc.ARCHS)
def test_no_moe_kernel_spills_and_the_grouped_gemm_keeps_its_occupancy(arch: str) -> None:
    """moe.cu's kernels and the grouped GEMM's take no local memory, and each grouped tile
    fits as many CTAs an SM as gemm.cu's plain kernel of its tile."""
    from test_kernels_compile import compiled, nvrtc_or_skip

    nvrtc_or_skip(arch)
    found = {}
    for name in ("moe.cu", "gemm.cu"):
        source = nvrtc.kernel_source(nvrtc.KERNEL_DIR / name)
        found.update(nvrtc.kernel_resources(compiled(source, name, arch).cubin))
    for name in nvrtc.kernel_names(nvrtc.kernel_source(nvrtc.KERNEL_DIR / "moe.cu")):
        assert found[name].local_bytes == 0, (name, found[name])
    for config in gemm_kernel.CONFIGS:
        grouped, plain = found[f"moe_gemm_bf16_{config.name}"], found[f"gemm_bf16_{config.name}"]
        assert grouped.local_bytes == 0, grouped
        fits = [
            gemm_kernel.ctas_per_sm(
                config.num_threads, used.registers, config.smem_bytes + used.shared_bytes, arch
            )
            for used in (grouped, plain)
        ]
        assert fits[0] == fits[1], (config.name, grouped.registers, plain.registers)


# ---- on a device: its double exp, -ftz=true and the tensor cores -----------------------


@pytest.fixture
def gpu_poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    poison_empty(monkeypatch)


def checked_grouped_gemm(
    ops: Any, xs: Any, w: np.ndarray, route: MoeRoute, sample: np.ndarray
) -> Any:
    """ops.moe_gemm(xs, w's device copy, route), checked: within BF16 rounding of the twin,
    and the `sample` rows each the unsplit GEMM of that row alone."""
    got = ops.moe_gemm(xs, ops.expert_weights(w), route)
    rows, ys, offsets = to_host(xs), to_host(got), to_host(route.offsets)
    assert max_row_ulps(ys, moe_gemm_ref(rows, list(w), offsets)) <= 1
    experts = row_experts(offsets)
    for r in sample:
        alone = gemm_kernel.gemm(to_device(rows[r : r + 1]), to_device(w[experts[r]]), splits=1)
        assert np.array_equal(bits(ys[r]), bits(to_host(alone)[0])), r
    return got


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("normalize", [False, True])
def test_a_moe_layer_on_the_gpu_is_its_twins(
    gpu_poisoned: None, rng: np.random.Generator, normalize: bool
) -> None:
    """A Qwen2-MoE-like layer (60 experts, 4 a token, a shared expert): the routing, the
    gather and the combine the twins' bits; each grouped GEMM within BF16 rounding of the
    twin and its rows the unsplit GEMM's of each row alone."""
    from reprise.cuda.cupy_backend import CupyBackend

    ops = CupyBackend()
    num_tokens, num_experts, top_k, hidden, inter = 37, 60, 4, 256, 128
    logits = random_logits(rng, num_tokens, num_experts, ties=False)
    logits[:5] = random_logits(rng, 5, num_experts, ties=True)
    x, shared = activations(rng, num_tokens, hidden), activations(rng, num_tokens, hidden)
    gate = (rng.standard_normal((num_tokens, 1)) * 3).astype(BF16)
    gate_up, down = (
        expert_stack(rng, num_experts, 2 * inter, hidden),
        expert_stack(rng, num_experts, hidden, inter),
    )

    route = ops.moe_route(to_device(logits), top_k, normalize)
    want_route = moe_route_ref(logits, top_k, normalize)
    assert_same_route(host_route(route), want_route)
    xs = ops.moe_gather(to_device(x), route)
    assert np.array_equal(bits(to_host(xs)), bits(moe_gather_ref(x, want_route)))
    sample = rng.choice(num_tokens * top_k, 12, replace=False)
    h = ops.silu_mul(checked_grouped_gemm(ops, xs, gate_up, route, sample))
    ys = checked_grouped_gemm(ops, h, down, route, sample)
    out = ops.moe_combine(ys, route, to_device(shared), to_device(gate))
    want = moe_combine_ref(to_host(ys), want_route, shared, gate)
    assert np.array_equal(bits(to_host(out)), bits(want))


@pytest.mark.gpu
@needs_gpu
def test_special_logits_on_the_gpu_route_as_the_twin(gpu_poisoned: None) -> None:
    """test_route_orders_special_values_as_the_twin where -ftz=true applies: subnormal
    logits still ordered by value, a subnormal weight still kept."""
    test_route_orders_special_values_as_the_twin(None)
