"""KV events of the disk medium ("DISK"): BlockStored once a block's file is in place
(sent from the writer thread), BlockRemoved when the tier evicts, drops or loses its
files, and on a restart one BlockStored per file found. Salted blocks carry hashes
only, as in the memory media."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from test_disk_tier import Chain, make_config
from test_disk_wiring import open_tier

from reprise.blockpool import disk_format as fmt
from reprise.blockpool.disk import DiskTier
from reprise.blockpool.events import MEDIUM_DISK, BlockRemoved, BlockStored, EventQueue, KVEvent
from reprise.blockpool.hashing import Namespace
from reprise.daemon.engine.engine import Engine
from reprise.daemon.engine.params import SamplingParams
from reprise.daemon.model.synth import synth_model

SETTINGS = dict(backend="numpy", block_size=16, num_device_blocks=64, kv_events=True)
PROMPT = list(range(3, 3 + 16 * 5 + 7))  # 5 full blocks and 7 tokens
ONE = SamplingParams(max_tokens=1, temperature=0)


def disk_events(events: list[KVEvent]) -> list[KVEvent]:
    return [
        e for e in events if not isinstance(e, BlockStored | BlockRemoved) or e.medium == "DISK"
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("disk-events") / "tiny")


def run(engine: Engine, prompt: list[int], **kwargs) -> None:
    engine.generate(prompt, ONE, **kwargs)
    while engine.has_work():
        engine.step()
    assert engine.disk_tier is not None and engine.disk_tier.flush(10)


def test_a_written_block_is_stored_on_disk_after_the_device(tiny: Path, tmp_path: Path) -> None:
    engine = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **SETTINGS)
    assert engine.take_events() == []  # an empty folder announces nothing
    run(engine, PROMPT)
    events = engine.take_events()
    gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
    disk = disk_events(events)
    assert MEDIUM_DISK == "DISK" and len(gpu) == len(disk) == 5
    for on_gpu, on_disk in zip(gpu, disk, strict=True):
        assert isinstance(on_disk, BlockStored)
        assert events.index(on_gpu) < events.index(on_disk)
        assert on_disk == BlockStored(
            block_hashes=on_gpu.block_hashes,
            parent_block_hash=on_gpu.parent_block_hash,
            token_ids=on_gpu.token_ids,
            block_size=16,
            lora_id=None,
            medium="DISK",
            lora_name=None,
            extra_keys=None,
        )
    engine.close()


def test_salted_blocks_carry_hashes_only_and_a_restart_announces_its_files(
    tiny: Path, tmp_path: Path
) -> None:
    first = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **SETTINGS)
    run(first, PROMPT)
    salted_prompt = [7 + t for t in PROMPT[:32]] + [1]
    run(first, salted_prompt, cache_salt="tenant-b")
    written = disk_events(first.take_events())
    assert len(written) == 7
    plain, salted = written[:5], written[5:]
    assert all(e.token_ids and e.medium == "DISK" for e in plain)
    assert all(e.token_ids == [] and e.extra_keys is None for e in salted)
    first.close()

    second = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **SETTINGS)
    announced = second.take_events()  # before any request
    assert all(isinstance(e, BlockStored) and e.medium == "DISK" for e in announced)
    assert sorted(e.block_hashes[0] for e in announced) == sorted(
        e.block_hashes[0] for e in written
    )
    by_hash = {e.block_hashes[0]: e for e in announced}
    for event in plain:  # the default namespace's as written, tokens and all
        assert by_hash[event.block_hashes[0]] == event
    for event in salted:  # its file holds no salt: hashes and parent only
        again = by_hash[event.block_hashes[0]]
        assert again.token_ids == [] and again.parent_block_hash == event.parent_block_hash
    second.close()


def test_eviction_a_bad_file_and_a_full_disk_remove_blocks(tmp_path: Path) -> None:
    chain = Chain(4, seed=5)
    probe = open_tier(tmp_path / "probe")
    assert chain.put(probe, 0) and probe.flush(10)
    one_file = probe.stats()["disk_bytes"]
    probe.close()

    # room for two files with a parent digest (32 bytes more than the first block's)
    tier = DiskTier.open(make_config(tmp_path / "t", max_bytes=2 * one_file + 64))
    events = EventQueue()
    tier.attach_events(events)
    for i in range(3):
        assert chain.put(tier, i) and tier.flush(10)
    got = events.take()
    assert [type(e).__name__ for e in got] == ["BlockStored"] * 3 + ["BlockRemoved"]
    assert got[-1] == BlockRemoved([chain.hashes[0]], "DISK")  # the least recently used

    path = tier.folder / fmt.file_name(chain.hashes[1])
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x10
    path.write_bytes(bytes(data))
    assert chain.get(tier, 1) is None
    assert events.take() == [BlockRemoved([chain.hashes[1]], "DISK")]

    def no_space(tmp: Path, final: Path, parts: list) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    tier._write_file = no_space  # type: ignore[method-assign]
    assert chain.put(tier, 3) and tier.flush(10)
    assert not tier.enabled
    assert events.take() == [BlockRemoved([chain.hashes[2]], "DISK")]  # what it still had
    tier.close()


def test_attaching_without_announcing(tmp_path: Path) -> None:
    chain = Chain(2, seed=6, namespace=Namespace(adapter_id="lora-a"))
    tier = open_tier(tmp_path)
    for i in range(2):
        assert chain.put(tier, i)
    assert tier.flush(10)
    tier.close()
    tier = open_tier(tmp_path)
    quiet, loud = EventQueue(), EventQueue()
    tier.attach_events(quiet, announce=False)
    assert quiet.take() == []
    tier.attach_events(loud)
    announced = loud.take()
    assert [e.block_hashes for e in announced] == [[h] for h in chain.hashes]
    # an adapter's namespace is not the default one: the files name no adapter
    assert all(e.token_ids == [] and e.lora_name is None for e in announced)
    tier.close()
