"""Rotary position embedding, Hugging Face's half-split layout.

cos/sin come from one fp32 table indexed by absolute position (computed in
float64 once, then rounded), so a token's rotation depends only on its
position, never on the chunk or batch it runs in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .dtypes import F32, to_bf16, to_f32


@dataclass(slots=True, frozen=True)
class Llama3Scaling:
    """`rope_scaling` of type `llama3` (Llama 3.1 and later)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3Scaling | None) -> np.ndarray:
    """Per-pair inverse frequencies, float64 [head_dim // 2]."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


def rope_table(
    head_dim: int, max_positions: int, theta: float, scaling: Llama3Scaling | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each fp32 [max_positions, head_dim // 2]."""
    angles = np.outer(
        np.arange(max_positions, dtype=np.float64), rope_inv_freq(head_dim, theta, scaling)
    )
    return np.cos(angles).astype(F32), np.sin(angles).astype(F32)


def rope_ref(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [T, heads, head_dim] BF16; positions: [T] -> rotated x, BF16.

    out[:half] = x1 * cos - x2 * sin; out[half:] = x2 * cos + x1 * sin.
    """
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]  # [T, 1, half]
    s = sin[positions][:, None, :]
    xf = to_f32(x)
    x1, x2 = xf[..., :half], xf[..., half:]
    return to_bf16(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))
