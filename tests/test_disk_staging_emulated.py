"""The GPU backend's disk writes in the emulated CuPy (tests/kernel_emu/emucupy.py): a
block's bytes leave the device on the copy stream without the engine loop waiting,
the tier's writer waits for the copy's event, and the emulation's checks hold: a copy
on the copy stream lands only once something waits for it, and a write of the block
not ordered after the read raises RaceError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kernel_emu import emucupy
from test_cupy_emulated import BS, GREEDY, PROMPTS, Engines, emulated, model_dir, random_prompt
from test_disk_wiring import record_copy_runs

from reprise.cuda.dtypes import BF16
from reprise.daemon import Completion, SamplingParams

pytestmark = pytest.mark.kernels
__all__ = ["emulated", "model_dir"]  # fixtures, used by name


@pytest.fixture(scope="module")
def engines(emulated: None, model_dir: Path) -> Engines:
    return Engines(model_dir, "tensor-cores")


def test_read_block_lands_when_waited_for(emulated: None) -> None:
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device

    ops = CupyBackend()
    want = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(BF16)
    cache = to_device(want)
    out = np.full((2, 8), 0xFFFF, dtype=np.uint16).view(BF16)
    done = ops.read_block(cache, 1, out)
    assert out.view(np.uint16).min() == 0xFFFF  # held back: nothing waited yet
    with pytest.raises(emucupy.RaceError, match="device-to-host copy"):
        cache[1] = 0  # a write of the block that nothing orders after the read
    ops.wait_copies()
    cache[1] = 0  # ordered after the read
    done.synchronize()
    assert out.tobytes() == want[1].tobytes()


def test_copies_done_is_the_copy_streams_event(emulated: None) -> None:
    """What the runner waits for when a step has no forward: the copies issued so far
    (here an offload, held back by the emulation until something waits for it)."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device

    ops = CupyBackend()
    ops.copies_done().synchronize()  # no copy yet: done
    want = np.random.default_rng(1).standard_normal((3, 2, 8)).astype(BF16)
    cache = to_device(want)
    host = np.full((2, 2, 8), 0xFFFF, dtype=np.uint16).view(BF16)
    ops.offload_block(cache, 2, host, 1)
    assert host.view(np.uint16).min() == 0xFFFF  # held back: nothing waited yet
    ops.copies_done().synchronize()
    assert host[1].tobytes() == want[2].tobytes()


TRACED = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, return_logits=True)


def written_to_disk(engines: Engines, tmp_path: Path, prompt: list[int]) -> Completion:
    """`prompt` computed fresh (reuse off), then by an engine over the disk folder
    `tmp_path` that writes its blocks there and closes; the fresh completion."""
    fresh = engines(enable_reuse=False).generate(prompt, TRACED)
    first = engines(disk_cache=str(tmp_path))
    first.generate(prompt, TRACED)
    while first.has_work():
        first.step()
    first.close()
    return fresh


def test_disk_hits_copies_started_inside_the_match_land_before_the_forward(
    engines: Engines, tmp_path: Path
) -> None:
    """Five disk hits read into host slots after a restart: the first four's copies are
    issued inside the match (the pool's copies_ready), on the copy stream, ahead of the
    step; the forward still reads the blocks only once they landed (the emulation holds
    a copy back until something waits for it), so the logits are bit-identical."""
    prompt = random_prompt(5 * BS + 3, seed=44)
    fresh = written_to_disk(engines, tmp_path, prompt)
    second = engines(disk_cache=str(tmp_path), num_host_blocks=8)
    runs = record_copy_runs(second)
    again = second.generate(prompt, TRACED)
    assert runs[:2] == [("match", 4), ("step", 1)]
    assert again.disk_cached_tokens == again.cached_tokens >= 5 * BS
    assert again.logits.tobytes() == fresh.logits.tobytes()
    second.close()


def test_a_restart_serves_blocks_staged_on_the_copy_stream(
    engines: Engines, tmp_path: Path
) -> None:
    """Blocks written through the copy stream, their device blocks then reused by other
    prompts: a new engine over the folder serves the prompt from disk, its logits
    bit-identical to computing it fresh."""
    fresh = engines(enable_reuse=False).generate(PROMPTS[0], GREEDY)
    first = engines(num_device_blocks=8, disk_cache=str(tmp_path))
    ops = first.runner.model.ops
    reads: list[int] = []
    read_block = ops.read_block
    ops.read_block = lambda cache, block_id, out: (
        reads.append(block_id) or read_block(cache, block_id, out)
    )
    try:
        first.generate(PROMPTS[0], GREEDY)
        for seed in range(2):  # other prompts take the device blocks over
            first.generate(random_prompt(60, seed=40 + seed), SamplingParams(max_tokens=2))
        while first.has_work():
            first.step()
        first.close()
    finally:
        del ops.read_block
    num_full = len(PROMPTS[0]) // BS
    assert len(reads) >= num_full and first.stats()["disk_writes"] == len(reads)

    second = engines(disk_cache=str(tmp_path))
    again = second.generate(PROMPTS[0], GREEDY)
    # the full blocks, and maybe the tail's first tokens by partial reuse of a disk block
    assert again.disk_cached_tokens == again.cached_tokens >= num_full * BS
    assert again.token_ids == fresh.token_ids
    assert again.logits.tobytes() == fresh.logits.tobytes()
    second.close()


def test_disk_hits_without_a_host_tier_are_uploaded_into_their_blocks(
    engines: Engines, tmp_path: Path
) -> None:
    """No host tier: a disk hit's checked payload is uploaded into its device block on
    the compute stream (one copy, no device array made from it), before the forward
    reads the block: a restarted engine's logits equal computing the prompt fresh."""
    prompt = random_prompt(4 * BS + 3, seed=81)
    fresh = written_to_disk(engines, tmp_path, prompt)
    second = engines(disk_cache=str(tmp_path))
    ops = second.runner.model.ops
    uploads = []
    upload = ops.upload
    ops.upload = lambda dst, src: uploads.append(src.shape) or upload(dst, src)
    try:
        again = second.generate(prompt, TRACED)
    finally:
        del ops.upload
    assert again.disk_cached_tokens == 4 * BS, again.disk_cached_tokens
    assert uploads.count(second.runner.kv_cache.shape[1:]) == 4
    assert again.token_ids == fresh.token_ids
    assert again.logits.tobytes() == fresh.logits.tobytes()
    second.close()
