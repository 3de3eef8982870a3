"""Logit bias, then repetition, frequency and presence penalties, then a token mask, on
logits rows (twin of penalties.cu).

OpenAI's and vLLM's semantics, applied in this order to each token a row lists
(vLLM's order: its logit-bias processor runs before `apply_penalties`):

- logit bias (OpenAI's `logit_bias`): a biased token has its bias added;
- repetition (vLLM): a token seen in the prompt or the output has its logit
  divided by the penalty if positive, multiplied by it otherwise;
- frequency and presence (OpenAI): a token generated c > 0 times has
  `frequency * c`, then `presence`, subtracted.

Every step is one fp32 op rounded to nearest (division included), on that
element alone, so a penalized row depends on nothing but its logits and its
own token counts: not on the batch, the other rows or the order tokens are
listed in. The kernel spells each op with an explicit `__f*_rn` intrinsic (no
fused multiply-add), so it computes the same bits as this twin (up to
subnormals, which CuPy's -ftz=true flushes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import F32


@dataclass(frozen=True, slots=True)
class LogitBias:
    """The logit biases of a batch of rows: row r adds `values[i]` to the logit of
    `ids[i]` for i in `offsets[r] .. offsets[r + 1]` (ids distinct within a row)."""

    offsets: np.ndarray  # [R + 1] int32, ascending from 0
    ids: np.ndarray  # [B] int32
    values: np.ndarray  # [B] fp32


@dataclass(frozen=True, slots=True)
class Penalties:
    """The penalties of a batch of logits rows, one entry a row; row r's tokens are
    `token_ids[token_offsets[r] : token_offsets[r + 1]]`, distinct within the row.

    NOTE: a row lists each token seen in its prompt (when its repetition penalty is
    not 1) or its output, once; a row without penalties lists none and is unchanged."""

    repetition: np.ndarray  # [R] fp32 > 0, 1 = off
    frequency: np.ndarray  # [R] fp32
    presence: np.ndarray  # [R] fp32
    token_offsets: np.ndarray  # [R + 1] int32, ascending from 0
    token_ids: np.ndarray  # [N] int32
    output_counts: np.ndarray  # [N] int32: times generated (0: seen in the prompt only)
    bias: LogitBias | None = None  # added first; None: no row has a logit bias
    mask: TokenMask | None = None  # applied last; None: no row has a mask


@dataclass(frozen=True, slots=True)
class TokenMask:
    """The tokens each row may take: token t of row r is kept when bit t % 32 of
    `words[r, t // 32]` is set; every other logit of the row becomes -inf. A row
    without a constraint has every bit set."""

    words: np.ndarray  # [R, ceil(vocab / 32)] uint32


def mask_words(vocab: int) -> int:
    """The uint32 words a mask row of `vocab` tokens has."""
    return -(-vocab // 32)


def mask_of(token_ids: np.ndarray, vocab: int) -> np.ndarray:
    """The mask row ([mask_words(vocab)] uint32, TokenMask's layout) that keeps exactly
    `token_ids` (each in [0, vocab))."""
    bits = np.zeros(mask_words(vocab) * 32, dtype=np.uint8)
    bits[token_ids] = 1
    return np.packbits(bits, bitorder="little").view(np.uint32)


def apply_token_mask_ref(logits: np.ndarray, mask: TokenMask) -> None:
    """Set each row's logits outside its mask to -inf, in place."""
    assert logits.dtype == F32 and logits.ndim == 2, (logits.dtype, logits.shape)
    rows, vocab = logits.shape
    assert mask.words.dtype == np.uint32 and mask.words.shape == (rows, mask_words(vocab)), (
        mask.words.dtype,
        mask.words.shape,
    )
    bits = np.unpackbits(mask.words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    logits[bits == 0] = -np.inf


def add_logit_bias_ref(logits: np.ndarray, bias: LogitBias) -> None:
    """Add each row's biases to [R, vocab] fp32 logits, in place: one fp32 add an element."""
    assert logits.dtype == F32 and logits.ndim == 2, (logits.dtype, logits.shape)
    for r in range(logits.shape[0]):
        ids = bias.ids[bias.offsets[r] : bias.offsets[r + 1]]
        assert np.unique(ids).size == ids.size, f"row {r} biases a token twice"
        logits[r, ids] += bias.values[bias.offsets[r] : bias.offsets[r + 1]]


def penalize_ref(logits: np.ndarray, penalties: Penalties) -> None:
    """Apply `penalties` (its logit bias first, its mask last) to [R, vocab] fp32 logits,
    in place."""
    assert logits.dtype == F32 and logits.ndim == 2, (logits.dtype, logits.shape)
    if penalties.bias is not None:
        add_logit_bias_ref(logits, penalties.bias)
    offsets = penalties.token_offsets
    for r in range(logits.shape[0]):
        ids = penalties.token_ids[offsets[r] : offsets[r + 1]]
        if not ids.size:
            continue
        assert np.unique(ids).size == ids.size, f"row {r} lists a token twice"
        counts = penalties.output_counts[offsets[r] : offsets[r + 1]]
        rep = F32.type(penalties.repetition[r])
        x = logits[r, ids]
        x = np.where(x > 0, x / rep, x * rep)
        generated = counts > 0
        charged = x - F32.type(penalties.frequency[r]) * counts.astype(F32)
        charged -= F32.type(penalties.presence[r])
        logits[r, ids] = np.where(generated, charged, x)
    if penalties.mask is not None:
        apply_token_mask_ref(logits, penalties.mask)
