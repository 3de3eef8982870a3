"""Sliding-window attention in attention.cu (the twin's `window`, paged_attention_ref), on
the CPU emulation (test_kernels_emulated.py's).

The query at position p sees keys p - window + 1 to p; the KV chunks keep their fixed
boundaries, a row skips the pages and chunks it sees no key of, and the chunk holding its
first visible key is its first. Here: the kernel stays within BF16 rounding of the twin
at windows around the page and chunk sizes, and a row's bits still depend on nothing but
its own query and the keys in its window: not its batch, its chunk of the prompt, its
path (prefill or decode), the split grid (lanes that see no chunk of a row, or none of
any) or which lane merges. A window no shorter than the sequence changes no bit; a
shorter one changes exactly the rows it cuts.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_kernels_emulated import (
    SCHEDULES,
    SPLIT_CONTEXTS,
    Paged,
    S,
    forced_grid,
    fp32_probe,
    max_row_ulps,
    paged_lens,
    reversed_ctas,
    warp_schedule,
)

from reprise.cuda.attention import paged_attention_ref
from reprise.cuda.attention_kernel import SplitGrid, split_grid
from reprise.cuda.dtypes import BF16
from reprise.cuda.kvcache import kv_write_ref

pytestmark = pytest.mark.kernels

WINDOWS = [1, 15, 16, 17, S - 1, S, S + 1, 2 * S + 3]  # around a page and a KV chunk


@pytest.fixture(scope="module")
def lib(emu_lib: ctypes.CDLL) -> ctypes.CDLL:
    return emu_lib


class Windowed(Paged):
    """Paged sequences (stale slots holding garbage and NaN) run through attention.cu and
    its twin under a sliding window (0: none)."""

    def emulated(self, lib: ctypes.CDLL, spans: list[tuple[int, int, int]],
                 cache: np.ndarray | None = None, grid: SplitGrid | None = None, *,
                 window: int = 0) -> np.ndarray:  # fmt: skip
        lib.set_attention_window(window)
        try:
            return super().emulated(lib, spans, cache, grid)
        finally:
            lib.set_attention_window(0)

    def twin(self, spans: list[tuple[int, int, int]], *, window: int = 0) -> np.ndarray:
        q, tables, seq_lens, starts = self.inputs(spans)
        scale = 1 / np.sqrt(self.head_dim)
        return paged_attention_ref(q, self.cache, 1, tables, seq_lens, starts, scale, window)

    def planned_grid(self, spans: list[tuple[int, int, int]]) -> SplitGrid:
        q, tables, _, _ = self.inputs(spans)
        group = self.heads // self.kv_heads
        return split_grid(q.shape[0], len(spans), self.kv_heads, group, tables.shape[1],
                          self.block_size)  # fmt: skip


def with_garbage_before(paged: Paged, rng: np.random.Generator, ends: dict[int, int]) -> np.ndarray:
    """The cache with each sequence b's keys and values at positions 0 .. ends[b] - 1
    overwritten by large values and NaN."""
    cache = paged.cache.copy()
    for b, end in ends.items():
        garbage = (rng.standard_normal((end, paged.kv_heads, paged.head_dim)) * 50).astype(BF16)
        garbage[::3, :, :5] = np.nan
        pos = np.arange(end)
        slots = np.asarray(paged.tables[b])[pos // paged.block_size] * paged.block_size
        kv_write_ref(cache, 1, garbage, garbage[::-1], slots + pos % paged.block_size)
    return cache


def span_starts(spans: list[tuple[int, int, int]]) -> np.ndarray:
    """Each span's first row in a launch of `spans`, and the end."""
    return np.cumsum([0] + [last - first for _, first, last in spans])


def first_chunk(pos: int, window: int) -> int:
    """The KV chunk holding the first key the query at `pos` sees."""
    return max(pos - window + 1, 0) // S


def chunks_seen(pos: int, window: int) -> int:
    """The KV chunks the query at `pos` sees a key of."""
    return pos // S - first_chunk(pos, window) + 1


