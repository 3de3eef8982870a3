"""Device block allocation: a fixed set of KV blocks handed out and taken back.

This is the pool's allocation core: block ids, a free list and reference
counts. Hash-based reuse, eviction order and the host tier build on it.
"""

from __future__ import annotations

from collections import deque
from typing import NewType

BlockId = NewType("BlockId", int)


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens; `allocate(n) -> ids | None`.

    NOTE: a block is either free (in `_free`, ref count 0) or held (ref count
    > 0); `check_integrity()` asserts exactly that partition.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two; got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[BlockId] = deque(BlockId(i) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[BlockId] | None:
        """Take `n` free blocks (ref count 1 each), or None when fewer are free."""
        assert n >= 0, n
        if n > len(self._free):
            return None
        block_ids = [self._free.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[BlockId]) -> None:
        """Drop one reference to each block; blocks at zero return to the free list.

        Appended tail first, so a request's tail blocks are taken again before
        its head blocks and a chain of blocks is consumed from its end.
        """
        for block_id in reversed(block_ids):
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, refs in enumerate(self._ref_counts):
            assert refs >= 0, f"block {block_id} has ref count {refs}"
            assert (refs == 0) == (block_id in free), (
                f"block {block_id}: refs {refs}, free {block_id in free}"
            )
