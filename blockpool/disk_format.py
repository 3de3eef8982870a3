"""The disk tier's file format, one file per block, self-describing and checksummed,
and the few calls that write, read, touch and remove such a file.

A block file is

    fixed header   FIXED (struct below): magic, format version, flags, layout key,
                   number of tokens, digest lengths, payload size, namespace digest,
                   the block's lineage and its parent's (zeros for a first block)
    variable part  block digest, parent digest (when there is one),
                   token ids and extra ids (unsigned 64-bit little-endian)
    header check   xxh3-64 over the fixed header and the variable part
    payload        the block's KV bytes (C order, the layout's dtype and shape)
    file check     xxh3-128 over everything before it

Guarantees:
- `read_header` needs only the first `header_nbytes` bytes and the file size: it
  rejects a foreign or damaged header, and a file whose size is not the one its
  header declares (a truncated or extended file), without reading the payload.
- `decode_block` accepts a file's bytes only if the file checksum, the header
  checksum, the layout key and every size agree; it never returns bytes of a
  damaged file. The caller compares the entry with the key it looks for.
- `write_atomically` makes a file appear under its final name only complete
  (written to a temporary name, then `os.replace`d).
- The layout key is a digest of everything that decides the meaning of the
  payload bytes (format version, model fingerprint, producer, block size,
  dtype, block shape, byte order), so files of another model or setting never match.
- Lineage (format 2): a block's KV is that of its whole prefix, which its own key
  (tokens, parent digest) fixes only while digests never collide. So each file also
  names the entry it was written from (`lineage`, random, drawn when the entry was
  made or taken from the file it was read from) and its parent's; the tier serves a
  file as a block's child only under the parent entry of that lineage. A file left by
  another entry of a colliding digest is then never served below the new one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from .hashing import BlockHash, Namespace, hash_block

MAGIC = b"RPRSKVB\x00"
FORMAT_VERSION = 2  # 2: lineages in the fixed header
LAYOUT_KEY_NBYTES = 16
LINEAGE_NBYTES = 16
NO_LINEAGE = bytes(LINEAGE_NBYTES)  # a first block's parent lineage
FILE_SUFFIX = ".kvb"

_FLAG_PARENT = 1
_FLAG_EXTRA = 2
# The namespace has neither a cache salt nor an adapter id: its tokens may appear in
# KV events (a file without the flag is announced by its digests alone).
_FLAG_PUBLIC = 4
# magic, version, flags, layout key, num tokens, digest length, parent digest length,
# payload bytes, namespace digest, lineage, parent lineage
_FIXED = struct.Struct(f"<8sHH{LAYOUT_KEY_NBYTES}sIHHQ32s{LINEAGE_NBYTES}s{LINEAGE_NBYTES}s")
_HEADER_CHECK = 8  # xxh3-64
_FILE_CHECK = 16  # xxh3-128
_MAX_DIGEST_NBYTES = 64
_NAMESPACE_FINGERPRINT = b"reprise/disk-namespace"


class BlockFileError(Exception):
    """A block file that must not be served; `kind` says why (a stats counter name)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


# The kinds of bad file, each counted apart in the tier's stats.
BAD_HEADER = "header"  # not a block file of this format, or a damaged header
FOREIGN = "foreign"  # another layout, or a file under another block's name
TRUNCATED = "truncated"  # size differs from the one the header declares
CHECKSUM = "checksum"  # payload or trailer bytes damaged
MISMATCH = "mismatch"  # a sound file whose key differs from the one looked up
UNREADABLE = "unreadable"  # the read itself failed (EIO, permissions)
BAD_KINDS = (BAD_HEADER, FOREIGN, TRUNCATED, CHECKSUM, MISMATCH, UNREADABLE)


def layout_key(
    model_fingerprint: bytes,
    producer: str,
    block_size: int,
    dtype_name: str,
    block_shape: Sequence[int],
) -> bytes:
    """The digest naming a layout's folder and stamped in each of its files."""
    fields = [
        struct.pack("<H", FORMAT_VERSION),
        bytes(model_fingerprint),
        producer.encode(),
        struct.pack("<Q", block_size),
        dtype_name.encode(),
        struct.pack(f"<{len(block_shape)}Q", *block_shape),
        sys.byteorder.encode(),
    ]
    encoded = b"".join(struct.pack("<Q", len(f)) + f for f in fields)
    return hashlib.sha256(b"reprise/disk-layout" + encoded).digest()[:LAYOUT_KEY_NBYTES]


