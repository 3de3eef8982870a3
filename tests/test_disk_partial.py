"""Partial matches found on disk, and clearing a pool that has a disk tier.

find_partial: a block only on disk whose first tokens are a request's is read and
checked as a full disk hit is, and its bytes go straight into the request's fresh
block (no device block for the source); through an engine, a warm restart whose
prompt diverges mid-block computes logits bit-identical to computing it fresh.

clear: every tier forgets its blocks, the disk's files go, and the next request
computes afresh (its logits equal to a fresh engine's)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from test_disk_staging import LateReads
from test_disk_tier import BLOCK_SIZE, Chain
from test_disk_wiring import open_tier

from reprise.blockpool import disk_format as fmt
from reprise.blockpool.events import AllBlocksCleared, BlockStored, EventQueue
from reprise.blockpool.hashing import Namespace
from reprise.blockpool.pool import BlockPool
from reprise.daemon.engine.engine import Engine
from reprise.daemon.engine.params import SamplingParams
from reprise.daemon.model.synth import synth_model


def stored_chain(tmp_path: Path, num_blocks: int = 3, seed: int = 7) -> tuple[Chain, object]:
    chain = Chain(num_blocks, seed=seed)
    tier = open_tier(tmp_path)
    for i in range(num_blocks):
        assert chain.put(tier, i)
    assert tier.flush(10)
    return chain, tier


def diverging(tokens: list[int], num_shared: int) -> list[int]:
    """The first `num_shared` tokens, then others (one short of a full block)."""
    rest = [(t + 1) % 50_000 for t in tokens[num_shared:-1]]
    return tokens[:num_shared] + rest


def test_a_partial_match_on_disk_onboards_into_the_fresh_block(tmp_path: Path) -> None:
    chain, tier = stored_chain(tmp_path)
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    match = pool.match(chain.hashes[:1], chain.tokens[:1])
    assert match.num_disk_hits == 1
    pool.take_copies()
    num_free = pool.num_free_blocks

    found = pool.find_partial(chain.hashes[0], diverging(chain.tokens[1], 2))
    assert found is not None
    handle, num_shared = found
    assert num_shared == 2 and handle >= pool.num_blocks
    assert pool.num_free_blocks == num_free  # no device block taken for the source
    assert not pool.is_arriving(handle)
    fresh = pool.allocate(1)
    assert fresh is not None
    pool.copy_block(handle, fresh[0])
    pool.free([handle])
    (copy,) = pool.take_copies()
    assert (copy.kind, copy.src, copy.dst) == ("disk_onboard", None, fresh[0])
    assert copy.staged is not None and copy.staged.tobytes() == chain.kvs[1].tobytes()
    pool.check_integrity()  # the fresh block is pinned by its copy
    assert pool.complete_copies() == 2  # the match's onboard and this one
    stats = pool.stats()
    assert (stats.partial_hits, stats.disk_hits) == (1, 2)
    pool.free(fresh + match.block_ids)
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    tier.close()


def test_a_first_block_matches_partly_under_its_namespace_only(tmp_path: Path) -> None:
    chain, tier = stored_chain(tmp_path)
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    wanted = diverging(chain.tokens[0], 1)
    assert pool.find_partial(None, wanted, namespace=Namespace(cache_salt="b")) is None
    assert pool.find_partial(None, wanted, extra_ids=[0] * len(wanted)) is None
    found = pool.find_partial(None, wanted)
    assert found is not None and found[1] == 1
    pool.free([found[0]])
    assert pool.take_copies() == []  # nothing planned without copy_block
    pool.check_integrity()
    tier.close()


def test_a_longer_match_in_memory_wins_and_a_bad_file_is_a_miss(tmp_path: Path) -> None:
    chain, tier = stored_chain(tmp_path)
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier)
    other = list(chain.tokens[0])
    other[2] = (other[2] + 2) % 50_000  # shares 2 tokens with the disk's block
    held = pool.allocate(1)
    assert held is not None
    assert pool.register(held[0], Chain(1, seed=99).hashes[0], other, None)
    pool.take_copies()
    found = pool.find_partial(None, diverging(chain.tokens[0], 2))
    assert found == (held[0], 2)  # memory shares 2, disk 2: memory wins the tie
    pool.free([held[0]])
    found = pool.find_partial(None, diverging(chain.tokens[0], 3))
    assert found is not None and found[0] >= pool.num_blocks and found[1] == 3
    pool.free([found[0]])

    path = tier.folder / fmt.file_name(chain.hashes[0])
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # in the payload
    path.write_bytes(bytes(data))
    found = pool.find_partial(None, diverging(chain.tokens[0], 3))
    assert found == (held[0], 2)  # the disk's block is gone
    pool.free([found[0]])
    assert not path.exists() and pool.stats().disk_corrupt_removed == 1
    pool.free(held)
    pool.check_integrity()
    tier.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("disk-partial") / "tiny")


SETTINGS = dict(backend="numpy", block_size=16, num_device_blocks=64, kv_events=True)
PARAMS = SamplingParams(max_tokens=3, temperature=0, return_logits=True)
PROMPT = list(range(3, 3 + 16 * 5 + 7))  # 5 full blocks and 7 tokens


def written(tiny: Path, where: Path, prompt: list[int] = PROMPT) -> Engine:
    engine = Engine.from_pretrained(tiny, disk_cache=str(where), **SETTINGS)
    engine.generate(prompt, PARAMS)
    while engine.has_work():  # the last blocks' writes were planned by the last step
        engine.step()
    assert engine.disk_tier is not None and engine.disk_tier.flush(10)
    return engine


@pytest.mark.parametrize("num_shared", [16 * 2 + 5, 9])
def test_a_restart_reuses_part_of_a_block_from_disk_bit_identically(
    tiny: Path, tmp_path: Path, num_shared: int
) -> None:
    written(tiny, tmp_path).close()
    prompt = PROMPT[:num_shared] + [200 + i for i in range(40)]  # diverges mid-block
    fresh = Engine.from_pretrained(tiny, enable_reuse=False, **SETTINGS).generate(prompt, PARAMS)

    engine = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **SETTINGS)
    out = engine.generate(prompt, PARAMS)
    assert (out.cached_tokens, out.disk_cached_tokens) == (num_shared, num_shared)
    assert engine.stats()["partial_hits"] == 1
    assert engine.prefill_tokens_computed == len(prompt) - num_shared
    assert out.token_ids == fresh.token_ids
    assert out.logits.tobytes() == fresh.logits.tobytes()
    engine.pool.check_integrity()
    engine.close()


# -- clear -------------------------------------------------------------------------------


def test_clear_forgets_the_disk_tier_and_removes_its_files(tmp_path: Path) -> None:
    chain, tier = stored_chain(tmp_path)
    events = EventQueue()
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier, event_sink=events)
    block_ids = pool.allocate(2)
    assert block_ids is not None
    later = Chain(2, seed=8)
    assert pool.register(block_ids[0], later.hashes[0], later.tokens[0], None)
    assert [c.kind for c in pool.take_copies()] == ["device_to_disk"]
    assert pool.register(block_ids[1], later.hashes[1], later.tokens[1], block_ids[0])
    assert pool.num_planned_copies == 1  # a write planned and not yet run
    events.take()

    pool.clear()
    assert pool.num_planned_copies == 0  # it would bring a cleared block back
    assert events.take() == [AllBlocksCleared()]
    assert not any(tier.contains(h) for h in chain.hashes)
    assert pool.match(chain.hashes, chain.tokens).num_blocks == 0
    assert tier.flush(10)
    assert not list(tier.folder.glob("*" + fmt.FILE_SUFFIX))
    assert tier.stats()["disk_blocks"] == 0 and tier.stats()["disk_bytes"] == 0
    assert chain.put(tier, 0) and tier.flush(10)  # the tier keeps working
    assert tier.contains(chain.hashes[0])
    tier.check_integrity()
    pool.free(block_ids)
    pool.check_integrity()
    tier.close()


def test_a_write_in_flight_at_clear_leaves_no_file_and_no_event(tmp_path: Path) -> None:
    chain = Chain(2, seed=9)
    tier = open_tier(tmp_path)
    events = EventQueue()
    pool = BlockPool(8, BLOCK_SIZE, disk_tier=tier, event_sink=events)
    reads = LateReads()
    device = np.stack(chain.kvs)
    for i in range(2):
        assert tier.put(
            chain.hashes[i],
            chain.parent(i),
            chain.tokens[i],
            lambda out, i=i: reads.read_block(device, i, out),
            allocate=reads.staging_buffer,
        )
    pool.clear()
    threading.Timer(0.05, reads.gate.set).start()
    assert tier.flush(10)
    assert events.take() == [AllBlocksCleared()]
    assert not list(tier.folder.glob("*" + fmt.FILE_SUFFIX))
    assert not tier.contains(chain.hashes[0]) and tier.stats()["disk_writes"] == 0
    tier.close()


def test_after_clear_the_next_request_computes_afresh(tiny: Path, tmp_path: Path) -> None:
    engine = written(tiny, tmp_path)
    fresh = Engine.from_pretrained(tiny, enable_reuse=False, **SETTINGS).generate(PROMPT, PARAMS)
    engine.take_events()
    engine.pool.clear()
    assert engine.take_events() == [AllBlocksCleared()]
    out = engine.generate(PROMPT, PARAMS)
    assert (out.cached_tokens, out.disk_cached_tokens) == (0, 0)
    assert out.logits.tobytes() == fresh.logits.tobytes()
    while engine.has_work():
        engine.step()
    engine.close()
    stored = [e for e in engine.take_events() if isinstance(e, BlockStored)]
    assert sum(e.medium == "DISK" for e in stored) == 5  # written anew after the clear
