"""NumPy twin of decode_block.cu: a decode layer's tail, o_proj through the next norm.

It is the op-by-op path itself, each step its own twin in turn: what the persistent
launch must equal (to the bit on a device, where every step is the same kernel
arithmetic; within BF16 rounding of these twins).
"""

from __future__ import annotations

import numpy as np

from .activation import silu_mul_ref
from .gemm import gemm_ref
from .rmsnorm import add_rmsnorm_ref


def decode_tail_ref(
    attn: np.ndarray, w_o: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray,
    residual: np.ndarray, mlp_norm: np.ndarray, next_norm: np.ndarray, eps: float,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """attn [T, q_size] BF16, residual [T, hidden] fp32, the weights [out, in] BF16
    (gate_up: the gate rows, then the up rows) -> (summed [T, hidden] fp32, normed
    [T, hidden] BF16): the residual stream after the MLP and the next layer's input."""
    summed1, x1 = add_rmsnorm_ref(residual, gemm_ref(attn, w_o), mlp_norm, eps)
    h = silu_mul_ref(gemm_ref(x1, w_gate_up))
    return add_rmsnorm_ref(summed1, gemm_ref(h, w_down), next_norm, eps)
