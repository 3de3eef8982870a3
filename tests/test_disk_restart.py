"""Warm restart with real processes: `reprise serve --disk-cache DIR` (NumPy backend, a
tiny synthetic model), a long prompt, a stop (SIGTERM, or SIGKILL while blocks are
being written), a new daemon over the same folder, the prompt again: its cached
tokens come from disk and its logits are bit-identical to computing it fresh. A
block file with flipped bytes is found, counted and removed, and never served."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_daemon import BLOCK_SIZE, Daemon, wait_idle

from reprise.blockpool import disk_format as fmt
from reprise.daemon.model.synth import synth_model
from reprise.ipc import Client, Done
from reprise.ipc.codec import logits_from_wire

PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(10 * BLOCK_SIZE + 5)]  # 10 full blocks + 5
NUM_MATCHABLE = 10 * BLOCK_SIZE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("restart") / "tiny")


@pytest.fixture(scope="module")
def fresh(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The prompt's logits computed by a daemon with no cache of any kind."""
    d = Daemon(tmp_path_factory.mktemp("fresh"), tiny, "--no-reuse")
    try:
        done = ask(d)
        assert done.cached_tokens == 0
        return logits(done)
    finally:
        d.stop()


def ask(d: Daemon) -> Done:
    with d.client() as client:
        return client.generate(PROMPT, max_tokens=4, temperature=0, return_logits=True)


def logits(done: Done) -> np.ndarray:
    assert done.logits is not None
    return logits_from_wire(done.logits)


def stats(d: Daemon) -> dict:
    with d.client() as client:
        return wait_idle(client)


@pytest.fixture
def started(tmp_path: Path, tiny: Path) -> Iterator[tuple[Daemon, Path]]:
    """A daemon with an empty disk tier that has computed the prompt once, fresh."""
    folder = tmp_path / "kv"
    folder.mkdir()
    d = Daemon(tmp_path / "a", tiny, "--disk-cache", str(folder))
    try:
        yield d, folder
    finally:
        d.stop()


def restart(tmp_path: Path, tiny: Path, folder: Path) -> Daemon:
    return Daemon(tmp_path / "b", tiny, "--disk-cache", str(folder))


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*/*{fmt.FILE_SUFFIX}"))


def flip_a_byte_of_block(folder: Path, index: int) -> tuple[Path, bytes]:
    """Flip one payload byte of the prompt's block `index` (found by following the
    chain of parent digests from the first block); its path and new bytes."""
    files = block_files(folder)
    assert len(files) == 10
    headers = {f: fmt.decode_block(f.read_bytes(), bytes.fromhex(f.parent.name)) for f in files}
    chain: list[Path] = []
    parent = None
    for _ in range(10):
        (nxt,) = [f for f, h in headers.items() if h.parent_hash == parent]
        chain.append(nxt)
        parent = headers[nxt].block_hash
    assert set(chain) == set(files)
    bad = chain[index]
    data = bytearray(bad.read_bytes())
    data[headers[bad].payload_offset + 100] ^= 0x01
    bad.write_bytes(bytes(data))
    return bad, bytes(data)


@pytest.fixture(autouse=True)
def _dirs(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "b").mkdir(mode=0o700)


def test_sigterm_then_restart_serves_the_prompt_from_disk(
    started: tuple[Daemon, Path], tmp_path: Path, tiny: Path, fresh: np.ndarray
) -> None:
    a, folder = started
    first = ask(a)
    assert first.cached_tokens == 0 and logits(first).tobytes() == fresh.tobytes()
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0
    assert len(block_files(folder)) == 10  # written through, the last ones at shutdown
    b = restart(tmp_path, tiny, folder)
    try:
        assert stats(b)["disk_blocks"] == 10
        again = ask(b)
        assert (again.cached_tokens, again.disk_cached_tokens) == (NUM_MATCHABLE, NUM_MATCHABLE)
        assert again.host_cached_tokens == 0
        assert logits(again).tobytes() == fresh.tobytes()
        assert again.token_ids == first.token_ids
        s = stats(b)
        assert (s["disk_hits"], s["disk_corrupt_removed"]) == (10, 0)
    finally:
        b.stop()
    assert b.proc.returncode == 0


def test_sigkill_while_writing_never_serves_half_a_block(
    started: tuple[Daemon, Path], tmp_path: Path, tiny: Path, fresh: np.ndarray
) -> None:
    a, folder = started
    done = ask(a)
    a.proc.send_signal(signal.SIGKILL)  # at once: the last blocks' writes may be under way
    a.proc.wait(timeout=30)
    files = block_files(folder)  # none at all if the kill came before the first write
    # what a killed writer may leave: a temporary file, never a named half file
    (layout_folder,) = [p for p in folder.iterdir() if p.is_dir()]  # made at start
    (layout_folder / "deadbeef.kvb.999.1.tmp").write_bytes(b"half a block")
    b = restart(tmp_path, tiny, folder)
    try:
        s = stats(b)
        assert s["disk_corrupt_removed"] == 0 and s["disk_blocks"] == len(files)
        assert not list(folder.glob("*/*.tmp"))
        again = ask(b)
        assert again.cached_tokens == again.disk_cached_tokens
        assert again.cached_tokens % BLOCK_SIZE == 0 and again.cached_tokens <= NUM_MATCHABLE
        assert logits(again).tobytes() == fresh.tobytes()
        assert again.token_ids == done.token_ids
    finally:
        b.stop()


