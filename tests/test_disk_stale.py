"""Other layouts' files under the disk tier's directory count toward its bound: removed
oldest first when the tier needs the room, never while a daemon holds their folder."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from test_disk_tier import Chain, make_config, path_of, store

from reprise.blockpool import disk_format as fmt
from reprise.blockpool.disk import DiskTier
from reprise.blockpool.disk_stale import LOCK_NAME, StaleFiles, is_layout_name


def _filled(where: Path, fingerprint: bytes, blocks: int, seed: int) -> tuple[Path, list[Path]]:
    """A closed tier of another model with `blocks` files, their mtimes one second
    apart (oldest first, an hour ago); returns its folder and files."""
    tier = DiskTier.open(make_config(where, model_fingerprint=fingerprint))
    chain = Chain(blocks, seed=seed)
    store(tier, chain)
    tier.close()
    files = [path_of(tier, h) for h in chain.hashes]
    for i, path in enumerate(files):
        os.utime(path, ns=(0, (1_000_000 + i) * 10**9))
    return tier.folder, files


def _file_nbytes(where: Path) -> int:
    """At least any block file's size here: a file's ids take a few bytes more or less,
    so a bound of k such sizes holds any k files and no k + 1 (k <= 8)."""
    _, files = _filled(where / "probe", b"probe", 8, seed=99)
    sizes = [f.stat().st_size for f in files]
    assert 9 * min(sizes) > 8 * max(sizes), sizes
    return max(sizes)


def _nbytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def _tier_bytes(where: Path) -> int:
    """The block files' and sidecars' bytes in the layout folders of `where`."""
    return sum(
        p.stat().st_size
        for folder in where.iterdir()
        if is_layout_name(folder.name)
        for p in folder.iterdir()
        if fmt.hash_of_file_name(p.name) or fmt.hash_of_sidecar_name(p.name)
    )


def test_another_layouts_files_count_and_go_first_oldest_first(tmp_path: Path) -> None:
    size = _file_nbytes(tmp_path)
    folder, files = _filled(tmp_path, b"model-old", 4, seed=1)
    tier = DiskTier.open(make_config(tmp_path, max_bytes=6 * size))
    try:
        assert tier.stats()["disk_stale_bytes"] == _nbytes(files)  # within the bound: all kept
        assert all(f.exists() for f in files)
        chain = Chain(3, seed=2)
        store(tier, chain)  # 7 files: the other layout's oldest goes
        assert [f.exists() for f in files] == [False, True, True, True]
        stats = tier.stats()
        assert (stats["disk_stale_bytes"], stats["disk_stale_removed"]) == (_nbytes(files[1:]), 1)
        assert stats["disk_evictions"] == 0 and stats["disk_blocks"] == 3
        store(tier, Chain(3, seed=3))  # 9 files wanted: three more of the old layout go
        assert not any(f.exists() for f in files)
        assert not folder.exists()  # emptied: removed with its lock file
        assert tier.stats()["disk_stale_bytes"] == 0
        store(tier, Chain(1, seed=4))  # then the tier's own, least recently used first
        assert not path_of(tier, chain.hashes[0]).exists()
        assert tier.stats()["disk_evictions"] == 1
        assert _tier_bytes(tmp_path) <= 6 * size
        tier.check_integrity()
    finally:
        tier.close()


def test_open_removes_other_layouts_down_to_the_bound(tmp_path: Path) -> None:
    size = _file_nbytes(tmp_path)
    _, old = _filled(tmp_path, b"model-old", 3, seed=1)
    _, older = _filled(tmp_path, b"model-older", 3, seed=2)
    for i, path in enumerate(older):  # older still: before every file of `old`
        os.utime(path, ns=(0, (500_000 + i) * 10**9))
    mine = DiskTier.open(make_config(tmp_path))
    chain = Chain(2, seed=3)
    store(mine, chain)
    mine.close()
    tier = DiskTier.open(make_config(tmp_path, max_bytes=4 * size))
    try:
        assert [f.exists() for f in older + old] == [False] * 4 + [True] * 2
        assert all(tier.contains(h) for h in chain.hashes)  # its own come first
        assert tier.stats()["disk_stale_removed"] == 4
    finally:
        tier.close()


def test_a_folder_a_daemon_holds_is_neither_counted_nor_touched(tmp_path: Path) -> None:
    size = _file_nbytes(tmp_path)
    other = DiskTier.open(make_config(tmp_path, model_fingerprint=b"model-busy"))
    busy = Chain(3, seed=1)
    store(other, busy)
    try:
        tier = DiskTier.open(make_config(tmp_path, max_bytes=3 * size))
        try:
            assert tier.stats()["disk_stale_bytes"] == 0
            store(tier, Chain(4, seed=2))
            assert tier.stats()["disk_evictions"] == 1  # its own, not the held folder's
        finally:
            tier.close()
        assert all(path_of(other, h).exists() for h in busy.hashes)
        assert other.enabled and all(busy.get(other, i) is not None for i in range(3))
    finally:
        other.close()


def test_a_folder_taken_after_the_scan_stops_counting(tmp_path: Path) -> None:
    size = _file_nbytes(tmp_path)
    _, files = _filled(tmp_path, b"model-back", 3, seed=1)
    tier = DiskTier.open(make_config(tmp_path, max_bytes=4 * size))
    try:
        assert tier.stats()["disk_stale_bytes"] == _nbytes(files)
        back = DiskTier.open(make_config(tmp_path, model_fingerprint=b"model-back"))
        try:
            assert back.enabled  # the first tier's looks never kept it from its lock
            store(tier, Chain(2, seed=2))  # over the bound: the held folder is forgotten
            assert all(f.exists() for f in files)
            stats = tier.stats()
            assert (stats["disk_stale_bytes"], stats["disk_stale_removed"]) == (0, 0)
            assert stats["disk_blocks"] == 2 and stats["disk_evictions"] == 0
            assert back.stats()["disk_blocks"] == 3
        finally:
            back.close()
    finally:
        tier.close()


def test_only_a_tiers_names_are_counted_or_removed(tmp_path: Path) -> None:
    size = _file_nbytes(tmp_path)
    folder, files = _filled(tmp_path, b"model-old", 2, seed=1)
    (folder / "notes.txt").write_text("the operator's")
    (folder / "sub").mkdir()
    (tmp_path / "README").write_text("not a layout")
    lookalike = tmp_path / ("AB" * fmt.LAYOUT_KEY_NBYTES)  # upper case: not a layout name
    lookalike.mkdir()
    kept = lookalike / files[0].name
    kept.write_bytes(b"x" * 10 * size)
    tier = DiskTier.open(make_config(tmp_path, max_bytes=size))
    try:
        assert [f.exists() for f in files] == [False, True]  # the oldest makes the room
        store(tier, Chain(1, seed=2))
        assert not any(f.exists() for f in files)
        assert (folder / "notes.txt").exists() and (folder / "sub").is_dir()
        assert (tmp_path / "README").exists() and kept.exists()
        assert tier.stats()["disk_stale_bytes"] == 0
    finally:
        tier.close()


def test_layout_names() -> None:
    assert is_layout_name(bytes(range(fmt.LAYOUT_KEY_NBYTES)).hex())
    assert not is_layout_name("ab" * (fmt.LAYOUT_KEY_NBYTES - 1))
    assert not is_layout_name("zz" * fmt.LAYOUT_KEY_NBYTES)
    assert not is_layout_name("AB" * fmt.LAYOUT_KEY_NBYTES)


def test_open_waits_out_a_lock_held_for_an_instant(tmp_path: Path) -> None:
    """Another tier looking whether this folder is held holds its lock for an instant:
    `open` retries rather than run without the tier."""
    first = DiskTier.open(make_config(tmp_path))
    folder = first.folder
    first.close()
    fd = os.open(folder / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    timer = threading.Timer(0.02, os.close, (fd,))
    timer.start()
    try:
        tier = DiskTier.open(make_config(tmp_path))
        assert tier.enabled
        tier.close()
    finally:
        timer.join()


def test_scan_order_and_removal_count(tmp_path: Path) -> None:
    """StaleFiles alone: oldest first whatever the folder, and `remove_oldest` stops as
    soon as enough bytes are gone."""
    a = tmp_path / ("a1" * fmt.LAYOUT_KEY_NBYTES)
    b = tmp_path / ("b2" * fmt.LAYOUT_KEY_NBYTES)
    own = tmp_path / ("c3" * fmt.LAYOUT_KEY_NBYTES)
    for folder in (a, b, own):
        folder.mkdir()
    made = []
    for i, folder in enumerate([a, b, a, b, own]):
        path = folder / f"{i + 16:02x}{fmt.FILE_SUFFIX}"
        path.write_bytes(bytes(100 + i))
        os.utime(path, ns=(0, (10 - i) * 10**9))  # the last made is the oldest
        made.append(path)
    stale = StaleFiles.scan(tmp_path, own)
    assert stale.nbytes == sum(100 + i for i in range(4)) and len(stale) == 4
    assert stale.remove_oldest(150) == 103 + 102  # two files: 103 alone is not enough
    assert [p.exists() for p in made] == [True, True, False, False, True]
    assert stale.files_removed == 2 and stale.folders == [a, b]
