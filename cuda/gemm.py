"""Linear layers: y = x @ w.T with BF16 operands and fp32 accumulation.

`w` is stored as `[out_features, in_features]` (Hugging Face layout). The
result is rounded to BF16 for hidden activations, or kept fp32 for logits.
The NumPy backend may pass `w` already widened to fp32 (same values) so the
widening is not paid on every call.
"""

from __future__ import annotations

import numpy as np

from reprise.cuda.dtypes import F32, to_bf16, to_f32


def gemm_ref(x: np.ndarray, w: np.ndarray, *, out_f32: bool = False) -> np.ndarray:
    """x: [M, K] BF16; w: [N, K] BF16 (or fp32 holding BF16 values) -> [M, N]."""
    assert x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    y = to_f32(x) @ to_f32(w).T
    return y.astype(F32, copy=False) if out_f32 else to_bf16(y)
