"""Gemma 3's two ops beside the Llama ones: gelu_tanh_mul (GeGLU, transformers'
"gelu_pytorch_tanh") and the scaled embedding (Gemma3TextScaledWordEmbedding).

Each twin against torch's BF16 arithmetic, and each kernel against its twin under the
emulated CuPy (tests/kernel_emu/emucupy.py: the launcher and the `.cu` source as the GPU
backend runs them). A BF16 input has 65,536 values, so gelu is checked on all of them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gpu_support import needs_gpu
from kernel_emu import emucupy

from reprise.cuda import kernels
from reprise.cuda.activation import GELU_BETA, GELU_KAPPA, gelu_tanh_mul_ref, gelu_tanh_ref
from reprise.cuda.backend import NumpyBackend
from reprise.cuda.dtypes import BF16, F32
from reprise.cuda.embedding import bf16_scale, embed_ref

pytestmark = pytest.mark.kernels

# Gemma 3's sqrt(hidden): 1B (1152), 4B (2560), 27B (5376); and a scale below 1
SCALES = [1152**0.5, 2560**0.5, 5376**0.5, 0.3]


def every_bf16() -> np.ndarray:
    """The 65,536 BF16 bit patterns, in order, as BF16 values (infinities and NaNs too)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype == BF16 else np.uint32)


def torch_bf16(a: np.ndarray) -> Any:
    """A BF16 array as a torch bfloat16 tensor, the same bits (torch is optional)."""
    import torch

    return torch.from_numpy(bits(a).view(np.int16).copy()).view(torch.bfloat16)


def from_torch(t: Any) -> np.ndarray:
    import torch

    return t.contiguous().view(torch.int16).numpy().view(np.uint16).view(BF16)


@pytest.fixture
def emulated(emu_lib: ctypes.CDLL) -> Iterator[None]:
    """`import cupy` is the emulation for the test (as in test_cupy_emulated: kernels a
    real CuPy compiled are forgotten before and after; per test, so that the GPU tests
    here get the real CuPy)."""
    with pytest.MonkeyPatch.context() as mp:
        kernels.module.cache_clear()
        kernels._stream_counters.cache_clear()
        emucupy.install(emu_lib, mp.setitem)
        yield
        kernels.module.cache_clear()
        kernels._stream_counters.cache_clear()


# ---- gelu_tanh_mul ------------------------------------------------------------------


def test_gelu_tanh_twin_against_torch_on_every_bf16_value() -> None:
    """torch's BF16 gelu(approximate="tanh") takes the same fp32 steps with its own tanhf
    (Sleef's on the CPU, within 1 ulp), so the two agree but where 1 + tanh cancels
    (x in about [-5.5, -4.5], |gelu| < 2e-7): there a last-bit tanh difference is all of
    the value (torch's -0 beside the twin's -1.5e-7 on 4 inputs here)."""
    torch = pytest.importorskip("torch")
    x = every_bf16()
    finite = np.isfinite(x.astype(F32))
    want = from_torch(torch.nn.functional.gelu(torch_bf16(x), approximate="tanh"))
    got = gelu_tanh_ref(x)
    assert np.array_equal(np.isnan(got.astype(F32)), np.isnan(want.astype(F32)))  # -inf, NaN
    g, w = got[finite].astype(np.float64), want[finite].astype(np.float64)
    differ = bits(got[finite]) != bits(want[finite])
    assert differ.sum() <= 20, differ.sum()  # 4 with torch 2.13 on x86-64
    assert np.all(np.abs(g - w)[differ] <= 2e-7)
    xs = x[finite].astype(F32)[differ]
    assert np.all((xs > -5.5) & (xs < -3)), xs


def test_gelu_tanh_large_inputs_are_x_or_zero_never_nan() -> None:
    """x^3 overflows past |x| ~ 7e12: tanh is then +-1, gelu x or -0, as torch's."""
    x = np.array([1e13, -1e13, 3e38, -3e38, 7e12, -7e12, 50.0, -50.0], dtype=F32).astype(BF16)
    got = gelu_tanh_ref(x).astype(F32)
    want = np.where(x.astype(F32) > 0, x.astype(F32), 0.0)
    assert np.array_equal(got, want)
    assert np.all(np.signbit(got[x.astype(F32) < 0]))


