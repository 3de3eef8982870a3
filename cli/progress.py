"""A tqdm bar that fits the engine's `progress(done, total)` callbacks."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm import tqdm


@contextmanager
def tqdm_progress(desc: str, unit: str = "it") -> Iterator[Callable[[int, int], None]]:
    bar: tqdm | None = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
        bar.n = done
        bar.refresh()

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
