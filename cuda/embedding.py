"""Embedding gather: token ids to rows of the (BF16) embedding table.

The residual stream is kept in fp32, so the gather widens the rows; the
values are exactly the table's BF16 values. Ids >= vocab (p-tuning's fake
ids) select rows of a second table, the step's prompt-table rows: id
`vocab + r` reads its row r. Each output row depends on its own id only.
"""

from __future__ import annotations

import numpy as np

from .dtypes import F32


def embed_ref(
    table: np.ndarray, token_ids: np.ndarray, prompt_rows: np.ndarray | None = None
) -> np.ndarray:
    """table: [vocab, hidden] BF16; token_ids: [T] int, each < vocab + P; prompt_rows:
    [P, hidden] BF16 or None (then every id < vocab) -> [T, hidden] fp32."""
    assert token_ids.ndim == 1, token_ids.shape
    vocab = table.shape[0]
    if prompt_rows is None:
        return table[token_ids].astype(F32)
    fake = token_ids >= vocab
    out = table[np.where(fake, 0, token_ids)].astype(F32)
    out[fake] = prompt_rows[token_ids[fake] - vocab].astype(F32)
    return out