def test_gelu_tanh_twins_tanh_rounds_as_the_exact_one() -> None:
    """The claim the kernel's bits rest on (activation.cu): for every BF16 x, the exact
    tanh of the fp32 inner value lies far (over 1e5 float64 ulps) from any fp32 rounding
    boundary, so any float64 tanh accurate to that (NumPy's, CUDA's double tanh: 1 ulp)
    rounds to the same fp32 value. Measured against extended precision."""
    if np.finfo(np.longdouble).nmant < 63:
        pytest.skip("needs an extended long double")
    x = every_bf16().astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x))
    inner = np.unique(inner[np.isfinite(inner) & (inner != 0)])
    exact = np.tanh(inner.astype(np.longdouble))
    rounded = exact.astype(F32)
    assert np.array_equal(rounded, np.tanh(inner.astype(np.float64)).astype(F32))
    # the boundaries around the rounded value: halfway to each neighbour
    neighbours = [np.nextafter(rounded, np.float32(s * np.inf)) for s in (1, -1)]
    to_boundary = np.min(
        [np.abs(exact - (rounded.astype(np.longdouble) + n) / 2) for n in neighbours], axis=0
    )
    ulps = to_boundary / np.spacing(np.abs(rounded.astype(np.float64))).astype(np.longdouble)
    assert float(np.min(ulps)) > 1e5


def test_gelu_tanh_mul_twin_against_torch(rng: np.random.Generator) -> None:
    """torch's BF16 MLP: gelu(gate, approximate="tanh") * up, each rounded to BF16."""
    torch = pytest.importorskip("torch")
    gate_up = rng.standard_normal((64, 2 * 384)) * np.exp2(rng.integers(-3, 4, (64, 1)))
    gate_up = gate_up.astype(BF16)
    gate, up = torch_bf16(gate_up[:, :384]), torch_bf16(gate_up[:, 384:])
    gelu = torch.nn.functional.gelu(gate, approximate="tanh")
    want = from_torch(gelu * up)
    got = gelu_tanh_mul_ref(gate_up)
    # the gelu values differ only where 1 + tanh cancels (as on every BF16 value above),
    # and the product's one rounding is torch's
    same_gelu = bits(gelu_tanh_ref(gate_up[:, :384])) == bits(from_torch(gelu))
    x = gate_up[:, :384].astype(F32)[~same_gelu]
    assert np.all((x > -5.5) & (x < -3)), x
    assert np.array_equal(bits(got)[same_gelu], bits(want)[same_gelu])


def test_gelu_tanh_mul_kernel_is_its_twin_bit_for_bit(emulated: None, rng) -> None:
    """Every BF16 gate value (infinities and NaNs too) against random up values, through
    the launcher: the kernel's bits are the twin's (NaN where the twin's is NaN), every
    output element written."""
    import cupy

    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host

    tokens, inter = 128, 512  # 65,536 gates
    gate = every_bf16().reshape(tokens, inter)
    up = rng.standard_normal((tokens, inter)) * np.exp2(rng.integers(-8, 9, (tokens, 1)))
    gate_up = np.concatenate([gate, up.astype(BF16)], axis=1)
    out = cupy.full((tokens, inter), 0xFFFF, dtype=np.uint16)  # poisoned: NaN
    from reprise.cuda.launchers import gelu_tanh_mul

    got = to_host(gelu_tanh_mul(to_device(gate_up), out=out)).view(BF16)
    want = gelu_tanh_mul_ref(gate_up)
    nan = np.isnan(want.astype(F32))
    assert np.array_equal(np.isnan(got.astype(F32)), nan)
    assert nan.sum() <= 2 * 256  # -inf and the NaN gates only
    assert np.array_equal(bits(got)[~nan], bits(want)[~nan])
    assert CupyBackend.gelu_tanh_mul is gelu_tanh_mul  # the GPU backend's op
    assert NumpyBackend.gelu_tanh_mul is gelu_tanh_mul_ref


# ---- the scaled embedding -----------------------------------------------------------


@pytest.mark.parametrize("scale", SCALES)
def test_scaled_embed_twin_is_torchs_bf16_product(rng: np.random.Generator, scale: float) -> None:
    """Gemma3TextScaledWordEmbedding in BF16: the table's rows times
    torch.tensor(scale, dtype=bfloat16), rounded to BF16; widened to fp32."""
    torch = pytest.importorskip("torch")
    table = rng.standard_normal((300, 96)) * np.exp2(rng.integers(-20, 20, (300, 1)))
    table = table.astype(BF16)
    ids = rng.integers(0, 300, 50).astype(np.int32)
    rows = torch_bf16(table)[torch.from_numpy(ids).long()]
    want = from_torch(rows * torch.tensor(scale, dtype=torch.bfloat16)).astype(F32)
    assert np.array_equal(bits(embed_ref(table, ids, scale=scale)), bits(want))
    assert bf16_scale(scale) == torch.tensor(scale, dtype=torch.bfloat16).float().item()


