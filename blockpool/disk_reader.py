"""Reading a block file back, checked against the key it was looked up by (the disk
tier's read half; disk.py keeps the index, the counts and the removals).

Guarantees:
- A payload is returned only if the file's checksums, layout, digest, parent digest,
  token ids, extra ids and namespace all agree with the caller's key; anything else
  raises `BlockFileError` (its kind says which check) or `OSError`, and nothing is
  counted, touched or removed here.
- Reads ahead run on up to `read_threads` threads, made at the first `read_ahead`;
  each reader checks what it read (the checksums release the GIL) so the caller only
  waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import disk_format as fmt
from .disk_config import DiskTierConfig
from .hashing import BlockHash, Namespace

Checked = np.ndarray  # a block file's payload, the file checked against the key looked up
BlockKeyOnDisk = tuple[BlockHash, BlockHash | None, Sequence[int], Sequence[int] | None]


class BlockReader:
    """Reads the block files of one layout folder and confirms each against a key."""

    def __init__(self, folder: Path, layout: bytes, config: DiskTierConfig) -> None:
        self.folder = folder
        self.layout = layout
        self.config = config
        self._dtype = config.np_dtype
        self._payload_nbytes = config.payload_nbytes
        self._threads: ThreadPoolExecutor | None = None  # made at the first read_ahead

    def read_ahead(
        self,
        keys: Sequence[BlockKeyOnDisk],
        sizes: Sequence[int],
        namespace: Namespace | None = None,
        into: Sequence[np.ndarray | None] | None = None,
        parent_lineages: Sequence[bytes | None] | None = None,
    ) -> list[Future[Checked]]:
        """Start reading and checking these blocks' files ((digest, parent digest, token
        ids, extra ids) each, as `DiskTier.get` takes them; `sizes`: each file's bytes, as
        indexed), in order, on the reader threads; pass each future to `DiskTier.get` as
        `ahead` with the same key. `into`: one destination per key (or None), as `get`
        takes it; `parent_lineages`: one per key (or None), as `get` takes it. Nothing is
        counted, touched or removed here.

        A future not taken must be cancelled, and, with `into`, waited for if it was
        running (`settle`) before its destination is used again.

        NOTE: without `into`, each buffer is allocated here, on the caller's thread:
        memory a reader thread allocates comes from its own malloc arena, which hands
        freed pages back to the kernel, so every read would fault them in again (reads
        ran 3x slower on a 2-CPU machine). Fresh memory faults all the same (about a
        quarter of the speed of reads into memory used before), which `into` avoids.
        And a reader checks what it read (the checksums release the GIL) so the caller
        only waits, and never holds the GIL a finished read needs."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.config.read_threads, "reprise-disk-read")
        dests = [None] * len(keys) if into is None else into
        if len(dests) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        lineages = [None] * len(keys) if parent_lineages is None else parent_lineages
        futures = []
        for dest, nbytes, lineage, (block_hash, parent, token_ids, extra_ids) in zip(
            dests, sizes, lineages, keys, strict=True
        ):
            # +1: a file that grew shows it
            buf = np.empty(nbytes + 1, np.uint8) if dest is None else None
            futures.append(self._threads.submit(
                self.read_checked, block_hash, parent, token_ids, extra_ids, namespace,
                into=dest, buf=buf, parent_lineage=lineage,
            ))  # fmt: skip
        return futures

    @staticmethod
    def settle(futures: Sequence[Future[Checked]]) -> None:
        """Cancel reads not taken, and wait for those already running to end (their
        destinations are free to reuse after this)."""
        for future in futures:
            if not future.cancel():
                with contextlib.suppress(Exception):
                    future.result()

    def read_checked(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_ids: Sequence[int] | None,
        namespace: Namespace | None,
        *,
        into: np.ndarray | None = None,
        buf: np.ndarray | None = None,
        parent_lineage: bytes | None = None,
    ) -> np.ndarray:
        """The block's payload, its file read and checked against this key (on the
        caller's or a reader thread): the payload into `into` (its destination), else
        the whole file into `buf` (uint8, one byte longer than the file should be) or,
        without one, into fresh memory."""
        path = self.folder / fmt.file_name(block_hash)
        if into is not None:
            if into.nbytes != self._payload_nbytes or not into.flags.c_contiguous:
                raise ValueError(
                    f"into must be C-contiguous and {self._payload_nbytes} bytes; "
                    f"got {into.nbytes} bytes"
                )
            flat = into.reshape(-1)
            header = fmt.read_block_into(
                path, flat.view(np.uint8).data, self.layout, self.config.block_size
            )
            self._confirm(header, block_hash, parent_hash, token_ids, extra_ids, namespace)
            _confirm_lineage(header, parent_lineage)
            return flat.view(self._dtype).reshape(self.config.block_shape)
        data = fmt.read_file(path) if buf is None else fmt.read_file_into(path, buf)
        header = self._checked(data, block_hash, parent_hash, token_ids, extra_ids, namespace)
        _confirm_lineage(header, parent_lineage)
        payload = np.frombuffer(
            data,
            self._dtype,
            self._payload_nbytes // self._dtype.itemsize,
            header.payload_offset,
        )
        payload.flags.writeable = False  # a buffer read ahead is writable
        return payload.reshape(self.config.block_shape)

    def _checked(
        self,
        data: bytes | memoryview,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_ids: Sequence[int] | None,
        namespace: Namespace | None,
    ) -> fmt.BlockHeader:
        """The header of a whole block file's bytes, every check passed (BlockFileError)."""
        header = fmt.decode_block(data, self.layout)
        self._confirm(header, block_hash, parent_hash, token_ids, extra_ids, namespace)
        return header

    def check_shape(self, header: fmt.BlockHeader, block_hash: BlockHash) -> None:
        """That the header is this digest's and of this layout's block size and payload
        (BlockFileError of kind FOREIGN if not): the checks a start's scan makes."""
        if header.block_hash != block_hash:
            raise fmt.BlockFileError(fmt.FOREIGN, "the file holds another block")
        if len(header.token_ids) != self.config.block_size:
            raise fmt.BlockFileError(fmt.FOREIGN, f"{len(header.token_ids)} tokens")
        if header.payload_nbytes != self._payload_nbytes:
            raise fmt.BlockFileError(fmt.FOREIGN, f"payload of {header.payload_nbytes} bytes")

    def _confirm(
        self,
        header: fmt.BlockHeader,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_ids: Sequence[int] | None,
        namespace: Namespace | None,
    ) -> None:
        self.check_shape(header, block_hash)
        extra = None if extra_ids is None else tuple(map(int, extra_ids))
        if (
            header.parent_hash != parent_hash
            or header.token_ids != tuple(map(int, token_ids))
            or header.extra_ids != extra
            or header.namespace_digest != fmt.namespace_digest(namespace)
        ):
            raise fmt.BlockFileError(fmt.MISMATCH, "stored key differs from the one looked up")

    def close(self) -> None:
        """Stop the reader threads (reads not started are cancelled)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
            self._threads = None


def _confirm_lineage(header: fmt.BlockHeader, parent_lineage: bytes | None) -> None:
    """That the file was written under the parent entry of `parent_lineage` (None: not
    checked); BlockFileError of kind MISMATCH if not."""
    if parent_lineage is not None and header.parent_lineage != parent_lineage:
        raise fmt.BlockFileError(fmt.MISMATCH, "written under another parent entry")
