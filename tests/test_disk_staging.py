"""Disk writes without a synchronous readback: a block leaves its device block through
a staging buffer of the disk tier, by a copy the engine loop issues and never waits
for; the tier's writer waits for it before reading the buffer.

Copies that land late are played by fakes here (the bytes are taken when the copy is
issued, as the copy stream reads them in order, and reach the buffer only when the
test opens a gate); the CuPy path runs in tests/test_disk_staging_emulated.py, and on
a GPU in the GPU test at the end:

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_disk_staging.py -m gpu

(REPRISE_EMULATE_GPU=skip-kernels in front runs their code in the emulated CuPy.)
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from gpu_support import needs_gpu
from test_disk_tier import Chain, make_config

from reprise.blockpool import disk_format as fmt
from reprise.blockpool.disk import DiskTier
from reprise.cuda.backend import NumpyBackend
from reprise.cuda.dtypes import BF16
from reprise.daemon.engine.engine import Engine
from reprise.daemon.engine.params import SamplingParams
from reprise.daemon.model.synth import synth_model

POISON = 0xA5


def poisoned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A staging buffer whose every byte shows if the writer reads it before its copy lands."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return np.full(nbytes, POISON, dtype=np.uint8).view(dtype).reshape(shape)


class LateCopy:
    """A copy whose bytes were read when issued and land in `out` only once `gate` opens
    and someone waits for it."""

    def __init__(self, block: np.ndarray, out: np.ndarray, gate: threading.Event) -> None:
        self.block, self.out, self.gate = block.copy(), out, gate
        self.landed = False

    def synchronize(self) -> None:
        assert self.gate.wait(10), "the test never opened the gate"
        if not self.landed:
            self.out[...] = self.block
            self.landed = True


class LateReads:
    """`read_block` as a backend with a copy stream does it: late, and counted."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.copies: list[LateCopy] = []
        self.buffers: list[np.ndarray] = []

    def read_block(self, cache: np.ndarray, block_id: int, out: np.ndarray) -> LateCopy:
        copy = LateCopy(cache[block_id], out, self.gate)
        self.copies.append(copy)
        return copy

    def staging_buffer(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        buffer = poisoned(shape, dtype)
        self.buffers.append(buffer)
        return buffer


def file_payload(tier: DiskTier, block_hash: bytes) -> bytes:
    data = fmt.read_file(tier.folder / fmt.file_name(block_hash))
    header = fmt.decode_block(data, tier.layout)
    return data[header.payload_offset : header.payload_offset + header.payload_nbytes]


def test_the_numpy_backend_reads_a_block_at_once() -> None:
    ops = NumpyBackend()
    cache = np.arange(3 * 2 * 4, dtype=np.float32).astype(BF16).reshape(3, 2, 4)
    out = poisoned((2, 4), BF16)
    done = ops.read_block(cache, 1, out)
    assert out.tobytes() == cache[1].tobytes()  # before any wait
    done.synchronize()
    assert out.tobytes() == cache[1].tobytes()


def test_the_writer_waits_for_a_late_copy(tmp_path: Path) -> None:
    chain = Chain(2)
    reads = LateReads()
    tier = DiskTier.open(make_config(tmp_path))
    try:
        device = np.stack(chain.kvs)  # [2, *block_shape], a stand-in device cache
        for i in range(2):
            assert tier.put(
                chain.hashes[i],
                chain.hashes[i - 1] if i else None,
                chain.tokens[i],
                lambda out, i=i: reads.read_block(device, i, out),
                allocate=reads.staging_buffer,
            )
        device[:] = 0  # the blocks' next owners write them; the copies read them before
        assert not tier.flush(0.05)  # the writer waits for the first copy
        assert not any(tier.folder.glob("*" + fmt.FILE_SUFFIX))
        assert all(b.view(np.uint8).min() == POISON for b in reads.buffers)
        reads.gate.set()
        assert tier.flush(10)
        for i in range(2):
            assert file_payload(tier, chain.hashes[i]) == chain.kvs[i].tobytes()
            got = chain.get(tier, i)
            assert got is not None and got.tobytes() == chain.kvs[i].tobytes()
        tier.check_integrity()
    finally:
        reads.gate.set()
        tier.close()


def test_staging_buffers_are_bounded_and_reused(tmp_path: Path) -> None:
    """At most `write_queue_blocks + 1` copies in flight; one more is dropped and counted
    at once (the caller never waits); the buffers come back after their writes."""
    chain = Chain(6)
    reads = LateReads()
    tier = DiskTier.open(make_config(tmp_path, write_queue_blocks=2))
    device = np.stack(chain.kvs)

    def put(i: int) -> bool:
        return tier.put(
            chain.hashes[i],
            chain.hashes[i - 1] if i else None,
            chain.tokens[i],
            lambda out: reads.read_block(device, i, out),
            allocate=reads.staging_buffer,
        )

    try:
        assert [put(i) for i in range(4)] == [True, True, True, False]
        assert tier.stats()["disk_writes_dropped"] == 1
        assert len(reads.copies) == 3  # the dropped write issued no copy
        reads.gate.set()
        assert tier.flush(10)
        assert [put(i) for i in (3, 4, 5)] == [True, True, True]
        assert tier.flush(10)
        assert len(reads.buffers) == 3  # no buffer made past the bound
        assert tier.stats()["disk_writes"] == 6
        for i in (0, 1, 2, 3, 4, 5):
            assert file_payload(tier, chain.hashes[i]) == chain.kvs[i].tobytes()
    finally:
        reads.gate.set()
        tier.close()


def test_a_dropped_write_still_waits_for_its_copy(tmp_path: Path) -> None:
    """Closing without a flush drops the queued writes, but no buffer is handed out
    again (or the tier let go) before the copy into it landed."""
    chain = Chain(1)
    reads = LateReads()
    tier = DiskTier.open(make_config(tmp_path))
    device = np.stack(chain.kvs)
    assert tier.put(
        chain.hashes[0],
        None,
        chain.tokens[0],
        lambda out: reads.read_block(device, 0, out),
        allocate=reads.staging_buffer,
    )
    threading.Timer(0.1, reads.gate.set).start()
    tier.close(flush=False, timeout_s=10)
    assert reads.copies[0].landed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("disk-staging") / "tiny")