@pytest.mark.parametrize(
    ("shape", "block_size"), [((4, 1, 64), 16), ((6, 2, 128), 64), ((4, 2, 256), 32)]
)
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_attention_matches_its_twin_alone_and_batched(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int], block_size: int,
    window: int,
) -> None:  # fmt: skip
    """Decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys, a whole prefill of 2S + 5 keys
    and a prefill chunk of 40 queries ending at 3S + 2 (garbage past it), batched in one
    launch (split_grid's geometry): within BF16 rounding of the twin, and each span alone
    (batch 1) gets the bits it gets in the batch of 7."""
    paged = Windowed(rng, shape, block_size, [*SPLIT_CONTEXTS, 2 * S + 5, 3 * S + 2])
    spans = [(b, n - 1, n) for b, n in enumerate(SPLIT_CONTEXTS)]
    spans += [(5, 0, 2 * S + 5), (6, 3 * S - 38, 3 * S + 2)]
    cache = paged.with_garbage_after(rng, 6, 3 * S + 2)
    batched = paged.emulated(lib, spans, cache, window=window)
    assert max_row_ulps(batched.view(BF16), paged.twin(spans, window=window)) <= 2
    starts = span_starts(spans)
    for i, span in enumerate(spans):
        alone = paged.emulated(lib, [span], cache, window=window)
        assert np.array_equal(alone, batched[starts[i] : starts[i + 1]]), span


@pytest.mark.parametrize("schedule", list(SCHEDULES.values()), ids=list(SCHEDULES))
@pytest.mark.parametrize(
    ("shape", "block_size"),
    [((4, 1, 64), 16), ((4, 1, 64), 64), ((6, 2, 128), 32), ((4, 2, 256), 16)],
)
def test_windowed_split_decode_matches_its_twin_on_every_grid(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int], block_size: int,
    schedule: int,
) -> None:  # fmt: skip
    """Decode steps at 1, S - 1, S, S + 1, 3S + 7 keys and two random lengths, batched (7
    rows, split_grid's geometry: chunk states through the workspace), within BF16
    rounding of the twin, and the same fp32 values behind the outputs on every other
    grid: one lane merging in registers, other lane and head-part counts (more lanes than
    a row has chunks in its window: CTA groups some of whose lanes have no chunk and do
    not count), the CTAs run last to first (another lane merges), and each row alone;
    under each thread schedule."""
    others = [int(n) for n in rng.integers(2, 2 * S, size=2)]
    paged = Windowed(rng, shape, block_size, [*SPLIT_CONTEXTS, *others])
    spans = [(b, n - 1, n) for b, n in enumerate(paged_lens(paged))]
    heads, kv_heads, _ = shape
    group = heads // kv_heads
    lane_grids = [(1, 1), (1, 2), (group, 3), (group, 4), (1, 8)]
    with warp_schedule(lib, schedule):
        for window in (17, S + 1, 2 * S + 3):
            # the row at 3S + 7 keys sees 2 or 3 of its 4 chunks: fewer than 4 lanes
            assert chunks_seen(3 * S + 6, window) < 4
            assert paged.planned_grid(spans).splits
            batched = paged.emulated(lib, spans, window=window)
            assert max_row_ulps(batched.view(BF16), paged.twin(spans, window=window)) <= 2
            with fp32_probe(lib):
                want = paged.emulated(lib, spans, window=window)
                assert len(np.unique(want)) > 100
                for parts, lanes in lane_grids:
                    grid = forced_grid(7, 7, kv_heads, group, parts, lanes)
                    got = paged.emulated(lib, spans, grid=grid, window=window)
                    assert np.array_equal(got, want), (window, parts, lanes)
                with reversed_ctas(lib):
                    got = paged.emulated(lib, spans, window=window)
                    assert np.array_equal(got, want), (window, "reversed")
                for i, span in enumerate(spans):
                    got = paged.emulated(lib, [span], window=window)
                    assert np.array_equal(got, want[i : i + 1]), (window, span)


