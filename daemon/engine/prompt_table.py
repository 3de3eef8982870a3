"""Prompt tables (p-tuning): checking a request's table, fake ids and extra ids.

A request may carry a prompt table, `[num_virtual, hidden]` BF16, and prompt ids
where an id >= the vocabulary size selects table row `id - vocab_size` (a "fake
id"); and extra ids, one per prompt id: 0 for a text token, > 0 for a fake id,
equal for equal embeddings. Extra ids enter the block keys (blockpool/hashing.py),
so two requests with the same fake ids but different tables never share a block.
Without extra ids, each fake id gets a digest of its row's bytes, so equal
embeddings share blocks without the caller inventing ids.

Every check raises ValueError naming the field and the offending value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...blockpool.hashing import MAX_ID
from ...cuda.dtypes import BF16


@dataclass(frozen=True, slots=True)
class PromptTable:
    """A checked table and the prompt's extra ids (one per prompt token)."""

    table: np.ndarray | None  # [num_virtual, hidden] BF16, C-contiguous; None: text only
    extra_ids: list[int]


def row_extra_id(row: np.ndarray) -> int:
    """The extra id derived from one table row: the first 8 bytes of its BLAKE2b
    digest, as an unsigned integer, forced > 0 (0 means "text token")."""
    digest = hashlib.blake2b(row.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def check_prompt_table(
    prompt_ids: Sequence[int] | np.ndarray,
    prompt_table: np.ndarray | None,
    extra_ids: Sequence[int] | None,
    *,
    vocab_size: int,
    hidden_size: int,
) -> PromptTable | None:
    """Check a request's table and extra ids against its prompt (ids already known to
    be in [0, vocab_size + num_virtual); a list, or the engine's int64 array, whose
    maximum is one NumPy call). Returns None when the request uses neither."""
    if prompt_table is None and extra_ids is None:
        if len(prompt_ids) and int(np.max(prompt_ids)) >= vocab_size:  # no per-token Python
            raise _no_table(next(int(t) for t in prompt_ids if t >= vocab_size), vocab_size)
        return None
    table = None if prompt_table is None else _check_table(prompt_table, hidden_size)
    num_virtual = 0 if table is None else table.shape[0]
    ids = np.asarray(prompt_ids, dtype=np.int64)
    fake = ids >= vocab_size
    past = ids >= vocab_size + num_virtual
    if past.any():
        bad = int(ids[past][0])
        if table is None:
            raise _no_table(bad, vocab_size)
        raise ValueError(
            f"prompt_table: token id {bad} selects row {bad - vocab_size}, but the table "
            f"has {num_virtual} rows (ids up to {vocab_size + num_virtual - 1})"
        )
    if extra_ids is None:
        assert table is not None
        derived = [0] * len(ids)
        rows = ids[fake] - vocab_size
        digests = {int(r): row_extra_id(table[r]) for r in np.unique(rows)}
        for pos, row in zip(np.flatnonzero(fake).tolist(), rows.tolist(), strict=True):
            derived[pos] = digests[row]
        return PromptTable(table, derived)
    return PromptTable(table, _check_extra_ids(extra_ids, ids, fake))


def _no_table(token_id: int, vocab_size: int) -> ValueError:
    return ValueError(
        f"prompt token ids must be in [0, {vocab_size}); got {token_id}: ids from "
        f"{vocab_size} up select prompt_table rows, but the request has no prompt_table"
    )


def _check_table(table: object, hidden_size: int) -> np.ndarray:
    if not isinstance(table, np.ndarray):
        raise ValueError(f"prompt_table must be a NumPy array; got {type(table).__name__}")
    if table.dtype != BF16:
        raise ValueError(f"prompt_table must be bfloat16 (the model's dtype); got {table.dtype}")
    if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_table must have shape [num_virtual >= 1, hidden {hidden_size}]; "
            f"got {list(table.shape)}"
        )
    return np.ascontiguousarray(table)


def _check_extra_ids(extra_ids: Sequence[int], ids: np.ndarray, fake: np.ndarray) -> list[int]:
    if isinstance(extra_ids, str | bytes) or not hasattr(extra_ids, "__len__"):
        raise ValueError(f"extra_ids must be a list of integers; got {type(extra_ids).__name__}")
    if len(extra_ids) != len(ids):
        raise ValueError(
            f"extra_ids must have one id per prompt token: {len(extra_ids)} for {len(ids)} tokens"
        )
    out: list[int] = []
    for pos, value in enumerate(extra_ids):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"extra_ids[{pos}] must be an integer; got {value!r}")
        value = int(value)
        if not 0 <= value <= MAX_ID:
            raise ValueError(f"extra_ids[{pos}] must be in [0, 2**64); got {value}")
        if fake[pos] and value == 0:
            raise ValueError(
                f"extra_ids[{pos}] is 0 but token id {int(ids[pos])} is a prompt-table id; "
                "a fake id needs an extra id > 0"
            )
        if not fake[pos] and value != 0:
            raise ValueError(
                f"extra_ids[{pos}] is {value} but token id {int(ids[pos])} is a text token; "
                "a text token's extra id must be 0"
            )
        out.append(value)
    return out
