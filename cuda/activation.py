"""Gated MLP activations, from the fused gate/up projection: SwiGLU's silu(gate) * up
and GeGLU's gelu_tanh(gate) * up (Gemma's); and Gemma 2's tanh soft-capping of logits."""

from __future__ import annotations

import numpy as np

from .dtypes import F32, to_bf16, to_f32

# gelu_tanh's constants as fp32, as torch takes them: sqrt(2 / pi) and 0.044715
GELU_BETA = F32.type(np.sqrt(2.0) * (2.0 / np.sqrt(np.pi)) * 0.5)
GELU_KAPPA = F32.type(0.044715)


def silu_mul_ref(gate_up: np.ndarray) -> np.ndarray:
    """gate_up: [T, 2 * inter] BF16 (gate first, then up) -> [T, inter] BF16."""
    inter = gate_up.shape[-1] // 2
    gate = to_f32(gate_up[..., :inter])
    up = to_f32(gate_up[..., inter:])
    # exp(-gate) is +inf below gate = -88.7, and gate / inf = -0, as the kernel's expf gives
    with np.errstate(over="ignore"):
        silu = gate / (F32.type(1.0) + np.exp(-gate, dtype=F32))
    return to_bf16(silu * up)


def gelu_tanh_ref(x: np.ndarray) -> np.ndarray:
    """gelu_tanh (transformers' "gelu_pytorch_tanh") of BF16 values, as BF16: torch's fp32
    steps in its order, 0.5 * x * (1 + tanh(beta * (x + kappa * (x * x * x)))), each op
    rounded to fp32, and tanh correctly rounded to fp32: taken in float64, whose result
    rounds as the exact one does (for every BF16 x, exact tanh lies over 2e5 float64 ulps
    from an fp32 rounding boundary; tests/test_gemma_ops.py), so the kernel's double tanh
    gives these bits too. Past |x| ~ 7e12 x^3 is inf and the value x or -0; for
    x in about [-5.5, -3] 1 + tanh cancels, so the fp32 value is coarse there (torch's
    too). NaN only for x = -inf or NaN."""
    x = to_f32(x)
    with np.errstate(over="ignore", invalid="ignore"):
        inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x))
        tanh = np.tanh(inner.astype(np.float64)).astype(F32)
        return to_bf16((F32.type(0.5) * x) * (F32.type(1.0) + tanh))


def gelu_tanh_mul_ref(gate_up: np.ndarray) -> np.ndarray:
    """gate_up: [T, 2 * inter] BF16 (gate first, then up) -> [T, inter] BF16: gelu_tanh of
    the gate rounded to BF16 (gelu_tanh_ref), times up, rounded to BF16, as torch's BF16
    `gelu(gate, approximate="tanh") * up` rounds. The product of two BF16 values is exact
    in fp32, so the one rounding is the last."""
    inter = gate_up.shape[-1] // 2
    gelu = to_f32(gelu_tanh_ref(gate_up[..., :inter]))
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN as the kernel's
        return to_bf16(gelu * to_f32(gate_up[..., inter:]))


def softcap_ref(x: np.ndarray, cap: float) -> np.ndarray:
    """Gemma 2's tanh soft-capping of fp32 logits, cap * tanh(x / cap), in torch's fp32
    steps (x / cap, tanh, times cap, each rounded to fp32), tanh taken in float64 and
    rounded (the kernel's double tanh gives the same bits): [R, vocab] fp32 -> the same."""
    c = F32.type(cap)
    with np.errstate(over="ignore", invalid="ignore"):
        t = (to_f32(x) / c).astype(F32)
        return (np.tanh(t.astype(np.float64)).astype(F32) * c).astype(F32)
