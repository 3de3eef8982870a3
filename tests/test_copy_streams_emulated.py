"""The GPU backend's block copies on two streams, in the emulated CuPy: offloads and disk
reads (device to host) on one, onboards (host to device) on the other, so the two
directions can share the bus at once, and an event wherever a copy touches bytes a copy
of the other direction touched since the last `wait_copies`.

The emulation holds a copy on a stream back until something waits for it, and raises
RaceError when two streams touch the same device or host bytes with nothing ordering
them; so the copies' results equal running them one by one in issue order only if every
dependency is there, and a missing one is an error, not luck."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kernel_emu import emucupy
from test_cupy_emulated import BS, Engines, emulated, model_dir, random_prompt
from test_disk_wiring import record_copy_runs

from reprise.cuda.dtypes import BF16
from reprise.daemon import SamplingParams

pytestmark = pytest.mark.kernels
__all__ = ["emulated", "model_dir"]  # fixtures, used by name

BLOCK = (2, 3, 4)  # a block's shape: small, the copies are what is tested
UNWRITTEN = 0xFFFF


def _backend_and_arrays(num_blocks: int, num_slots: int, seed: int):  # type: ignore[no-untyped-def]
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device

    rng = np.random.default_rng(seed)
    device = rng.standard_normal((num_blocks, *BLOCK)).astype(BF16)
    host = rng.standard_normal((num_slots, *BLOCK)).astype(BF16)
    return CupyBackend(), to_device(device), host, device.copy(), host.copy()


@pytest.mark.parametrize("seed", range(6))
def test_random_copies_land_as_if_run_one_by_one_in_issue_order(emulated: None, seed: int) -> None:
    """Random offloads, onboards and disk reads over 3 device blocks and 3 host slots
    (so most copies share bytes with an earlier one), in batches each ended by
    `wait_copies` and followed by compute writing a block, as the runner runs them:
    every block, slot and read buffer ends as the sequential model says."""
    from reprise.cuda.kernels import to_device, to_host

    ops, cache, host, want_device, want_host = _backend_and_arrays(3, 3, seed)
    rng = np.random.default_rng(100 + seed)
    reads: list[tuple[np.ndarray, np.ndarray, object]] = []
    for _ in range(6):
        for _ in range(int(rng.integers(1, 9))):
            kind, block, slot = rng.choice(3), int(rng.integers(3)), int(rng.integers(3))
            if kind == 0:
                ops.offload_block(cache, block, host, slot)
                want_host[slot] = want_device[block]
            elif kind == 1:
                ops.onboard_block(host, slot, cache, block)
                want_device[block] = want_host[slot]
            else:
                out = np.full(BLOCK, UNWRITTEN, dtype=np.uint16).view(BF16)
                reads.append((out, want_device[block].copy(), ops.read_block(cache, block, out)))
        ops.wait_copies()
        block = int(rng.integers(3))  # the step's compute writes a block
        value = rng.standard_normal(BLOCK).astype(BF16)
        cache[block] = to_device(value)
        want_device[block] = value
    ops.copies_done().synchronize()
    assert to_host(cache).tobytes() == want_device.tobytes()
    assert host.tobytes() == want_host.tobytes()
    for out, want, done in reads:
        done.synchronize()
        assert out.tobytes() == want.tobytes()


def test_an_onboard_waits_for_the_offload_of_its_block_and_not_for_later_ones(
    emulated: None,
) -> None:
    """An evicted block's offload, then an onboard into it: the onboard waits for that
    offload (the emulation runs a held-back copy when it is waited for), and for the
    offloads issued before it (one event of the offload stream covers them: they run in
    issue order, so it lands after them anyway), not for an offload issued after it,
    which may still be on the bus while it runs."""
    ops, cache, host, device, _ = _backend_and_arrays(4, 4, seed=7)
    host[:] = np.full((4, *BLOCK), UNWRITTEN, dtype=np.uint16).view(BF16)
    host[3] = np.ones(BLOCK, dtype=BF16)
    ops.offload_block(cache, 0, host, 0)  # block 0 evicted to slot 0
    ops.onboard_block(host, 3, cache, 0)  # slot 3 onboarded into block 0
    ops.offload_block(cache, 1, host, 1)  # block 1 evicted to slot 1, later
    assert host[0].tobytes() == device[0].tobytes()  # waited for: run
    assert host[1].view(np.uint16).min() == UNWRITTEN  # not waited for: still held back
    ops.copies_done().synchronize()
    assert host[1].tobytes() == device[1].tobytes()


def test_a_run_of_copies_records_an_event_only_where_a_copy_waits_for_the_other_stream(
    emulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long host-tier match's copies in one `tier_copies` call: each block evicted
    (offloaded) and then onboarded over. One event records the compute queued before
    them, and one a pair orders the onboard after its block's offload; each copy is one
    memcpyAsync. (Before: four events and two array copies a pair, the host time that
    paced a long match on the H200.) The blocks and slots end as in issue order."""
    ops, cache, host, device, _ = _backend_and_arrays(8, 16, seed=11)
    want_host, want_device = host.copy(), device.copy()
    copies = []
    for block in range(8):
        copies += [("offload", block, block), ("onboard", 8 + block, block)]
        want_host[block] = want_device[block]
        want_device[block] = want_host[8 + block]
    records, memcpys = [], []
    record = emucupy.Stream.record
    monkeypatch.setattr(
        emucupy.Stream, "record", lambda self, *a: records.append(self) or record(self, *a)
    )
    memcpy = emucupy._Runtime.memcpyAsync
    monkeypatch.setattr(emucupy._Runtime, "memcpyAsync", lambda *a: memcpys.append(a) or memcpy(*a))
    ops.tier_copies(cache, host, copies)
    assert len(memcpys) == 16
    assert len(records) == 1 + 8, records
    monkeypatch.undo()
    ops.wait_copies()
    ops.copies_done().synchronize()
    from reprise.cuda.kernels import to_host

    assert to_host(cache).tobytes() == want_device.view(np.uint16).tobytes()
    assert host.tobytes() == want_host.tobytes()


