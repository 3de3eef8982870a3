"""RMSNorm, alone and fused with the residual add.

Math in fp32 (mean of squares over the row, rsqrt, times the weight), the
result rounded once to BF16 because it feeds a GEMM. The residual stream
stays fp32. Each row is reduced on its own: a row's result never depends on
the other rows of the batch.
"""

from __future__ import annotations

import numpy as np

from .dtypes import F32, to_bf16, to_f32


def rmsnorm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: [T, hidden] fp32; weight: [hidden] BF16 -> [T, hidden] BF16."""
    x = to_f32(x)
    mean_sq = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    inv_rms = (F32.type(1.0) / np.sqrt(mean_sq + F32.type(eps))).astype(F32)
    return to_bf16(x * inv_rms * to_f32(weight))


def add_rmsnorm_ref(
    residual: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """residual: [T, hidden] fp32; delta: [T, hidden] BF16 (a layer's output).

    Returns (residual + delta in fp32, rmsnorm of that sum in BF16).
    """
    summed = to_f32(residual) + to_f32(delta)
    return summed, rmsnorm_ref(summed, weight, eps)


def norm_add_rmsnorm_ref(
    residual: np.ndarray,
    delta: np.ndarray,
    delta_weight: np.ndarray,
    weight: np.ndarray,
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Gemma's sandwich norm and the next: add_rmsnorm of the residual and rmsnorm(delta,
    delta_weight) (the layer output normalized and rounded to BF16 before the add).
    residual: [T, hidden] fp32; delta: [T, hidden] BF16 -> (summed fp32, normed BF16)."""
    return add_rmsnorm_ref(residual, rmsnorm_ref(delta, delta_weight, eps), weight, eps)


def head_rmsnorm_ref(
    qkv: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, num_heads: int, eps: float
) -> np.ndarray:
    """qkv: [T, num_heads + 2 * kv_heads, head_dim] BF16 -> the same with each query head
    RMS-normalized over head_dim with `q_weight` and each key head with `k_weight`
    ([head_dim] BF16; Qwen3's q_norm and k_norm, before RoPE); the values as they were.
    Weights as long as all the query heads ([num_heads * head_dim]) and all the key heads
    ([kv_heads * head_dim]) normalize each token's queries as one row and its keys as one
    (OLMo 2's and OLMoE's q_norm and k_norm, over the whole projection)."""
    tokens, heads, head_dim = qkv.shape
    kv_heads = (heads - num_heads) // 2
    out = qkv.copy()
    for start, count, weight in ((0, num_heads, q_weight), (num_heads, kv_heads, k_weight)):
        width = head_dim if weight.shape[0] == head_dim else count * head_dim
        rows = qkv[:, start : start + count].reshape(-1, width)
        out[:, start : start + count] = rmsnorm_ref(rows, weight, eps).reshape(
            tokens, count, head_dim
        )
    return out


def norm_add_ref(
    residual: np.ndarray, delta: np.ndarray | None, delta_weight: np.ndarray | None, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """OLMo 2's post-norm: the residual plus rmsnorm(delta, delta_weight) (the layer's
    output normalized and rounded to BF16 before the add), and that sum rounded to BF16
    (the next layer's input: OLMo 2 normalizes no layer input). residual: [T, hidden] fp32;
    delta: [T, hidden] BF16, or None for the residual alone (the first layer's input)
    -> (summed fp32, summed BF16)."""
    summed = to_f32(residual)
    if delta is not None:
        assert delta_weight is not None
        summed = summed + to_f32(rmsnorm_ref(delta, delta_weight, eps))
    return summed, to_bf16(summed)
