"""KV cache events: what a KV-aware router needs to mirror the pool's index.

The fields follow vLLM's KV events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`), so the daemon can publish them in the layout existing
routers consume. Digests are the raw key bytes; encoding them for the wire
is the daemon's job.

Guarantees (for a subscriber that sees every event in order):
- a digest is findable in a medium exactly between a `BlockStored` naming it
  in that medium and the next `BlockRemoved` naming it in that medium, or
  the next `AllBlocksCleared` (which empties both media);
- a block moving between tiers is first stored in the new medium, then
  removed from the old one, so it never looks absent while it stays findable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .hashing import BlockHash

MEDIUM_DEVICE = "GPU"  # the device tier, named as vLLM names it
MEDIUM_HOST = "CPU"  # the host tier


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
    `take()` once per step and publishes what it got.
    """

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def take(self) -> list[KVEvent]:
        """Every event since the last call, oldest first."""
        events, self._events = self._events, []
        return events
