"""The disk tier's in-memory index of its block files, and the KV events its changes send.

Per file: its size, its place in the last-use order, and its key (parent digest,
token ids, extra ids; packed, a few hundred bytes a block), so a partial match
needs no I/O. Children are bucketed by (parent, first token): a partial match
shares the first token, so it looks at one bucket.

Not thread-safe on its own: DiskTier (disk.py) calls it under its lock, so the
events go out in the order of the index's changes.

Events (medium DISK, events.py), once a sink is attached: BlockStored for a file
added by a write, BlockRemoved for files removed. NOTE: a salted namespace's
events carry hashes only, as in the memory tiers; so do those of files found at
start outside the default namespace, as a file keeps a namespace digest, never
the salt or the adapter id.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from . import disk_format as fmt
from .events import MEDIUM_DISK, BlockRemoved, BlockStored, EventSink
from .hashing import BlockHash, Namespace

# A first block's parent: its namespace's root, named by the namespace digest.
DiskParent = BlockHash | tuple[str, bytes]


def parent_of(parent_hash: BlockHash | None, namespace_digest: bytes) -> DiskParent:
    return parent_hash if parent_hash is not None else ("root", namespace_digest)


@dataclass(slots=True)
class StoredFile:
    """What the index keeps of one block file."""

    nbytes: int
    parent_hash: BlockHash | None
    parent: DiskParent
    token_ids: array  # unsigned 64-bit, as in the file
    extra_ids: array | None
    public: bool  # the default namespace: its tokens may appear in events
    lineage: bytes  # disk_format.py: lineage
    parent_lineage: bytes

    @classmethod
    def of_header(cls, header: fmt.BlockHeader, nbytes: int) -> StoredFile:
        """A file found at start, from its header."""
        extra = header.extra_ids
        return cls(
            nbytes,
            header.parent_hash,
            parent_of(header.parent_hash, header.namespace_digest),
            array("Q", header.token_ids),
            None if extra is None else array("Q", extra),
            header.public,
            header.lineage,
            header.parent_lineage,
        )

    @classmethod
    def of_write(
        cls,
        nbytes: int,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_ids: Sequence[int] | None,
        namespace: Namespace | None,
        lineage: bytes = fmt.NO_LINEAGE,
        parent_lineage: bytes = fmt.NO_LINEAGE,
    ) -> StoredFile:
        """A file just written for this key."""
        return cls(
            nbytes,
            parent_hash,
            parent_of(parent_hash, fmt.namespace_digest(namespace)),
            array("Q", token_ids),
            None if extra_ids is None else array("Q", extra_ids),
            namespace is None or namespace == Namespace(),
            lineage,
            parent_lineage,
        )

    @property
    def bucket(self) -> tuple[DiskParent, int]:
        return self.parent, self.token_ids[0]

    def common_prefix(self, token_ids: Sequence[int], extra_ids: Sequence[int] | None) -> int:
        """How many leading tokens (and extra ids) this block shares with the given ones."""
        if (self.extra_ids is None) != (extra_ids is None):
            return 0
        n = min(len(self.token_ids), len(token_ids))
        for idx in range(n):
            if self.token_ids[idx] != token_ids[idx]:
                return idx
            if extra_ids is not None and self.extra_ids[idx] != extra_ids[idx]:  # type: ignore[index]
                return idx
        return n


@dataclass(frozen=True, slots=True)
class PartialMatch:
    """A stored block whose first `num_tokens` tokens (and extra ids) are a request's."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]  # all of the stored block's, to confirm it by (`get`)
    extra_ids: tuple[int, ...] | None
    num_tokens: int


