"""The disk tier: full blocks leaving the host tier, kept as files and found again by key.

One folder per layout (`<directory>/<layout key hex>/`, see disk_format.py), one
file per block named by its digest, and an in-memory index of those files in
least-recently-used order (disk_index.py). The pool calls `put` when a block leaves
the host tier and `contains` / `get` on a device and host miss. This module keeps
the index, the counts and the public calls; the writer thread is disk_writer.py's,
reading a file back and confirming it disk_reader.py's, the settings disk_config.py's.

Guarantees:
- Never serves wrong or damaged bytes: `get` returns a block only if its file's
  checksums, layout, digest, parent digest, token ids, extra ids and namespace
  all agree with the caller's (the pool's hit confirmation, DESIGN §3), and, when
  the caller names it, the lineage of the parent entry the file was written under
  (disk_format.py: a file outlives its entry, so under a digest collision a later
  entry of the same digest must not find the old one's children). A file failing
  any check is counted by kind, removed, and reported as a miss.
- Never blocks the caller on a write: `put` copies the bytes into one of at most
  `write_queue_blocks + 1` staging buffers (a full queue and the block being
  written) and hands it to one writer thread; when none is free the write is
  dropped and counted. The copy may be asynchronous (`put` given a `ReadBlock`,
  e.g. a device-to-host copy on the GPU's copy stream): the writer waits for it
  (`CopyDone.synchronize`) before it reads the buffer, and a buffer is reused
  only after its copy landed and its write ended.
- Crash safety: a block file only ever appears under its final name by
  `os.replace` of a fully written temporary file, so after a process crash
  (SIGTERM or SIGKILL) every named file is complete. Without `fsync` (the
  default; one fsync per block costs more than the write) a power loss may
  leave a named file damaged; the checksum then keeps it from being served.
- Bounded size: the directory holds at most `max_bytes` of block files once the
  writer has caught up: the tier's own, least recently used (written or hit) first,
  and the files of other layouts no running daemon holds (another model, an older
  reprise or file format), which count toward the bound and go before any of its
  own, oldest first (disk_stale.py). Last use is kept as the file's mtime, so the
  order survives a restart. A folder a running daemon holds is left to its bound.
- Bounded start: `open` lists the folder once and reads at most
  `header_nbytes_max(block_size)` bytes (about 0.7 KiB at 32 tokens) of each
  block file, never a payload; temporary files of a killed writer are removed.
- Never fails the daemon: a folder that cannot be created, written or locked at
  `open`, and any write error later (a full disk, a read-only remount), logs ONE
  warning and disables the tier; a disabled tier acts as an empty one.
- One process per folder: `open` takes an exclusive `flock` on the folder; a
  second daemon on the same folder runs without the tier. (A tier looking whether
  another layout's folder is held takes its lock for an instant: `open` retries its
  lock for about 50 ms before it gives up.)
- Chains read ahead: `read_ahead` reads and checks a run of block files (a chain the
  pool matched on disk) on up to `read_threads` reader threads, into buffers the
  caller's thread allocates; `get(..., ahead=)` takes one's outcome, so the counts,
  touches and removals stay the caller's, in chain order, and a block read ahead
  but never taken counts for nothing.
- Partial matches without I/O: the index (disk_index.py) keeps each file's key,
  so `find_partial` reads nothing until `get` confirms its choice.
- `clear` forgets every block at once; files go on the writer thread, after the
  writes queued before it (which are dropped), so no cleared block comes back.
- Sidecars: `put_sidecar` queues a block's extra bytes (its prompt-logprob
  entries, known only once a request asked for them, maybe after the block was
  written) for the writer, as `<digest>.plp` (disk_format.py; at most
  `write_queue_blocks` queued, more dropped and counted), and `get_sidecar` reads
  one back checked (checksum, layout, digest; a bad one is a miss, counted and
  removed). A sidecar goes when its block's file is evicted or found bad, on
  `clear`, and at `open` when its block has no file (its write was dropped). Not
  counted in `max_bytes`: about 5 KiB against a block file of megabytes.
- KV events (medium DISK), once `attach_events` names a sink: a BlockStored when
  a block's file is in place (from the writer thread), a BlockRemoved when a file
  is evicted, found bad or gone, or the tier disabled; sent under the tier's
  lock, so in the order of the index's changes (disk_index.py says which carry
  tokens).
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from . import disk_format as fmt
from .disk_config import Allocate, DiskTierConfig, ReadBlock
from .disk_index import DiskIndex, PartialMatch, StoredFile, parent_of
from .disk_reader import BlockKeyOnDisk, BlockReader, Checked
from .disk_stale import LOCK_NAME, StaleFiles
from .disk_writer import TMP_SUFFIX, QueuedClear, QueuedSidecar, QueuedWrite, Writer
from .events import EventSink
from .hashing import BlockHash, Namespace

log = logging.getLogger(__name__)

LOCK_TRIES = 6  # `open`'s tries at the folder's lock, LOCK_RETRY_S apart
LOCK_RETRY_S = 0.01


class DiskTier(Writer):
    """Block files under one layout folder; build with `DiskTier.open(config)`."""

    def __init__(self, config: DiskTierConfig) -> None:
        self.config = config
        self.layout = fmt.layout_key(
            config.model_fingerprint,
            config.producer,
            config.block_size,
            config.dtype,
            config.block_shape,
        )
        self.folder = Path(config.directory) / self.layout.hex()
        self._dtype = config.np_dtype
        self._payload_nbytes = config.payload_nbytes
        self._lock = threading.Lock()
        self._index = DiskIndex(config.block_size)
        self._queued: set[BlockHash] = set()
        self._generation = 0  # bumped by clear
        # Unbounded: the staging buffers bound what is queued.
        self._queue: queue.Queue[QueuedWrite | QueuedSidecar | QueuedClear | None] = queue.Queue()
        self._num_sidecars_queued = 0  # at most write_queue_blocks
        self._idle = threading.Condition(self._lock)
        self._num_unwritten = 0  # queued or being written
        # Staging buffers: each queued or written block holds one until its write ends.
        self._free_buffers: list[np.ndarray] = []
        self._num_buffers = 0
        self._max_buffers = config.write_queue_blocks + 1  # a full queue + the writer's
        self._enabled = False
        self._closing = False  # set by close: no more puts
        self._stopping = False  # set by close: the writer drops what is queued
        self._lock_fd: int | None = None
        self._writer: threading.Thread | None = None
        self._num_tmp = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "writes", "writes_dropped", "evictions", "tmp_removed"), 0
        )
        self._side_counts = dict.fromkeys(
            ("hits", "misses", "writes", "writes_dropped", "corrupt_removed"), 0
        )
        self._bad = dict.fromkeys(fmt.BAD_KINDS, 0)
        self._reader = BlockReader(self.folder, self.layout, config)
        self._stale = StaleFiles([])  # other layouts' files, found by `open`

    @classmethod
    def open(cls, config: DiskTierConfig) -> DiskTier:
        """The tier over `config.directory`, its index rebuilt from the files there; a
        folder that cannot be used gives a disabled tier and one warning, not an error."""
        tier = cls(config)
        try:
            tier._start()
        except OSError as exc:
            tier._disable(f"cannot use {tier.folder}: {exc}")
        return tier

    @property
    def enabled(self) -> bool:
        return self._enabled

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether a file for this digest is indexed (no I/O; `get` still confirms it)."""
        with self._lock:
            return self._enabled and block_hash in self._index

    def lineages(self, block_hash: BlockHash) -> tuple[bytes, bytes] | None:
        """The indexed file's lineage and its parent's (disk_format.py), None when no file
        for this digest is indexed (no I/O)."""
        with self._lock:
            stored = self._index.get(block_hash) if self._enabled else None
            return None if stored is None else (stored.lineage, stored.parent_lineage)

    def twin_lineage(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_ids: Sequence[int] | None,
        namespace: Namespace | None,
        parent_lineage: bytes | None,
    ) -> bytes | None:
        """The lineage of the indexed file of this very key written under the parent entry
        of `parent_lineage` (None: a first block), if there is one (no I/O): an entry
        computed anew of the same prefix takes it, so the file's children on disk stay
        its children."""
        with self._lock:
            stored = self._index.get(block_hash) if self._enabled else None
            if stored is None or stored.parent_lineage != (parent_lineage or fmt.NO_LINEAGE):
                return None
            same = (
                stored.parent == parent_of(parent_hash, fmt.namespace_digest(namespace))
                and stored.common_prefix(token_ids, extra_ids) == len(stored.token_ids)
                and len(token_ids) == len(stored.token_ids)
            )
            return stored.lineage if same else None

    def knows(self, block_hash: BlockHash) -> bool:
        """Whether a file for this digest is indexed or queued for writing (no I/O)."""
        with self._lock:
            return self._enabled and (block_hash in self._index or block_hash in self._queued)

    def find_partial(
        self,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        *,
        extra_ids: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        parent_lineage: bytes | None = None,
    ) -> PartialMatch | None:
        """The indexed child of `parent_hash` (None: of the namespace's root) sharing the
        longest nonzero prefix with `token_ids` (and `extra_ids`), from the index alone
        (no I/O; `get` with the match's key then reads and confirms the file). Ties go to
        the child indexed first. With `parent_lineage`, only a child written under the
        parent entry of that lineage."""
        parent = parent_of(parent_hash, fmt.namespace_digest(namespace))
        with self._lock:
            if not self._enabled:
                return None
            return self._index.find_partial(parent, token_ids, extra_ids, parent_lineage)

    def clear(self) -> None:
        """Forget every block: the index empties now (later lookups miss, later puts are
        written anew), writes queued before are dropped, and the writer removes every
        block file once it gets to this clear. Emits no event: the pool's
        AllBlocksCleared covers this tier."""
        with self._lock:
            if not self._enabled or self._closing:
                return
            self._generation += 1
            self._index.clear(emit=False)
            self._queued.clear()
            self._num_unwritten += 1  # flush waits for the files to go
        self._queue.put(QueuedClear())

    def attach_events(self, sink: EventSink, *, announce: bool = True) -> None:
        """Send the tier's KV events (medium DISK) to `sink` from now on, from whichever
        thread changes the index (the writer's, for a block written; `sink` must be
        thread-safe). With `announce`, first a BlockStored for every block indexed now
        (a restart's files), least recently used first."""
        with self._lock:
            self._index.attach(sink, announce=announce)

    def put(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        kv: np.ndarray | ReadBlock,
        *,
        extra_ids: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        allocate: Allocate | None = None,
        lineage: bytes = fmt.NO_LINEAGE,
        parent_lineage: bytes = fmt.NO_LINEAGE,
    ) -> bool:
        """Queue one block for writing: its KV (`block_shape`, `dtype`), copied into a
        staging buffer now, or a `ReadBlock` that issues that copy and returns what the
        writer waits for. `allocate` makes a staging buffer when fewer than the bound
        exist (default: ordinary host memory). False when not queued: disabled, already
        stored or queued, or no staging buffer free (counted as dropped)."""
        self._check_block(token_ids, extra_ids, kv)
        with self._lock:
            if not self._enabled or self._closing or block_hash in self._queued:
                return False
            if block_hash in self._index:
                self._index.touch(block_hash)
                return False
            buffer = self._free_buffers.pop() if self._free_buffers else None
            if buffer is None and self._num_buffers == self._max_buffers:
                self._counts["writes_dropped"] += 1
                return False
            if buffer is None:
                self._num_buffers += 1  # allocated below, outside the lock
            self._queued.add(block_hash)
            self._num_unwritten += 1
        try:
            if buffer is None:
                buffer = (allocate or np.empty)((self._payload_nbytes,), np.uint8)
            block = buffer.view(self._dtype).reshape(self.config.block_shape)
            if isinstance(kv, np.ndarray):
                np.copyto(block, kv)
                done = None
            else:
                done = kv(block)
        except BaseException:
            with self._lock:
                if buffer is None:
                    self._num_buffers -= 1
                else:
                    self._free_buffers.append(buffer)
                self._queued.discard(block_hash)
                self._finish_one()
            raise
        extra = None if extra_ids is None else tuple(map(int, extra_ids))
        item = QueuedWrite(
            block_hash, parent_hash, tuple(map(int, token_ids)), extra, namespace, lineage,
            parent_lineage, buffer, done, self._generation,
        )  # fmt: skip
        # NOTE: every queued item holds a staging buffer and there is one buffer more
        # than queue places (the writer's), so the queue always has room here.
        self._queue.put_nowait(item)
        return True

    def get(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        *,
        extra_ids: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        ahead: Future[Checked] | None = None,
        into: np.ndarray | None = None,
        parent_lineage: bytes | None = None,
    ) -> np.ndarray | None:
        """The block's KV (an array of `block_shape`) if its file is sound and was stored
        under this very key, else None (a bad file is counted and removed). Reads and
        checks the file on the calling thread, or takes the outcome of this block's
        `read_ahead` (`ahead`, for this very key). With `into` (a writable C-contiguous
        array of the payload's size, e.g. a host-tier slot) the payload is read into it
        and returned as a view of it; without, the array is read-only. A hit makes the
        block the most recently used. With `parent_lineage`, the file must have been
        written under the parent entry of that lineage (else a miss, the file removed);
        `ahead` must then have been read with it too."""
        with self._lock:
            if not self._enabled:
                return None
            if block_hash not in self._index:
                self._counts["misses"] += 1
                return None
        path = self.folder / fmt.file_name(block_hash)
        try:
            if ahead is None:
                payload = self._reader.read_checked(
                    block_hash, parent_hash, token_ids, extra_ids, namespace, into=into,
                    parent_lineage=parent_lineage,
                )  # fmt: skip
            else:
                payload = ahead.result()
        except FileNotFoundError:
            self._forget(block_hash)
            return None
        except OSError as exc:
            self._drop_bad(block_hash, path, fmt.UNREADABLE, str(exc))
            return None
        except fmt.BlockFileError as exc:
            self._drop_bad(block_hash, path, exc.kind, str(exc))
            return None
        with self._lock:
            self._index.touch(block_hash)
            self._counts["hits"] += 1
        fmt.touch(path)
        return payload

    def read_ahead(
        self,
        keys: Sequence[BlockKeyOnDisk],
        namespace: Namespace | None = None,
        into: Sequence[np.ndarray | None] | None = None,
        parent_lineages: Sequence[bytes | None] | None = None,
    ) -> list[Future[Checked]]:
        """Start reading and checking these blocks' files on the reader threads, in order
        (BlockReader.read_ahead); pass each future to `get` as `ahead` with the same key.
        Nothing is counted, touched or removed here."""
        with self._lock:
            sizes = [self._index.nbytes_of(key[0]) for key in keys]
        return self._reader.read_ahead(keys, sizes, namespace, into, parent_lineages)

    @staticmethod
    def settle(futures: Sequence[Future[Checked]]) -> None:
        """Cancel reads not taken, and wait for those already running to end (their
        destinations are free to reuse after this)."""
        BlockReader.settle(futures)

    def put_sidecar(self, block_hash: BlockHash, body: bytes) -> bool:
        """Queue `body` (a block's extra data: its prompt-logprob entries) for writing as
        the block's sidecar file, replacing any before. False when not queued: disabled,
        or `write_queue_blocks` sidecars already queued (counted as dropped)."""
        parts = fmt.encode_sidecar(self.layout, block_hash, body)
        with self._lock:
            if not self._enabled or self._closing:
                return False
            if self._num_sidecars_queued == self.config.write_queue_blocks:
                self._side_counts["writes_dropped"] += 1
                return False
            self._num_sidecars_queued += 1
            self._num_unwritten += 1
            item = QueuedSidecar(block_hash, parts, self._generation)
        self._queue.put_nowait(item)
        return True

    def get_sidecar(self, block_hash: BlockHash) -> bytes | None:
        """The body of the block's sidecar if its file is sound and is this block's, else
        None (a bad file is counted and removed). Reads on the calling thread."""
        if not self.enabled:
            return None
        path = self.folder / fmt.sidecar_name(block_hash)
        try:
            body = fmt.decode_sidecar(fmt.read_file(path), self.layout, block_hash)
        except FileNotFoundError:
            body = None
        except (OSError, fmt.BlockFileError) as exc:
            self.drop_sidecar(block_hash, str(exc))
            with self._lock:
                self._side_counts["misses"] += 1
            return None
        with self._lock:
            self._side_counts["misses" if body is None else "hits"] += 1
        return body

    def drop_sidecar(self, block_hash: BlockHash, detail: str) -> None:
        """Remove a sidecar found bad (by `get_sidecar`, or by its caller reading the
        body: e.g. fewer top entries than now asked for), counted as corrupt."""
        path = self.folder / fmt.sidecar_name(block_hash)
        with self._lock:
            first = not self._side_counts["corrupt_removed"]
            self._side_counts["corrupt_removed"] += 1
        (log.warning if first else log.debug)("disk tier: removing %s (%s)", path, detail)
        fmt.unlink(path)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write is done (or dropped); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle:
            while self._num_unwritten:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self, *, flush: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the writer: finish the queued writes (`flush`) or drop them, within
        `timeout_s`, then let go of the folder. Later puts are refused."""
        self._reader.close()
        writer = self._writer
        if writer is None:
            self._enabled = False
            self._release_folder()
            return
        with self._lock:
            self._closing = True  # puts are refused from now on
            self._stopping = self._stopping or not flush
        deadline = time.monotonic() + timeout_s
        self._queue.put(None)  # after every queued write
        writer.join(max(0.0, deadline - time.monotonic()))
        if writer.is_alive():
            self._stopping = True
            writer.join(1.0)
        if writer.is_alive():
            log.warning("disk tier writer did not stop within %.1f s", timeout_s)
            return
        self._writer = None
        with self._lock:
            self._enabled = False
        self._release_folder()

    def _release_folder(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            out: dict[str, int | bool] = {
                "disk_enabled": self._enabled,
                "disk_blocks": len(self._index),
                "disk_bytes": self._index.num_bytes,
                **{f"disk_{name}": n for name, n in self._counts.items()},
                **{f"disk_sidecar_{name}": n for name, n in self._side_counts.items()},
                "disk_corrupt_removed": sum(self._bad.values()),
                "disk_stale_bytes": self._stale.nbytes,
                "disk_stale_removed": self._stale.files_removed,
            }
            out.update({f"disk_corrupt_{kind}": n for kind, n in self._bad.items()})
        return out

    def lru_order(self) -> list[BlockHash]:
        """Indexed digests, least recently used (next to evict) first."""
        with self._lock:
            return list(self._index)

    def check_integrity(self) -> None:
        """Index and files agree (call with the writer idle, e.g. after `flush`)."""
        with self._lock:
            self._index.check()
            assert self._index.num_bytes <= self.config.max_bytes or not self._enabled
            for block_hash, stored in self._index.items():
                path = self.folder / fmt.file_name(block_hash)
                assert path.stat().st_size == stored.nbytes, (path, stored.nbytes)

    # -- start ---------------------------------------------------------------

    def _start(self) -> None:
        self._lock_fd = self._take_folder()
        probe = self.folder / f".probe.{os.getpid()}{TMP_SUFFIX}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
        self._scan()
        self._stale = StaleFiles.scan(Path(self.config.directory), self.folder)
        if self._stale.nbytes:
            log.info(
                "disk tier: %.1f MiB of other layouts' files in %s count toward its bound "
                "(removed oldest first when it needs the room): %s",
                self._stale.nbytes / (1 << 20),
                self.config.directory,
                ", ".join(f.name for f in self._stale.folders),
            )
        self._enabled = True
        self._evict_to_bound()
        self._writer = threading.Thread(target=self._write_loop, name="disk-tier", daemon=True)
        self._writer.start()

    def _take_folder(self) -> int:
        """Make the folder and hold its lock; returns the lock's descriptor. Retried a
        few times: another tier may hold it for an instant (disk_stale.py), or be
        removing the folder, emptied, under its lock."""
        for attempt in range(LOCK_TRIES):
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            path = self.folder / LOCK_NAME
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:  # the folder went meanwhile
                time.sleep(LOCK_RETRY_S)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = os.fstat(fd)
                now = os.stat(path)
            except OSError as exc:
                os.close(fd)
                if isinstance(exc, FileNotFoundError) or attempt + 1 < LOCK_TRIES:
                    time.sleep(LOCK_RETRY_S)
                    continue
                raise OSError(exc.errno, "the folder is in use by another process") from exc
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                return fd
            os.close(fd)  # a lock file removed after we opened it: take the new one
        raise OSError(f"could not hold {self.folder / LOCK_NAME} in {LOCK_TRIES} tries")

    def _scan(self) -> None:
        found: list[tuple[int, str, BlockHash, int, fmt.BlockHeader]] = []
        sidecars: list[str] = []
        limit = fmt.header_nbytes_max(self.config.block_size)
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name.endswith(TMP_SUFFIX):
                    fmt.unlink(entry.path)
                    self._counts["tmp_removed"] += 1
                    continue
                if fmt.hash_of_sidecar_name(entry.name) is not None:
                    sidecars.append(entry.name)
                    continue
                block_hash = fmt.hash_of_file_name(entry.name)
                if block_hash is None or not entry.is_file(follow_symlinks=False):
                    continue  # the lock, or nothing of ours
                try:
                    st = entry.stat(follow_symlinks=False)
                    head = fmt.read_file(entry.path, limit)
                    header = fmt.read_header(head, self.layout, st.st_size)
                    self._reader.check_shape(header, block_hash)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    self._count_bad(entry.path, fmt.UNREADABLE, str(exc))
                    continue
                except fmt.BlockFileError as exc:
                    self._count_bad(entry.path, exc.kind, str(exc))
                    continue
                found.append((st.st_mtime_ns, entry.name, block_hash, st.st_size, header))
        for _, _, block_hash, nbytes, header in sorted(found, key=lambda f: f[:2]):
            self._index.add(block_hash, StoredFile.of_header(header, nbytes))
        for name in sidecars:  # a sidecar outlives its block only if the block's write failed
            if fmt.hash_of_sidecar_name(name) not in self._index:
                fmt.unlink(self.folder / name)

    # -- bookkeeping ---------------------------------------------------------

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._index.remove([block_hash])
            self._counts["misses"] += 1

    def _drop_bad(self, block_hash: BlockHash, path: Path, kind: str, detail: str) -> None:
        self._forget(block_hash)
        self._count_bad(path, kind, detail)
        fmt.unlink(self.folder / fmt.sidecar_name(block_hash))

    def _count_bad(self, path: str | Path, kind: str, detail: str) -> None:
        with self._lock:
            first = not self._bad[kind]
            self._bad[kind] += 1
        (log.warning if first else log.debug)("disk tier: removing %s (%s)", path, detail)
        fmt.unlink(path)

    def _disable(self, reason: str) -> None:
        with self._lock:
            was_enabled = self._enabled or self._writer is None
            self._enabled = False
            self._index.clear(emit=True)
        if was_enabled:
            log.warning("disk tier disabled, serving without it: %s", reason)

    def _check_block(
        self, token_ids: Sequence[int], extra_ids: Sequence[int] | None, kv: object
    ) -> None:
        cfg = self.config
        if len(token_ids) != cfg.block_size:
            raise ValueError(f"a block holds {cfg.block_size} token ids; got {len(token_ids)}")
        if extra_ids is not None and len(extra_ids) != len(token_ids):
            raise ValueError(f"extra_ids must have one id per token; got {len(extra_ids)}")
        if callable(kv):
            return
        if not isinstance(kv, np.ndarray) or kv.shape != cfg.block_shape or kv.dtype != self._dtype:
            got = (type(kv).__name__, getattr(kv, "shape", None), getattr(kv, "dtype", None))
            raise ValueError(
                f"kv must be a {cfg.block_shape} {cfg.dtype} ndarray or a ReadBlock; got {got}"
            )
