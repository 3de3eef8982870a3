"""The disk tier's store: round trips, restarts, layouts, damaged files, LRU, queue, failures."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from reprise.blockpool import disk_format as fmt
from reprise.blockpool.disk import DiskTier
from reprise.blockpool.disk_config import DiskTierConfig
from reprise.blockpool.hashing import BlockHash, Namespace, hash_block

SHAPE = (2, 2, 1, 4, 8)  # [num_layers, 2, num_kv_heads, block_size, head_dim]
BLOCK_SIZE = 4
FINGERPRINT = b"model-a"
LOGGER = "reprise.blockpool.disk"


def make_config(where: Path, **overrides: object) -> DiskTierConfig:
    fields: dict[str, object] = dict(
        directory=where,
        max_bytes=1 << 20,
        block_shape=SHAPE,
        block_size=BLOCK_SIZE,
        model_fingerprint=FINGERPRINT,
        producer="numpy/cpu/test",
    )
    fields.update(overrides)
    return DiskTierConfig(**fields)  # type: ignore[arg-type]


def random_kv(seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Random BF16 bit patterns (NaNs and infinities included): only bytes-exact passes."""
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return bits.view(ml_dtypes.bfloat16)


class Chain:
    """A chain of blocks as the pool would offer them: digest, parent, tokens, KV."""

    def __init__(self, num_blocks: int, seed: int = 0, namespace: Namespace | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.tokens = [rng.integers(0, 50_000, BLOCK_SIZE).tolist() for _ in range(num_blocks)]
        self.kvs = [random_kv(seed * 1000 + i) for i in range(num_blocks)]
        self.namespace = namespace
        self.hashes: list[BlockHash] = []
        parent = None
        for tokens in self.tokens:
            parent = hash_block(parent, tokens, namespace=namespace, model_fingerprint=FINGERPRINT)
            self.hashes.append(parent)

    def parent(self, i: int) -> BlockHash | None:
        return self.hashes[i - 1] if i else None

    def put(self, tier: DiskTier, i: int) -> bool:
        return tier.put(
            self.hashes[i], self.parent(i), self.tokens[i], self.kvs[i], namespace=self.namespace
        )

    def get(self, tier: DiskTier, i: int) -> np.ndarray | None:
        return tier.get(self.hashes[i], self.parent(i), self.tokens[i], namespace=self.namespace)


def store(tier: DiskTier, chain: Chain, ids: range | list[int] | None = None) -> None:
    for i in range(len(chain.hashes)) if ids is None else ids:
        assert chain.put(tier, i)
        assert tier.flush(10)


def path_of(tier: DiskTier, block_hash: BlockHash) -> Path:
    return tier.folder / fmt.file_name(block_hash)


@pytest.fixture
def tier(tmp_path: Path):
    t = DiskTier.open(make_config(tmp_path))
    yield t
    t.close()


def test_a_file_names_its_lineage_and_is_served_only_under_its_parents(tier: DiskTier) -> None:
    """Each file keeps the lineage of the entry it was written from and of its parent
    entry (disk_format.py); `lineages` reads them from the index, `find_partial` and
    `get` given a parent lineage pass over a file written under another (`get` counts
    and removes it, as any file of another key), and without one do not check it."""
    chain = Chain(2, seed=9)
    own, parent, other = (bytes([i]) * fmt.LINEAGE_NBYTES for i in (7, 8, 9))
    assert tier.put(chain.hashes[1], chain.parent(1), chain.tokens[1], chain.kvs[1],
                    lineage=own, parent_lineage=parent)  # fmt: skip
    assert tier.flush(10)
    assert tier.lineages(chain.hashes[1]) == (own, parent)
    assert tier.lineages(chain.hashes[0]) is None
    head = chain.tokens[1][:3]
    assert tier.find_partial(chain.hashes[0], head, parent_lineage=other) is None
    found = tier.find_partial(chain.hashes[0], head, parent_lineage=parent)
    assert found is not None and found.block_hash == chain.hashes[1]
    assert tier.find_partial(chain.hashes[0], head) is not None
    key = (chain.hashes[1], chain.hashes[0], chain.tokens[1])
    got = tier.get(*key, parent_lineage=parent)
    assert got is not None and got.tobytes() == chain.kvs[1].tobytes()
    assert tier.get(*key, parent_lineage=other) is None
    assert tier.stats()["disk_corrupt_mismatch"] == 1 and not tier.contains(chain.hashes[1])
    with pytest.raises(ValueError, match="lineages are 16 bytes"):
        fmt.encode_header(tier.layout, chain.hashes[0], None, chain.tokens[0], None, None, 8,
                          lineage=b"short")  # fmt: skip


def test_lineages_survive_a_restart(tmp_path: Path) -> None:
    """Read back from each file's header at open, as the writer indexed them."""
    chain = Chain(2, seed=10)
    lineages = [(bytes([3 + i]) * fmt.LINEAGE_NBYTES, bytes([9 - i]) * fmt.LINEAGE_NBYTES)
                for i in range(2)]  # fmt: skip
    tier = DiskTier.open(make_config(tmp_path))
    for i, (own, parent) in enumerate(lineages):
        assert tier.put(chain.hashes[i], chain.parent(i), chain.tokens[i], chain.kvs[i],
                        lineage=own, parent_lineage=parent)  # fmt: skip
    assert tier.flush(10)
    tier.close()
    tier = DiskTier.open(make_config(tmp_path))
    try:
        assert [tier.lineages(h) for h in chain.hashes] == lineages
    finally:
        tier.close()


def test_round_trip_is_bytes_exact(tier: DiskTier) -> None:
    chain = Chain(3)
    store(tier, chain)
    for i in range(3):
        assert tier.contains(chain.hashes[i])
        got = chain.get(tier, i)
        assert got is not None and got.shape == SHAPE and got.dtype == ml_dtypes.bfloat16
        assert got.tobytes() == chain.kvs[i].tobytes()
    stats = tier.stats()
    assert (stats["disk_blocks"], stats["disk_writes"], stats["disk_hits"]) == (3, 3, 3)
    assert stats["disk_bytes"] == sum(path_of(tier, h).stat().st_size for h in chain.hashes)
    assert stats["disk_enabled"] is True and stats["disk_corrupt_removed"] == 0
    assert not chain.put(tier, 0)  # already stored
    tier.check_integrity()


def test_put_copies_the_callers_bytes(tier: DiskTier) -> None:
    chain = Chain(1)
    kv = chain.kvs[0].copy()
    assert tier.put(chain.hashes[0], None, chain.tokens[0], kv)
    kv[...] = 0  # the caller's arena slot is reused at once
    assert tier.flush(10)
    got = chain.get(tier, 0)
    assert got is not None and got.tobytes() == chain.kvs[0].tobytes()


def test_miss_is_counted_and_touches_nothing(tier: DiskTier) -> None:
    chain = Chain(1)
    assert not tier.contains(chain.hashes[0])
    assert chain.get(tier, 0) is None
    assert tier.stats()["disk_misses"] == 1


def test_restart_finds_blocks_in_last_use_order(tmp_path: Path) -> None:
    chain = Chain(4)
    first = DiskTier.open(make_config(tmp_path))
    store(first, chain)
    assert chain.get(first, 1) is not None  # block 1 becomes the most recently used
    first.close()
    second = DiskTier.open(make_config(tmp_path))
    try:
        expected = [chain.hashes[i] for i in (0, 2, 3, 1)]
        assert second.lru_order() == expected
        for i in range(4):
            got = chain.get(second, i)
            assert got is not None and got.tobytes() == chain.kvs[i].tobytes()
        second.check_integrity()
    finally:
        second.close()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(model_fingerprint=b"model-b"),
        dict(producer="cupy/sm_90/test"),
        dict(block_size=8, block_shape=(2, 2, 1, 8, 8)),
        dict(dtype="float16"),
        dict(block_shape=(2, 2, 2, 4, 4)),
    ],
    ids=["fingerprint", "producer", "block_size", "dtype", "shape"],
)
def test_another_model_or_setting_finds_nothing(tmp_path: Path, overrides: dict) -> None:
    chain = Chain(2)
    first = DiskTier.open(make_config(tmp_path))
    store(first, chain)
    first.close()
    other = DiskTier.open(make_config(tmp_path, **overrides))
    try:
        assert other.folder != first.folder
        assert not any(other.contains(h) for h in chain.hashes)
        assert other.stats()["disk_blocks"] == 0
    finally:
        other.close()
    assert all(path_of(first, h).exists() for h in chain.hashes)  # left alone


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _damage(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "payload":
        _flip(path, size - 16 - 3)
    elif how == "trailer":
        _flip(path, size - 1)
    elif how == "header_tokens":
        _flip(path, 76 + 32 + 32 + 1)  # inside the first token id
    elif how == "magic":
        _flip(path, 0)
    elif how == "truncated":
        os.truncate(path, size - 100)
    elif how == "truncated_header":
        os.truncate(path, 40)
    elif how == "extended":
        with open(path, "ab") as f:
            f.write(b"\0")


DAMAGE_KINDS = {
    "payload": fmt.CHECKSUM,
    "trailer": fmt.CHECKSUM,
    "header_tokens": fmt.BAD_HEADER,
    "magic": fmt.BAD_HEADER,
    "truncated": fmt.TRUNCATED,
    "truncated_header": fmt.TRUNCATED,
    "extended": fmt.TRUNCATED,
}


def _dest(fill: int = 0x5A) -> np.ndarray:
    """A destination slot (a host-tier slot's shape), filled with a pattern no block has."""
    return np.full(SHAPE, fill, np.uint16).view(ml_dtypes.bfloat16)


def test_get_into_reads_the_payload_into_the_destination(tier: DiskTier) -> None:
    chain = Chain(2, seed=9)
    store(tier, chain)
    dest = _dest()
    got = tier.get(chain.hashes[1], chain.parent(1), chain.tokens[1], into=dest)
    assert got is not None and np.shares_memory(got, dest) and got.shape == SHAPE
    assert dest.tobytes() == chain.kvs[1].tobytes()
    with pytest.raises(ValueError, match="into must be C-contiguous and 256 bytes"):
        tier.get(chain.hashes[0], None, chain.tokens[0], into=_dest()[:1])


def test_reading_into_a_slot_judges_every_damage_as_reading_the_whole_file(
    tier: DiskTier,
) -> None:
    """Random damage (a flipped bit anywhere, a cut or an extension of any length):
    `read_block_into` (header, payload and trailer read apart) accepts exactly the files
    `decode_block` accepts, names the same kind of damage, and what it accepts is the
    block's payload."""
    chain = Chain(1, seed=3)
    store(tier, chain)
    path = path_of(tier, chain.hashes[0])
    sound = path.read_bytes()
    rng = np.random.default_rng(11)
    kinds = set()
    for _ in range(300):
        data = bytearray(sound)
        what = rng.integers(3)
        if what == 0:
            data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
        elif what == 1:
            del data[int(rng.integers(len(data))) :]
        else:
            data += bytes(int(rng.integers(1, 600)))
        path.write_bytes(bytes(data))

        def verdict(read) -> str:
            try:
                read()
            except fmt.BlockFileError as exc:
                return exc.kind
            return "sound"

        dest = _dest()
        whole = verdict(lambda data=data: fmt.decode_block(bytes(data), tier.layout))
        apart = verdict(lambda dest=dest: fmt.read_block_into(
            path, memoryview(dest.view(np.uint8).reshape(-1)), tier.layout, BLOCK_SIZE
        ))  # fmt: skip
        assert apart == whole, (what, len(data))
        kinds.add(whole)
        if whole == "sound":
            assert dest.tobytes() == chain.kvs[0].tobytes()
    assert {fmt.BAD_HEADER, fmt.TRUNCATED, fmt.CHECKSUM} <= kinds, kinds


@pytest.mark.parametrize("into", [False, True], ids=["fresh", "into"])
@pytest.mark.parametrize("how", list(DAMAGE_KINDS))
def test_damaged_file_is_never_served(tier: DiskTier, how: str, into: bool) -> None:
    chain = Chain(3)
    store(tier, chain)
    path = path_of(tier, chain.hashes[1])
    _damage(path, how)
    dest = _dest() if into else None
    assert tier.get(chain.hashes[1], chain.parent(1), chain.tokens[1], into=dest) is None
    stats = tier.stats()
    assert stats[f"disk_corrupt_{DAMAGE_KINDS[how]}"] == 1 and stats["disk_corrupt_removed"] == 1
    assert not path.exists() and not tier.contains(chain.hashes[1])
    assert stats["disk_blocks"] == 2
    for i in (0, 2):  # the others still serve
        got = chain.get(tier, i)
        assert got is not None and got.tobytes() == chain.kvs[i].tobytes()
    tier.check_integrity()


@pytest.mark.parametrize("into", [False, True], ids=["fresh", "into"])
@pytest.mark.parametrize("how", [None, "wrong_key", *DAMAGE_KINDS])
def test_a_chain_read_ahead_is_checked_as_it_is_taken(
    tier: DiskTier, how: str | None, into: bool
) -> None:
    """Blocks read and checked ahead on the reader threads give `get` the bytes and the
    verdicts of a read on the caller's: a damaged file (or one looked up under another
    key) in the middle is found when taken, counted and removed there, and the blocks
    after it, read but never taken, count nothing. Read `into` destinations (host
    slots), each block lands in its own, and `settle` waits for reads not taken."""
    chain = Chain(5, seed=4)
    store(tier, chain)
    tokens = [list(t) for t in chain.tokens]
    if how == "wrong_key":
        tokens[2][0] += 1
    elif how is not None:
        _damage(path_of(tier, chain.hashes[2]), how)
    keys = [(chain.hashes[i], chain.parent(i), tokens[i], None) for i in range(5)]
    dests = [_dest(i) for i in range(5)] if into else None
    reads = tier.read_ahead(keys, into=dests)
    taken = []
    for i, read in enumerate(reads):
        got = tier.get(chain.hashes[i], chain.parent(i), tokens[i], ahead=read)
        if got is None:
            break
        if dests is None:
            assert not got.flags.writeable
        else:
            assert np.shares_memory(got, dests[i])
        taken.append(got.tobytes())
    tier.settle(reads[len(taken) :])
    assert all(read.done() for read in reads)
    num = 5 if how is None else 2
    assert taken == [kv.tobytes() for kv in chain.kvs[:num]]
    stats = tier.stats()
    assert stats["disk_hits"] == num and stats["disk_misses"] == (how is not None)
    assert stats["disk_corrupt_removed"] == (how is not None)
    kind = fmt.MISMATCH if how == "wrong_key" else DAMAGE_KINDS.get(how or "")
    if kind is not None:
        assert stats[f"disk_corrupt_{kind}"] == 1
    assert stats["disk_blocks"] == 5 - (how is not None)
    tier.check_integrity()


@pytest.mark.parametrize("how", ["header_tokens", "magic", "truncated", "truncated_header"])
def test_damaged_header_or_size_is_removed_at_open(tmp_path: Path, how: str) -> None:
    chain = Chain(3)
    first = DiskTier.open(make_config(tmp_path))
    store(first, chain)
    first.close()
    _damage(path_of(first, chain.hashes[1]), how)
    second = DiskTier.open(make_config(tmp_path))
    try:
        assert second.lru_order() == [chain.hashes[0], chain.hashes[2]]
        assert second.stats()[f"disk_corrupt_{DAMAGE_KINDS[how]}"] == 1
        assert not path_of(second, chain.hashes[1]).exists()
    finally:
        second.close()


def test_file_under_another_blocks_name(tmp_path: Path) -> None:
    chain = Chain(3)
    tier = DiskTier.open(make_config(tmp_path))
    store(tier, chain)
    os.replace(path_of(tier, chain.hashes[0]), path_of(tier, chain.hashes[1]))
    assert chain.get(tier, 1) is None  # while running
    assert tier.stats()["disk_corrupt_foreign"] == 1
    assert not path_of(tier, chain.hashes[1]).exists()
    os.replace(path_of(tier, chain.hashes[2]), tier.folder / fmt.file_name(BlockHash(b"\x07" * 32)))
    tier.close()
    reopened = DiskTier.open(make_config(tmp_path))  # and at open
    try:
        assert reopened.stats()["disk_corrupt_foreign"] == 1
        assert reopened.stats()["disk_blocks"] == 0
        assert sorted(p.name for p in reopened.folder.iterdir()) == ["lock"]
    finally:
        reopened.close()


def test_file_of_another_layout_copied_in_is_foreign(tmp_path: Path) -> None:
    chain = Chain(1)
    other = DiskTier.open(make_config(tmp_path / "b", model_fingerprint=b"model-b"))
    store(other, chain)
    other.close()
    mine = DiskTier.open(make_config(tmp_path / "a"))
    mine.close()
    name = fmt.file_name(chain.hashes[0])
    (mine.folder / name).write_bytes((other.folder / name).read_bytes())
    reopened = DiskTier.open(make_config(tmp_path / "a"))
    try:
        assert not reopened.contains(chain.hashes[0])
        assert reopened.stats()["disk_corrupt_foreign"] == 1
        assert not (mine.folder / name).exists()
    finally:
        reopened.close()


@pytest.mark.parametrize("wrong", ["tokens", "parent", "extra_ids", "namespace"])
def test_stored_key_must_match_the_lookup(tier: DiskTier, wrong: str) -> None:
    chain = Chain(2, namespace=Namespace(cache_salt="tenant-secret"))
    store(tier, chain)
    tokens, parent, extra, namespace = chain.tokens[1], chain.parent(1), None, chain.namespace
    if wrong == "tokens":
        tokens = [*tokens[:-1], tokens[-1] + 1]
    elif wrong == "parent":
        parent = BlockHash(b"\x01" * 32)
    elif wrong == "extra_ids":
        extra = [0] * BLOCK_SIZE
    else:
        namespace = Namespace(cache_salt="tenant-other")
    got = tier.get(chain.hashes[1], parent, tokens, extra_ids=extra, namespace=namespace)
    assert got is None
    assert tier.stats()["disk_corrupt_mismatch"] == 1
    assert not path_of(tier, chain.hashes[1]).exists()


def test_salt_is_not_written_in_clear(tier: DiskTier) -> None:
    chain = Chain(1, namespace=Namespace(cache_salt="tenant-secret"))
    store(tier, chain)
    assert b"tenant-secret" not in path_of(tier, chain.hashes[0]).read_bytes()


def test_extra_ids_round_trip(tier: DiskTier) -> None:
    chain = Chain(1)
    extra = [7, 8, 9, 10]
    assert tier.put(chain.hashes[0], None, chain.tokens[0], chain.kvs[0], extra_ids=extra)
    assert tier.flush(10)
    assert tier.get(chain.hashes[0], None, chain.tokens[0], extra_ids=extra) is not None


def test_leftover_temporary_file_is_removed_at_open(tmp_path: Path) -> None:
    chain = Chain(2)
    first = DiskTier.open(make_config(tmp_path))
    store(first, chain, [0])
    first.close()
    name = fmt.file_name(chain.hashes[1])
    partial = path_of(first, chain.hashes[0]).read_bytes()[:100]
    (first.folder / f"{name}.4242.1.tmp").write_bytes(partial)
    second = DiskTier.open(make_config(tmp_path))
    try:
        assert second.stats()["disk_tmp_removed"] == 1
        assert second.lru_order() == [chain.hashes[0]]
        assert sorted(p.name for p in second.folder.iterdir()) == sorted(
            ["lock", fmt.file_name(chain.hashes[0])]
        )
    finally:
        second.close()


def test_open_reads_headers_only(tmp_path: Path, monkeypatch) -> None:
    chain = Chain(5)
    first = DiskTier.open(make_config(tmp_path))
    store(first, chain)
    first.close()
    limits: list[int] = []
    real_read = fmt.read_file

    def recording_read(path: str | Path, limit: int = -1) -> bytes:
        limits.append(limit)
        return real_read(path, limit)

    monkeypatch.setattr(fmt, "read_file", recording_read)
    second = DiskTier.open(make_config(tmp_path))
    try:
        assert limits == [fmt.header_nbytes_max(BLOCK_SIZE)] * 5
        assert fmt.header_nbytes_max(BLOCK_SIZE) < path_of(second, chain.hashes[0]).stat().st_size
        assert second.stats()["disk_blocks"] == 5
    finally:
        second.close()


def test_lru_eviction_by_last_use(tmp_path: Path) -> None:
    # a first block's file is 452 bytes, a later block's 484: room for three, not four
    tier = DiskTier.open(make_config(tmp_path, max_bytes=3 * 484 + 100))
    try:
        chain = Chain(6)
        store(tier, chain, [0, 1, 2])
        assert chain.get(tier, 0) is not None  # 0 is now the most recently used
        store(tier, chain, [3])
        assert tier.lru_order() == [chain.hashes[i] for i in (2, 0, 3)]
        assert not chain.put(tier, 2)  # a put of a stored block counts as a use
        store(tier, chain, [4])
        assert tier.lru_order() == [chain.hashes[i] for i in (3, 2, 4)]
        names = sorted(p.name for p in tier.folder.iterdir() if p.name != "lock")
        assert names == sorted(fmt.file_name(chain.hashes[i]) for i in (2, 3, 4))
        assert tier.stats()["disk_evictions"] == 2
        tier.check_integrity()
    finally:
        tier.close()


def test_open_evicts_down_to_a_smaller_bound(tmp_path: Path) -> None:
    chain = Chain(4)
    first = DiskTier.open(make_config(tmp_path))
    store(first, chain)
    first.close()
    second = DiskTier.open(make_config(tmp_path, max_bytes=2 * 484))
    try:
        assert second.lru_order() == [chain.hashes[2], chain.hashes[3]]
        assert not path_of(second, chain.hashes[0]).exists()
    finally:
        second.close()


class PausedTier(DiskTier):
    """A tier whose writer waits at each write until `go` is set."""

    def __init__(self, config: DiskTierConfig) -> None:
        super().__init__(config)
        self.go = threading.Event()
        self.writing = threading.Event()

    def _write_file(self, tmp: Path, final: Path, parts: list[bytes]) -> None:
        self.writing.set()
        assert self.go.wait(10)
        super()._write_file(tmp, final, parts)


def test_full_queue_drops_and_counts(tmp_path: Path) -> None:
    tier = PausedTier.open(make_config(tmp_path, write_queue_blocks=2))
    assert isinstance(tier, PausedTier)
    chain = Chain(5)
    try:
        assert chain.put(tier, 0)
        assert tier.writing.wait(10)  # the writer holds block 0
        assert chain.put(tier, 1) and chain.put(tier, 2)  # the queue is full now
        assert not chain.put(tier, 3) and not chain.put(tier, 4)
        assert tier.stats()["disk_writes_dropped"] == 2
        assert not tier.flush(0.01)  # the writer is held: flush gives up at its bound
        tier.go.set()
        assert tier.flush(10)
        assert tier.lru_order() == chain.hashes[:3]
        assert tier.stats()["disk_writes"] == 3
        assert chain.put(tier, 3)  # room again
        assert tier.flush(10) and tier.contains(chain.hashes[3])
    finally:
        tier.go.set()
        tier.close()


def test_close_without_flush_drops_the_queue(tmp_path: Path) -> None:
    tier = PausedTier.open(make_config(tmp_path, write_queue_blocks=4))
    assert isinstance(tier, PausedTier)
    chain = Chain(4)
    for i in range(4):
        assert chain.put(tier, i)
    assert tier.writing.wait(10)
    threading.Timer(0.2, tier.go.set).start()
    tier.close(flush=False, timeout_s=5)
    stats = tier.stats()
    assert stats["disk_writes"] + stats["disk_writes_dropped"] == 4
    assert stats["disk_writes_dropped"] >= 2  # at most the write under way and one more finish
    assert not chain.put(tier, 0)


class FullDiskTier(DiskTier):
    def _write_file(self, tmp: Path, final: Path, parts: list[bytes]) -> None:
        with open(tmp, "wb") as f:
            f.write(parts[0])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_disables_with_one_warning(tmp_path: Path, caplog) -> None:
    chain = Chain(3)
    healthy = DiskTier.open(make_config(tmp_path))
    store(healthy, chain, [0])
    healthy.close()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier = FullDiskTier.open(make_config(tmp_path))
    try:
        assert tier.contains(chain.hashes[0])
        assert chain.put(tier, 1)
        assert tier.flush(10)
        assert not tier.enabled and tier.stats()["disk_enabled"] is False
        assert not chain.put(tier, 2)
        assert not tier.contains(chain.hashes[0]) and chain.get(tier, 0) is None
        assert tier.stats()["disk_blocks"] == 0
        assert not any(p.name.endswith(".tmp") for p in tier.folder.iterdir())
    finally:
        tier.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()


def _assert_acts_empty(tier: DiskTier, chain: Chain) -> None:
    assert not tier.enabled
    assert not chain.put(tier, 0)
    assert tier.flush(1)
    assert not tier.contains(chain.hashes[0]) and chain.get(tier, 0) is None
    stats = tier.stats()
    assert stats["disk_enabled"] is False and stats["disk_blocks"] == 0
    tier.close()


def test_unusable_directory_disables_with_one_warning(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    (tmp_path / "file").write_bytes(b"")
    tier = DiskTier.open(make_config(tmp_path / "file" / "cache"))
    _assert_acts_empty(tier, Chain(1))
    assert len(caplog.records) == 1 and "cannot use" in caplog.records[0].getMessage()


def test_read_only_filesystem_disables_with_one_warning(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    chain = Chain(1)
    first = DiskTier.open(make_config(tmp_path))
    store(first, chain)
    first.close()
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier = DiskTier.open(make_config(tmp_path))
    _assert_acts_empty(tier, chain)
    assert len(caplog.records) == 1 and "Read-only" in caplog.records[0].getMessage()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a 0500 directory")
def test_chmod_read_only_directory(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tmp_path.chmod(0o500)
    try:
        tier = DiskTier.open(make_config(tmp_path))
        _assert_acts_empty(tier, Chain(1))
    finally:
        tmp_path.chmod(0o700)
    assert len(caplog.records) == 1


def test_second_tier_on_the_same_folder_is_refused(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    first = DiskTier.open(make_config(tmp_path))
    try:
        second = DiskTier.open(make_config(tmp_path))
        _assert_acts_empty(second, Chain(1))
        assert "in use by another process" in caplog.records[0].getMessage()
        assert first.enabled
    finally:
        first.close()
    third = DiskTier.open(make_config(tmp_path))  # the lock went with the first
    assert third.enabled
    third.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_bytes", 10),
        ("max_bytes", -1),
        ("block_shape", ()),
        ("block_shape", (2, 0, 4)),
        ("block_size", 3),
        ("block_size", 0),
        ("model_fingerprint", b""),
        ("model_fingerprint", "model"),
        ("dtype", "no-such-dtype"),
        ("producer", ""),
        ("write_queue_blocks", 0),
        ("fsync", "yes"),
        ("directory", ""),
        ("read_threads", 0),
    ],
)
def test_config_names_the_bad_field(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        make_config(tmp_path, **{field: value})


@pytest.mark.parametrize("bad", ["shape", "dtype", "tokens", "extra_ids", "type"])
def test_put_refuses_a_malformed_block(tier: DiskTier, bad: str) -> None:
    chain = Chain(1)
    kv, tokens, extra = chain.kvs[0], chain.tokens[0], None
    if bad == "shape":
        kv = kv.reshape(2, 2, 4, 8)
    elif bad == "dtype":
        kv = kv.view(np.float16)
    elif bad == "tokens":
        tokens = tokens[:-1]
    elif bad == "extra_ids":
        extra = [1, 2]
    else:
        kv = kv.tolist()
    with pytest.raises(ValueError, match=r"kv|token ids|extra_ids"):
        tier.put(chain.hashes[0], None, tokens, kv, extra_ids=extra)  # type: ignore[arg-type]


# -- SIGKILL during writes -------------------------------------------------------

# 1 MiB a block, so that a kill most often lands inside a write (Linux stops a write
# to a regular file at a page boundary on SIGKILL, leaving a partial file)
KILL_SHAPE = (32, 2, 4, BLOCK_SIZE, 512)
KILL_FINGERPRINT = b"kill-test"
_KILL_KVS: dict[int, np.ndarray] = {}


def kill_test_block(i: int) -> tuple[BlockHash, list[int], np.ndarray]:
    tokens = [i, i + 1, i + 2, i + 3]
    block_hash = hash_block(None, tokens, model_fingerprint=KILL_FINGERPRINT)
    if i % 8 not in _KILL_KVS:
        _KILL_KVS[i % 8] = random_kv(i % 8, KILL_SHAPE)
    return block_hash, tokens, _KILL_KVS[i % 8]


def kill_test_config(directory: str | Path) -> DiskTierConfig:
    return DiskTierConfig(
        directory=directory,
        max_bytes=48 << 20,
        block_shape=KILL_SHAPE,
        block_size=BLOCK_SIZE,
        model_fingerprint=KILL_FINGERPRINT,
        producer="numpy/cpu/test",
        write_queue_blocks=8,
    )


_CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
from test_disk_tier import DiskTier, kill_test_block, kill_test_config
tier = DiskTier.open(kill_test_config(sys.argv[1]))
i = 0
while True:
    block_hash, tokens, kv = kill_test_block(i)
    if tier.put(block_hash, None, tokens, kv):
        i += 1
    if i == 12:
        tier.flush()
        print("ready", flush=True)
        i += 1
"""


def test_sigkill_during_writes_serves_only_complete_blocks(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        threading.Event().wait(0.3)  # let it write a while longer
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    tier = DiskTier.open(kill_test_config(tmp_path))
    try:
        stored = set(tier.lru_order())
        assert len(stored) >= 12
        served = 0
        for i in range(100_000):
            block_hash, tokens, kv = kill_test_block(i)
            if block_hash in stored:
                got = tier.get(block_hash, None, tokens)
                assert got is not None and got.tobytes() == kv.tobytes(), i
                served += 1
            if served == len(stored):
                break
        assert served == len(stored)
        assert tier.stats()["disk_corrupt_removed"] == 0
        assert not any(p.name.endswith(".tmp") for p in tier.folder.iterdir())
        tier.check_integrity()
    finally:
        tier.close()