class DiskIndex:
    """Indexed block files, least recently used first, and their events."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.num_bytes = 0
        self._files: OrderedDict[BlockHash, StoredFile] = OrderedDict()
        # (parent digest or namespace root, first token) -> children, oldest first
        self._children: dict[tuple[DiskParent, int], dict[BlockHash, None]] = {}
        self._sink: EventSink | None = None

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._files

    def __iter__(self) -> Iterator[BlockHash]:
        """Least recently used first."""
        return iter(self._files)

    def items(self) -> Iterator[tuple[BlockHash, StoredFile]]:
        return iter(self._files.items())

    def get(self, block_hash: BlockHash) -> StoredFile | None:
        return self._files.get(block_hash)

    def nbytes_of(self, block_hash: BlockHash) -> int:
        """The size of the block's file (0 when it is not indexed)."""
        stored = self._files.get(block_hash)
        return 0 if stored is None else stored.nbytes

    def add(
        self,
        block_hash: BlockHash,
        stored: StoredFile,
        *,
        lora_name: str | None = None,
        with_tokens: bool = False,
    ) -> None:
        """Index a file as the most recently used; a sink gets its BlockStored (its token
        ids and extra ids only `with_tokens`)."""
        assert block_hash not in self._files, block_hash
        self._files[block_hash] = stored
        self._children.setdefault(stored.bucket, {})[block_hash] = None
        self.num_bytes += stored.nbytes
        if self._sink is not None:
            self._sink(self._stored_event(block_hash, stored, lora_name, with_tokens))

    def remove(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Unindex files; returns those that were indexed (one BlockRemoved for them)."""
        removed = [h for h in block_hashes if self._unindex(h)]
        if removed and self._sink is not None:
            self._sink(BlockRemoved(removed, MEDIUM_DISK))
        return removed

    def clear(self, *, emit: bool) -> None:
        """Forget every file (one BlockRemoved for them all when `emit`)."""
        if emit and self._files and self._sink is not None:
            self._sink(BlockRemoved(list(self._files), MEDIUM_DISK))
        self._files.clear()
        self._children.clear()
        self.num_bytes = 0

    def touch(self, block_hash: BlockHash) -> None:
        """Make an indexed file the most recently used."""
        if block_hash in self._files:
            self._files.move_to_end(block_hash)

    def least_recent(self) -> BlockHash | None:
        return next(iter(self._files), None)

    def find_partial(
        self,
        parent: DiskParent,
        token_ids: Sequence[int],
        extra_ids: Sequence[int] | None,
        parent_lineage: bytes | None = None,
    ) -> PartialMatch | None:
        """The child of `parent` (written under the parent entry of `parent_lineage`, when
        given) sharing the longest nonzero prefix with `token_ids`; ties go to the child
        indexed first."""
        if not token_ids:
            return None
        best: PartialMatch | None = None
        for block_hash in self._children.get((parent, token_ids[0]), ()):
            stored = self._files[block_hash]
            if parent_lineage is not None and stored.parent_lineage != parent_lineage:
                continue
            length = stored.common_prefix(token_ids, extra_ids)
            if length > (0 if best is None else best.num_tokens):
                extra = None if stored.extra_ids is None else tuple(stored.extra_ids)
                best = PartialMatch(block_hash, tuple(stored.token_ids), extra, length)
        return best

    def attach(self, sink: EventSink, *, announce: bool) -> None:
        """Send events to `sink` from now on; with `announce`, first a BlockStored for
        every file indexed now, least recently used first (tokens: default namespace)."""
        self._sink = sink
        if announce:
            for block_hash, stored in self._files.items():
                sink(self._stored_event(block_hash, stored, None, stored.public))

    def check(self) -> None:
        """The sizes, the order and the buckets agree (for tests)."""
        assert self.num_bytes == sum(s.nbytes for s in self._files.values()), self.num_bytes
        for block_hash, stored in self._files.items():
            assert block_hash in self._children[stored.bucket], block_hash
        assert sum(map(len, self._children.values())) == len(self._files)
        assert all(self._children.values()), "an empty child set"

    def _unindex(self, block_hash: BlockHash) -> bool:
        stored = self._files.pop(block_hash, None)
        if stored is None:
            return False
        siblings = self._children[stored.bucket]
        del siblings[block_hash]
        if not siblings:
            del self._children[stored.bucket]
        self.num_bytes -= stored.nbytes
        return True

    def _stored_event(
        self, block_hash: BlockHash, stored: StoredFile, lora_name: str | None, with_tokens: bool
    ) -> BlockStored:
        extra = stored.extra_ids
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=stored.parent_hash,
            token_ids=list(stored.token_ids) if with_tokens else [],
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM_DISK,
            lora_name=lora_name,
            extra_keys=None if extra is None or not with_tokens else [tuple(extra)],
        )