def test_the_engine_writes_blocks_whose_copies_land_late(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every written block's copy lands only after the engine ran on (its device blocks
    reused by other prompts); the files still hold the blocks' bytes: a restarted
    engine serves the prompt from them with logits bit-identical to computing it fresh."""
    settings = dict(backend="numpy", block_size=16, num_device_blocks=12)
    prompt = list(range(3, 3 + 16 * 5 + 7))
    params = SamplingParams(max_tokens=3, temperature=0, return_logits=True)
    fresh = Engine.from_pretrained(tiny, enable_reuse=False, **settings).generate(prompt, params)

    first = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **settings)
    reads = LateReads()
    ops = first.runner.model.ops
    monkeypatch.setattr(ops, "read_block", reads.read_block)
    monkeypatch.setattr(ops, "staging_buffer", reads.staging_buffer)
    first.generate(prompt, params)
    for seed in range(2):  # other prompts take the device blocks over
        other = np.random.default_rng(seed).integers(3, 200, size=70).tolist()
        first.generate(other, SamplingParams(max_tokens=1, temperature=0))
    while first.has_work():
        first.step()
    assert len(reads.copies) >= 5 and not any(c.landed for c in reads.copies)
    assert first.stats()["disk_writes"] == 0
    reads.gate.set()
    first.close()
    assert first.stats()["disk_writes"] == len(reads.copies)

    second = Engine.from_pretrained(tiny, disk_cache=str(tmp_path), **settings)
    again = second.generate(prompt, params)
    assert again.disk_cached_tokens == 80
    assert again.token_ids == fresh.token_ids
    assert again.logits.tobytes() == fresh.logits.tobytes()
    second.close()


@pytest.mark.gpu
@needs_gpu
def test_gpu_read_block_lands_once_waited_for() -> None:
    """On a device: the read is issued on the copy stream behind the compute that wrote
    the block, a later write of the block (ordered by wait_copies) does not reach the
    staged bytes, and the event says when the pinned buffer holds them."""
    import cupy

    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device

    ops = CupyBackend()
    rng = np.random.default_rng(0)
    shape = (4, 2, 2, 3, 16, 64)  # [blocks, layers, 2, kv heads, block size, head dim]
    want = rng.standard_normal(shape).astype(BF16)
    cache = ops.kv_cache(shape)
    cache[...] = to_device(want).view(cache.dtype)  # compute stream
    out = ops.staging_buffer((int(np.prod(shape[1:])) * 2,), np.uint8).view(BF16)
    out = out.reshape(shape[1:])
    out.view(np.uint8)[...] = POISON
    done = ops.read_block(cache, 2, out)
    ops.wait_copies()
    cache[2] = 0  # the block's next owner, after the read
    done.synchronize()
    assert out.tobytes() == want[2].tobytes()
    cupy.cuda.Device().synchronize()
    assert not cupy.asnumpy(cache[2]).any()


@pytest.mark.gpu
@needs_gpu
def test_gpu_engine_restart_from_disk_is_bit_identical(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """On a device, the default model: blocks written through the copy stream while the
    engine runs on, then a new engine over the folder: logits bit-identical to fresh."""
    settings = dict(backend="cupy", block_size=16, num_device_blocks=64)
    prompt = list(range(300, 300 + 16 * 5 + 7))
    params = SamplingParams(max_tokens=3, temperature=0, return_logits=True)
    fresh = Engine.from_pretrained(default_model_dir, enable_reuse=False, **settings)
    want = fresh.generate(prompt, params)
    first = Engine.from_pretrained(default_model_dir, disk_cache=str(tmp_path), **settings)
    first.generate(prompt, params)
    while first.has_work():
        first.step()
    first.close()
    assert first.stats()["disk_writes"] == 5
    second = Engine.from_pretrained(default_model_dir, disk_cache=str(tmp_path), **settings)
    got = second.generate(prompt, params)
    assert got.disk_cached_tokens == 80
    assert got.logits.tobytes() == want.logits.tobytes()
    second.close()
