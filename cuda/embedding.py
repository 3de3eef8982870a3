"""Embedding gather: token ids to rows of the (BF16) embedding table.

The residual stream is kept in fp32, so the gather widens the rows; the
values are exactly the table's BF16 values, or with a `scale` (Gemma's
sqrt(hidden)) each table row times BF16(scale), rounded to BF16, as torch's
BF16 product rounds. Ids >= vocab (p-tuning's fake ids) select rows of a
second table, the step's prompt-table rows, never scaled: id `vocab + r`
reads its row r. Each output row depends on its own id only.
"""

from __future__ import annotations

import numpy as np

from .dtypes import F32, to_bf16


def bf16_scale(scale: float) -> np.float32:
    """`scale` rounded to BF16, as an fp32 value (what the kernel multiplies by)."""
    return F32.type(to_bf16(np.float32(scale)))


def embed_ref(
    table: np.ndarray,
    token_ids: np.ndarray,
    prompt_rows: np.ndarray | None = None,
    scale: float | None = None,
) -> np.ndarray:
    """table: [vocab, hidden] BF16; token_ids: [T] int, each < vocab + P; prompt_rows:
    [P, hidden] BF16 or None (then every id < vocab); scale: a table row's factor, or None
    for none -> [T, hidden] fp32."""
    assert token_ids.ndim == 1, token_ids.shape
    vocab = table.shape[0]
    fake = token_ids >= vocab  # none without prompt_rows
    table_ids = token_ids if prompt_rows is None else np.where(fake, 0, token_ids)
    out = table[table_ids].astype(F32)
    if scale is not None:  # BF16 times BF16 is exact in fp32: one rounding, to BF16
        with np.errstate(over="ignore", invalid="ignore"):
            out = to_bf16(out * bf16_scale(scale)).astype(F32)
    if prompt_rows is not None:
        out[fake] = prompt_rows[token_ids[fake] - vocab].astype(F32)
    return out
