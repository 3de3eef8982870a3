"""Prompt-logprob entries kept in the disk tier (sidecar files beside the block files):
after a warm restart a prompt's entries come from disk, computing only what a warm
in-memory store would, and equal a no-cache engine's; a damaged sidecar is a miss
(removed, recomputed, still identical); clear and a restart remove sidecars whose
blocks are gone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_disk_tier import Chain, make_config, store
from test_prompt_logprobs import A48, A50, BS, MAX_TOP, all_cached, asking, engine, fresh

from reprise.blockpool import disk_format as fmt
from reprise.blockpool.disk import DiskTier
from reprise.daemon.engine.prompt_logprobs import EntryRows
from reprise.daemon.model.synth import synth_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("plp-disk") / "tiny")


def drained(eng):
    while eng.has_work():  # the last blocks' disk writes were planned by the last step
        eng.step()
    assert eng.disk_tier is not None and eng.disk_tier.flush(10)
    return eng


def computed(eng, prompt_ids: list[int], num_top: int = MAX_TOP):
    """The request's output and the prompt tokens it computed."""
    before = eng.stats()["prefill_tokens_computed"]
    out = eng.generate(prompt_ids, asking(num_top))
    return out, eng.stats()["prefill_tokens_computed"] - before


def sidecars(where: Path) -> list[Path]:
    return sorted(where.glob("*/*" + fmt.SIDECAR_SUFFIX))


def warm_in_memory(tiny: Path, prompt_ids: list[int]) -> int:
    """Prompt tokens a repeat computes with the entries and KV in memory."""
    eng = engine(tiny)
    eng.generate(prompt_ids, asking())
    return computed(eng, prompt_ids)[1]


@pytest.mark.parametrize("prompt_ids", [A48, A50], ids=["48", "50"])
def test_a_restart_serves_the_entries_from_disk(
    tiny: Path, tmp_path: Path, prompt_ids: list[int]
) -> None:
    eng = engine(tiny, disk_cache=str(tmp_path))
    first, cold = computed(eng, prompt_ids)
    drained(eng).close()
    num_full = len(prompt_ids) // BS
    assert len(sidecars(tmp_path)) == num_full

    again = engine(tiny, disk_cache=str(tmp_path))
    out, warm = computed(again, prompt_ids)
    assert out.prompt_logprobs == first.prompt_logprobs == fresh(tiny, prompt_ids)
    # a tail's entries (A50's last 2 tokens) are kept in memory only: after a restart
    # the row before the tail is computed again, one token more than in memory
    tail = len(prompt_ids) % BS != 0
    assert warm == warm_in_memory(tiny, prompt_ids) + tail < cold
    assert out.cached_tokens == out.disk_cached_tokens == all_cached(prompt_ids) - tail
    stats = again.disk_tier.stats()
    assert (stats["disk_sidecar_hits"], stats["disk_sidecar_corrupt_removed"]) == (num_full, 0)
    drained(again).close()


def test_a_damaged_sidecar_is_a_miss_removed_and_replaced(tiny: Path, tmp_path: Path) -> None:
    eng = engine(tiny, disk_cache=str(tmp_path))
    first, cold = computed(eng, A48)
    drained(eng).close()
    for path in sidecars(tmp_path):  # one byte flipped in each
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))

    again = engine(tiny, disk_cache=str(tmp_path))
    out, num_computed = computed(again, A48)
    assert out.prompt_logprobs == first.prompt_logprobs == fresh(tiny, A48)
    assert num_computed == cold  # the first block's entries missed: all computed again
    stats = again.disk_tier.stats()
    assert (stats["disk_sidecar_hits"], stats["disk_sidecar_corrupt_removed"]) == (0, 1)
    drained(again).close()
    tier_layout = sidecars(tmp_path)[0].parent.name
    for path in sidecars(tmp_path):  # the computed entries were written anew, sound
        digest = fmt.hash_of_sidecar_name(path.name)
        assert fmt.decode_sidecar(path.read_bytes(), bytes.fromhex(tier_layout), digest)

    third = engine(tiny, disk_cache=str(tmp_path))
    out, warm = computed(third, A48)
    assert out.prompt_logprobs == first.prompt_logprobs and warm == warm_in_memory(tiny, A48)
    third.close()


