"""Blocks as the pool sees them: id, references, cache entry, retention, queue links.

A `KVBlock` is one device block (its id indexes the device KV arrays); a
`HostBlock` is one slot of the host arena. Both carry the same `CachedBlock`
fields, so one eviction queue and one set of rules serve both tiers.

A block is *blank* (no `block_hash`: never registered, or forgotten) or holds
a *cache entry*: the digest, the key the digest was computed from (to confirm
a hit without trusting the digest), the parent digest, the namespace, and a
`serial` naming the entry's content for as long as it lives. An entry keeps
its serial when it moves between tiers, and a new serial is drawn whenever a
digest is registered anew, so "same serial" means "same bytes of KV".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

from .hashing import BlockHash, Namespace

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from 3.11

BlockId = NewType("BlockId", int)
HostSlot = NewType("HostSlot", int)

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority


def validate_priority(priority: int) -> int:
    """A retention priority, or ValueError naming the bad value."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer in [0, 100]; got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be in [0, 100]; got {priority}")
    return priority


def validate_duration(duration_s: float | None) -> float | None:
    """A priority duration in seconds (None: never expires), or ValueError naming the bad value."""
    if duration_s is None:
        return None
    if isinstance(duration_s, bool) or not isinstance(duration_s, int | float):
        raise ValueError(f"priority_duration_s must be a number of seconds; got {duration_s!r}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"priority_duration_s must be > 0 and finite; got {duration_s}")
    return float(duration_s)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What a block's digest was computed from, stored to confirm a hit."""

    token_ids: tuple[int, ...]
    extra_ids: tuple[int, ...] | None = None

    @classmethod
    def of(cls, token_ids: Sequence[int], extra_ids: Sequence[int] | None = None) -> BlockKey:
        """A key of plain ints (NumPy scalars in, Python ints out: events must serialize)."""
        extra = None if extra_ids is None else tuple(map(int, extra_ids))
        return cls(tuple(map(int, token_ids)), extra)

    def common_prefix(self, token_ids: Sequence[int], extra_ids: Sequence[int] | None) -> int:
        """How many leading tokens (and their extra ids) this key shares with the given ones."""
        if (self.extra_ids is None) != (extra_ids is None):
            return 0
        mine: Sequence[object] = self.token_ids
        theirs: Sequence[object] = token_ids
        if self.extra_ids is not None and extra_ids is not None:
            mine = list(zip(mine, self.extra_ids, strict=True))
            theirs = list(zip(theirs, extra_ids, strict=True))
        for idx, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a != b:
                return idx
        return min(len(mine), len(theirs))


@dataclass(slots=True, eq=False, kw_only=True)
class CachedBlock:
    """The fields a device block and a host slot share.

    NOTE: `ref_count > 0` exactly when the block is out of its eviction queue
    (`queue_level is None`). On a host slot the references are copy pins.
    NOTE: a block in an eviction queue with a `block_hash` is findable (it is
    the one block its tier's index holds for that digest); a held block may
    also carry the entry of a block it duplicates (see `BlockPool.register`).
    """

    ref_count: int = 0
    # The cache entry; all None while blank.
    block_hash: BlockHash | None = None
    key: BlockKey | None = None
    parent_hash: BlockHash | None = None
    namespace: Namespace | None = None
    serial: int | None = None
    # Random, drawn when the entry is made (or its disk file's, when read from disk),
    # and kept through tier moves: the disk tier serves a file as a block's child only
    # under the parent entry of the lineage it was written under (disk_format.py).
    lineage: bytes | None = None
    # Retention: `priority` until `priority_expiry` (set while queued, when a
    # duration is given), then DEFAULT_PRIORITY.
    priority: int = DEFAULT_PRIORITY
    priority_duration_s: float | None = None
    priority_expiry: float | None = None
    # Eviction-queue links (see free_queue.py); None while out of the queue. A queue
    # holds blocks of one tier, so the links are blocks of this block's own class.
    prev: Self | None = field(default=None, repr=False)
    next: Self | None = field(default=None, repr=False)
    queue_level: int | None = field(default=None, repr=False)
    queue_token: int = field(default=0, repr=False)

    @property
    def is_blank(self) -> bool:
        return self.block_hash is None

    def confirms(self, key: BlockKey, parent_hash: BlockHash | None, namespace: Namespace) -> bool:
        """Whether this entry was registered from this key, parent and namespace: a
        digest match is a hit only if this holds too. (Below the first block the
        namespace is the parent's, so it can only differ there.)"""
        return self.confirms_ids(key.token_ids, key.extra_ids, parent_hash, namespace)

    def confirms_ids(
        self,
        token_ids: tuple[int, ...],
        extra_ids: tuple[int, ...] | None,
        parent_hash: BlockHash | None,
        namespace: Namespace,
    ) -> bool:
        """`confirms` for the key these ids would make (ints compare equal whatever
        their type), without making one: a chain's lookup confirms every block."""
        key = self.key
        return (
            key is not None
            and key.token_ids == token_ids
            and key.extra_ids == extra_ids
            and self.parent_hash == parent_hash
            and (self.namespace is namespace or self.namespace == namespace)
        )

    def set_retention(self, priority: int, duration_s: float | None) -> None:
        self.priority = priority
        self.priority_duration_s = None if priority == DEFAULT_PRIORITY else duration_s

    def take_entry(self, other: CachedBlock) -> None:
        """Move `other`'s cache entry and retention here (a tier move); `other` becomes blank."""
        assert self.is_blank and not other.is_blank
        self.block_hash, self.key, self.parent_hash = other.block_hash, other.key, other.parent_hash
        self.namespace, self.serial, self.lineage = other.namespace, other.serial, other.lineage
        self.set_retention(other.priority, other.priority_duration_s)
        other.clear_entry()

    def share_entry(self, other: CachedBlock) -> None:
        """Record that this block holds the same bytes as `other`'s entry (a duplicate)."""
        assert self.is_blank and not other.is_blank
        self.block_hash, self.key, self.parent_hash = other.block_hash, other.key, other.parent_hash
        self.namespace, self.serial, self.lineage = other.namespace, other.serial, other.lineage

    def clear_entry(self) -> None:
        self.block_hash = self.key = self.parent_hash = self.namespace = self.serial = None
        self.lineage = None
        self.set_retention(DEFAULT_PRIORITY, None)


@dataclass(slots=True, eq=False, kw_only=True)
class KVBlock(CachedBlock):
    """One device block: `block_size` tokens of K and V for every layer."""

    block_id: BlockId


@dataclass(slots=True, eq=False, kw_only=True)
class HostBlock(CachedBlock):
    """One slot of the host arena, with the device blocks' per-block layout."""

    slot: HostSlot