@pytest.mark.parametrize(
    ("shape", "block_size"),
    [((2, 2, 64), 16), ((4, 1, 64), 32), ((6, 2, 128), 64), ((4, 1, 256), 64)],
)
@pytest.mark.parametrize("window", [40, S + 1])
def test_windowed_prefill_rows_equal_their_decode_steps(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int], block_size: int,
    window: int,
) -> None:  # fmt: skip
    """A prompt's rows from a prefill (whole, in chunks of 48 with garbage past each, or a
    chunk of 40 queries whose windows start on both sides of 2S, in one CTA of every
    group size here: 32, 8 and 10 queries a CTA) bit-equal the same positions as decode
    steps (split through the workspace), the prefill's rows match the twin, and the
    prefills give the same bits on split_grid's (split) grid and on one lane (merged in
    registers): the same fp32 values behind the outputs."""
    whole_len, long_len = 2 * S + 5, 2 * S + window + 18
    paged = Windowed(rng, shape, block_size, [whole_len, long_len])
    first = long_len - 40
    # queries 0-20 of the chunk see keys from chunk 1 on, queries 21-39 from chunk 2 on
    assert first_chunk(first + 20, window) == 1 and first_chunk(first + 21, window) == 2
    cache = paged.with_garbage_after(rng, 1, long_len)
    whole_span, chunk_span = (0, 0, whole_len), (1, first, long_len)
    assert paged.planned_grid([chunk_span]).splits
    for span, with_cache in ((whole_span, None), (chunk_span, cache)):
        got = paged.emulated(lib, [span], with_cache, window=window)
        assert max_row_ulps(got.view(BF16), paged.twin([span], window=window)) <= 2, span
    heads, kv_heads, _ = shape
    with fp32_probe(lib):
        whole = paged.emulated(lib, [whole_span], window=window)
        chunk = paged.emulated(lib, [chunk_span], cache, window=window)
        for span, with_cache, want in ((whole_span, None, whole), (chunk_span, cache, chunk)):
            one_lane = forced_grid(span[2] - span[1], 1, kv_heads, heads // kv_heads, 1, 1)
            got = paged.emulated(lib, [span], with_cache, grid=one_lane, window=window)
            assert np.array_equal(got, want), span
        pieces = []
        for s in range(0, whole_len, 48):
            end = min(s + 48, whole_len)
            garbage = paged.with_garbage_after(rng, 0, end)
            pieces.append(paged.emulated(lib, [(0, s, end)], garbage, window=window))
        assert np.array_equal(np.concatenate(pieces), whole)
        for pos in (0, S - 1, S, window - 1, window, S + window - 1, S + window, whole_len - 1):
            garbage = paged.with_garbage_after(rng, 0, pos + 1)
            step = paged.emulated(lib, [(0, pos, pos + 1)], garbage, window=window)
            assert np.array_equal(step, whole[pos : pos + 1]), pos
        for pos in (first, first + 20, first + 21, long_len - 1):
            garbage = paged.with_garbage_after(rng, 1, pos + 1)
            step = paged.emulated(lib, [(1, pos, pos + 1)], garbage, window=window)
            assert np.array_equal(step, chunk[pos - first : pos - first + 1]), pos


@pytest.mark.parametrize(
    ("shape", "block_size"), [((4, 1, 64), 16), ((6, 2, 128), 64), ((4, 2, 256), 32)]
)
def test_a_window_reaches_exactly_the_rows_it_cuts(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int], block_size: int
) -> None:
    """A window no shorter than the sequence (up to the largest int32) gives the bits of no
    window; a shorter one gives them to the rows it does not cut (position < window),
    other fp32 values to every row it cuts, and the pages wholly before a row's window
    reach it not at all: garbage and NaN there (a freed page's next use) change no bit."""
    seq_lens = [1, 2 * S + 5, S + 60, int(rng.integers(2, 3 * S))]
    paged = Windowed(rng, shape, block_size, seq_lens)
    spans = [
        (0, 0, 1),
        (1, 2 * S + 4, 2 * S + 5),
        (2, 0, S + 60),
        (3, seq_lens[3] - 1, seq_lens[3]),
    ]
    positions = np.concatenate([np.arange(first, last) for _, first, last in spans])
    with fp32_probe(lib):
        full = paged.emulated(lib, spans)
        for window in (max(seq_lens), 2**31 - 1):
            assert np.array_equal(paged.emulated(lib, spans, window=window), full), window
        for window in (S // 2 + 3, S - 1):
            got = paged.emulated(lib, spans, window=window)
            cut = positions >= window
            assert np.array_equal(got[~cut], full[~cut]), window
            differs = (got[cut] != full[cut]).reshape(cut.sum(), -1).any(axis=-1)
            assert cut.sum() > 50 and differs.all(), window
            ends = {
                b: max(first - window + 1, 0) // block_size * block_size for b, first, _ in spans
            }
            garbage = with_garbage_before(paged, rng, ends)
            assert sum(ends.values()) > 0, window
            assert np.array_equal(paged.emulated(lib, spans, garbage, window=window), got), window
