"""The disk tier wired into the pool and the engine: the copies the pool plans for it
(write-through, writes on leaving the memory tiers, disk hits onboarded), their
pins and stats, damaged files, and an in-process restart whose logits are
bit-identical to computing the prompt fresh."""

from __future__ import annotations

import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_disk_tier import BLOCK_SIZE, SHAPE, Chain, make_config

from reprise.blockpool import disk_format as fmt
from reprise.blockpool.copies import BlockCopy, DiskEntry
from reprise.blockpool.disk import DiskTier
from reprise.blockpool.hashing import DEFAULT_NAMESPACE
from reprise.blockpool.host import HostTier
from reprise.blockpool.pool import BlockPool
from reprise.daemon.engine.config import EngineConfig, SettingError
from reprise.daemon.engine.engine import Engine
from reprise.daemon.engine.params import SamplingParams
from reprise.daemon.model.synth import synth_model


def open_tier(where: Path) -> DiskTier:
    tier = DiskTier.open(make_config(where))
    assert tier.enabled
    return tier


def run_writes(pool: BlockPool, tier: DiskTier, kvs: dict[int, np.ndarray]) -> list[BlockCopy]:
    """Play the runner for the planned copies: device block b holds kvs[b]."""
    copies = pool.take_copies()
    for copy in copies:
        if copy.kind == "device_to_disk":
            e = copy.entry
            assert e is not None and copy.src is not None
            tier.put(e.block_hash, e.parent_hash, e.token_ids, kvs[copy.src], namespace=e.namespace,
                     lineage=e.lineage, parent_lineage=e.parent_lineage)  # fmt: skip
    pool.complete_copies()
    assert tier.flush(10)
    return copies


def register_chain(pool: BlockPool, chain: Chain) -> list[int]:
    block_ids = pool.allocate(len(chain.hashes))
    assert block_ids is not None
    for i, block_id in enumerate(block_ids):
        parent = block_ids[i - 1] if i else None
        assert pool.register(block_id, chain.hashes[i], chain.tokens[i], parent)
    return block_ids


def test_register_writes_through_and_a_new_pool_onboards_from_disk(tmp_path: Path) -> None:
    chain = Chain(3, seed=1)
    tier = open_tier(tmp_path)
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    block_ids = register_chain(pool, chain)
    lineages = [pool.blocks[b].lineage for b in block_ids]  # random, one each
    assert len(set(lineages)) == 3 and all(len(x) == fmt.LINEAGE_NBYTES for x in lineages)
    copies = run_writes(pool, tier, dict(zip(block_ids, chain.kvs, strict=True)))
    assert copies == [
        BlockCopy(
            "device_to_disk",
            block_ids[i],
            None,
            entry=DiskEntry(
                chain.hashes[i],
                chain.parent(i),
                tuple(chain.tokens[i]),
                None,
                DEFAULT_NAMESPACE,
                lineages[i],
                lineages[i - 1] if i else fmt.NO_LINEAGE,
            ),
        )
        for i in range(3)
    ]
    assert pool.take_copies() == []  # registering again plans nothing: the tier knows them
    tier.close()

    tier = open_tier(tmp_path)  # a restart: a new pool over the same folder
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    match = pool.match(chain.hashes, chain.tokens)
    assert (match.num_blocks, match.num_disk_hits, match.num_device_hits) == (3, 3, 0)
    copies = pool.take_copies()
    assert [(c.kind, c.src, c.dst) for c in copies] == [
        ("disk_onboard", None, b) for b in match.block_ids
    ]
    for copy, kv in zip(copies, chain.kvs, strict=True):
        assert copy.staged is not None and copy.staged.tobytes() == kv.tobytes()
    assert pool.num_pending_copies == 3  # each destination pinned until the copy ran
    pool.check_integrity()
    assert pool.complete_copies() == 3 and pool.num_pending_copies == 0
    stats = pool.stats()
    assert (stats.disk_hits, stats.reused_blocks, stats.host_hits) == (3, 3, 0)
    assert (stats.disk_blocks, stats.disk_enabled, stats.cached_blocks) == (3, 1, 3)
    # the onboarded blocks are device entries now: a second match hits the device
    pool.free(match.block_ids)
    again = pool.match(chain.hashes, chain.tokens)
    assert (again.num_disk_hits, again.num_device_hits) == (0, 3)
    assert pool.take_copies() == []
    pool.free(again.block_ids)
    pool.check_integrity()
    tier.close()