def test_an_onboard_from_a_slot_waits_for_the_offload_into_it(emulated: None) -> None:
    """A slot offloaded into and onboarded from before any wait (a block evicted and
    asked for again in one match): the onboard reads the offload's bytes."""
    from reprise.cuda.kernels import to_host

    ops, cache, host, device, _ = _backend_and_arrays(3, 2, seed=8)
    ops.offload_block(cache, 0, host, 1)
    ops.onboard_block(host, 1, cache, 2)
    ops.wait_copies()
    ops.copies_done().synchronize()
    assert to_host(cache)[2].tobytes() == device[0].tobytes()


def test_without_the_cross_stream_waits_the_emulation_sees_the_race(
    emulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: with the copies of the other direction forgotten, an
    onboard into a block whose offload is in flight is a race."""
    from reprise.cuda import cupy_backend

    ops, cache, host, _, _ = _backend_and_arrays(2, 2, seed=9)
    monkeypatch.setattr(cupy_backend, "_keys", lambda device, host: ())
    ops.offload_block(cache, 0, host, 0)
    with pytest.raises(emucupy.RaceError):
        ops.onboard_block(host, 1, cache, 0)


def test_a_long_host_tier_match_starts_its_copies_inside_the_match(
    emulated: None, model_dir: Path
) -> None:
    """Full blocks from the host tier: their onboards (and the offloads of the device
    blocks they evict) start inside the scheduler's pass every 4 hits, without the
    compute waiting for them there; the step's forward still reads the blocks only
    once landed (the emulation holds a copy back until something waits for it, and
    raises on a read no wait orders), so the logits equal computing the prompt fresh."""
    engines = Engines(model_dir, "tensor-cores")
    num_full = 10
    prompt = random_prompt(num_full * BS + 1, seed=61)  # the one token past them computed
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, return_logits=True)
    fresh = engines(enable_reuse=False).generate(prompt, params)
    engine = engines(num_device_blocks=14, num_host_blocks=40)
    engine.generate(prompt, params)
    for seed in range(2):  # other prompts push its blocks to the host tier
        other = random_prompt(num_full * BS + 1, seed=70 + seed)
        engine.generate(other, SamplingParams(max_tokens=1))
    runs = record_copy_runs(engine)
    again = engine.generate(prompt, params)
    assert again.host_cached_tokens == num_full * BS, again.host_cached_tokens
    assert [kind for kind, _ in runs] == ["match", "match", "step"], runs
    assert again.token_ids == fresh.token_ids
    assert again.logits.tobytes() == fresh.logits.tobytes()
    engine.pool.check_integrity()


def test_copies_started_ahead_are_waited_for_by_a_step_with_none_of_its_own(
    emulated: None, model_dir: Path
) -> None:
    """The runner's contract for copies started inside a match (`wait=False`): the
    step's `run_copies` orders the compute after them even when its own plan has no
    tier copy, so the forward never reads a block still being onboarded."""
    from reprise.blockpool.copies import BlockCopy
    from reprise.cuda.kernels import to_host

    engine = Engines(model_dir, "tensor-cores")(num_device_blocks=8, num_host_blocks=4)
    runner = engine.runner
    want = np.random.default_rng(3).standard_normal(runner.host_cache[0].shape).astype(BF16)
    runner.host_cache[2] = want
    runner.run_copies([BlockCopy("onboard", 2, 5)], wait=False)  # inside a match
    runner.run_copies([])  # the step: no copy of its own
    assert to_host(runner.kv_cache[5]).tobytes() == want.view(np.uint16).tobytes()


def test_tier_copies_refuse_other_kinds_and_other_block_sizes(emulated: None) -> None:
    """Only offloads and onboards, between arrays of one block size: a device copy or a
    host arena of another block shape is refused before any copy is issued."""
    ops, cache, host, _, before = _backend_and_arrays(2, 2, seed=12)
    with pytest.raises(ValueError, match="not 'device'"):
        ops.tier_copies(cache, host, [("offload", 0, 0), ("device", 0, 1)])
    ops.copies_done().synchronize()
    assert host.tobytes() == before.tobytes()  # the offload before it was not issued either
    wider = np.zeros((2, 2, 3, 8), dtype=BF16)
    with pytest.raises(ValueError, match="one block size"):
        ops.tier_copies(cache, wider, [("onboard", 0, 1)])