@functools.lru_cache(maxsize=1024)
def namespace_digest(namespace: Namespace | None) -> bytes:
    """A digest of the namespace, so a file confirms it without holding the salt in clear.

    NOTE: this reuses hashing.py's injective namespace encoding (a first block with
    no tokens under a fingerprint of its own), so two namespaces never share it.
    """
    return hash_block(None, (), namespace=namespace, model_fingerprint=_NAMESPACE_FINGERPRINT)


def file_name(block_hash: BlockHash) -> str:
    return bytes(block_hash).hex() + FILE_SUFFIX


def hash_of_file_name(name: str) -> BlockHash | None:
    """The digest a file name stands for, or None for a name no block file has."""
    if not name.endswith(FILE_SUFFIX):
        return None
    stem = name[: -len(FILE_SUFFIX)]
    try:
        digest = bytes.fromhex(stem)
    except ValueError:
        return None
    if not 0 < len(digest) <= _MAX_DIGEST_NBYTES or digest.hex() != stem:
        return None
    return BlockHash(digest)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a block file says about itself (everything but the payload)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_ids: tuple[int, ...] | None
    namespace_digest: bytes
    payload_offset: int
    payload_nbytes: int
    public: bool = False  # written for the default namespace (no salt, no adapter)
    lineage: bytes = NO_LINEAGE  # the entry the file was written from
    parent_lineage: bytes = NO_LINEAGE  # its parent entry's (NO_LINEAGE: a first block)

    @property
    def file_nbytes(self) -> int:
        return self.payload_offset + self.payload_nbytes + _FILE_CHECK


def header_nbytes_max(block_size: int) -> int:
    """An upper bound on a header's size: a scan reads at most this much of a file."""
    return _FIXED.size + 2 * _MAX_DIGEST_NBYTES + 2 * 8 * block_size + _HEADER_CHECK


def encode_header(
    layout: bytes,
    block_hash: BlockHash,
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_ids: Sequence[int] | None,
    namespace: Namespace | None,
    payload_nbytes: int,
    lineage: bytes = NO_LINEAGE,
    parent_lineage: bytes = NO_LINEAGE,
) -> bytes:
    """The bytes before the payload, header checksum included."""
    if len(lineage) != LINEAGE_NBYTES or len(parent_lineage) != LINEAGE_NBYTES:
        raise ValueError(
            f"lineages are {LINEAGE_NBYTES} bytes; got {lineage!r}, {parent_lineage!r}"
        )
    parent = b"" if parent_hash is None else bytes(parent_hash)
    flags = (_FLAG_PARENT if parent_hash is not None else 0) | (
        _FLAG_EXTRA if extra_ids is not None else 0
    )
    if namespace is None or namespace == Namespace():
        flags |= _FLAG_PUBLIC
    n = len(token_ids)
    head = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        flags,
        layout,
        n,
        len(block_hash),
        len(parent),
        payload_nbytes,
        namespace_digest(namespace),
        lineage,
        parent_lineage,
    )
    ids = struct.pack(f"<{n}Q", *token_ids)
    if extra_ids is not None:
        ids += struct.pack(f"<{n}Q", *extra_ids)
    body = head + bytes(block_hash) + parent + ids
    return body + xxhash.xxh3_64_digest(body)


def file_checksum(
    header: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview
) -> bytes:
    h = xxhash.xxh3_128()
    h.update(header)
    h.update(payload)
    return h.digest()