def test_unscaled_embed_is_the_gather_it_was(rng: np.random.Generator) -> None:
    table = rng.standard_normal((50, 32)).astype(BF16)
    ids = rng.integers(0, 50, 20).astype(np.int32)
    want = table[ids].astype(F32)
    assert np.array_equal(bits(embed_ref(table, ids)), bits(want))
    assert np.array_equal(bits(embed_ref(table, ids, scale=1.0)), bits(want))


def test_scaled_embed_kernel_is_its_twin_bit_for_bit(emulated: None, rng) -> None:
    """The launcher's kernel against embed_ref, bit for bit: scaled table rows, unscaled
    prompt-table rows, and with no scale the exact gather (as before scales were)."""
    import cupy

    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.launchers import embed

    vocab, hidden = 100, 300  # 300: threads with one element and with two
    table = rng.standard_normal((vocab, hidden)) * np.exp2(rng.integers(-30, 30, (vocab, 1)))
    table = table.astype(BF16)
    prompt_rows = rng.standard_normal((4, hidden)).astype(BF16)
    ids = rng.integers(0, vocab + 4, 23).astype(np.int32)
    ids[:2] = [vocab, vocab + 3]
    for scale in [None, 1.0, *SCALES]:
        for rows in [None, prompt_rows]:
            step_ids = ids if rows is not None else ids % vocab
            out = cupy.full((23, hidden), np.nan, dtype=np.float32)  # poisoned
            dev_rows = None if rows is None else to_device(rows)
            got = to_host(embed(to_device(table), to_device(step_ids), dev_rows, scale, out=out))
            assert np.array_equal(bits(got), bits(embed_ref(table, step_ids, rows, scale))), scale


