"""Exact repeats: the last prompt position's logits row (and, for an embedding request,
its hidden row: `embedding_key`), kept so that a prompt seen before samples its first
token, or gets its embedding, without a forward step.

`LogitsCache` is an LRU bounded in bytes mapping a prompt key (`prompt_key`) to the
fp32 logits row the forward returned for the prompt's last position, as a read-only
host array. The key covers every prompt token, their extra ids (prompt tables), the
namespace (cache salt, adapter) and the model fingerprint, so a salted request never
meets another salt's row. The cache lives with one engine (one backend, device and
block size), where DESIGN §4 makes the row bit-identical however the prompt's prefix
was computed: a token drawn from the stored row is the token a forward would give.

Guarantees: the rows held never exceed `max_bytes` (a row larger than the bound is
not stored); a capacity of 0 stores nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NewType

import numpy as np

from ...blockpool.hashing import BlockHash, sha256

PromptKey = NewType("PromptKey", bytes)

# A prompt key hashes this tag and a block-style digest of the prompt's tail: the tag
# keeps it apart from every block key, even when the tail is empty.
_KEY_TAG = b"reprise/prompt-logits\x00v1\x00"
_EMBEDDING_TAG = b"reprise/prompt-embedding\x00v1\x00"


def prompt_key(tail_digest: BlockHash) -> PromptKey:
    """The key of a prompt whose tail (the tokens after its last full block, possibly
    none) hashes, chained to its full blocks' keys, to `tail_digest`."""
    return PromptKey(sha256(_KEY_TAG + tail_digest))


def embedding_key(key: PromptKey) -> PromptKey:
    """Where the same prompt's embedding (SamplingParams.embed: the final norm's output
    at its last position) is kept beside its logits row, in the same LRU and bound."""
    return PromptKey(sha256(_EMBEDDING_TAG + key))


class LogitsCache:
    """Prompt key -> the prompt's last logits row, least recently used evicted first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0; got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        # NOTE: insertion order is recency order: the first entry is evicted first.
        self._rows: OrderedDict[PromptKey, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def get(self, key: PromptKey) -> np.ndarray | None:
        """The stored row (read-only), now the most recently used; None if absent."""
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
        return row

    def put(self, key: PromptKey, row: np.ndarray) -> bool:
        """Store a copy of `row` under `key`, evicting the least recently used rows as
        needed; False (nothing stored) when the row alone exceeds the bound."""
        if row.nbytes > self.max_bytes:
            return False
        old = self._rows.pop(key, None)
        if old is not None:
            self.num_bytes -= old.nbytes
        stored = np.array(row, copy=True)  # its own bytes: not a view of a batch's rows
        stored.setflags(write=False)
        while self._rows and self.num_bytes + stored.nbytes > self.max_bytes:
            _, evicted = self._rows.popitem(last=False)
            self.num_bytes -= evicted.nbytes
            self.num_evictions += 1
        self._rows[key] = stored
        self.num_bytes += stored.nbytes
        return True

    def stats(self) -> dict[str, int]:
        return {
            "logits_cache_entries": len(self._rows),
            "logits_cache_bytes": self.num_bytes,
            "logits_cache_max_bytes": self.max_bytes,
            "logits_cache_evictions": self.num_evictions,
        }
