"""Rotary position embedding, Hugging Face's half-split layout.

cos/sin come from one fp32 table indexed by absolute position (computed in
float64 once, then rounded), so a token's rotation depends only on its
position, never on the chunk or batch it runs in.

The frequencies may be scaled as transformers' `rope_scaling` types scale them, where
that is a fixed function of the position: `llama3`, `linear`, `yarn` and `longrope`
(one of its two factor lists, chosen once for the context: config.py). yarn's and
longrope's attention factor multiplies cos and sin, as transformers multiplies them.
A partial rotary embedding (Phi-4-mini's `partial_rotary_factor`) rotates the first
`rotary_dim` dimensions of each head (pairs i, i + rotary_dim / 2) and passes the rest
through; the weights put those pairs at i, i + head_dim / 2 (weights.py permutes q and
k's dimensions alike, which keeps every q . k), so the table's pairs past
rotary_dim / 2 are cos 1, sin 0: the identity, exactly, in every kernel.
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


@dataclass(slots=True, frozen=True)
class LinearScaling:
    """`rope_scaling` of type `linear`: every frequency divided by `factor`."""

    factor: float


@dataclass(slots=True, frozen=True)
class YarnScaling:
    """`rope_scaling` of type `yarn` (transformers' `_compute_yarn_parameters`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool


@dataclass(slots=True, frozen=True)
class LongRopeScaling:
    """`rope_scaling` of type `longrope`, its factor list chosen for the context (short
    or long: config.py): each frequency divided by its factor."""

    factors: tuple[float, ...]  # [rotary_dim // 2]
    attention_factor: float
    long: bool  # the long factors (a context past original_max_position_embeddings)


RopeScaling = Llama3Scaling | LinearScaling | YarnScaling | LongRopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Per-pair inverse frequencies, float64 [head_dim // 2] (head_dim: the rotated
    dimensions)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, LongRopeScaling):
        return inv_freq / np.asarray(scaling.factors, dtype=np.float64)
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
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


def _yarn_inv_freq(
    inv_freq: np.ndarray, dim: int, theta: float, scaling: YarnScaling
) -> np.ndarray:
    """YaRN: the high frequencies kept, the low ones divided by the factor, a linear ramp
    between the dimensions that turn beta_fast and beta_slow times over the original
    context."""

    def correction_dim(rotations: float) -> float:
        length = scaling.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: the frequency as it is; 0: divided by the factor
    return inv_freq / scaling.factor * (1 - kept) + inv_freq * kept


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (yarn's and longrope's; else 1)."""
    if isinstance(scaling, YarnScaling | LongRopeScaling):
        return scaling.attention_factor
    return 1.0


def rope_table(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: RopeScaling | None = None,
    rotary_dim: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each fp32 [max_positions, head_dim // 2]; pairs past rotary_dim // 2
    (a partial rotary embedding's) are cos 1, sin 0."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, (rotary_dim, head_dim)
    angles = np.outer(
        np.arange(max_positions, dtype=np.float64), rope_inv_freq(rotary_dim, theta, scaling)
    )
    factor = attention_factor(scaling)
    cos = np.ones((max_positions, head_dim // 2), dtype=F32)
    sin = np.zeros((max_positions, head_dim // 2), dtype=F32)
    cos[:, : rotary_dim // 2] = np.cos(angles) * factor
    sin[:, : rotary_dim // 2] = np.sin(angles) * factor
    return cos, sin


def rotary_permutation(head_dim: int, rotary_dim: int) -> np.ndarray:
    """The order of a head's dimensions that puts a partial rotary embedding's pairs
    (i, i + rotary_dim / 2) at (i, i + head_dim / 2) and the passed-through dimensions'
    halves after each: [head_dim] indices into the checkpoint's order."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return np.concatenate([np.arange(r), rotary_dim + np.arange(p), r + np.arange(r),
                           rotary_dim + p + np.arange(p)])  # fmt: skip


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
