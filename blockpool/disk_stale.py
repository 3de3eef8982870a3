"""Block files of other layouts in the disk tier's directory, counted toward its bound.

A directory holds one folder per layout (disk.py). A layout no running daemon holds
(another model, an older reprise, whose producer differs, or an older file format) is
stale: nothing reads its files until a daemon of that layout starts again, and without
this module they would stay forever, each upgrade or model change leaving another
folder. `--disk-cache-gb` bounds the directory, so a tier counts the stale folders'
files with its own and, when it needs the room, removes them before any of its own,
least recently used (oldest mtime) first. A daemon that starts again on a stale
layout finds what is left of it.

Guarantees:
- Touches only folders named as a layout is (`LAYOUT_KEY_NBYTES` bytes in hex), never
  the tier's own, and in them only names a tier writes (block files, sidecars,
  temporary files); anything else is neither counted nor removed.
- Never touches a folder in use: one whose lock a running daemon holds is left out at
  the scan, and a folder is looked at again before the first removal from it in each
  pass (a daemon of that layout may have started since); held, its files leave the
  list and stop counting. The look takes the lock and lets it go at once; a daemon
  starting in that instant retries its own lock (disk.py), so it is not refused.
- Bounded: the scan lists each folder once and stats each file; it reads nothing.
- A folder emptied of its files goes, with its lock file, unless something else is in
  it; it is removed holding its lock, and a daemon starting on it meanwhile makes it
  anew when it retries (disk.py).

Only the tier's writer thread calls `remove_oldest` (and `scan` runs before it starts);
`nbytes` may be read from any thread.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import deque
from pathlib import Path

from . import disk_format as fmt
from .disk_writer import TMP_SUFFIX

log = logging.getLogger(__name__)

LOCK_NAME = "lock"


def is_layout_name(name: str) -> bool:
    """Whether a directory entry is named as a layout's folder is."""
    if len(name) != 2 * fmt.LAYOUT_KEY_NBYTES:
        return False
    try:
        bytes.fromhex(name)
    except ValueError:
        return False
    return name == name.lower()


def is_tier_file(name: str) -> bool:
    """Whether a name is one a tier writes into its folder."""
    return (
        name.endswith(TMP_SUFFIX)
        or fmt.hash_of_file_name(name) is not None
        or fmt.hash_of_sidecar_name(name) is not None
    )


def in_use(folder: Path) -> bool:
    """Whether a running daemon holds `folder`'s lock (not knowing counts as held)."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # lets go of the lock, if taken
    return False


class StaleFiles:
    """The stale folders' files, least recently used first (module docstring)."""

    def __init__(self, files: list[tuple[int, Path, int]]) -> None:
        # (mtime_ns, path, size), oldest first; ties by path, so the order is fixed
        self._files = deque(sorted(files))
        self._per_folder: dict[Path, int] = {}
        for _, path, _ in self._files:
            self._per_folder[path.parent] = self._per_folder.get(path.parent, 0) + 1
        self.nbytes = sum(size for _, _, size in self._files)
        self.files_removed = 0

    @classmethod
    def scan(cls, directory: Path, own: Path) -> StaleFiles:
        """The files of every layout folder under `directory` but `own` that no running
        daemon holds; a folder that cannot be listed is left out."""
        files: list[tuple[int, Path, int]] = []
        try:
            with os.scandir(directory) as entries:
                folders = [
                    Path(e.path)
                    for e in entries
                    if is_layout_name(e.name)
                    and e.name != own.name
                    and e.is_dir(follow_symlinks=False)
                ]
        except OSError:
            return cls([])
        for folder in sorted(folders):
            if in_use(folder):
                continue
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        if not is_tier_file(entry.name) or not entry.is_file(follow_symlinks=False):
                            continue
                        st = entry.stat(follow_symlinks=False)
                        files.append((st.st_mtime_ns, Path(entry.path), st.st_size))
            except OSError as exc:
                log.debug("disk tier: leaving %s alone (%s)", folder, exc)
        return cls(files)

    def __len__(self) -> int:
        return len(self._files)

    @property
    def folders(self) -> list[Path]:
        """The folders that still hold files counted here."""
        return sorted(self._per_folder)

    def remove_oldest(self, nbytes: int) -> int:
        """Remove the oldest files until at least `nbytes` are gone or none is left
        (a folder found in use since stops counting instead); returns the bytes gone
        from the count."""
        gone = 0
        looked: set[Path] = set()
        while gone < nbytes and self._files:
            _, path, size = self._files[0]
            folder = path.parent
            if folder not in looked:
                looked.add(folder)
                if in_use(folder):
                    gone += self._forget_folder(folder)
                    continue
            self._files.popleft()
            fmt.unlink(path)
            self.nbytes -= size
            gone += size
            self.files_removed += 1
            self._per_folder[folder] -= 1
            if not self._per_folder[folder]:
                del self._per_folder[folder]
                _remove_folder(folder)
        return gone

    def _forget_folder(self, folder: Path) -> int:
        kept = [f for f in self._files if f[1].parent != folder]
        size = self.nbytes - sum(s for _, _, s in kept)
        self._files = deque(kept)
        self._per_folder.pop(folder, None)
        self.nbytes -= size
        return size


def _remove_folder(folder: Path) -> None:
    """Remove an emptied layout folder and its lock file, holding the lock, unless it
    holds anything else or a daemon holds it."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError:
        return
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with os.scandir(folder) as entries:
            if any(e.name != LOCK_NAME for e in entries):
                return
        fmt.unlink(folder / LOCK_NAME)
        folder.rmdir()
    except OSError as exc:  # held, or something came into it meanwhile
        log.debug("disk tier: leaving %s (%s)", folder, exc)
    finally:
        if fd is not None:
            os.close(fd)
