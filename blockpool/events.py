"""KV cache events: what a KV-aware router needs to mirror the pool's index.

The fields follow vLLM's KV events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`), so the daemon can publish them in the layout existing
routers consume. Digests are the raw key bytes; encoding them for the wire
is the daemon's job.

Media: "GPU" (the device tier) and "CPU" (the host tier), as vLLM names them, and
"DISK" (the disk tier), the name SGLang's and Dynamo's KV events give a disk tier.
A block may be in the disk medium and a memory medium at once: blocks are written
through to disk while they stay in memory.

Guarantees (for a subscriber that sees every event in order):
- a digest is findable in a memory medium exactly between a `BlockStored`
  naming it in that medium and the next `BlockRemoved` naming it in that
  medium, or the next `AllBlocksCleared` (which empties every medium);
- a block moving between memory tiers is first stored in the new medium, then
  removed from the old one, so it never looks absent while it stays findable;
- the disk medium follows the tier's index: `BlockStored` once a block's file
  is in place (sent from the tier's writer thread), `BlockRemoved` when the
  tier evicts or drops a file (or is disabled), and on a restart one
  `BlockStored` per file found (disk.py says which of those carry tokens).
  A disk event reaches the queue when the change happens, which may fall
  between two steps; a lookup never depends on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from .hashing import BlockHash

MEDIUM_DEVICE = "GPU"  # the device tier, named as vLLM names it
MEDIUM_HOST = "CPU"  # the host tier
MEDIUM_DISK = "DISK"  # the disk tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became findable in `medium`; `parent_block_hash` is the first one's parent."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]  # the blocks' tokens, concatenated
    block_size: int
    lora_id: int | None  # vLLM's numeric adapter id; reprise names adapters, see lora_name
    medium: str
    lora_name: str | None = None  # the namespace's adapter id
    # Per block, its tokens' extra ids (prompt-table requests) as they entered its key,
    # or None for a block keyed without extra ids; None altogether when no block has
    # any. vLLM's `extra_keys` (one entry per block). Empty for salted namespaces too.
    extra_keys: list[tuple[int, ...] | None] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks stopped being findable in `medium`."""

    block_hashes: list[BlockHash]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of every medium stopped being findable."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[KVEvent], None]


class EventQueue:
    """An event sink that keeps events until the owner drains them.

    Pass an instance as `BlockPool(event_sink=...)`; the daemon's loop calls
    `take()` once per step and publishes what it got. Thread-safe: the disk tier's
    writer thread adds events too.
    """

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def take(self) -> list[KVEvent]:
        """Every event since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events
