"""The block pool's side of the disk tier (pool.py's `BlockPool` is a `DiskSide`):
extending a match past its memory hits with sound block files, a partial match's
source found on disk, and planning a findable entry's write to disk.

Guarantees (as pool.py states them for the disk tier):
- A disk hit is served only once the tier read and checked its file against the
  request's key (checksums, digest, parent digest, tokens, extra ids, namespace)
  and against its parent entry's lineage (a first block's parent is the root); a
  digest already in memory under another key ends the match (a collision). An
  entry read from disk takes its file's lineage, and an entry computed anew the
  lineage of a file of the very same block under the same parent entry (its twin),
  so the files below stay its children.
- The blocks matched so far are held, so taking free blocks for disk hits evicts
  none of them, and each new entry's parent is findable when it is inserted.
- Only entries of priority >= `offload_min_priority` are written, once each (the
  tier `knows` what it holds or has queued).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .block import BlockId, BlockKey, CachedBlock, HostBlock, KVBlock
from .copies import BlockCopy, CopyKind, DiskEntry
from .disk import DiskTier
from .disk_format import NO_LINEAGE
from .free_queue import EvictionQueue
from .hashing import DEFAULT_NAMESPACE, BlockHash, Namespace
from .host import HostTier
from .index import CacheIndex
from .stats import PoolCounters

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np


class DiskSide:
    """The disk tier's half of the block pool; its fields are the pool's (set in
    `BlockPool.__init__`), named here so this half reads on its own."""

    host_tier: HostTier | None
    disk_tier: DiskTier | None
    offload_min_priority: int
    _host_memory: Callable[[int], np.ndarray] | None
    _copies_ready: Callable[[], None] | None
    _copy_batch: int
    _queue: EvictionQueue[KVBlock]
    _index: CacheIndex
    _counters: PoolCounters
    _copies: list[BlockCopy]
    _disk_arrivals: list[KVBlock]
    _disk_partials: dict[BlockId, np.ndarray]
    _handles: itertools.count[int]
    _take_free_block: Callable[[float], KVBlock]

    def _match_disk(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids_per_block: Sequence[Sequence[int]],
        extra_ids_per_block: Sequence[Sequence[int] | None] | None,
        namespace: Namespace | None,
        block_ids: list[BlockId],
        now: float,
    ) -> int:
        """Extend a match past its memory hits with sound disk files, each read and
        checked by the disk tier and onboarded into a fresh device entry; returns how many.

        NOTE: the matched blocks so far are held, so taking free blocks here evicts
        none of them, and each new entry's parent is findable when it is inserted.
        """
        disk = self.disk_tier
        if disk is None or not disk.enabled:
            return 0
        namespace = namespace or DEFAULT_NAMESPACE
        start = len(block_ids)
        # The run of blocks the disk holds, as many as there are free blocks to take them,
        # each written under the entry before it (the first: under the match's last): a
        # file outlives the entry it was written under, and a later entry of a colliding
        # digest is no parent of its children (disk_format.py: lineage). A run of several
        # is read and checked ahead on the tier's reader threads, and taken here in chain
        # order.
        end = start
        limit = min(len(block_hashes), start + len(self._queue))
        lineage = self._parent_lineage(block_hashes[start - 1] if start else None)
        lineages: list[bytes | None] = []  # the parent entry's, for each block of the run
        while end < limit and (stored := disk.lineages(block_hashes[end])) is not None:
            if lineage is not None and stored[1] != lineage:
                break
            lineages.append(lineage)
            lineage = stored[0]
            end += 1
        keys = []
        for idx in range(start, end):
            extra_ids = None if extra_ids_per_block is None else extra_ids_per_block[idx]
            key = BlockKey.of(token_ids_per_block[idx], extra_ids)
            keys.append((block_hashes[idx], block_hashes[idx - 1] if idx else None, key))
        slots = self._take_read_slots(len(keys), now)
        into: list[np.ndarray | None] = (
            [self._host_memory(slot.slot) for slot in slots] if self._host_memory else []
        )
        into += [None] * (len(keys) - len(into))
        reads = (
            disk.read_ahead(
                [(h, p, k.token_ids, k.extra_ids) for h, p, k in keys], namespace, into, lineages
            )
            if len(keys) > 1
            else []
        )
        parent_hash = block_hashes[start - 1] if start else None
        num_hits = 0
        for offset, (block_hash, _, key) in enumerate(keys):
            if self._index.lookup(block_hash) is not None:
                break  # a memory entry under this digest with another key: a collision
            staged = disk.get(
                block_hash,
                parent_hash,
                key.token_ids,
                extra_ids=key.extra_ids,
                namespace=namespace,
                ahead=reads[offset] if reads else None,
                into=None if reads else into[offset],
                parent_lineage=lineages[offset],
            )
            stored = disk.lineages(block_hash)
            # gone, damaged (counted and removed), another key's or another parent's
            if staged is None or stored is None:
                break
            block = self._take_free_block(now)
            self._index.insert(block, block_hash, key, parent_hash, namespace, lineage=stored[0])
            if offset < len(slots):  # read into a host slot: onboarded from there
                assert self.host_tier is not None
                self._copies.append(self.host_tier.start_onboard(slots[offset], block))
            else:
                block.ref_count += 1  # the copy's pin, released by complete_copies()
                self._disk_arrivals.append(block)
                self._copies.append(BlockCopy("disk_onboard", None, block.block_id, staged=staged))
            block_ids.append(block.block_id)
            parent_hash = block_hash
            num_hits += 1
            if self._copies_ready is not None and num_hits % self._copy_batch == 0:
                self._copies_ready()  # these blocks' copies start while later reads go on
        # Reads not taken: those not started never run, those running end before their
        # slots are free again.
        disk.settle(reads[num_hits:])
        for slot in slots[num_hits:]:
            assert self.host_tier is not None
            self.host_tier.return_slot(slot, now)
        return num_hits

    def _take_read_slots(self, n: int, now: float) -> list[HostBlock]:
        """Up to `n` host slots to read disk hits into (none without `host_memory`): free
        ones, blank or holding an entry the disk tier has (or would not keep), which is
        forgotten. Fewer when the tier runs out, or at an entry still to be written to
        disk (its write reads the slot after this step's reads have overwritten it)."""
        host, disk = self.host_tier, self.disk_tier
        slots: list[HostBlock] = []
        if host is None or self._host_memory is None or disk is None:
            return slots
        while len(slots) < n:
            slot = host.take_slot(now)  # None when every slot is pinned
            if slot is None:
                break
            if slot.block_hash is not None:
                if slot.priority >= self.offload_min_priority and not disk.knows(slot.block_hash):
                    host.return_slot(slot, now)
                    break
                self._counters.host_evictions += 1
                self._index.drop(slot, now)
            slots.append(slot)
        return slots

    def _find_partial_on_disk(
        self,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_ids: Sequence[int] | None,
        namespace: Namespace | None,
        num_in_memory: int,
    ) -> tuple[BlockId, int] | None:
        """A disk child sharing more than `num_in_memory` tokens, read and checked, as a
        handle (find_partial); None if there is none or its file is bad."""
        disk = self.disk_tier
        if disk is None or not disk.enabled:
            return None
        namespace = namespace or DEFAULT_NAMESPACE
        parent_lineage = self._parent_lineage(parent_hash)
        found = disk.find_partial(
            parent_hash, token_ids, extra_ids=extra_ids, namespace=namespace,
            parent_lineage=parent_lineage,
        )  # fmt: skip
        if found is None or found.num_tokens <= num_in_memory:
            return None
        if self._index.lookup(found.block_hash) is not None:
            return None  # in memory under another key (a collision), or found there already
        staged = disk.get(
            found.block_hash,
            parent_hash,
            found.token_ids,
            extra_ids=found.extra_ids,
            namespace=namespace,
            parent_lineage=parent_lineage,
        )
        if staged is None:  # gone, damaged (counted and removed) or another key's
            return None
        handle = BlockId(next(self._handles))
        self._disk_partials[handle] = staged
        self._counters.partial_hits += 1
        self._counters.disk_hits += 1
        return handle, found.num_tokens

    def _plan_disk_write(self, entry: CachedBlock, kind: CopyKind, src: int) -> None:
        """Plan writing a findable entry's block to disk, unless the tier has it or is off,
        or the entry's retention is below the offload minimum (dropped, not kept)."""
        disk = self.disk_tier
        if disk is None or not disk.enabled or entry.priority < self.offload_min_priority:
            return
        assert entry.block_hash is not None and entry.key is not None
        assert entry.namespace is not None
        if disk.knows(entry.block_hash):
            return
        assert entry.lineage is not None
        parent_lineage = self._parent_lineage(entry.parent_hash)  # its parent is findable
        disk_entry = DiskEntry(
            entry.block_hash, entry.parent_hash, entry.key.token_ids, entry.key.extra_ids,
            entry.namespace, entry.lineage, parent_lineage or NO_LINEAGE,
        )  # fmt: skip
        self._copies.append(BlockCopy(kind, src, None, entry=disk_entry))

    def _twin_lineage(
        self,
        block_hash: BlockHash,
        key: BlockKey,
        parent_hash: BlockHash | None,
        namespace: Namespace,
    ) -> bytes | None:
        """The lineage of a disk file of this very block (its key, under the parent entry
        the new entry has), for the entry computed anew to take; None: a fresh one."""
        disk = self.disk_tier
        if disk is None or not disk.enabled:
            return None
        return disk.twin_lineage(
            block_hash, parent_hash, key.token_ids, key.extra_ids, namespace,
            self._parent_lineage(parent_hash),
        )  # fmt: skip

    def _parent_lineage(self, parent_hash: BlockHash | None) -> bytes | None:
        """The lineage of the findable entry `parent_hash` names (None for a first block:
        its parent is the namespace's root, which every lineage shares)."""
        if parent_hash is None:
            return None
        parent = self._index.lookup(parent_hash)
        assert parent is not None and parent.lineage is not None, "no findable parent"
        return parent.lineage