def test_a_memory_prefix_continues_on_disk(tmp_path: Path) -> None:
    chain = Chain(4, seed=2)
    tier = open_tier(tmp_path)
    for i in range(4):
        assert chain.put(tier, i)
    assert tier.flush(10)
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    first = Chain(4, seed=2)
    head = pool.allocate(2)
    assert head is not None
    assert pool.register(head[0], first.hashes[0], first.tokens[0], None)
    assert pool.register(head[1], first.hashes[1], first.tokens[1], head[0])
    pool.take_copies()  # the write-through of blocks the tier has already: none
    match = pool.match(chain.hashes, chain.tokens)
    assert match.block_ids[:2] == head and (match.num_device_hits, match.num_disk_hits) == (2, 2)
    pool.take_copies()
    pool.complete_copies()
    pool.free(match.block_ids)
    pool.free(head)
    pool.check_integrity()
    tier.close()


def put_with_lineages(tier: DiskTier, chain: Chain, lineages: list[tuple[bytes, bytes]]) -> None:
    """Block i's file written by entry lineages[i][0] under the parent entry lineages[i][1]."""
    for i, (lineage, parent_lineage) in enumerate(lineages):
        assert tier.put(chain.hashes[i], chain.parent(i), chain.tokens[i], chain.kvs[i],
                        lineage=lineage, parent_lineage=parent_lineage)  # fmt: skip
    assert tier.flush(10)


@pytest.mark.parametrize("consistent", [True, False])
def test_a_file_written_under_another_parent_entry_is_no_child(
    tmp_path: Path, consistent: bool
) -> None:
    """A file names the entry it was written from and its parent's (disk_format.py:
    lineage). Files whose lineages chain are a chain on disk; a file written under a
    parent entry of another lineage (what a digest collision leaves: a file outlives
    its entry, and a later entry of the same digest is no parent of its children) is
    neither matched, nor a partial match's source, nor a twin a recomputed entry takes
    the lineage of, and so nothing below it is found either."""
    a, b, c = (bytes([i]) * fmt.LINEAGE_NBYTES for i in (1, 2, 3))
    chain = Chain(3, seed=4)
    tier = open_tier(tmp_path)
    put_with_lineages(tier, chain, [(a, fmt.NO_LINEAGE), (b, a if consistent else c), (c, b)])
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    match = pool.match(chain.hashes, chain.tokens)
    assert match.num_disk_hits == (3 if consistent else 1)
    assert [pool.blocks[i].lineage for i in match.block_ids] == [a, b, c][: match.num_blocks]
    pool.take_copies()
    pool.complete_copies()
    if not consistent:  # block 1's file: no partial source under block 0's entry either
        assert pool.find_partial(chain.hashes[0], chain.tokens[1][:5]) is None
        # computed anew under block 0's entry, it takes no lineage of a file: block 2's
        # file, a child of block 1's file, is no child of it
        fresh = pool.allocate(1)
        assert fresh is not None
        assert pool.register(fresh[0], chain.hashes[1], chain.tokens[1], match.block_ids[0])
        assert pool.blocks[fresh[0]].lineage not in (a, b, c)
        pool.take_copies()
        again = pool.match(chain.hashes, chain.tokens)
        assert again.block_ids == [match.block_ids[0], fresh[0]] and again.num_disk_hits == 0
        pool.free(again.block_ids + fresh)
    pool.free(match.block_ids)
    pool.check_integrity()
    tier.close()


