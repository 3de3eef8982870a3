"""The disk tier's writer thread (disk.py's `DiskTier` is a `Writer`): it takes what
`put`, `put_sidecar` and `clear` queued, in order, and writes each file atomically
(a temporary file, then `os.replace`), makes a written block findable, and keeps the
folder within `max_bytes` by evicting the least recently used.

Guarantees (the tier's lock guards every field below that two threads touch):
- A staging buffer goes back to the free list only once the copy into it landed
  (`CopyDone.synchronize`) and its write ended or was dropped.
- A write queued before a `clear` (an older generation) is dropped, and one the
  clear overtook is not indexed: no cleared block comes back.
- Any write error disables the tier (one warning); the thread outlives any one block.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import disk_format as fmt
from .disk_config import CopyDone, DiskTierConfig
from .disk_index import DiskIndex, StoredFile
from .hashing import BlockHash, Namespace

if TYPE_CHECKING:
    from .disk_stale import StaleFiles

TMP_SUFFIX = ".tmp"


@dataclass(frozen=True, slots=True)
class QueuedWrite:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_ids: tuple[int, ...] | None
    namespace: Namespace | None
    lineage: bytes  # disk_format.py: lineage
    parent_lineage: bytes
    buffer: np.ndarray  # [payload_nbytes] uint8, a staging buffer
    done: CopyDone | None  # the copy into `buffer`, when it may still be under way
    generation: int  # the tier's at `put`: a `clear` since drops the write


@dataclass(frozen=True, slots=True)
class QueuedSidecar:
    block_hash: BlockHash
    parts: list[bytes]  # the whole file, encoded
    generation: int


@dataclass(frozen=True, slots=True)
class QueuedClear:
    """Queued by `clear`: the writer removes every block file when it gets here."""


class Writer:
    """The writer thread's half of the disk tier; its fields are the tier's (set in
    `DiskTier.__init__`), named here so this half reads on its own."""

    config: DiskTierConfig
    folder: Path
    layout: bytes
    _lock: threading.Lock
    _idle: threading.Condition
    _index: DiskIndex
    _stale: StaleFiles
    _queue: queue.Queue[QueuedWrite | QueuedSidecar | QueuedClear | None]
    _queued: set[BlockHash]
    _free_buffers: list[np.ndarray]
    _generation: int
    _enabled: bool
    _stopping: bool
    _num_unwritten: int
    _num_sidecars_queued: int
    _num_tmp: int
    _counts: dict[str, int]
    _side_counts: dict[str, int]
    _disable: Callable[[str], None]  # one warning, then the tier acts as an empty one

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, QueuedClear):
                self._remove_all_files()
                continue
            if isinstance(item, QueuedSidecar):
                self._write_sidecar(item)
                continue
            landed = False
            try:
                # Even a write to drop waits: the buffer is reused only once its copy landed.
                if item.done is not None:
                    item.done.synchronize()
                landed = True
                if self._enabled and not self._stopping and item.generation == self._generation:
                    self._write(item)
                else:
                    with self._lock:
                        self._counts["writes_dropped"] += 1
            except Exception as exc:  # the writer must outlive any one block
                self._disable(f"writing a block failed: {exc!r}")
            finally:
                with self._lock:
                    if landed:  # else a copy may still land in it: never reuse it
                        self._free_buffers.append(item.buffer)
                    self._queued.discard(item.block_hash)
                    self._finish_one()

    def _write(self, item: QueuedWrite) -> None:
        header = fmt.encode_header(
            self.layout,
            item.block_hash,
            item.parent_hash,
            item.token_ids,
            item.extra_ids,
            item.namespace,
            item.buffer.nbytes,
            item.lineage,
            item.parent_lineage,
        )
        payload = item.buffer.data
        parts: list[bytes | memoryview] = [header, payload, fmt.file_checksum(header, payload)]
        name = fmt.file_name(item.block_hash)
        self._num_tmp += 1
        tmp = self.folder / f"{name}.{os.getpid()}.{self._num_tmp}{TMP_SUFFIX}"
        try:
            self._write_file(tmp, self.folder / name, parts)
        except OSError as exc:
            fmt.unlink(tmp)
            self._disable(f"writing {tmp.name} failed: {exc}")
            return
        stored = StoredFile.of_write(
            sum(len(p) for p in parts),
            item.parent_hash,
            item.token_ids,
            item.extra_ids,
            item.namespace,
            item.lineage,
            item.parent_lineage,
        )
        namespace = item.namespace or Namespace()
        with self._lock:
            if not self._enabled or item.generation != self._generation:
                return  # cleared meanwhile: the clear queued behind this removes the file
            self._index.remove([item.block_hash])
            self._index.add(
                item.block_hash,
                stored,
                lora_name=namespace.adapter_id,
                with_tokens=namespace.cache_salt is None,
            )
            self._counts["writes"] += 1
        self._evict_to_bound()

    def _write_sidecar(self, item: QueuedSidecar) -> None:
        name = fmt.sidecar_name(item.block_hash)
        self._num_tmp += 1
        tmp = self.folder / f"{name}.{os.getpid()}.{self._num_tmp}{TMP_SUFFIX}"
        try:
            if self._enabled and not self._stopping and item.generation == self._generation:
                self._write_file(tmp, self.folder / name, item.parts)
                # NOTE: a clear since queued its removal behind this write; a block
                # write not done yet (planned, queued, or dropped) may leave the
                # sidecar alone until the next start removes it
                with self._lock:
                    self._side_counts["writes"] += 1
            else:
                with self._lock:
                    self._side_counts["writes_dropped"] += 1
        except OSError as exc:
            fmt.unlink(tmp)
            self._disable(f"writing {tmp.name} failed: {exc}")
        finally:
            with self._lock:
                self._num_sidecars_queued -= 1
                self._finish_one()

    def _write_file(self, tmp: Path, final: Path, parts: Sequence[bytes | memoryview]) -> None:
        """Write `parts` to `tmp`, then rename it to `final` (a test seam for I/O errors)."""
        fmt.write_atomically(tmp, final, parts, fsync=self.config.fsync)

    def _evict_to_bound(self) -> None:
        """Remove files until the directory is within `max_bytes`: other layouts'
        stale files first (disk_stale.py), then the tier's own, least recently used
        first."""
        with self._lock:
            over = self._index.num_bytes + self._stale.nbytes - self.config.max_bytes
        if over > 0 and len(self._stale):
            self._stale.remove_oldest(over)  # unlinks: outside the lock
        victims: list[BlockHash] = []
        with self._lock:
            while self._index.num_bytes + self._stale.nbytes > self.config.max_bytes:
                block_hash = self._index.least_recent()
                assert block_hash is not None
                self._index.remove([block_hash])  # one event each: each a file gone now
                self._counts["evictions"] += 1
                victims.append(block_hash)
        for block_hash in victims:
            fmt.unlink(self.folder / fmt.file_name(block_hash))
            fmt.unlink(self.folder / fmt.sidecar_name(block_hash))

    def _remove_all_files(self) -> None:
        """The writer's part of `clear`: every block file of the folder goes."""
        try:
            with os.scandir(self.folder) as entries:
                names = [
                    e.name
                    for e in entries
                    if fmt.hash_of_file_name(e.name) is not None
                    or fmt.hash_of_sidecar_name(e.name) is not None
                ]
        except OSError as exc:
            self._disable(f"clearing {self.folder} failed: {exc}")
            names = []
        for name in names:
            fmt.unlink(self.folder / name)
        with self._lock:
            self._finish_one()

    def _finish_one(self) -> None:
        self._num_unwritten -= 1
        if not self._num_unwritten:
            self._idle.notify_all()
