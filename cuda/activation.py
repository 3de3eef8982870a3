"""SwiGLU: silu(gate) * up, from the fused gate/up projection."""

from __future__ import annotations

import numpy as np

from .dtypes import F32, to_bf16, to_f32


def silu_mul_ref(gate_up: np.ndarray) -> np.ndarray:
    """gate_up: [T, 2 * inter] BF16 (gate first, then up) -> [T, inter] BF16."""
    inter = gate_up.shape[-1] // 2
    gate = to_f32(gate_up[..., :inter])
    up = to_f32(gate_up[..., inter:])
    # exp(-gate) is +inf below gate = -88.7, and gate / inf = -0, as the kernel's expf gives
    with np.errstate(over="ignore"):
        silu = gate / (F32.type(1.0) + np.exp(-gate, dtype=F32))
    return to_bf16(silu * up)