def test_a_sidecar_of_another_shape_is_a_miss_and_removed(tiny: Path, tmp_path: Path) -> None:
    eng = engine(tiny, disk_cache=str(tmp_path), max_prompt_logprobs=MAX_TOP - 1)
    computed(eng, A48, MAX_TOP - 1)
    drained(eng).close()
    smaller = sidecars(tmp_path)

    again = engine(tiny, disk_cache=str(tmp_path))  # asks for top MAX_TOP: more than kept
    out, _ = computed(again, A48)
    assert out.prompt_logprobs == fresh(tiny, A48)
    stats = again.disk_tier.stats()  # the first block's, read sound, of the wrong shape
    assert (stats["disk_sidecar_hits"], stats["disk_sidecar_corrupt_removed"]) == (1, 1)
    drained(again).close()
    assert len(sidecars(tmp_path)) == len(smaller)  # written anew with top MAX_TOP

    fewer = engine(tiny, disk_cache=str(tmp_path), max_prompt_logprobs=MAX_TOP - 1)
    out, warm = computed(fewer, A48, MAX_TOP - 1)  # a larger top list serves a smaller one
    assert fewer.disk_tier.stats()["disk_sidecar_hits"] == len(A48) // BS
    assert out.prompt_logprobs == fresh(tiny, A48, MAX_TOP - 1)
    assert warm == warm_in_memory(tiny, A48)
    fewer.close()


def test_clear_removes_the_sidecars(tiny: Path, tmp_path: Path) -> None:
    eng = engine(tiny, disk_cache=str(tmp_path))
    computed(eng, A48)
    drained(eng)
    assert sidecars(tmp_path)
    eng.pool.clear()
    assert eng.disk_tier.flush(10)
    assert not sidecars(tmp_path)
    eng.close()


def test_a_restart_removes_sidecars_without_a_block(tiny: Path, tmp_path: Path) -> None:
    eng = engine(tiny, disk_cache=str(tmp_path))
    computed(eng, A48)
    drained(eng).close()
    kept = sidecars(tmp_path)
    orphan = kept[0].parent / fmt.sidecar_name(b"\x01" * 32)
    orphan.write_bytes(kept[0].read_bytes())
    engine(tiny, disk_cache=str(tmp_path)).close()
    assert sidecars(tmp_path) == kept


def test_entry_rows_round_trip_bit_identically() -> None:
    rng = np.random.default_rng(3)
    rows = EntryRows(
        rng.standard_normal(BS).astype(np.float32),
        rng.integers(1, 1 << 17, BS).astype(np.int32),
        rng.integers(0, 1 << 31, (BS, MAX_TOP)).astype(np.int32),
        rng.standard_normal((BS, MAX_TOP)).astype(np.float32),
    )
    back = EntryRows.of_bytes(rows.to_bytes(), BS, MAX_TOP)
    for a, b in zip(
        (rows.logprobs, rows.ranks, rows.top_ids, rows.top_logprobs),
        (back.logprobs, back.ranks, back.top_ids, back.top_logprobs),
        strict=True,
    ):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    cut = EntryRows.of_bytes(rows.to_bytes(), BS, 2)
    assert cut.top_ids.tobytes() == rows.top_ids[:, :2].tobytes()
    for bad in (rows.to_bytes()[:-1], rows.to_bytes() + b"\x00", b"\x00"):
        with pytest.raises(ValueError):
            EntryRows.of_bytes(bad, BS, MAX_TOP)
    with pytest.raises(ValueError):
        EntryRows.of_bytes(rows.to_bytes(), BS + 1, MAX_TOP)
    with pytest.raises(ValueError):
        EntryRows.of_bytes(rows.to_bytes(), BS, MAX_TOP + 1)


