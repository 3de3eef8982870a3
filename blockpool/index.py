"""The cache index: which blocks are findable, in which tier, under which parent.

It keeps the device tier's digest -> block map (the host tier keeps its own,
which this class also maintains), the tree of findable children under every
findable entry or namespace root, the entries' serials, and the KV events.

Guarantees:
- One findable entry per digest across both tiers; an entry keeps its serial
  when it moves between tiers, and every new entry draws a fresh serial.
- No findable orphans: `drop` forgets an entry together with every findable
  descendant, in either tier (one BlockRemoved each). So every findable
  block's parent is findable, and a cached chain never has a hole.
- Every change reaches the event sink; a tier move is stored in the new
  medium before it is removed from the old one.
- A findable entry without extra ids is also found by what it holds: its parent key
  and its token ids as keys encode them (`find_prefix_by_ids`). A digest is a function of
  exactly that (and the model, fixed per pool), so a chain found this way has the
  digests hashing its ids would give, without hashing them (a cached prompt's
  admission: a dict lookup a block instead of a SHA-256).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

from .block import BlockKey, CachedBlock, HostBlock, KVBlock
from .disk_format import LINEAGE_NBYTES
from .events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSink,
)
from .free_queue import EvictionQueue
from .hashing import BlockHash, Namespace, encode_ids
from .host import HostTier

ParentKey = BlockHash | Namespace  # a first block's parent is its namespace's root
ContentKey = tuple[ParentKey, bytes]  # (parent key, the block's ids as keys encode them)


def parent_key(block: CachedBlock) -> ParentKey:
    if block.parent_hash is not None:
        return block.parent_hash
    assert block.namespace is not None, block
    return block.namespace


def content_key(block: CachedBlock) -> ContentKey | None:
    """What an entry without extra ids is found by in `find_prefix_by_ids`; None with them."""
    assert block.key is not None, block
    if block.key.extra_ids is not None:
        return None
    return parent_key(block), encode_ids(block.key.token_ids)


def medium_of(block: CachedBlock) -> str:
    return MEDIUM_DEVICE if isinstance(block, KVBlock) else MEDIUM_HOST


class CacheIndex:
    """Findable entries of both tiers, their parent -> children tree, and their events
    (made only when there is a sink: without one, a move or a drop builds none)."""

    def __init__(
        self,
        block_size: int,
        device_queue: EvictionQueue[KVBlock],
        host_tier: HostTier | None,
        event_sink: EventSink | None,
    ) -> None:
        self.block_size = block_size
        self.device: dict[BlockHash, KVBlock] = {}
        self._device_queue = device_queue
        self._host_tier = host_tier
        self._event_sink = event_sink
        # Dicts as insertion-ordered sets, so every walk is deterministic.
        self._children: dict[ParentKey, dict[BlockHash, None]] = {}
        # The digest of the findable entry holding each content (entries without extra ids)
        self._by_content: dict[ContentKey, BlockHash] = {}
        self._serials = itertools.count(1)

    def lookup(self, block_hash: BlockHash) -> CachedBlock | None:
        block = self.device.get(block_hash)
        if block is None and self._host_tier is not None:
            return self._host_tier.lookup(block_hash)
        return block

    def is_findable(self, block: CachedBlock) -> bool:
        """Whether `block` is the one block its tier finds under its digest."""
        return block.block_hash is not None and self.lookup(block.block_hash) is block

    def is_current(self, block: CachedBlock) -> bool:
        """Whether `block` holds the content of the entry now findable under its digest
        (it is that entry, or a duplicate registered while that entry lived)."""
        if block.block_hash is None:
            return False
        entry = self.lookup(block.block_hash)
        return entry is not None and entry.serial == block.serial

    def find_prefix(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids_per_block: Sequence[Sequence[int]],
        extra_ids_per_block: Sequence[Sequence[int] | None] | None,
        namespace: Namespace,
    ) -> list[CachedBlock]:
        """The entries of the longest findable prefix of a chain, either tier, each
        confirmed by its stored key (token ids and extra ids, compared as `BlockKey.of`
        would make them, without making one), parent digest and namespace."""
        entries: list[CachedBlock] = []
        parent_hash: BlockHash | None = None
        device_get = self.device.get
        for idx, block_hash in enumerate(block_hashes):
            entry: CachedBlock | None = device_get(block_hash)
            if entry is None and self._host_tier is not None:
                entry = self._host_tier.lookup(block_hash)
            if entry is None:
                break
            extra = None if extra_ids_per_block is None else extra_ids_per_block[idx]
            if not entry.confirms_ids(
                tuple(token_ids_per_block[idx]),
                None if extra is None else tuple(extra),
                parent_hash,
                namespace,
            ):
                break
            entries.append(entry)
            parent_hash = block_hash
        return entries

    def find_prefix_by_ids(
        self, block_hashes: Sequence[BlockHash], id_bytes: bytes, namespace: Namespace
    ) -> list[CachedBlock]:
        """The entries of the longest findable chain, either tier, holding `id_bytes`
        block by block (ids as keys encode them, a whole number of blocks) from
        `namespace`'s root, each found and confirmed by the content map (its parent key
        and ids hold exactly under its digest) rather than by a tuple of ids; where
        `block_hashes` gives a block's key, the entry must have it. Past the keys given,
        the entries' digests are those hashing their blocks gives (a digest is a
        function of that content). Entries with extra ids are never found this way."""
        width = 8 * self.block_size
        get, device_get = self._by_content.get, self.device.get
        entries: list[CachedBlock] = []
        parent: ParentKey = namespace
        for idx, start in enumerate(range(0, len(id_bytes) - width + 1, width)):
            block_hash = get((parent, id_bytes[start : start + width]))
            if block_hash is None or (idx < len(block_hashes) and block_hash != block_hashes[idx]):
                break
            entry = device_get(block_hash) or self.lookup(block_hash)
            assert entry is not None, "the content map names an entry that is gone"
            entries.append(entry)
            parent = block_hash
        return entries

    def find_partial(
        self, parent: ParentKey, token_ids: Sequence[int], extra_ids: Sequence[int] | None
    ) -> tuple[CachedBlock, int] | None:
        """The findable child of `parent`, in either tier, sharing the longest nonzero
        prefix with `token_ids`, and its length; ties go to the oldest child."""
        best: tuple[CachedBlock, int] | None = None
        for child_hash in self._children.get(parent, ()):
            child = self.lookup(child_hash)
            if child is not None and child.key is not None:
                length = child.key.common_prefix(token_ids, extra_ids)
                if length > (0 if best is None else best[1]):
                    best = child, length
        return best

    def insert(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        key: BlockKey,
        parent_hash: BlockHash | None,
        namespace: Namespace,
        lineage: bytes | None = None,
    ) -> None:
        """Make a blank device block findable as a new entry, of `lineage` (a disk file's,
        read into it) or a fresh random one."""
        assert block.block_hash is None and block_hash not in self.device
        block.block_hash, block.key, block.parent_hash = block_hash, key, parent_hash
        block.namespace, block.serial = namespace, next(self._serials)
        block.lineage = lineage if lineage is not None else os.urandom(LINEAGE_NBYTES)
        self.device[block_hash] = block
        self._children.setdefault(parent_key(block), {})[block_hash] = None
        if (content := content_key(block)) is not None:
            # a digest is a function of its content: only made-up digests (tests) can
            # give one content two, and the first entry keeps it then
            self._by_content.setdefault(content, block_hash)
        if self._event_sink is not None:  # an event is made only for a sink that keeps it
            self._event_sink(self._stored_event(block))

    def move(self, src: CachedBlock, dst: CachedBlock) -> None:
        """Move an entry to a blank block of the other tier (neither queued)."""
        assert src.queue_level is None and dst.queue_level is None
        assert self._host_tier is not None and src.block_hash is not None
        block_hash, src_medium = src.block_hash, medium_of(src)
        if isinstance(dst, HostBlock):
            dst.take_entry(src)
            del self.device[block_hash]
            self._host_tier.store(dst)
        else:
            assert isinstance(dst, KVBlock) and isinstance(src, HostBlock)
            self._host_tier.unstore(src)
            dst.take_entry(src)
            self.device[block_hash] = dst
        if self._event_sink is not None:
            self._event_sink(self._stored_event(dst))
            self._event_sink(BlockRemoved([block_hash], src_medium))

    def drop(self, block: CachedBlock, now: float) -> None:
        """Forget a findable entry and every findable descendant, in either tier.

        Queued blocks among them stay queued, now blank (taken first).
        """
        assert block.block_hash is not None
        siblings = self._children[parent_key(block)]
        del siblings[block.block_hash]
        if not siblings:
            del self._children[parent_key(block)]
        stack = [block]
        while stack:
            entry = stack.pop()
            assert entry.block_hash is not None
            for child_hash in self._children.pop(entry.block_hash, {}):
                child = self.lookup(child_hash)
                assert child is not None, "a findable child's entry is missing"
                stack.append(child)
            self._forget(entry, now)

    def clear(self, device_blocks: Sequence[KVBlock], now: float) -> None:
        """Forget every entry of both tiers at once (held duplicates too)."""
        self._device_queue.clear_all(device_blocks, now)
        if self._host_tier is not None:
            self._host_tier.clear(now)
        self.device.clear()
        self._children.clear()
        self._by_content.clear()
        if self._event_sink is not None:
            self._event_sink(AllBlocksCleared())

    def check(self) -> None:
        """Assert the tiers' maps, the children tree and the serials agree (no holes)."""
        for block_hash, block in self.device.items():
            assert block.block_hash == block_hash, f"block {block.block_id} under another hash"
        entries: list[CachedBlock] = list(self.device.values())
        if self._host_tier is not None:
            host_entries = self._host_tier.entries()
            assert not any(e.block_hash in self.device for e in host_entries), "in both tiers"
            entries += host_entries
        serials = [entry.serial for entry in entries]
        assert None not in serials and len(set(serials)) == len(serials), "serials not unique"
        for entry in entries:
            assert entry.key is not None and len(entry.key.token_ids) == self.block_size, entry
            assert entry.namespace is not None, entry
            if entry.parent_hash is not None:
                parent = self.lookup(entry.parent_hash)
                assert parent is not None, f"hole: the parent of {entry.block_hash!r} is gone"
                assert parent.namespace == entry.namespace, entry
            assert entry.block_hash in self._children.get(parent_key(entry), {}), entry
        num_children = 0
        for key, children in self._children.items():
            assert children, f"an empty child set under {key!r}"
            assert isinstance(key, Namespace) or self.lookup(key) is not None, "children of nothing"
            for child_hash in children:
                child = self.lookup(child_hash)
                assert child is not None and parent_key(child) == key, child_hash
                num_children += 1
        assert num_children == len(entries), (num_children, len(entries))
        for content, block_hash in self._by_content.items():
            holder = self.lookup(block_hash)
            assert holder is not None and content_key(holder) == content, block_hash
        # every mapping names an entry holding it; an entry no mapping names shares its
        # content with another's made-up digest (tests), as insert's note says
        assert len(self._by_content) <= sum(content_key(e) is not None for e in entries)

    def _forget(self, block: CachedBlock, now: float) -> None:
        assert block.block_hash is not None
        block_hash, medium = block.block_hash, medium_of(block)
        content = content_key(block)
        if content is not None and self._by_content.get(content) == block_hash:
            del self._by_content[content]
        if isinstance(block, KVBlock):
            del self.device[block_hash]
            self._device_queue.make_blank(block, now)
        else:
            assert isinstance(block, HostBlock) and self._host_tier is not None
            self._host_tier.forget(block, now)
        if self._event_sink is not None:
            self._event_sink(BlockRemoved([block_hash], medium))

    def _stored_event(self, block: CachedBlock) -> BlockStored:
        assert block.block_hash is not None and block.key is not None
        assert block.namespace is not None
        # NOTE: a salted namespace's tokens never leave the pool: its events carry
        # hashes only (no token ids, no extra ids), so a subscriber learns nothing of
        # another tenant's prompt.
        salted = block.namespace.cache_salt is not None
        extra = block.key.extra_ids
        return BlockStored(
            block_hashes=[block.block_hash],
            parent_block_hash=block.parent_hash,
            token_ids=[] if salted else list(block.key.token_ids),
            block_size=self.block_size,
            lora_id=None,
            medium=medium_of(block),
            lora_name=block.namespace.adapter_id,
            extra_keys=None if salted or extra is None else [tuple(extra)],
        )