def test_scaled_embed_replays_in_a_cuda_graph(emulated: None, rng) -> None:
    """The scale is a launch constant: a captured embedding replays with the ids uploaded
    into its static buffer, scaled as an eager launch is."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host

    ops = CupyBackend()
    table = rng.standard_normal((64, 128)).astype(BF16)
    dev_table, ids = to_device(table), ops.zeros((9,), np.int32)
    replay = ops.capture(lambda: ops.embed(dev_table, ids, None, SCALES[1]))
    for _ in range(2):
        step_ids = rng.integers(0, 64, 9).astype(np.int32)
        ops.upload(ids, step_ids)
        got = to_host(replay())
        assert np.array_equal(bits(got), bits(embed_ref(table, step_ids, scale=SCALES[1])))


# ---- on a device: the GPU's own arithmetic (its double tanh, -ftz=true) -------------


@pytest.mark.gpu
@needs_gpu
def test_gelu_tanh_mul_on_the_gpu_is_its_twin_bit_for_bit(rng: np.random.Generator) -> None:
    """Every finite BF16 gate value but the tiny (|x| < 2^-100: -ftz=true flushes the
    subnormals their gelu and product may be) through the real kernel: the twin's bits
    (activation.cu's double tanh; a tanhf would miss by many ulps where 1 + tanh
    cancels)."""
    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.launchers import gelu_tanh_mul

    gate = every_bf16()
    gate = gate[np.isfinite(gate.astype(F32)) & (np.abs(gate.astype(F32)) >= 2.0**-100)]
    gate = gate[: gate.size // 256 * 256].reshape(-1, 256)
    up = rng.standard_normal(gate.shape).astype(BF16)
    gate_up = np.concatenate([gate, up], axis=1)
    got = to_host(gelu_tanh_mul(to_device(gate_up))).view(BF16)
    assert np.array_equal(bits(got), bits(gelu_tanh_mul_ref(gate_up)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("scale", [None, *SCALES])
def test_scaled_embed_on_the_gpu_is_its_twin_bit_for_bit(
    rng: np.random.Generator, scale: float | None
) -> None:
    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.launchers import embed

    table = rng.standard_normal((1000, 2560)).astype(BF16)
    prompt_rows = rng.standard_normal((3, 2560)).astype(BF16)
    ids = rng.integers(0, 1003, 37).astype(np.int32)
    got = to_host(embed(to_device(table), to_device(ids), to_device(prompt_rows), scale))
    assert np.array_equal(bits(got), bits(embed_ref(table, ids, prompt_rows, scale)))


# ---- the sandwich norm ----------------------------------------------------------------


# 640 and 1,152: Gemma 3 270M's and 1B's rows, held in registers; 5,376: the 27B's, past
# what the registers hold (the looping path)
@pytest.mark.parametrize("hidden", [640, 1152, 5376])
def test_norm_add_rmsnorm_is_rmsnorm_then_add_rmsnorm(emulated: None, rng, hidden: int) -> None:
    """One launch, the bits of the rmsnorm kernel on the widened delta followed by the
    add_rmsnorm kernel; and within an ulp of the twin (whose sums run in NumPy's order)."""
    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.launchers import add_rmsnorm, norm_add_rmsnorm, rmsnorm
    from reprise.cuda.rmsnorm import norm_add_rmsnorm_ref

    rows = 5
    residual = (rng.standard_normal((rows, hidden)) * 30).astype(F32)
    scales = np.exp2(rng.integers(-6, 7, (rows, 1)))
    delta = (rng.standard_normal((rows, hidden)) * scales).astype(BF16)
    delta_weight, weight = (rng.standard_normal((2, hidden)) + 1).astype(BF16)
    dev = [to_device(a) for a in (residual, delta, delta_weight, weight)]
    summed, normed = (to_host(a) for a in norm_add_rmsnorm(*dev, 1e-6))
    normed_delta = rmsnorm(to_device(delta.astype(F32)), dev[2], 1e-6)
    want_summed, want_normed = (to_host(a) for a in add_rmsnorm(dev[0], normed_delta, dev[3], 1e-6))
    assert np.array_equal(summed, want_summed)
    assert np.array_equal(normed, want_normed)
    ref_summed, ref_normed = norm_add_rmsnorm_ref(residual, delta, delta_weight, weight, 1e-6)
    ulp = np.exp2(np.floor(np.log2(np.abs(ref_summed) + 1e-30)) - 7)  # the delta's BF16 ulp
    assert np.all(np.abs(summed - ref_summed) <= ulp)
    got, want = normed.view(BF16).astype(F32), ref_normed.astype(F32)
    assert np.max(np.abs(got - want) / np.exp2(np.floor(np.log2(np.abs(want) + 1e-30)) - 7)) <= 2


# ---- Gemma 2's logit soft-capping ------------------------------------------------------


def test_softcap_twin_is_torchs_fp32_steps(rng: np.random.Generator) -> None:
    """cap * tanh(logits / cap) as transformers runs it in fp32: torch's tanhf may differ
    from the rounded tanh by one ulp (its AVX-512 build does on 0.7 % of inputs), which the
    product by the cap carries (up to two of the result's ulps: 30 ulp(0.26) > ulp(7.6)),
    so within that plus the product's rounding; bounded by the cap, odd."""
    import torch

    from reprise.cuda.activation import softcap_ref

    logits = (rng.standard_normal((4, 4096)) * np.exp2(rng.integers(-4, 8, (4, 1)))).astype(F32)
    logits[0, :4] = [0.0, -0.0, 1e30, -1e30]
    got = softcap_ref(logits, 30.0)
    t = torch.from_numpy(logits)
    tanh = (t / 30.0).tanh()
    want = (tanh * 30.0).numpy()
    carried = 30.0 * np.spacing(np.abs(tanh.numpy()))
    assert np.all(np.abs(got - want) <= carried + np.spacing(np.abs(want).astype(F32)))
    assert np.all(np.abs(got) <= 30.0) and got[0, 2] == 30.0 and got[0, 3] == -30.0
    assert np.array_equal(softcap_ref(-logits, 30.0), -got)


def test_softcap_kernel_is_its_twin_bit_for_bit(emulated: None, rng) -> None:
    """The kernel (in place, through the launcher) gives the twin's bits, every element."""
    from reprise.cuda.activation import softcap_ref
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.launchers import softcap

    logits = (rng.standard_normal((3, 5000)) * np.exp2(rng.integers(-6, 9, (3, 1)))).astype(F32)
    device = to_device(logits)
    assert softcap(device, 30.0) is device
    assert np.array_equal(bits(to_host(device)), bits(softcap_ref(logits, 30.0)))
    assert CupyBackend.softcap is softcap and NumpyBackend.softcap is softcap_ref


@pytest.mark.gpu
@needs_gpu
def test_softcap_on_the_gpu_is_its_twin_bit_for_bit(rng: np.random.Generator) -> None:
    from reprise.cuda.activation import softcap_ref
    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.launchers import softcap

    logits = (rng.standard_normal((5, 50000)) * np.exp2(rng.integers(-6, 9, (5, 1)))).astype(F32)
    got = to_host(softcap(to_device(logits), 30.0))
    assert np.array_equal(bits(got), bits(softcap_ref(logits, 30.0)))