def test_an_entry_computed_anew_takes_its_twin_files_lineage(tmp_path: Path) -> None:
    """A block computed in memory while the disk holds its file, written under the same
    parent entry (here: the first block, under the root), takes that file's lineage, so
    the files below it on disk stay its children."""
    a, b = (bytes([i]) * fmt.LINEAGE_NBYTES for i in (5, 6))
    chain = Chain(2, seed=5)
    tier = open_tier(tmp_path)
    put_with_lineages(tier, chain, [(a, fmt.NO_LINEAGE), (b, a)])
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    head = pool.allocate(1)
    assert head is not None and pool.register(head[0], chain.hashes[0], chain.tokens[0], None)
    assert pool.blocks[head[0]].lineage == a
    pool.take_copies()  # the tier has it: no write
    match = pool.match(chain.hashes, chain.tokens)
    assert match.block_ids[0] == head[0] and match.num_disk_hits == 1
    pool.take_copies()
    pool.complete_copies()
    pool.free(match.block_ids + head)
    pool.check_integrity()
    tier.close()


def test_a_flipped_byte_is_a_miss_counted_and_removed(tmp_path: Path) -> None:
    chain = Chain(3, seed=3)
    tier = open_tier(tmp_path)
    for i in range(3):
        assert chain.put(tier, i)
    assert tier.flush(10)
    path = tier.folder / fmt.file_name(chain.hashes[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # in the payload
    path.write_bytes(bytes(data))
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    match = pool.match(chain.hashes, chain.tokens)
    assert (match.num_blocks, match.num_disk_hits) == (1, 1)  # the chain ends at the bad file
    assert [c.kind for c in pool.take_copies()] == ["disk_onboard"]
    pool.complete_copies()
    assert not path.exists()
    stats = pool.stats()
    assert (stats.disk_corrupt_removed, stats.disk_hits, stats.missed_blocks) == (1, 1, 2)
    pool.free(match.block_ids)
    pool.check_integrity()
    tier.close()


def test_another_namespace_never_hits_on_disk(tmp_path: Path) -> None:
    chain = Chain(2, seed=4)
    tier = open_tier(tmp_path)
    for i in range(2):
        assert chain.put(tier, i)
    assert tier.flush(10)
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    salted = DEFAULT_NAMESPACE.__class__(cache_salt="tenant-b")
    match = pool.match(chain.hashes, chain.tokens, namespace=salted)
    assert match.num_blocks == 0 and pool.take_copies() == []
    tier.close()


def test_leaving_the_host_tier_unwritten_plans_a_host_to_disk_write(tmp_path: Path) -> None:
    """A block whose write-through never ran (dropped) is written when it leaves
    the host tier, read from its host slot before the slot is overwritten."""
    chain = Chain(2, seed=5)
    tier = open_tier(tmp_path)
    pool = BlockPool(2, BLOCK_SIZE, host_tier=HostTier(1), disk_tier=tier)
    block_ids = register_chain(pool, chain)
    assert [c.kind for c in pool.take_copies()] == ["device_to_disk"] * 2  # not run: dropped
    pool.free(block_ids)
    assert pool.allocate(1) is not None  # evicts block 1 (the tail) to the host slot
    assert [(c.kind, c.src, c.dst) for c in pool.take_copies()] == [("offload", 1, 0)]
    pool.complete_copies()
    assert pool.allocate(1) is not None  # evicts block 0: the slot's entry (block 1) leaves
    copies = pool.take_copies()
    assert [(c.kind, c.src) for c in copies] == [("host_to_disk", 0), ("offload", 0)]
    assert copies[0].entry is not None and copies[0].entry.block_hash == chain.hashes[1]
    pool.complete_copies()
    pool.check_integrity()
    tier.close()


def _arena(num_slots: int) -> np.ndarray:
    """A host tier's memory, filled with a pattern no block has."""
    return np.full((num_slots, *SHAPE), 0x5A, np.uint16).view(ml_dtypes.bfloat16)


def _restarted(tmp_path: Path, chain: Chain, num_slots: int, num_blocks: int = 8):
    """A pool over a disk tier holding `chain`, its host tier's memory `arena`."""
    tier = open_tier(tmp_path)
    for i in range(len(chain.hashes)):
        assert chain.put(tier, i)
    assert tier.flush(10)
    arena = _arena(num_slots)
    pool = BlockPool(
        num_blocks, BLOCK_SIZE, host_tier=HostTier(num_slots), disk_tier=tier,
        host_memory=arena.__getitem__,
    )  # fmt: skip
    return pool, tier, arena


@pytest.mark.parametrize("num_slots", [9, 5, 0], ids=["slots", "slots-short", "no-host"])
def test_a_long_disk_match_hands_its_copies_out_as_the_reads_land(
    tmp_path: Path, num_slots: int
) -> None:
    """Inside a match, copies_ready is called every copy_batch hits; the copies
    taken then are those of the blocks read so far, in chain order, their bytes final
    (read and checked), so the engine can start their device copies while the later
    reads go on. Every hit's copy is handed out once, pinned until complete_copies."""
    chain = Chain(9, seed=13)
    seen: list[tuple[str, int, bytes]] = []  # (kind, device block, source bytes) when taken
    calls: list[int] = []

    def take(copies: list[BlockCopy]) -> None:
        for copy in copies:
            kv = arena[copy.src] if copy.staged is None else copy.staged
            seen.append((copy.kind, copy.dst, kv.tobytes()))

    def copies_ready() -> None:
        copies = pool.take_copies()
        calls.append(len(copies))
        take(copies)

    tier = open_tier(tmp_path)
    for i in range(len(chain.hashes)):
        assert chain.put(tier, i)
    assert tier.flush(10)
    arena = _arena(max(num_slots, 1))
    host = dict(host_tier=HostTier(num_slots), host_memory=arena.__getitem__) if num_slots else {}
    pool = BlockPool(
        12, BLOCK_SIZE, disk_tier=tier, copies_ready=copies_ready, copy_batch=4, **host
    )
    match = pool.match(chain.hashes, chain.tokens)
    assert match.num_disk_hits == 9
    assert calls == [4, 4]  # after the 4th and the 8th hit: the 9th is the step's
    take(pool.take_copies())
    assert [dst for _, dst, _ in seen] == match.block_ids  # each block once, in order
    assert [kv for _, _, kv in seen] == [kv.tobytes() for kv in chain.kvs]
    kinds = ["onboard"] * min(num_slots, 9) + ["disk_onboard"] * (9 - min(num_slots, 9))
    assert [kind for kind, _, _ in seen] == kinds
    assert pool.num_pending_copies == 9  # pinned until the step's copies are complete
    pool.check_integrity()
    assert pool.complete_copies() == 9
    pool.free(match.block_ids)
    pool.check_integrity()
    tier.close()


def test_copy_batch_is_checked() -> None:
    with pytest.raises(ValueError, match="copy_batch must be >= 1; got 0"):
        BlockPool(4, BLOCK_SIZE, copy_batch=0)


def test_disk_hits_are_read_into_host_slots_and_onboarded_from_there(tmp_path: Path) -> None:
    """With a host tier, each disk hit's payload is read straight into a free host slot
    (memory used before, pinned on the GPU) and moves on as a host onboard: the slot is
    pinned until the copy ran, then free and blank (findable only on the device)."""
    chain = Chain(3, seed=7)
    pool, tier, arena = _restarted(tmp_path, chain, num_slots=4)
    match = pool.match(chain.hashes, chain.tokens)
    assert (match.num_blocks, match.num_disk_hits, match.num_host_hits) == (3, 3, 0)
    copies = pool.take_copies()
    assert [(c.kind, c.dst) for c in copies] == [("onboard", b) for b in match.block_ids]
    for copy, kv in zip(copies, chain.kvs, strict=True):
        assert copy.staged is None and arena[copy.src].tobytes() == kv.tobytes()
    assert len({c.src for c in copies}) == 3
    host = pool.host_tier
    assert host is not None and (host.num_free_blocks, host.num_cached_blocks) == (1, 0)
    assert pool.num_pending_copies == 3
    pool.check_integrity()
    assert pool.complete_copies() == 3
    assert (host.num_free_blocks, host.num_cached_blocks) == (4, 0)
    stats = pool.stats()
    assert (stats.disk_hits, stats.host_hits, stats.host_onboards) == (3, 0, 0)
    pool.free(match.block_ids)
    again = pool.match(chain.hashes, chain.tokens)
    assert (again.num_device_hits, again.num_disk_hits) == (3, 0)
    pool.free(again.block_ids)
    pool.check_integrity()
    tier.close()


def test_a_host_tier_short_of_slots_reads_the_rest_into_fresh_memory(tmp_path: Path) -> None:
    chain = Chain(4, seed=8)
    pool, tier, arena = _restarted(tmp_path, chain, num_slots=2)
    match = pool.match(chain.hashes, chain.tokens)
    assert match.num_disk_hits == 4
    copies = pool.take_copies()
    assert [c.kind for c in copies] == ["onboard"] * 2 + ["disk_onboard"] * 2
    got = [arena[c.src] if c.staged is None else c.staged for c in copies]
    assert [g.tobytes() for g in got] == [kv.tobytes() for kv in chain.kvs]
    pool.check_integrity()
    assert pool.complete_copies() == 4
    pool.free(match.block_ids)
    pool.check_integrity()
    tier.close()


def test_host_entries_give_their_slots_only_when_the_disk_has_them(tmp_path: Path) -> None:
    """A host slot holding an entry the disk tier has is taken (the entry forgotten:
    counted as a host eviction); one holding an entry still to be written is not (its
    write would read the slot after the disk read overwrote it), and stops the taking."""
    chain = Chain(2, seed=9)
    pool, tier, arena = _restarted(tmp_path, chain, num_slots=1, num_blocks=2)
    other = Chain(1, seed=10)
    (block_id,) = register_chain(pool, other)
    pool.take_copies()  # its write-through, not run: the tier does not know it
    pool.free([block_id])
    assert pool.allocate(2) is not None  # evicts it to the host slot
    assert [c.kind for c in pool.take_copies()] == ["offload"]
    pool.complete_copies()
    pool.free([0, 1])
    host = pool.host_tier
    assert host is not None and host.num_cached_blocks == 1
    match = pool.match(chain.hashes, chain.tokens)
    assert match.num_disk_hits == 2
    assert [c.kind for c in pool.take_copies()] == ["disk_onboard"] * 2
    assert host.num_cached_blocks == 1 and host.lookup(other.hashes[0]) is not None
    pool.complete_copies()
    pool.free(match.block_ids)
    pool.check_integrity()

    assert other.put(tier, 0) and tier.flush(10)  # now the disk has it: its slot is taken
    later = Chain(1, seed=12)
    assert later.put(tier, 0) and tier.flush(10)
    before = pool.stats().host_evictions
    match = pool.match(later.hashes, later.tokens)
    assert match.num_disk_hits == 1
    copies = pool.take_copies()
    assert [(c.kind, c.src) for c in copies] == [("onboard", 0)]
    assert arena[0].tobytes() == later.kvs[0].tobytes()
    assert host.lookup(other.hashes[0]) is None
    assert pool.stats().host_evictions == before + 1
    pool.complete_copies()
    pool.free(match.block_ids)
    pool.check_integrity()
    tier.close()


def test_a_damaged_file_read_into_a_slot_ends_the_match_and_frees_the_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slots of blocks after the damaged one go back to the host tier, and only once
    every read into them has ended (slow reads here, so those behind it are running)."""
    chain = Chain(4, seed=11)
    pool, tier, _ = _restarted(tmp_path, chain, num_slots=4)
    path = tier.folder / fmt.file_name(chain.hashes[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    running = []
    read = fmt.read_block_into

    def slow_read(*args, **kwargs):
        running.append(1)
        try:
            time.sleep(0.2)
            return read(*args, **kwargs)
        finally:
            running.pop()

    monkeypatch.setattr(fmt, "read_block_into", slow_read)
    match = pool.match(chain.hashes, chain.tokens)
    assert not running, "a read into a slot given back is still running"
    assert (match.num_blocks, match.num_disk_hits) == (1, 1)
    assert [c.kind for c in pool.take_copies()] == ["onboard"]
    host = pool.host_tier
    assert host is not None and host.num_free_blocks == 3  # the unused slots are back
    pool.check_integrity()
    pool.complete_copies()
    assert host.num_free_blocks == 4
    assert pool.stats().disk_corrupt_removed == 1 and not path.exists()
    pool.free(match.block_ids)
    pool.check_integrity()
    tier.close()


def test_low_retention_blocks_are_not_written(tmp_path: Path) -> None:
    chain = Chain(1, seed=6)
    tier = open_tier(tmp_path)
    pool = BlockPool(2, BLOCK_SIZE, disk_tier=tier)
    (block_id,) = pool.allocate(1) or []
    assert pool.register(block_id, chain.hashes[0], chain.tokens[0], None, priority=10)
    assert pool.take_copies() == []
    tier.close()


# -- the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("disk-wiring") / "tiny")


def test_settings_refuse_a_missing_folder_and_a_bad_size(tmp_path: Path) -> None:
    with pytest.raises(SettingError, match="does not exist") as info:
        EngineConfig(disk_cache=str(tmp_path / "nope"))
    assert info.value.flag == "--disk-cache"
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingError, match="is not a folder"):
        EngineConfig(disk_cache=str(tmp_path / "file"))
    with pytest.raises(SettingError, match="disk_cache_gb must be > 0"):
        EngineConfig(disk_cache=str(tmp_path), disk_cache_gb=0)


@pytest.mark.parametrize("host_blocks", [0, 8, 3], ids=["no-host", "host", "host-short"])
def test_engine_restart_serves_the_prompt_from_disk_bit_identically(
    tiny: Path, tmp_path: Path, host_blocks: int
) -> None:
    """Without a host tier the disk hits are read into fresh memory; with one, into its
    slots (all of them, or as many as there are)."""
    settings = dict(
        backend="numpy", block_size=16, num_device_blocks=64, num_host_blocks=host_blocks
    )
    prompt = list(range(3, 3 + 16 * 5 + 7))  # 5 full blocks and a partial one
    params = SamplingParams(max_tokens=3, temperature=0, return_logits=True)

    fresh = Engine.from_pretrained(tiny, **settings).generate(prompt, params)
    first = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **settings)
    out = first.generate(prompt, params)
    assert out.cached_tokens == 0 and np.array_equal(out.logits, fresh.logits)
    while first.has_work():  # the last blocks' writes were planned by the last step
        first.step()
    first.close()
    assert first.stats()["disk_writes"] == 5

    second = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **settings)
    assert second.stats()["disk_blocks"] == 5
    ops = second.runner.model.ops
    onboards = []
    onboard = ops.onboard_block
    ops.onboard_block = lambda *args: onboards.append(args[1]) or onboard(*args)
    runs = record_copy_runs(second)
    again = second.generate(prompt, params)
    del ops.onboard_block
    assert len(onboards) == min(5, host_blocks)  # from the slots the reads landed in
    # the first 4 hits' copies ran inside the match (COPY_BATCH), the 5th with the step
    assert runs[:2] == [("match", 4), ("step", 1)]
    assert (again.cached_tokens, again.disk_cached_tokens, again.host_cached_tokens) == (80, 80, 0)
    assert again.token_ids == fresh.token_ids
    assert again.logits.tobytes() == fresh.logits.tobytes()
    stats = second.stats()
    assert (stats["disk_hits"], stats["reused_blocks"], stats["host_hits"]) == (5, 5, 0)
    assert second.prefill_tokens_computed == len(prompt) - 80
    second.close()


def record_copy_runs(engine: Engine) -> list[tuple[str, int]]:
    """Each run of block copies from now on: ("match", n) inside the scheduler's pass
    (the pool's copies_ready), ("step", n) when a step's plan runs them."""
    runs: list[tuple[str, int]] = []
    scheduling = []
    run_copies, schedule = engine.runner.run_copies, engine.scheduler.schedule

    def run(copies: list[BlockCopy], **options: bool) -> None:
        if copies:
            runs.append(("match" if scheduling else "step", len(copies)))
        run_copies(copies, **options)

    def plan():
        scheduling.append(1)
        try:
            return schedule()
        finally:
            scheduling.pop()

    engine.runner.run_copies, engine.scheduler.schedule = run, plan
    return runs


@pytest.mark.parametrize("num_blocks", [6, 8])
@pytest.mark.parametrize("host_blocks", [0, 8], ids=["no-host", "host"])
def test_copies_started_in_a_match_are_completed_when_nothing_is_scheduled(
    tiny: Path, tmp_path: Path, host_blocks: int, num_blocks: int
) -> None:
    """A match starts its disk hits' copies, then the request finds no room and goes
    back to waiting: the step has no forward to run (with 8 blocks, no copy either: all
    ran in the match), yet waits for the copies on the device and releases their pins;
    the request then runs, bit-identical to fresh."""
    settings = dict(
        backend="numpy", block_size=16, num_device_blocks=64, num_host_blocks=host_blocks
    )
    prompt = list(range(7, 7 + 16 * num_blocks + 3))
    params = SamplingParams(max_tokens=2, temperature=0, return_logits=True)
    fresh = Engine.from_pretrained(tiny, **settings).generate(prompt, params)
    first = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **settings)
    first.generate(prompt, params)
    first.close()

    engine = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **settings)
    runs = record_copy_runs(engine)
    grow, refused = engine.kv.grow, []

    def grow_once(seq, num):  # no room, the first time
        if refused:
            return grow(seq, num)
        refused.append(seq)
        return False

    engine.kv.grow = grow_once
    ops = engine.runner.model.ops
    waits = []
    copies_done = ops.copies_done
    ops.copies_done = lambda: waits.append(1) or copies_done()
    request_id = engine.add_request(prompt, params)
    assert engine.step() == [] and refused
    assert runs == [("match", 4), ("match", 4)] if num_blocks == 8 else [("match", 4), ("step", 2)]
    assert waits == [1] and engine.pool.num_pending_copies == 0  # waited for, released
    engine.pool.check_integrity()
    while engine.has_work():
        engine.step()
    out = engine.take_completion(request_id)
    assert out.logits.tobytes() == fresh.logits.tobytes()
    # admitted again: the blocks the early copies filled are device hits now
    assert (out.cached_tokens, out.disk_cached_tokens) == (16 * num_blocks, 0)
    assert engine.stats()["disk_hits"] == num_blocks
    assert engine.pool.num_pending_copies == 0
    engine.pool.check_integrity()
    engine.close()


def test_the_runner_hands_each_run_of_tier_copies_to_one_call_in_list_order(tiny: Path) -> None:
    """run_copies gives each run of consecutive offloads and onboards to the backend's
    tier_copies in one call, in list order, and orders a device copy after the tier
    copies before it (wait_copies first) and the compute after all of them; the blocks
    and slots end as the copies run one by one say."""
    engine = Engine.from_pretrained(
        tiny, backend="numpy", block_size=16, num_device_blocks=8, num_host_blocks=4
    )
    runner, ops = engine.runner, engine.runner.model.ops
    rng = np.random.default_rng(5)
    runner.kv_cache[...] = rng.standard_normal(runner.kv_cache.shape).astype(runner.kv_cache.dtype)
    runner.host_cache[...] = rng.standard_normal(runner.host_cache.shape).astype(
        runner.host_cache.dtype
    )
    want_device, want_host = runner.kv_cache.copy(), runner.host_cache.copy()
    calls: list[object] = []
    tier_copies, wait_copies, copy_block = ops.tier_copies, ops.wait_copies, ops.copy_block
    ops.tier_copies = lambda cache, host, copies: (
        calls.append(list(copies)) or tier_copies(cache, host, copies)
    )
    ops.wait_copies = lambda: calls.append("wait") or wait_copies()
    ops.copy_block = lambda cache, src, dst: (
        calls.append(("device", src, dst)) or copy_block(cache, src, dst)
    )
    copies = [
        BlockCopy("offload", 1, 0),  # block 1 -> slot 0
        BlockCopy("onboard", 2, 1),  # slot 2 -> block 1
        BlockCopy("device", 1, 3),  # block 1 (slot 2's bytes now) -> block 3
        BlockCopy("onboard", 0, 5),  # slot 0 (block 1's old bytes) -> block 5
        BlockCopy("offload", 5, 3),  # block 5 -> slot 3
    ]
    runner.run_copies(copies)
    assert calls == [
        [("offload", 1, 0), ("onboard", 2, 1)],
        "wait",
        ("device", 1, 3),
        [("onboard", 0, 5), ("offload", 5, 3)],
        "wait",
    ]
    want_host[0] = want_device[1]
    want_device[1] = want_host[2]
    want_device[3] = want_device[1]
    want_device[5] = want_host[0]
    want_host[3] = want_device[5]
    assert runner.kv_cache.tobytes() == want_device.tobytes()
    assert runner.host_cache.tobytes() == want_host.tobytes()