def read_header(
    data: bytes | bytearray | memoryview, layout: bytes, file_nbytes: int
) -> BlockHeader:
    """Parse and check the header at the start of `data`; BlockFileError if it must not be used."""
    if len(data) < _FIXED.size:
        raise BlockFileError(TRUNCATED if file_nbytes < _FIXED.size else BAD_HEADER, "short header")
    (
        magic,
        version,
        flags,
        file_layout,
        n,
        hash_len,
        parent_len,
        payload_nbytes,
        ns,
        lineage,
        parent_lineage,
    ) = _FIXED.unpack_from(data, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BlockFileError(BAD_HEADER, f"magic {magic!r}, version {version}")
    ids_nbytes = 8 * n * (2 if flags & _FLAG_EXTRA else 1)
    body_nbytes = _FIXED.size + hash_len + parent_len + ids_nbytes
    if len(data) < body_nbytes + _HEADER_CHECK:
        kind = TRUNCATED if file_nbytes < body_nbytes + _HEADER_CHECK else BAD_HEADER
        raise BlockFileError(kind, f"header of {body_nbytes} bytes; have {len(data)}")
    body = bytes(data[:body_nbytes])
    if xxhash.xxh3_64_digest(body) != bytes(data[body_nbytes : body_nbytes + _HEADER_CHECK]):
        raise BlockFileError(BAD_HEADER, "header checksum")
    if file_layout != layout:
        raise BlockFileError(FOREIGN, f"layout {file_layout.hex()}; expected {layout.hex()}")
    pos = _FIXED.size
    block_hash = BlockHash(body[pos : pos + hash_len])
    pos += hash_len
    parent_hash = BlockHash(body[pos : pos + parent_len]) if flags & _FLAG_PARENT else None
    pos += parent_len
    token_ids = struct.unpack_from(f"<{n}Q", body, pos)
    extra_ids = struct.unpack_from(f"<{n}Q", body, pos + 8 * n) if flags & _FLAG_EXTRA else None
    header = BlockHeader(
        block_hash=block_hash,
        parent_hash=parent_hash,
        token_ids=tuple(token_ids),
        extra_ids=None if extra_ids is None else tuple(extra_ids),
        namespace_digest=ns,
        payload_offset=body_nbytes + _HEADER_CHECK,
        payload_nbytes=payload_nbytes,
        public=bool(flags & _FLAG_PUBLIC),
        lineage=lineage,
        parent_lineage=parent_lineage,
    )
    if header.file_nbytes != file_nbytes:
        raise BlockFileError(TRUNCATED, f"{file_nbytes} bytes; header says {header.file_nbytes}")
    return header


def decode_block(data: bytes | bytearray | memoryview, layout: bytes) -> BlockHeader:
    """Check a whole block file's bytes; BlockFileError unless every check passes."""
    view = memoryview(data)
    header = read_header(view, layout, len(data))
    end = header.payload_offset + header.payload_nbytes
    expected = file_checksum(view[: header.payload_offset], view[header.payload_offset : end])
    if expected != bytes(view[end:]):
        raise BlockFileError(CHECKSUM, "file checksum")
    return header


def write_atomically(
    tmp: Path, final: Path, parts: Sequence[bytes | memoryview], *, fsync: bool
) -> None:
    """Write `parts` to a new file `tmp`, stamp its mtime now, then rename it to `final`."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        views = [memoryview(p) for p in parts]
        while views:
            n = os.writev(fd, views)
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if views:
                views[0] = views[0][n:]
        now = time.time_ns()  # finer than the kernel's file clock: last-use order survives restarts
        os.utime(fd, ns=(now, now))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def read_file(path: str | Path, limit: int = -1) -> bytes:
    """The file's bytes (the first `limit` of them when given)."""
    with open(path, "rb", buffering=0) as f:
        return f.read(limit) if limit >= 0 else f.readall()


def read_file_into(path: str | Path, buf: np.ndarray) -> memoryview:
    """Read the file into `buf` (uint8; one byte longer than the file is meant to be,
    so a file that grew shows as too long); its bytes, a view of `buf`."""
    view = buf.data.cast("B")  # buf.data is memoryview(buf), typed for mypy
    total = 0
    with open(path, "rb", buffering=0) as f:
        while total < len(view):
            n = f.readinto(view[total:])
            if not n:
                break
            total += n
    return view[:total]


def read_block_into(
    path: str | Path, payload: memoryview, layout: bytes, block_size: int
) -> BlockHeader:
    """Read a block file with its payload landing in `payload` (writable bytes of the
    payload's exact size, e.g. a host-tier slot: no copy, no fresh memory), header and
    trailer apart; checked as `decode_block` checks the whole file's bytes
    (BlockFileError unless every check passes; `payload` then holds no sound block).

    A file that fails is read again whole and judged by `decode_block`, so every kind
    of bad file is named as it is there (a bad file is rare; its second read is cheap)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            return _read_apart(fd, payload, layout, block_size)
        except BlockFileError as exc:
            decode_block(read_file(path), layout)
            raise exc from None  # sound whole: it changed between the reads
    finally:
        os.close(fd)


def _read_apart(fd: int, payload: memoryview, layout: bytes, block_size: int) -> BlockHeader:
    size = os.fstat(fd).st_size
    head_nbytes = size - len(payload) - _FILE_CHECK
    if not _FIXED.size + _HEADER_CHECK <= head_nbytes <= header_nbytes_max(block_size):
        raise BlockFileError(TRUNCATED, f"a {size}-byte file")
    head, trailer = bytearray(head_nbytes), bytearray(_FILE_CHECK + 1)  # +1: grown
    nbytes = _preadv_all(fd, [memoryview(head), payload, memoryview(trailer)])
    if nbytes != size:
        raise BlockFileError(TRUNCATED, f"read {nbytes} bytes of a {size}-byte file")
    header = read_header(head, layout, nbytes)
    if header.payload_offset != head_nbytes or header.payload_nbytes != len(payload):
        raise BlockFileError(FOREIGN, f"payload of {header.payload_nbytes} bytes")
    if file_checksum(head, payload) != bytes(trailer[:_FILE_CHECK]):
        raise BlockFileError(CHECKSUM, "file checksum")
    return header


def _preadv_all(fd: int, views: list[memoryview]) -> int:
    """Read from offset 0 into `views` in turn until they are full or the file ends;
    the number of bytes read."""
    total = 0
    while views:
        n = os.preadv(fd, views, total)
        if not n:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    return total


def touch(path: Path) -> None:
    """Mark a file used now (its mtime is its place in the last-use order)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):  # only the order after a restart suffers
        os.utime(path, ns=(now, now))


