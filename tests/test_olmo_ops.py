"""OLMo 2's two ops beside the Llama ones: head_rmsnorm's full-width form (q_norm and
k_norm over all the query heads and over all the key heads, not head by head) and
norm_add (the post-norm: the residual plus the normalized layer output, and that sum in
BF16, the next layer's input).

Each twin against its definition, and each kernel through its launcher under the
emulated CuPy (tests/kernel_emu/emucupy.py) and on a device where there is one: the
bits of the rmsnorm kernel on the same rows (rmsnorm.cuh's one tree), and within a BF16
ulp of the twin (whose sums run in NumPy's order; bit for bit on most rows).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import needs_gpu
from test_gemma_ops import bits, emulated  # noqa: F401 (a fixture)

from reprise.cuda import launchers
from reprise.cuda.backend import NumpyBackend
from reprise.cuda.dtypes import BF16, F32, to_bf16, to_f32
from reprise.cuda.rmsnorm import head_rmsnorm_ref, norm_add_ref, rmsnorm_ref

pytestmark = pytest.mark.kernels

EPS = 1e-6
# (num_heads, kv_heads, head_dim): query rows of 256 to 4,096 elements (held in
# registers), OLMo 2 32B's 5,120 (past them: the looping path) and qk_rmsnorm's widest
FULL_WIDTH = [(4, 2, 64), (9, 3, 64), (32, 8, 128), (40, 8, 128)]
WIDEST = (launchers.QK_RMSNORM_MAX_WIDTH // 128, 8, 128)
# small rows, OLMo 2 7B's hidden (4,096: the widest the registers hold) and a row past it
HIDDEN = [64, 576, 4096, 5000]


def random_qkv(rng: np.random.Generator, tokens: int, heads: int, head_dim: int) -> np.ndarray:
    """[tokens, heads, head_dim] BF16, a scale a head: normalizing each head alone and
    normalizing the whole row give far apart results."""
    scales = np.exp2(rng.integers(-4, 5, (tokens, heads, 1)))
    return (rng.standard_normal((tokens, heads, head_dim)) * scales).astype(BF16)


def ulps_apart(got: np.ndarray, want: np.ndarray) -> int:
    """The largest difference in BF16 bit patterns (ulps, for values of one sign)."""
    return int(np.abs(bits(got).astype(np.int32) - bits(want).astype(np.int32)).max())


# ---- head_rmsnorm's full-width form -------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), FULL_WIDTH)
def test_the_full_width_twin_is_the_definition(
    rng: np.random.Generator, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Weights as long as all the query heads and all the key heads: each token's queries
    normalized as one row (the mean of squares over all its query heads), its keys as
    another, in float64 here; the twin within one BF16 ulp of that, and the values' bits
    kept."""
    tokens = 5
    qkv = random_qkv(rng, tokens, heads + 2 * kv_heads, head_dim)
    q_w = (rng.standard_normal(heads * head_dim) + 1).astype(BF16)
    k_w = (rng.standard_normal(kv_heads * head_dim) + 1).astype(BF16)
    out = head_rmsnorm_ref(qkv, q_w, k_w, heads, EPS)
    assert np.array_equal(bits(out[:, heads + kv_heads :]), bits(qkv[:, heads + kv_heads :]))
    x = qkv.astype(np.float64)
    for part, weight in ((slice(0, heads), q_w), (slice(heads, heads + kv_heads), k_w)):
        row = x[:, part].reshape(tokens, -1)
        exact = row / np.sqrt((row**2).mean(axis=1, keepdims=True) + EPS)
        exact *= weight.astype(np.float64)
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 7)
        got = out[:, part].reshape(tokens, -1).astype(np.float64)
        assert np.all(np.abs(got - exact) <= ulp)


