"""The host tier: a host-memory arena of block slots that evicted device blocks spill to.

The pool decides what moves (see pool.py); this module keeps the slots, their
index, their eviction queue (the same policy as the device tier) and the
copies in flight. It never touches bytes: each copy it starts is returned as a
`BlockCopy` (copies.py) for the pool's list, which the model runner executes.

Only this module reads or writes the tier's slots, index, queue and copies
in flight: the index (index.py) and the pool call the methods below (`lookup`,
`store`, `forget`, `take_slot`, `return_slot`, `pin`/`unpin`, `clear`, ...).

Copies and pins: from `start_offload`/`start_onboard` until `complete_copies()`
both ends of every copy are pinned (one reference each), so neither a slot
being written or read nor a device block being read or written is evicted or
handed out again. The engine calls `BlockPool.complete_copies()` once the
runner has executed the step's copies.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block import BlockId, HostBlock, HostSlot, KVBlock
from .copies import BlockCopy
from .free_queue import EvictionQueue
from .hashing import BlockHash


@dataclass(slots=True)
class PendingCopy:
    device_block: KVBlock
    host_block: HostBlock
    to_host: bool  # True: offload (device -> host); False: onboard


class HostTier:
    """`num_blocks` host slots with their own index and eviction queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks = [HostBlock(slot=HostSlot(i)) for i in range(num_blocks)]
        self._index: dict[BlockHash, HostBlock] = {}
        self._queue: EvictionQueue[HostBlock] = EvictionQueue()
        self._pending: list[PendingCopy] = []
        for block in self._blocks:
            self._queue.append(block, 0.0)

    @classmethod
    def from_num_bytes(cls, num_bytes: int, bytes_per_block: int) -> HostTier:
        """As many slots as `num_bytes` holds at `bytes_per_block` each (at least one)."""
        if bytes_per_block < 1:
            raise ValueError(f"bytes_per_block must be >= 1; got {bytes_per_block}")
        if num_bytes < bytes_per_block:
            raise ValueError(
                f"a host tier of {num_bytes} bytes holds no block of {bytes_per_block} bytes"
            )
        return cls(num_bytes // bytes_per_block)

    @property
    def num_free_blocks(self) -> int:
        return len(self._queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    @property
    def num_pending_copies(self) -> int:
        return len(self._pending)

    def slots(self) -> tuple[HostBlock, ...]:
        """Every slot, in slot order (read-only view for checks and tests)."""
        return tuple(self._blocks)

    def entries(self) -> list[HostBlock]:
        """The findable slots, in the order they were stored."""
        return list(self._index.values())

    def pending_copies(self) -> tuple[PendingCopy, ...]:
        """The copies issued and not yet completed, in issue order."""
        return tuple(self._pending)

    def is_arriving(self, block_id: BlockId) -> bool:
        """Whether an onboard into device block `block_id` is still in flight."""
        return any(not c.to_host and c.device_block.block_id == block_id for c in self._pending)

    def lookup(self, block_hash: BlockHash) -> HostBlock | None:
        return self._index.get(block_hash)

    def store(self, block: HostBlock) -> None:
        """Make a slot that has just taken an entry findable under its digest."""
        assert block.block_hash is not None and block.block_hash not in self._index, block
        self._index[block.block_hash] = block

    def unstore(self, block: HostBlock) -> None:
        """Stop finding a slot whose entry is moving to the device tier (it keeps it)."""
        assert block.block_hash is not None and self._index.get(block.block_hash) is block
        del self._index[block.block_hash]

    def forget(self, block: HostBlock, now: float) -> None:
        """Forget a findable slot's entry; a free slot moves to the blank level (taken first)."""
        self.unstore(block)
        self._queue.make_blank(block, now)

    def take_slot(self, now: float) -> HostBlock | None:
        """Pop the next free slot (its entry, if any, still findable); None when every
        slot is pinned. The caller forgets its entry or gives it back (`return_slot`)."""
        return self._queue.pop(now)

    def return_slot(self, block: HostBlock, now: float) -> None:
        """Give back a slot taken by `take_slot` and not used."""
        assert block.queue_level is None and block.ref_count == 0, block
        self._queue.append(block, now)

    def clear(self, now: float) -> None:
        """Forget every entry at once; free slots keep their order, behind the blank ones."""
        self._queue.clear_all(self._blocks, now)
        self._index.clear()

    def pin(self, block: HostBlock) -> None:
        if block.queue_level is not None:
            self._queue.remove(block)
        block.ref_count += 1

    def unpin(self, block: HostBlock, now: float) -> None:
        assert block.ref_count > 0, block
        block.ref_count -= 1
        if block.ref_count == 0:
            self._queue.append(block, now)

    def start_offload(self, device_block: KVBlock, host_block: HostBlock) -> BlockCopy:
        """Plan device -> host; pins both ends until `complete_copies`."""
        self._track(PendingCopy(device_block, host_block, to_host=True))
        return BlockCopy("offload", device_block.block_id, host_block.slot)

    def start_onboard(self, host_block: HostBlock, device_block: KVBlock) -> BlockCopy:
        """Plan host -> device; pins both ends until `complete_copies`."""
        self._track(PendingCopy(device_block, host_block, to_host=False))
        return BlockCopy("onboard", host_block.slot, device_block.block_id)

    def complete_copies(self, now: float) -> list[KVBlock]:
        """The copies planned so far have been executed: unpin their slots; returns
        their device blocks, one per copy, whose pins the pool releases."""
        if not self._pending:
            return []
        done, self._pending = self._pending, []
        for copy in done:
            self.unpin(copy.host_block, now)
        return [copy.device_block for copy in done]

    def check_integrity(self) -> None:
        self._queue.check()
        pins: dict[int, int] = {}
        for copy in self._pending:
            pins[copy.host_block.slot] = pins.get(copy.host_block.slot, 0) + 1
        for block in self._blocks:
            # NOTE: outside a pool call, a slot's only references are copy pins.
            assert block.ref_count == pins.get(block.slot, 0), (block, pins.get(block.slot, 0))
            assert (block.queue_level is None) == (block.ref_count > 0), block
            if block.block_hash is not None:
                assert self._index.get(block.block_hash) is block, f"slot {block.slot} not indexed"
        for block_hash, block in self._index.items():
            assert block.block_hash == block_hash, f"slot {block.slot} indexed under another hash"

    def _track(self, copy: PendingCopy) -> None:
        assert copy.device_block.queue_level is None, copy.device_block
        self.pin(copy.host_block)
        copy.device_block.ref_count += 1  # the device side's pin; the pool releases it
        self._pending.append(copy)