def unlink(path: str | Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


# -- sidecars ------------------------------------------------------------------
#
# A sidecar holds a block's extra data (its prompt-logprob entries), known only
# after the block may already be on disk, in a file of its own beside the block's:
#
#     magic, format version, layout key, digest length, body length (SIDE_FIXED)
#     block digest
#     body           the caller's bytes
#     file check     xxh3-128 over everything before it

SIDECAR_SUFFIX = ".plp"
SIDE_MAGIC = b"RPRSSDC\x00"
_SIDE_FIXED = struct.Struct(f"<8sH{LAYOUT_KEY_NBYTES}sHQ")


def sidecar_name(block_hash: BlockHash) -> str:
    return bytes(block_hash).hex() + SIDECAR_SUFFIX


def hash_of_sidecar_name(name: str) -> BlockHash | None:
    """The digest a sidecar's name stands for, or None for a name no sidecar has."""
    if not name.endswith(SIDECAR_SUFFIX):
        return None
    return hash_of_file_name(name[: -len(SIDECAR_SUFFIX)] + FILE_SUFFIX)


def encode_sidecar(layout: bytes, block_hash: BlockHash, body: bytes) -> list[bytes]:
    head = _SIDE_FIXED.pack(SIDE_MAGIC, FORMAT_VERSION, layout, len(block_hash), len(body))
    parts = [head, bytes(block_hash), body]
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return [*parts, h.digest()]


def decode_sidecar(data: bytes, layout: bytes, block_hash: BlockHash) -> bytes:
    """The body of a sound sidecar of this layout and block; else BlockFileError."""
    fixed = _SIDE_FIXED.size
    if len(data) < fixed + _FILE_CHECK:
        raise BlockFileError(TRUNCATED, f"{len(data)} bytes")
    magic, version, file_layout, digest_nbytes, body_nbytes = _SIDE_FIXED.unpack_from(data)
    if magic != SIDE_MAGIC or version != FORMAT_VERSION:
        raise BlockFileError(BAD_HEADER, "not a sidecar of this format")
    end = fixed + digest_nbytes + body_nbytes
    if len(data) != end + _FILE_CHECK:
        raise BlockFileError(TRUNCATED, f"{len(data)} bytes, {end + _FILE_CHECK} declared")
    if xxhash.xxh3_128_digest(data[:end]) != data[end:]:
        raise BlockFileError(CHECKSUM, "sidecar checksum")
    if file_layout != layout or data[fixed : fixed + digest_nbytes] != bytes(block_hash):
        raise BlockFileError(FOREIGN, "another layout's or block's sidecar")
    return data[fixed + digest_nbytes : end]