def check_full_width(rng: np.random.Generator, heads: int, kv_heads: int, head_dim: int) -> None:
    """The launcher's full-width form on the current CuPy (emulated, or a device), in
    place: the queries and the keys the rmsnorm kernel's bits on the same rows, within an
    ulp of the twin; the values' bits kept."""
    from reprise.cuda.kernels import to_device, to_host

    tokens = 3
    qkv = random_qkv(rng, tokens, heads + 2 * kv_heads, head_dim)
    q_w = (rng.standard_normal(heads * head_dim) + 1).astype(BF16)
    k_w = (rng.standard_normal(kv_heads * head_dim) + 1).astype(BF16)
    device = to_device(qkv)
    assert launchers.head_rmsnorm(device, to_device(q_w), to_device(k_w), heads, EPS) is device
    got = to_host(device)
    assert np.array_equal(bits(got[:, heads + kv_heads :]), bits(qkv[:, heads + kv_heads :]))
    for start, count, weight in ((0, heads, q_w), (heads, kv_heads, k_w)):
        rows = qkv[:, start : start + count].reshape(tokens, -1)
        alone = to_host(launchers.rmsnorm(to_device(to_f32(rows)), to_device(weight), EPS))
        assert np.array_equal(bits(got[:, start : start + count].reshape(tokens, -1)), bits(alone))
    assert ulps_apart(got, head_rmsnorm_ref(qkv, q_w, k_w, heads, EPS)) <= 1


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [*FULL_WIDTH, WIDEST])
@pytest.mark.usefixtures("emulated")
def test_the_full_width_kernel_is_rmsnorm_of_the_whole_rows(
    rng: np.random.Generator, heads: int, kv_heads: int, head_dim: int
) -> None:
    check_full_width(rng, heads, kv_heads, head_dim)


@pytest.mark.usefixtures("emulated")
def test_the_per_head_form_is_as_it_was(rng: np.random.Generator) -> None:
    """[head_dim] weights: each query and key head normalized alone (Qwen3's), the rmsnorm
    kernel's bits on each head's row."""
    from reprise.cuda.kernels import to_device, to_host

    tokens, heads, kv_heads, head_dim = 3, 4, 2, 64
    qkv = random_qkv(rng, tokens, heads + 2 * kv_heads, head_dim)
    q_w, k_w = (rng.standard_normal((2, head_dim)) + 1).astype(BF16)
    device = to_device(qkv)
    got = to_host(launchers.head_rmsnorm(device, to_device(q_w), to_device(k_w), heads, EPS))
    assert np.array_equal(bits(got[:, heads + kv_heads :]), bits(qkv[:, heads + kv_heads :]))
    for part, weight in ((slice(0, heads), q_w), (slice(heads, heads + kv_heads), k_w)):
        rows = qkv[:, part].reshape(-1, head_dim)
        alone = to_host(launchers.rmsnorm(to_device(to_f32(rows)), to_device(weight), EPS))
        assert np.array_equal(bits(got[:, part].reshape(-1, head_dim)), bits(alone))
    assert ulps_apart(got, head_rmsnorm_ref(qkv, q_w, k_w, heads, EPS)) <= 1


@pytest.mark.usefixtures("emulated")
def test_weights_of_other_lengths_are_refused() -> None:
    from reprise.cuda.kernels import to_device

    heads, kv_heads, head_dim = 4, 2, 64
    qkv = to_device(np.zeros((2, heads + 2 * kv_heads, head_dim), BF16))

    def weights(q: int, k: int) -> tuple:
        return to_device(np.ones(q, BF16)), to_device(np.ones(k, BF16))

    for q, k in [(heads * head_dim, head_dim), (head_dim, kv_heads * head_dim), (32, 32),
                 (heads * head_dim, heads * head_dim)]:  # fmt: skip
        with pytest.raises(
            ValueError, match=rf"q_weight and k_weight must have 64 elements each .head_dim., "
            rf"or 256 and 128 .all the query heads, all the key heads.; got {q} and {k}$"
        ):  # fmt: skip
            launchers.head_rmsnorm(qkv, *weights(q, k), heads, EPS)
    heads = WIDEST[0] + 1  # one head past qk_rmsnorm's widest row
    qkv = to_device(np.zeros((1, heads + 2 * 8, 128), BF16))
    with pytest.raises(ValueError, match=r"num_heads \* head_dim must be at most 12288; got 12416"):
        launchers.head_rmsnorm(qkv, *weights(heads * 128, 8 * 128), heads, EPS)
    qkv = to_device(np.zeros((1, 4, 512), BF16))  # per-head rows past a CTA's threads
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\]; got 512"):
        launchers.head_rmsnorm(qkv, *weights(512, 512), 2, EPS)


# ---- norm_add -----------------------------------------------------------------------


