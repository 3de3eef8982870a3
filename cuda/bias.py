"""A linear layer's bias: y = bf16(x @ w.T + b), the sum rounded to BF16 once.

The GEMM returns fp32 (`out_f32`); the bias, held in BF16, is widened and added in
fp32, and the sum is rounded to BF16, as transformers' BF16 `nn.Linear` (one GEMM
with the bias in its fp32 epilogue) rounds it. Elementwise: a row's result depends
on that row alone.
"""

from __future__ import annotations

import numpy as np

from .dtypes import to_bf16, to_f32


def add_bias_ref(y: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """y: [T, N] fp32 (a GEMM's output); bias: [N] BF16 -> [T, N] BF16."""
    assert y.ndim == 2 and bias.shape == (y.shape[1],), (y.shape, bias.shape)
    return to_bf16(y + to_f32(bias))
