"""Token selection: greedy argmax and seeded sampling from a counter-based RNG.

Greedy ties go to the lowest token id. A random draw is Philox4x32-10 keyed
by the request's 64-bit seed with the token's absolute position as the
counter, so a request's draws depend on nothing but (seed, position): not on
the batch, the step, or other requests. The same integer arithmetic runs in
the CUDA kernel, so both backends draw the same uniforms.

Sampling, all in fp32: scale by 1 / temperature; order tokens by (logit
descending, id ascending); keep the first `top_k`; take p = exp(s - s_max) of
each; keep those before the first whose p is below `min_p` (p is 1 at the top,
so at least one); keep the shortest prefix whose running sum of p reaches
`top_p` times the kept sum (at least one token); pick the first token whose
running sum exceeds u * the sum at that cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import F32

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Draws:
    """What a backend's `sample` needs to draw one token per logits row, one entry a row."""

    temperature: np.ndarray  # [D] fp32, > 0
    top_k: np.ndarray  # [D] int32; the vocabulary size or more for no cut
    top_p: np.ndarray  # [D] fp32 in (0, 1]
    min_p: np.ndarray  # [D] fp32 in [0, 1]; 0 for no cut
    seeds: np.ndarray  # [D] uint64
    positions: np.ndarray  # [D] int64, the position of the token drawn


def philox4x32(
    counter: tuple[int, int, int, int], key: tuple[int, int]
) -> tuple[int, int, int, int]:
    """Philox4x32 with 10 rounds (Salmon et al., 2011), on Python ints."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_idx in range(10):
        if round_idx:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (
            ((p1 >> 32) ^ c1 ^ k0) & _MASK32,
            p1 & _MASK32,
            ((p0 >> 32) ^ c3 ^ k1) & _MASK32,
            p0 & _MASK32,
        )
    return c0, c1, c2, c3


def uniform(seed: int, position: int) -> float:
    """One uniform draw in [0, 1) with 24 random bits, keyed by (seed, position)."""
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    counter = (position & _MASK32, (position >> 32) & _MASK32, 0, 0)
    return float(F32.type((philox4x32(counter, key)[0] >> 8) * (1.0 / (1 << 24))))


def argmax_ref(logits: np.ndarray) -> int:
    """Greedy choice over [vocab] logits; ties go to the lowest id."""
    return int(np.argmax(logits))  # np.argmax returns the first maximum


def ranked(scores: np.ndarray, top_k: int | None) -> np.ndarray:
    """Ids of the `top_k` highest scores (all with None), by descending score, ties by
    ascending id: the same ids in the same order as a stable sort of the whole
    vocabulary, at a fraction of its cost for a large one.

    With top_k, only candidates are sorted: the scores at or above t, the top_k-th
    largest of the maxima of `blocks >= top_k` slices. Those maxima are top_k distinct
    scores >= t, so the top_k-th score overall is >= t and every id that ranks in the
    first top_k (ties included) is a candidate."""
    n = scores.size
    blocks = max(top_k or 0, 256)
    width = n // blocks
    if top_k is None or width < 2 or np.isnan(scores).any():
        return np.argsort(-scores, kind="stable")[:top_k]
    maxima = scores[: blocks * width].reshape(blocks, width).max(axis=1)
    threshold = np.partition(maxima, blocks - top_k)[blocks - top_k]
    candidates = np.flatnonzero(scores >= threshold)
    return candidates[np.lexsort((candidates, -scores[candidates]))][:top_k]


def sample_ref(
    logits: np.ndarray,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float,
    seed: int,
    position: int,
    min_p: float = 0.0,
) -> int:
    """Draw one token id from [vocab] fp32 logits (temperature > 0). A row whose every
    logit is -inf (bans, masks and holds that leave no token) gives its lowest id, as the
    greedy argmax and the device's kernel do."""
    scaled = logits.astype(F32) / F32.type(temperature)
    order = ranked(scaled, top_k)
    kept = scaled[order]
    if kept[0] == -np.inf:
        return int(order[0])
    probs = np.exp(kept - kept[0], dtype=F32)
    if min_p > 0:
        below = np.flatnonzero(probs < F32.type(min_p))  # probs[0] == 1: never the first
        if below.size:
            probs = probs[: below[0]]
    cumulative = np.cumsum(probs, dtype=F32)
    if top_p < 1.0:
        keep = int(np.searchsorted(cumulative, F32.type(top_p) * cumulative[-1], side="left")) + 1
        cumulative = cumulative[: min(keep, cumulative.size)]
    target = F32.type(uniform(seed, position)) * cumulative[-1]
    choice = int(np.searchsorted(cumulative, target, side="right"))
    return int(order[min(choice, cumulative.size - 1)])