def norm_add_inputs(
    rng: np.random.Generator, rows: int, hidden: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(residual fp32, delta BF16 at a scale a row, delta_weight BF16)."""
    residual = (rng.standard_normal((rows, hidden)) * 30).astype(F32)
    delta = rng.standard_normal((rows, hidden)) * np.exp2(rng.integers(-6, 7, (rows, 1)))
    return residual, delta.astype(BF16), (rng.standard_normal(hidden) + 1).astype(BF16)


def test_the_norm_add_twin_is_its_definition(rng: np.random.Generator) -> None:
    """The residual plus rmsnorm(delta) (rounded to BF16, then added in fp32), and that
    sum rounded once to BF16; with no delta the residual itself."""
    residual, delta, weight = norm_add_inputs(rng, 4, 576)
    summed, out = norm_add_ref(residual, delta, weight, EPS)
    assert summed.dtype == F32 and out.dtype == BF16
    assert np.array_equal(bits(summed), bits(residual + to_f32(rmsnorm_ref(delta, weight, EPS))))
    assert np.array_equal(bits(out), bits(to_bf16(summed)))
    summed, out = norm_add_ref(residual, None, None, EPS)
    assert np.array_equal(bits(summed), bits(residual))
    assert np.array_equal(bits(out), bits(to_bf16(residual)))


def check_norm_add(rng: np.random.Generator, hidden: int, with_delta: bool) -> None:
    """The launcher on the current CuPy (emulated, or a device): the sum is the residual
    plus the rmsnorm kernel's bits (exactly), the BF16 output that sum's rounding; the twin
    within an ulp of the normalized delta, and its bits on the rows the rmsnorm kernel
    gives the twin's; with no delta the twin's bits."""
    from reprise.cuda.kernels import to_device, to_host

    rows = 5
    residual, delta, weight = norm_add_inputs(rng, rows, hidden)
    if not with_delta:
        summed, out = (to_host(a) for a in launchers.norm_add(to_device(residual), None, None, EPS))
        want_summed, want_out = norm_add_ref(residual, None, None, EPS)
        assert np.array_equal(bits(summed), bits(want_summed))
        assert np.array_equal(bits(out), bits(want_out))
        return
    dev_weight = to_device(weight)
    summed, out = (
        to_host(a)
        for a in launchers.norm_add(to_device(residual), to_device(delta), dev_weight, EPS)
    )
    normed = to_host(launchers.rmsnorm(to_device(to_f32(delta)), dev_weight, EPS))
    assert np.array_equal(bits(summed), bits(residual + to_f32(normed)))
    assert np.array_equal(bits(out), bits(to_bf16(summed)))
    twin_normed = rmsnorm_ref(delta, weight, EPS)
    assert ulps_apart(normed, twin_normed) <= 1
    same = np.all(bits(normed) == bits(twin_normed), axis=1)
    assert same.any()  # about a row in a hundred differs by an ulp
    want_summed, want_out = norm_add_ref(residual, delta, weight, EPS)
    assert np.array_equal(bits(summed[same]), bits(want_summed[same]))
    assert np.array_equal(bits(out[same]), bits(want_out[same]))


@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.usefixtures("emulated")
def test_the_norm_add_kernel_is_its_twin(
    rng: np.random.Generator, hidden: int, with_delta: bool
) -> None:
    check_norm_add(rng, hidden, with_delta)


@pytest.mark.usefixtures("emulated")
def test_norm_add_refuses_a_delta_without_its_weight() -> None:
    from reprise.cuda.kernels import to_device

    residual = to_device(np.zeros((2, 64), F32))
    delta = to_device(np.zeros((2, 64), BF16))
    with pytest.raises(ValueError, match="delta and delta_weight must be given together"):
        launchers.norm_add(residual, delta, None, EPS)
    with pytest.raises(ValueError, match=r"weight must have 64 elements; got 32"):
        launchers.norm_add(residual, delta, to_device(np.zeros(32, BF16)), EPS)


def test_the_backends_have_both_ops() -> None:
    from reprise.cuda.cupy_backend import CupyBackend

    assert CupyBackend.norm_add is launchers.norm_add
    assert NumpyBackend.norm_add is norm_add_ref
    assert CupyBackend.head_rmsnorm is launchers.head_rmsnorm
    assert NumpyBackend.head_rmsnorm is head_rmsnorm_ref


# ---- on a device ----------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [*FULL_WIDTH, WIDEST])
def test_the_full_width_kernel_on_the_gpu(
    rng: np.random.Generator, heads: int, kv_heads: int, head_dim: int
) -> None:
    check_full_width(rng, heads, kv_heads, head_dim)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_the_norm_add_kernel_on_the_gpu(
    rng: np.random.Generator, hidden: int, with_delta: bool
) -> None:
    check_norm_add(rng, hidden, with_delta)