def test_flipped_bytes_are_detected_counted_removed_and_not_served(
    started: tuple[Daemon, Path], tmp_path: Path, tiny: Path, fresh: np.ndarray
) -> None:
    a, folder = started
    ask(a)
    a.stop()
    bad, data = flip_a_byte_of_block(folder, 3)
    b = restart(tmp_path, tiny, folder)
    try:
        again = ask(b)
        assert (again.cached_tokens, again.disk_cached_tokens) == (3 * BLOCK_SIZE, 3 * BLOCK_SIZE)
        assert logits(again).tobytes() == fresh.tobytes()
        s = stats(b)
        assert s["disk_corrupt_removed"] == 1 and s["disk_hits"] == 3
        assert not bad.exists() or bad.read_bytes() != bytes(data)  # removed (then rewritten)
    finally:
        b.stop()


def test_metrics_count_disk_hits_and_corrupt_files(
    started: tuple[Daemon, Path], tmp_path: Path, tiny: Path
) -> None:
    """/metrics of a restarted daemon with --http: the disk tier's hits in tokens under
    tier="disk" (not device or host), its blocks, and the damaged file it removed."""
    pytest.importorskip("httpx")
    from http_support import HttpDaemon, scrape

    a, folder = started
    ask(a)
    a.stop()
    flip_a_byte_of_block(folder, 5)
    b = HttpDaemon(tmp_path / "b", tiny, "--disk-cache", str(folder))
    disk_blocks = ("reprise_kv_blocks_used", (("tier", "disk"),))
    try:
        before = scrape(b.url)
        with Client(b.address, timeout_s=120) as client:
            again = client.generate(PROMPT, max_tokens=1, temperature=0)
            wait_idle(client)
        # the damaged block and those after it, computed again, are written again by the
        # tier's writer thread, in its own time
        deadline = time.monotonic() + 60
        while (after := scrape(b.url))[disk_blocks] < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        b.stop()
    assert (again.cached_tokens, again.disk_cached_tokens) == (5 * BLOCK_SIZE, 5 * BLOCK_SIZE)

    def rise(name: str, tier: str | None = None) -> float:
        key = (name, () if tier is None else (("tier", tier),))
        return after[key] - before.get(key, 0)

    hits = "reprise_prefix_cache_hits_tokens_total"
    assert rise(hits, "disk") == 5 * BLOCK_SIZE
    assert rise(hits, "device") == rise(hits, "host") == 0
    assert rise("reprise_disk_tier_corrupt_files_total") == 1
    assert after[disk_blocks] == 10
