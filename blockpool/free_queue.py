"""The eviction queue: free blocks of one tier, in the order they are taken for reuse.

Order (the next block taken first):
1. blank blocks (never registered, or forgotten), oldest-freed first;
2. then cached blocks by retention priority, lowest first;
3. within one priority, least recently freed first.

A request's blocks are freed tail first (see `BlockPool.free`), so within a
priority a cached chain is taken from its end.

Why not a deque: a cached block hit by a later request must leave the queue
from wherever it sits, in O(1); a deque removes from the middle in O(n).
Why not a heap: a heap is O(log n) per push and pop, cannot remove an
arbitrary entry without lazy deletion, and would need a timestamp to keep LRU
order among equal priorities. Instead each level (blank, and each of the 101
priorities) is an intrusive doubly linked list whose links live on the blocks
themselves, and an integer bit mask of non-empty levels finds the lowest one
in O(1). Append, remove and pop are O(1).

Priority expiry: a block queued with a priority other than the default and a
duration falls back to the default priority `duration` seconds after it
entered the queue (the countdown restarts each time it is freed; while held
it does not run). Expiries are evaluated lazily, from a small heap of expiry
times consulted before every append and pop; an expired block moves to the
end of the default level as if freed at the moment it expired, which keeps
the order above exact for a monotonic clock. The heap only holds blocks that
have a duration; stale entries (blocks taken meanwhile) are skipped and
compacted away.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from .block import DEFAULT_PRIORITY, MAX_PRIORITY, CachedBlock

B = TypeVar("B", bound=CachedBlock)

BLANK_LEVEL = 0
NUM_LEVELS = MAX_PRIORITY + 2  # the blank level, then one per priority 0..100


def level_of(block: CachedBlock) -> int:
    return BLANK_LEVEL if block.block_hash is None else 1 + block.priority


class EvictionQueue(Generic[B]):
    """Free blocks of one tier in eviction order (see the module docstring)."""

    def __init__(self) -> None:
        self._heads: list[B | None] = [None] * NUM_LEVELS
        self._tails: list[B | None] = [None] * NUM_LEVELS
        self._nonempty = 0  # bit L set <=> level L has a block
        self._len = 0
        self._tokens = itertools.count(1)
        # (expiry, token, block): token matches block.queue_token while the entry is live.
        self._expiring: list[tuple[float, int, B]] = []
        self._num_expiring = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[B]:
        """Blocks in eviction order, as of the last `refresh`."""
        mask = self._nonempty
        while mask:
            level = (mask & -mask).bit_length() - 1
            mask &= mask - 1
            block = self._heads[level]
            while block is not None:
                yield block
                block = block.next

    def append(self, block: B, now: float) -> None:
        """Queue a freed block at the most-recently-used end of its level."""
        self.append_all((block,), now)

    def append_all(self, blocks: Sequence[B], now: float) -> None:
        """`append` each block, in order, with one expiry refresh for all (a request's
        blocks freed at once)."""
        self.refresh(now)
        # NOTE: `_link` inlined, the links kept in locals: a 4k prompt frees 128 blocks at
        # once, and the calls were most of a cached prompt's host time (bench_host_step)
        heads, tails, tokens = self._heads, self._tails, self._tokens
        nonempty = self._nonempty
        for block in blocks:
            assert block.queue_level is None and block.ref_count == 0, block
            level = BLANK_LEVEL if block.block_hash is None else 1 + block.priority
            tail = tails[level]
            block.prev, block.next, block.queue_level = tail, None, level
            if tail is None:
                heads[level] = block
                nonempty |= 1 << level
            else:
                tail.next = block
            tails[level] = block
            block.queue_token = next(tokens)
            if block.priority_duration_s is not None and block.priority != DEFAULT_PRIORITY:
                block.priority_expiry = now + block.priority_duration_s
                heapq.heappush(self._expiring, (block.priority_expiry, block.queue_token, block))
                self._num_expiring += 1
        self._nonempty = nonempty
        self._len += len(blocks)

    def remove(self, block: B) -> None:
        """Take a block out of the queue, wherever it sits."""
        self.remove_all((block,))

    def remove_all(self, blocks: Sequence[B]) -> None:
        """`remove` each block, the stale expiry entries compacted once for all (a
        matched prefix held at once)."""
        heads, tails = self._heads, self._tails
        for block in blocks:  # `_unlink` inlined, as `append_all` inlines `_link`
            level = block.queue_level
            assert level is not None, block
            prev, nxt = block.prev, block.next
            if prev is None:
                heads[level] = nxt
                if nxt is None:
                    self._nonempty &= ~(1 << level)
            else:
                prev.next = nxt
            if nxt is None:
                tails[level] = prev
            else:
                nxt.prev = prev
            block.prev = block.next = block.queue_level = None
            if block.priority_expiry is not None:
                block.priority_expiry = None
                self._num_expiring -= 1
        self._len -= len(blocks)
        if len(self._expiring) > 2 * self._num_expiring + 64:
            self._expiring = [e for e in self._expiring if self._is_live(e)]
            heapq.heapify(self._expiring)

    def peek(self, now: float) -> B | None:
        """The block `pop` would take, left in place."""
        self.refresh(now)
        if not self._nonempty:
            return None
        return self._heads[(self._nonempty & -self._nonempty).bit_length() - 1]

    def pop(self, now: float) -> B | None:
        """Take the next block to reuse, or None when the queue is empty."""
        block = self.peek(now)
        if block is not None:
            self.remove(block)
        return block

    def refresh(self, now: float) -> None:
        """Apply every priority expiry due by `now`, in expiry order."""
        while self._expiring and self._expiring[0][0] <= now:
            entry = heapq.heappop(self._expiring)
            if not self._is_live(entry):
                continue
            block = entry[2]
            self._num_expiring -= 1
            self._unlink(block)
            block.priority_expiry = None
            block.set_retention(DEFAULT_PRIORITY, None)
            self._link(block, level_of(block))

    def make_blank(self, block: B, now: float) -> None:
        """Clear a block's entry; a queued block moves to the blank level (taken first)."""
        queued = block.queue_level is not None
        if queued:
            self.remove(block)
        block.clear_entry()
        if queued:
            self.append(block, now)

    def clear_all(self, blocks: Sequence[B], now: float) -> None:
        """Make every block of a tier blank; queued ones keep their order, behind the
        blank ones."""
        for block in list(self):
            if block.block_hash is not None:
                self.make_blank(block, now)
        for block in blocks:
            if block.block_hash is not None:
                block.clear_entry()

    def check(self) -> None:
        """Assert the links, levels, mask and counts agree."""
        count = 0
        live = 0
        for level in range(NUM_LEVELS):
            block = self._heads[level]
            assert (block is None) == (not self._nonempty >> level & 1), f"mask bit {level}"
            prev = None
            while block is not None:
                assert block.queue_level == level == level_of(block), (block, level)
                assert block.prev is prev and block.ref_count == 0, block
                live += block.priority_expiry is not None
                prev, block, count = block, block.next, count + 1
            assert self._tails[level] is prev, f"tail of level {level}"
        assert count == self._len, (count, self._len)
        assert live == self._num_expiring == sum(map(self._is_live, self._expiring))

    def _is_live(self, entry: tuple[float, int, B]) -> bool:
        block = entry[2]
        return block.queue_level is not None and block.queue_token == entry[1]

    def _link(self, block: B, level: int) -> None:
        tail = self._tails[level]
        block.prev, block.next, block.queue_level = tail, None, level
        if tail is None:
            self._heads[level] = block
            self._nonempty |= 1 << level
        else:
            tail.next = block
        self._tails[level] = block
        self._len += 1

    def _unlink(self, block: B) -> None:
        level = block.queue_level
        assert level is not None
        prev, nxt = block.prev, block.next
        if prev is None:
            self._heads[level] = nxt
        else:
            prev.next = nxt
        if nxt is None:
            self._tails[level] = prev
        else:
            nxt.prev = prev
        if self._heads[level] is None:
            self._nonempty &= ~(1 << level)
        block.prev = block.next = None
        block.queue_level = None
        self._len -= 1