# -- the tier's sidecars, without an engine -------------------------------------


def test_a_sidecar_goes_with_its_evicted_or_bad_block(tmp_path: Path) -> None:
    chain = Chain(4, seed=5)
    probe = DiskTier.open(make_config(tmp_path / "probe"))
    store(probe, chain, [1])  # a block with a parent: the larger file
    nbytes = probe.stats()["disk_bytes"]
    probe.close()
    tier = DiskTier.open(make_config(tmp_path / "tier", max_bytes=2 * nbytes))
    store(tier, chain, [0, 1])
    for i in (0, 1):
        assert tier.put_sidecar(chain.hashes[i], f"entries {i}".encode())
    assert tier.flush(10)
    assert tier.get_sidecar(chain.hashes[0]) == b"entries 0"
    assert tier.get_sidecar(chain.hashes[2]) is None  # none written
    assert chain.get(tier, 0) is not None  # block 0 used last
    store(tier, chain, [2])  # evicts block 1, the least recently used
    assert tier.lru_order() == [chain.hashes[0], chain.hashes[2]]
    assert tier.get_sidecar(chain.hashes[1]) is None
    assert not (tier.folder / fmt.sidecar_name(chain.hashes[1])).exists()

    block_file = tier.folder / fmt.file_name(chain.hashes[0])
    data = bytearray(block_file.read_bytes())
    data[-1] ^= 1
    block_file.write_bytes(bytes(data))
    assert chain.get(tier, 0) is None  # a bad block file: its sidecar goes too
    assert not (tier.folder / fmt.sidecar_name(chain.hashes[0])).exists()
    stats = tier.stats()
    assert (stats["disk_sidecar_hits"], stats["disk_sidecar_misses"]) == (1, 2)
    tier.close()


def test_a_sidecar_under_another_blocks_name_is_removed(tmp_path: Path) -> None:
    chain = Chain(2, seed=6)
    tier = DiskTier.open(make_config(tmp_path))
    store(tier, chain)
    assert tier.put_sidecar(chain.hashes[0], b"entries")
    assert tier.flush(10)
    moved = tier.folder / fmt.sidecar_name(chain.hashes[1])
    (tier.folder / fmt.sidecar_name(chain.hashes[0])).rename(moved)
    assert tier.get_sidecar(chain.hashes[1]) is None
    assert not moved.exists()
    stats = tier.stats()
    assert (stats["disk_sidecar_misses"], stats["disk_sidecar_corrupt_removed"]) == (1, 1)
    tier.close()


class Gated:
    """A copy that lands once `gate` is set: holds the writer until then."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def synchronize(self) -> None:
        assert self.gate.wait(10)


def test_sidecars_past_the_queue_bound_are_dropped_and_counted(tmp_path: Path) -> None:
    chain = Chain(1, seed=8)
    tier = DiskTier.open(make_config(tmp_path, write_queue_blocks=1))
    gate = threading.Event()

    def late(buffer: np.ndarray) -> Gated:
        np.copyto(buffer, chain.kvs[0])
        return Gated(gate)

    assert tier.put(chain.hashes[0], None, chain.tokens[0], late)  # the writer waits on it
    assert tier.put_sidecar(chain.hashes[0], b"first")
    assert not tier.put_sidecar(chain.hashes[0], b"second")  # one queued already
    gate.set()
    assert tier.flush(10)
    assert tier.get_sidecar(chain.hashes[0]) == b"first"
    stats = tier.stats()
    assert (stats["disk_sidecar_writes"], stats["disk_sidecar_writes_dropped"]) == (1, 1)
    assert tier.put_sidecar(chain.hashes[0], b"third")  # room again once written
    assert tier.flush(10) and tier.get_sidecar(chain.hashes[0]) == b"third"
    tier.close()
