"""The device block pool: allocation, reference counts, and reuse of full blocks by key.

Life of a block: `allocate` hands out blank blocks (taking a cached one, when
no blank is left, evicts it); the request writes KV into it; once full and
written, `register` makes it findable by its key (hashing.py); `match` finds
the longest cached prefix of a later request and gives it references to
those blocks; `free` drops references, and a block nobody holds waits in the
eviction queue (free_queue.py), still findable, until it is taken again.

Guarantees:
- A block with references is never evicted, handed out or written by the
  pool; `allocate` returns None (and evicts nothing) when it cannot give all.
- A hit is never served on the digest alone: the stored tokens, extra ids,
  namespace (first block) and parent digest must equal the request's; and a
  block is only registered under a parent whose bytes are those of the entry
  findable under the parent's digest (same serial). So a digest collision
  never serves KV computed for other tokens or another prefix.
- No findable orphans and no holes (index.py): an entry leaving both tiers
  takes its findable descendants with it. Freeing tail first makes this rare:
  within one priority, a chain is evicted from its end.
- Host tier: a device block evicted with priority >= `offload_min_priority`
  (default 35, the default priority, so only blocks a client ranked below the
  default are dropped rather than kept) moves to a host slot and stays
  findable; a host hit moves back into a fresh device block inside `match`.
- The pool never moves bytes: every copy it decides on (offload, onboard, and
  the partial-reuse copy the KV manager asks for) is appended to one ordered
  list (copies.py) that `take_copies()` hands to the runner, which executes it
  before the forward pass; both ends of a tier copy stay pinned until
  `complete_copies()`.
- Disk tier (disk.py), below the host tier: every block registered with
  priority >= `offload_min_priority` is written through to disk (so a killed
  daemon leaves it behind), and an entry leaving the memory tiers before its
  write was queued is written then. Writes are copies in the list (the runner
  reads the bytes and queues them to the tier's writer thread). On a device
  and host miss, `match` looks the rest of the chain up on disk: the tier
  reads and checks each file there (checksums, then the stored key as for a
  memory hit), so a damaged or foreign file ends the match as a miss, and each
  sound one becomes a fresh device entry filled by a `disk_onboard` copy.
  With `copies_ready`, a long run of host or disk hits tells the engine every
  `copy_batch` hits that copies are planned, so it can take and start them
  (in list order, as it would at the step) while the match goes on (the later
  reads, or the later host hits' bookkeeping).
  `find_partial` looks there too (read and checked the same way), and a disk
  block's bytes go straight into the request's fresh block: no device block
  is taken for the source. `clear` forgets the disk tier's blocks with the
  rest (its files are removed by its writer thread). The pool's side of all this
  (matching on disk, planning writes) is pool_disk.py's `DiskSide`.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .block import (
    DEFAULT_PRIORITY,
    BlockId,
    BlockKey,
    CachedBlock,
    HostBlock,
    KVBlock,
    validate_duration,
    validate_priority,
)
from .copies import DISK_WRITE_KINDS, PINNED_KINDS, BlockCopy
from .disk import DiskTier
from .events import EventSink
from .free_queue import EvictionQueue
from .hashing import DEFAULT_NAMESPACE, BlockHash, Namespace, decode_blocks
from .host import HostTier
from .index import CacheIndex, ParentKey
from .pool_disk import DiskSide
from .stats import KVCacheStats, PoolCounters

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = ["BlockId", "BlockPool", "MatchResult"]

# Host or disk hits planned between two calls of `copies_ready` during one match: with
# 4 MiB blocks (Llama-3.1-8B, 32 tokens), 16 MiB, about 0.3 ms of host-to-device copy.
COPY_BATCH = 4


@dataclass(slots=True)
class MatchResult:
    """The cached prefix `match` found: one device block per matched block, in order.

    The caller holds one reference to each (free them like allocated ones).
    `num_host_hits` of them are onboarded from the host tier, then the last
    `num_disk_hits` from the disk tier, by copies in the pool's list
    (`take_copies()`).
    """

    block_ids: list[BlockId]
    num_host_hits: int = 0
    num_disk_hits: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)  # the matched blocks' keys

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_device_hits(self) -> int:
        return len(self.block_ids) - self.num_host_hits - self.num_disk_hits


class BlockPool(DiskSide):
    """`num_blocks` device blocks of `block_size` tokens, found again by key.

    NOTE: a block is either free (in the eviction queue, ref count 0) or held
    (ref count > 0, out of it); `check_integrity()` asserts that partition and
    every other invariant named in the module docstrings.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_reuse: bool = True,
        host_tier: HostTier | None = None,
        disk_tier: DiskTier | None = None,
        offload_min_priority: int = DEFAULT_PRIORITY,
        clock: Callable[[], float] = time.monotonic,
        event_sink: EventSink | None = None,
        host_memory: Callable[[int], np.ndarray] | None = None,
        copies_ready: Callable[[], None] | None = None,
        copy_batch: int = COPY_BATCH,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two; got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_reuse = enable_reuse
        self.host_tier = host_tier
        self.disk_tier = disk_tier
        # a host slot's memory (its index -> a writable array of one block), where disk
        # hits are read when the host tier has free slots; None: into fresh memory
        self._host_memory = host_memory if host_tier is not None else None
        # called inside a match, every `copy_batch` host hits and every `copy_batch` disk
        # hits, so the engine may run `take_copies()` now (in order, as at the step): the
        # device copies of the blocks matched so far overlap the rest of the match (disk
        # reads still going on). It must not call the pool but for take_copies.
        self._copies_ready = copies_ready
        if copy_batch < 1:
            raise ValueError(f"copy_batch must be >= 1; got {copy_batch}")
        self._copy_batch = copy_batch
        self.offload_min_priority = validate_priority(offload_min_priority)
        self._clock = clock
        self.blocks = [KVBlock(block_id=BlockId(i)) for i in range(num_blocks)]
        self._queue: EvictionQueue[KVBlock] = EvictionQueue()
        now = clock()
        for block in self.blocks:
            self._queue.append(block, now)
        self._index = CacheIndex(block_size, self._queue, host_tier, event_sink)
        self._counters = PoolCounters()
        self._copies: list[BlockCopy] = []  # planned since the last take_copies(), in order
        self._disk_arrivals: list[KVBlock] = []  # disk_onboard destinations, pinned
        # find_partial's sources found on disk: handle -> the block's checked bytes
        # [num_layers, 2, num_kv_heads, block_size, head_dim]; see find_partial
        self._disk_partials: dict[BlockId, np.ndarray] = {}
        self._handles = itertools.count(num_blocks)
        if disk_tier is not None and event_sink is not None:
            disk_tier.attach_events(event_sink)  # a restart's files are announced here

    @property
    def num_free_blocks(self) -> int:
        return len(self._queue)

    @property
    def num_pending_copies(self) -> int:
        host = 0 if self.host_tier is None else self.host_tier.num_pending_copies
        return host + len(self._disk_arrivals)

    @property
    def num_planned_copies(self) -> int:
        """Copies planned and not yet taken (e.g. disk writes planned by `register`)."""
        return len(self._copies)

    @property
    def num_planned_pins(self) -> int:
        """Copies planned and not yet taken that pin their ends (tier copies, disk
        onboards): `complete_copies` must wait until they are taken and have run."""
        return sum(copy.kind in PINNED_KINDS for copy in self._copies)

    def eviction_order(self) -> list[BlockId]:
        """The free blocks, the next to be taken first."""
        self._queue.refresh(self._clock())
        return [block.block_id for block in self._queue]

    def allocate(self, n: int) -> list[BlockId] | None:
        """Take `n` free blocks (ref count 1 each), or None when fewer are free.

        Blank blocks go first; taking a cached block evicts it (to the host
        tier when it qualifies, else it is forgotten with its descendants).
        A block being offloaded is read by a copy in the list `take_copies()`
        returns, which must run before the forward pass writes the blocks.
        """
        assert n >= 0, n
        if n > len(self._queue):
            return None
        now = self._clock()
        block_ids = [self._take_free_block(now).block_id for _ in range(n)]
        self._counters.alloc_new_blocks += n
        return block_ids

    def free(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one reference to each block; blocks at zero join the eviction queue.

        Queued tail first, so a request's tail blocks are evicted before its
        head blocks and a cached chain is consumed from its end.
        """
        now = self._clock()
        freed: list[KVBlock] = []  # at zero references, in the order they join the queue
        blocks, num_blocks, device = self.blocks, self.num_blocks, self._index.device
        for block_id in reversed(block_ids):
            if block_id >= num_blocks:  # a disk partial's handle (find_partial)
                del self._disk_partials[block_id]
                continue
            block = blocks[block_id]
            # `_unref` inlined (a 4k prompt's 128 blocks: bench_host_step's cached prompt)
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.block_hash is not None and device.get(block.block_hash) is not block:
                block.clear_entry()  # a duplicate: its entry lives in another block
            freed.append(block)
        self._queue.append_all(freed, now)

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """Take one more reference to each held or cached block (e.g. to share a prefix)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0 or block.block_hash is not None, f"block {block_id} is blank"
            self._hold(block)

    def chain_of_ids(self, id_bytes: bytes, namespace: Namespace | None = None) -> list[BlockHash]:
        """The keys of the longest cached chain (device or host) holding `id_bytes` (ids
        as keys encode them, `hashing.encode_ids`, a whole number of blocks, no extra
        ids) under `namespace`: those `hash_encoded_blocks` gives its blocks, found
        by content instead of hashed. Takes nothing; [] with reuse off."""
        if not self.enable_reuse:
            return []
        entries = self._index.find_prefix_by_ids((), id_bytes, namespace or DEFAULT_NAMESPACE)
        return [entry.block_hash for entry in entries]  # type: ignore[misc]

    @property
    def searches_disk(self) -> bool:
        """Whether a match goes on to the disk tier past its memory hits (which it finds
        by key: a match by ids needs the keys of the blocks past them)."""
        return self.enable_reuse and self.disk_tier is not None and self.disk_tier.enabled

    def match(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids_per_block: Sequence[Sequence[int]] | bytes,
        *,
        extra_ids_per_block: Sequence[Sequence[int] | None] | None = None,
        namespace: Namespace | None = None,
        priority: int | None = None,
        priority_duration_s: float | None = None,
    ) -> MatchResult:
        """The longest prefix of consecutive hits (device or host), held for the caller.

        A hit needs the digest AND the stored key: tokens, extra ids, parent
        digest and (first block) namespace. Host hits are onboarded into fresh
        device blocks; if none is free, the match ends before that block. With
        `priority`, the matched blocks take this request's retention (the
        latest request's retention wins, as in TensorRT-LLM).

        The blocks' ids may come as one `bytes`, every block's ids as keys encode them
        (`hashing.encode_ids`), for blocks without extra ids: each hit is then found and
        confirmed by the index's content map instead of a tuple of ids (the same hits),
        and `block_hashes` may stop short of the blocks: past it, a hit's key is the one
        its entry holds (the key hashing gives), and the disk tier is not searched.
        `MatchResult.block_hashes` has every matched block's key.
        """
        if isinstance(token_ids_per_block, bytes):
            width = 8 * self.block_size
            num_blocks, rest = divmod(len(token_ids_per_block), width)
            if rest or num_blocks < len(block_hashes):
                raise ValueError(
                    f"{len(block_hashes)} hashes but {len(token_ids_per_block)} bytes of ids "
                    f"({width} a block)"
                )
            if extra_ids_per_block is not None:
                raise ValueError("ids given as bytes hold no extra ids: give them per block")
        elif len(token_ids_per_block) != len(block_hashes):
            raise ValueError(
                f"{len(block_hashes)} hashes but {len(token_ids_per_block)} token blocks"
            )
        if extra_ids_per_block is not None and len(extra_ids_per_block) != len(block_hashes):
            raise ValueError(
                f"{len(block_hashes)} hashes but {len(extra_ids_per_block)} extra-id blocks"
            )
        if priority is not None:
            priority = validate_priority(priority)
        duration_s = validate_duration(priority_duration_s)
        hits: list[CachedBlock] = []
        if self.enable_reuse:
            if isinstance(token_ids_per_block, bytes):
                hits = self._index.find_prefix_by_ids(
                    block_hashes, token_ids_per_block, namespace or DEFAULT_NAMESPACE
                )
            else:
                hits = self._index.find_prefix(
                    block_hashes,
                    token_ids_per_block,
                    extra_ids_per_block,
                    namespace or DEFAULT_NAMESPACE,
                )
        # the hits' keys, read before any moves to the device tier
        keys: list[BlockHash] = [entry.block_hash for entry in hits]  # type: ignore[misc]
        device_hits = [entry for entry in hits if type(entry) is KVBlock]
        now = self._clock()
        if len(device_hits) == len(hits):  # all in device memory: nothing to onboard
            self._hold_all(device_hits)
            block_ids, num_host_hits = [entry.block_id for entry in device_hits], 0
        else:
            block_ids, num_host_hits = self._take_hits(hits, device_hits, now)
        num_disk_hits = 0
        if self.enable_reuse and len(block_ids) == len(hits) < len(block_hashes):
            if isinstance(token_ids_per_block, bytes):
                token_ids_per_block = decode_blocks(token_ids_per_block, self.block_size)
            num_disk_hits = self._match_disk(
                block_hashes, token_ids_per_block, extra_ids_per_block, namespace, block_ids, now
            )
        keys = keys[: len(block_ids) - num_disk_hits] + list(
            block_hashes[len(block_ids) - num_disk_hits : len(block_ids)]
        )
        if priority is not None:
            for block_id in block_ids:
                self.blocks[block_id].set_retention(priority, duration_s)
        self._counters.reused_blocks += len(block_ids)
        self._counters.missed_blocks += len(block_hashes) - len(block_ids)
        self._counters.host_hits += num_host_hits
        self._counters.host_onboards += num_host_hits
        self._counters.disk_hits += num_disk_hits
        return MatchResult(block_ids, num_host_hits, num_disk_hits, keys)

    def _take_hits(
        self, hits: list[CachedBlock], device_hits: list[KVBlock], now: float
    ) -> tuple[list[BlockId], int]:
        """Hold a match's device hits and onboard its host hits, in chain order, each
        into a free device block; stops at the first host hit with none left. Returns
        the device blocks and how many of them were onboarded."""
        assert self.host_tier is not None
        for entry in hits:  # pinned, so that onboarding the earlier hits cannot evict it
            if isinstance(entry, HostBlock):
                self.host_tier.pin(entry)
        self._hold_all(device_hits)
        block_ids: list[BlockId] = []
        num_host_hits = 0
        for idx, entry in enumerate(hits):
            if isinstance(entry, KVBlock):
                block_ids.append(entry.block_id)
                continue
            assert isinstance(entry, HostBlock)
            if not len(self._queue):
                self._unhold(hits[idx:], now)
                break
            device_block = self._take_free_block(now)
            self._index.move(entry, device_block)
            self._copies.append(self.host_tier.start_onboard(entry, device_block))
            self.host_tier.unpin(entry, now)  # match's own pin; the copy's pin stays
            block_ids.append(device_block.block_id)
            num_host_hits += 1
            if self._copies_ready is not None and num_host_hits % self._copy_batch == 0:
                self._copies_ready()  # these onboards (and offloads) start while we go on
        return block_ids, num_host_hits

    def register(
        self,
        block_id: BlockId,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_block_id: BlockId | None,
        *,
        extra_ids: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        priority: int = DEFAULT_PRIORITY,
        priority_duration_s: float | None = None,
    ) -> bool:
        """Make a held, full, written block findable under `block_hash`.

        `parent_block_id` is the request's previous block (None for its first,
        which records `namespace`; later blocks inherit it). Returns True when
        later blocks can chain onto this one: it is now findable, or it
        duplicates the findable entry of the same key (that entry is kept, with
        its place in the eviction order and its retention; this block stays
        unfindable and turns blank when freed). Returns False, leaving the
        block unfindable, when reuse is off, the parent's bytes are not (or no
        longer) those findable under its digest, or the digest is taken by a
        different key (a collision: the entry there stays).
        """
        priority = validate_priority(priority)
        duration_s = validate_duration(priority_duration_s)
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are registered; got {len(token_ids)} tokens")
        if extra_ids is not None and len(extra_ids) != len(token_ids):
            raise ValueError(f"{len(extra_ids)} extra ids for {len(token_ids)} tokens")
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} is not held"
        if block.block_hash is not None:
            assert block.block_hash == block_hash, f"block {block_id} registered twice"
            return self._index.is_current(block)
        if not self.enable_reuse:
            return False
        if parent_block_id is None:
            parent_hash, namespace = None, namespace or DEFAULT_NAMESPACE
        else:
            parent = self.blocks[parent_block_id]
            if not self._index.is_current(parent):
                return False
            parent_hash, namespace = parent.block_hash, parent.namespace
        assert namespace is not None
        key = BlockKey.of(token_ids, extra_ids)
        existing = self._index.lookup(block_hash)
        if existing is None:
            block.set_retention(priority, duration_s)
            lineage = self._twin_lineage(block_hash, key, parent_hash, namespace)
            self._index.insert(block, block_hash, key, parent_hash, namespace, lineage)
            self._plan_disk_write(block, "device_to_disk", block.block_id)
            return True
        if not existing.confirms(key, parent_hash, namespace):
            return False  # a digest collision: the entry there stays
        block.share_entry(existing)
        return True

    def find_partial(
        self,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        *,
        extra_ids: Sequence[int] | None = None,
        namespace: Namespace | None = None,
    ) -> tuple[BlockId, int] | None:
        """The cached child of `parent_hash` (None: of the namespace's root) sharing
        the longest nonzero prefix with `token_ids`, as a device block, and that length.

        `parent_hash` must be the digest of the request's last matched block.
        The block is held for the caller (one reference) so it survives the
        allocation of the block its tokens' KV is copied into; free it after
        the copy. Ties go to the child registered first. A child in the host tier
        is onboarded into a free device block first (None if there is none), by
        a copy in the pool's list.

        A child found only in the disk tier, sharing more tokens than any in
        memory, is read and checked as a disk hit of `match` is (a bad file: None),
        and takes no device block: the id returned is then a handle past the
        pool's blocks, which `copy_block` turns into a `disk_onboard` copy of the
        checked bytes into its destination and `free` lets go of.
        """
        if not self.enable_reuse or not token_ids:
            return None
        key: ParentKey = parent_hash if parent_hash is not None else namespace or DEFAULT_NAMESPACE
        found = self._index.find_partial(key, token_ids, extra_ids)
        on_disk = self._find_partial_on_disk(
            parent_hash, token_ids, extra_ids, namespace, 0 if found is None else found[1]
        )
        if on_disk is not None:
            return on_disk
        if found is None:
            return None
        entry, num_tokens = found
        if isinstance(entry, KVBlock):
            self._hold(entry)
            block = entry
        else:
            assert isinstance(entry, HostBlock) and self.host_tier is not None
            if not len(self._queue):
                return None
            now = self._clock()
            self.host_tier.pin(entry)  # taking a free block may evict to the host tier
            block = self._take_free_block(now)
            self._index.move(entry, block)
            self._copies.append(self.host_tier.start_onboard(entry, block))
            self.host_tier.unpin(entry, now)  # ours; the copy's pin stays
            self._counters.host_hits += 1
            self._counters.host_onboards += 1
        self._counters.partial_hits += 1
        return block.block_id, num_tokens

    def is_disk_partial(self, block_id: BlockId) -> bool:
        """Whether `block_id` is a disk partial's handle (find_partial), not a device block."""
        return block_id in self._disk_partials

    def is_arriving(self, block_id: BlockId) -> bool:
        """Whether a host-tier copy into this device block is planned and not completed."""
        return self.host_tier is not None and self.host_tier.is_arriving(block_id)

    def copy_block(self, src: BlockId, dst: BlockId) -> None:
        """Plan a whole-block device copy (partial reuse); both blocks must be held
        by the caller until the copy has run, i.e. until after the step's forward.
        `src` may be a disk partial's handle (find_partial): its bytes are onboarded
        into `dst`, pinned until `complete_copies()`."""
        staged = self._disk_partials.get(src)
        if staged is not None:
            block = self.blocks[dst]
            assert block.ref_count > 0 and block.block_hash is None, dst
            block.ref_count += 1  # the copy's pin, released by complete_copies()
            self._disk_arrivals.append(block)
            self._copies.append(BlockCopy("disk_onboard", None, dst, staged=staged))
            return
        assert self.blocks[src].ref_count > 0 and self.blocks[dst].ref_count > 0, (src, dst)
        self._copies.append(BlockCopy("device", src, dst))

    def take_copies(self) -> list[BlockCopy]:
        """The copies planned since the last call, in the order they must run."""
        copies, self._copies = self._copies, []
        return copies

    def complete_copies(self) -> int:
        """Every copy taken has run: release the tier copies' pins; returns how many.

        NOTE: call only after the runner executed everything `take_copies()`
        returned; a copy planned and not yet taken would still read or write a
        block whose pin this releases.
        """
        assert not any(c.kind in PINNED_KINDS for c in self._copies), (
            "complete_copies before take_copies"
        )
        now = self._clock()
        device_blocks, self._disk_arrivals = self._disk_arrivals, []
        if self.host_tier is not None:
            device_blocks += self.host_tier.complete_copies(now)
        for block in device_blocks:
            self._release(block, now)
        return len(device_blocks)

    def clear(self) -> None:
        """Forget every cached block of every tier (held blocks stay held), so the next
        request computes afresh; emits AllBlocksCleared. Counters are kept.

        The disk tier forgets its blocks at once and its writer removes their files;
        disk writes planned and not yet run are dropped (they would bring cleared
        blocks back)."""
        if self.disk_tier is not None:
            self.disk_tier.clear()  # before the event: no disk event of old blocks follows it
            self._copies = [c for c in self._copies if c.kind not in DISK_WRITE_KINDS]
        self._index.clear(self.blocks, self._clock())

    def stats(self) -> KVCacheStats:
        host = self.host_tier
        return KVCacheStats.from_counters(
            self._counters,
            max_blocks=self.num_blocks,
            free_blocks=len(self._queue),
            tokens_per_block=self.block_size,
            cached_blocks=len(self._index.device),
            host_max_blocks=0 if host is None else host.num_blocks,
            host_cached_blocks=0 if host is None else host.num_cached_blocks,
            disk=None if self.disk_tier is None else self.disk_tier.stats(),
        )

    def check_integrity(self) -> None:
        """Assert every invariant of the pool, its index and its host tier (O(pool); for tests)."""
        self._queue.check()
        host = self.host_tier
        pending = host.pending_copies() if host is not None else ()
        pins = Counter(id(c.device_block) for c in pending)
        pins.update(id(block) for block in self._disk_arrivals)
        assert not self._disk_partials, "a disk partial's handle was never freed"
        for block in self.blocks:
            assert block.ref_count >= pins[id(block)], f"block {block.block_id}: refs below pins"
            assert (block.queue_level is None) == (block.ref_count > 0), block
            if block.ref_count == 0 and block.block_hash is not None:
                assert self._index.is_findable(block), f"free block {block.block_id} not findable"
        if host is not None:
            host.check_integrity()
        self._index.check()

    def _hold(self, block: KVBlock) -> None:
        self._hold_all((block,))

    def _hold_all(self, blocks: Sequence[KVBlock]) -> None:
        """One more reference to each block; those at zero leave the queue together."""
        self._queue.remove_all([block for block in blocks if block.ref_count == 0])
        for block in blocks:
            block.ref_count += 1

    def _release(self, block: KVBlock, now: float) -> None:
        if self._unref(block):
            self._queue.append(block, now)

    def _unref(self, block: KVBlock) -> bool:
        """Drop one reference; True when none is left (the block is then to be queued)."""
        assert block.ref_count > 0, f"block {block.block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count:
            return False
        # a device block is findable where the device map holds it (is_findable, inlined:
        # a request's release runs this for each of its blocks)
        if block.block_hash is not None and self._index.device.get(block.block_hash) is not block:
            block.clear_entry()  # a duplicate: its entry lives in another block
        return True

    def _unhold(self, entries: Sequence[CachedBlock], now: float) -> None:
        for entry in reversed(entries):
            if isinstance(entry, KVBlock):
                self._release(entry, now)
            else:
                assert isinstance(entry, HostBlock) and self.host_tier is not None
                self.host_tier.unpin(entry, now)

    def _take_free_block(self, now: float) -> KVBlock:
        """Pop the next free block, evicting its entry if it has one; returns it held once."""
        block = self._queue.pop(now)
        assert block is not None
        if block.block_hash is not None:
            self._counters.evictions += 1
            self._evict(block, now)
        block.ref_count += 1
        return block

    def _evict(self, block: KVBlock, now: float) -> None:
        """Move a popped device block's entry to the host tier, or drop it."""
        host = self.host_tier
        slot = None
        if host is not None and block.priority >= self.offload_min_priority:
            slot = host.take_slot(now)  # None when every slot is pinned
        if host is None or slot is None:
            self._plan_disk_write(block, "device_to_disk", block.block_id)
            self._index.drop(block, now)
            return
        if slot.block_hash is not None:
            self._counters.host_evictions += 1
            self._plan_disk_write(slot, "host_to_disk", slot.slot)
            self._index.drop(slot, now)  # drops `block` too if the slot held its ancestor
        if block.block_hash is None:
            host.return_slot(slot, now)
            return
        self._index.move(block, slot)
        self._copies.append(host.start_offload(block, slot))
        self._counters.host_offloads += 1
