"""Embedding gather: token ids to rows of the (BF16) embedding table.

The residual stream is kept in fp32, so the gather widens the rows; the
values are exactly the table's BF16 values.
"""

from __future__ import annotations

import numpy as np

from .dtypes import F32


def embed_ref(table: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """table: [vocab, hidden] BF16; token_ids: [T] int -> [T, hidden] fp32."""
    assert token_ids.ndim == 1, token_ids.shape
    return table[token_ids].astype(F32)
