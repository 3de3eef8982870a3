"""Launchers of penalties.cu (twins: penalties.penalize_ref, add_logit_bias_ref and
apply_token_mask_ref). CuPy is imported lazily."""

from __future__ import annotations

from typing import Any

import numpy as np

from .kernels import check, kernel, launch_kernel
from .penalties import mask_words

PENALTY_THREADS = 128


def apply_penalties(
    logits: Any,
    token_offsets: Any,
    token_ids: Any,
    output_counts: Any,
    repetition: Any,
    frequency: Any,
    presence: Any,
) -> None:
    """Penalize [R, vocab] fp32 device logits in place. token_offsets [R + 1] int32;
    token_ids, output_counts [N] int32 (ids distinct within a row, in [0, vocab));
    repetition, frequency, presence [R] fp32: penalties.Penalties' fields, on the device."""
    check("logits", logits, np.float32, 2)
    rows, vocab = logits.shape
    check("token_offsets", token_offsets, np.int32, 1)
    check("token_ids", token_ids, np.int32, 1)
    check("output_counts", output_counts, np.int32, 1)
    if token_offsets.shape[0] != rows + 1:
        raise ValueError(
            f"token_offsets must have {rows + 1} entries; got {token_offsets.shape[0]}"
        )
    if output_counts.shape != token_ids.shape:
        raise ValueError(
            f"output_counts must match token_ids {token_ids.shape}; got {output_counts.shape}"
        )
    for name, x in [("repetition", repetition), ("frequency", frequency), ("presence", presence)]:
        check(name, x, np.float32, 1)
        if x.shape[0] != rows:
            raise ValueError(f"{name} must have one value per row ({rows}); got {x.shape[0]}")
    if rows == 0 or token_ids.shape[0] == 0:
        return
    args = (logits, np.int32(vocab), token_offsets, token_ids, output_counts,
            repetition, frequency, presence)  # fmt: skip
    launch_kernel(kernel("penalties", "apply_penalties"), (rows,), (PENALTY_THREADS,), args)


def add_logit_bias(logits: Any, offsets: Any, ids: Any, values: Any) -> None:
    """Add logit biases to [R, vocab] fp32 device logits in place. offsets [R + 1] int32;
    ids [B] int32 (distinct within a row, in [0, vocab)); values [B] fp32: penalties.
    LogitBias' fields, on the device."""
    check("logits", logits, np.float32, 2)
    rows, vocab = logits.shape
    check("offsets", offsets, np.int32, 1)
    check("ids", ids, np.int32, 1)
    check("values", values, np.float32, 1)
    if offsets.shape[0] != rows + 1:
        raise ValueError(f"offsets must have {rows + 1} entries; got {offsets.shape[0]}")
    if values.shape != ids.shape:
        raise ValueError(f"values must match ids {ids.shape}; got {values.shape}")
    if rows == 0 or ids.shape[0] == 0:
        return
    args = (logits, np.int32(vocab), offsets, ids, values)
    launch_kernel(kernel("penalties", "add_logit_bias"), (rows,), (PENALTY_THREADS,), args)


def apply_token_mask(logits: Any, words: Any) -> None:
    """Set the logits of [R, vocab] fp32 device logits outside each row's mask to -inf,
    in place. words [R, ceil(vocab / 32)] uint32: penalties.TokenMask's, on the device."""
    check("logits", logits, np.float32, 2)
    rows, vocab = logits.shape
    check("words", words, np.uint32, 2)
    if words.shape != (rows, mask_words(vocab)):
        raise ValueError(f"words must be [{rows}, {mask_words(vocab)}]; got {list(words.shape)}")
    if rows == 0:
        return
    args = (logits, np.int32(vocab), words, np.int32(words.shape[1]))
    launch_kernel(kernel("penalties", "apply_token_mask"), (rows,), (PENALTY_THREADS,), args)
