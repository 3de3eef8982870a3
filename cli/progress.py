"""Progress bars on stderr for long work: a tqdm bar that fits the engine's
`progress(done, total)` callbacks, and `run`'s prefill driven step by step.

Bars are drawn only where a person watches: when stderr is a terminal, or when
REPRISE_PROGRESS=1 forces them (REPRISE_PROGRESS=0 turns them off), so logs and
pipes get no carriage-return noise.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from ..daemon import Engine, SamplingParams
    from ..daemon.engine.params import Completion

Progress = Callable[[int, int], None]


def progress_wanted() -> bool:
    forced = os.environ.get("REPRISE_PROGRESS", "")
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


@contextmanager
def tqdm_progress(desc: str, unit: str = "it") -> Iterator[Progress]:
    """A callback `update(done, total)`; the bar appears at its first call (never when
    progress is not wanted) and is cleared once `done` reaches `total`."""
    bar: tqdm | None = None
    wanted = progress_wanted()

    def update(done: int, total: int) -> None:
        nonlocal bar
        if not wanted:
            return
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
        bar.total = total
        bar.n = done
        bar.refresh()
        if done >= total:  # finished: cleared now, not when the work around it ends
            bar.close()
            bar = None

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def complete_with_progress(
    engine: Engine, prompt_ids: list[int], params: SamplingParams, progress: Progress
) -> Completion:
    """Run one request to its end, step by step, calling `progress(computed, total)`
    with the prompt tokens computed so far and those to compute (the prompt less what
    the cache served) after every step of a prefill that takes more than one step."""
    stats = engine.stats()
    computed_before = int(stats["prefill_tokens_computed"])
    skipped_before = int(stats["prefill_tokens_skipped"])
    request_id = engine.add_request(prompt_ids, params)
    shown = prefilled = False
    while True:
        outputs = engine.step()
        if not prefilled:
            stats = engine.stats()
            total = len(prompt_ids) - (int(stats["prefill_tokens_skipped"]) - skipped_before)
            computed = int(stats["prefill_tokens_computed"]) - computed_before
            if shown or computed < total:  # a one-step prefill needs no bar
                progress(computed, total)
                shown = True
            prefilled = computed >= total
        if any(o.request_id == request_id and o.finish_reason for o in outputs):
            return engine.take_completion(request_id)
