"""The element types every backend agrees on."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round fp32 values to BF16 (round to nearest, ties to even, as `__float2bfloat16_rn`)."""
    return np.asarray(x, dtype=F32).astype(BF16)


def to_f32(x: np.ndarray) -> np.ndarray:
    """Widen to fp32 (exact for BF16 input); no copy when already fp32."""
    return np.asarray(x).astype(F32, copy=False)
