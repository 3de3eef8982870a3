"""Sliding-window attention in the tensor-core kernel (cuda/attention_tc.cu), emulated on
the CPU as in test_attention_tc_emulated.py, against its twin with the same window
(paged_attention_ref's `window`: the query at p sees keys p - window + 1 to p).

The KV chunks keep their fixed boundaries; a row skips the pages and chunks it sees no
key of (its state in a chunk stays m = -inf, denom = acc = 0 until the first page it
sees: no NaN from the pages before its window), and takes the chunk holding its first
visible key as its first. Here: the kernel is within BF16 rounding of the twin at windows
around the page and chunk sizes, on decode steps, whole prefills and prefill chunks; and
a query's bits still depend on nothing but its own keys: not its batch, its chunk of the
prompt, its path (prefill or decode), the launch's grid (lanes with no chunk a row sees
included), the ring's depth, the shared page, or the order CTAs and warps run in. A
window no shorter than the sequence changes no bit, and a shorter one does.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import test_attention_tc_emulated as tc_tests
from test_attention_tc_emulated import PagedTc, shape
from test_kernels_emulated import (
    SPLIT_CONTEXTS,
    S,
    forced_grid,
    fp32_probe,
    max_row_ulps,
    reversed_ctas,
    warp_schedule,
)

from reprise.cuda.attention import paged_attention_ref
from reprise.cuda.attention_kernel import SplitGrid
from reprise.cuda.attention_tc_kernel import ROWS_PER_CTA
from reprise.cuda.dtypes import BF16

pytestmark = pytest.mark.kernels

# the emulation builds test_attention_tc_emulated.py takes (module fixtures: built once here)
lib = tc_tests.lib
lib_coop = tc_tests.lib_coop
lib_chunk64 = tc_tests.lib_chunk64
lib_expf = tc_tests.lib_expf
lib_exp_select = tc_tests.lib_exp_select

# around a page (16), and around a KV chunk (S)
WINDOWS = [1, 15, 16, 17, S - 1, S, S + 1, 2 * S + 3]
# decode steps at SPLIT_CONTEXTS, a prefill chunk of 40 queries ending at 3S + 2 and a
# whole prefill over S + 1 keys: batch 7
CONTEXTS = [*SPLIT_CONTEXTS, 3 * S + 2, S + 1]
SPANS = [*((b, n - 1, n) for b, n in enumerate(SPLIT_CONTEXTS)), (5, 3 * S - 38, 3 * S + 2),
         (6, 0, S + 1)]  # fmt: skip


class WindowedTc(PagedTc):
    """PagedTc's sequences run with a sliding window: the kernel's through the emulation's
    set_attention_window (the launch's last argument), the twin's with the same window."""

    def run(self, lib: ctypes.CDLL, spans: list[tuple[int, int, int]],
            cache: np.ndarray | None = None, grid: SplitGrid | None = None,
            deep: bool | None = None, reads: list[int] | None = None, *,
            window: int = 0) -> np.ndarray:  # fmt: skip
        lib.set_attention_window(window)
        try:
            return super().run(lib, spans, cache, grid, deep, reads)
        finally:
            lib.set_attention_window(0)

    def twin(self, spans: list[tuple[int, int, int]], window: int = 0) -> np.ndarray:
        q, tables, seq_lens, starts = self.inputs(spans)
        scale = 1 / np.sqrt(self.head_dim)
        return paged_attention_ref(q, self.cache, 1, tables, seq_lens, starts, scale, window)


def rows_of(spans: list[tuple[int, int, int]]) -> list[slice]:
    """Each span's rows of a launch's output."""
    ends = np.cumsum([0] + [last - first for _, first, last in spans])
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(ends)]


@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 64), (128, 1, 32)]
)
def test_windowed_tc_matches_its_twin(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int
) -> None:
    """Decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys, a prefill chunk of 40 queries
    ending at 3S + 2 (split) and a whole prefill over S + 1 keys in one launch, at each
    window: every element written, no NaN from the stale slots, within BF16 rounding of the
    twin, and the same bits on one lane (merged in shared memory) as on split_grid's grid
    (through the workspace); and, at windows of 17 and S + 1, each span alone (batch 1)
    gives the batch's bits."""
    paged = WindowedTc(rng, shape(head_dim, group, 2), block_size, CONTEXTS)
    num_tokens = sum(last - first for _, first, last in SPANS)
    one_lane = forced_grid(num_tokens, len(SPANS), 2, group, 1, 1, ROWS_PER_CTA)
    assert paged.planned_grid(SPANS).splits
    for window in WINDOWS:
        batched = paged.run(lib, SPANS, window=window)
        assert max_row_ulps(batched.view(BF16), paged.twin(SPANS, window)) <= 2, window
        assert np.array_equal(paged.run(lib, SPANS, grid=one_lane, window=window), batched)
        if window not in (17, S + 1):
            continue
        for span, at in zip(SPANS, rows_of(SPANS), strict=True):
            alone = paged.run(lib, [span], window=window)
            assert np.array_equal(alone, batched[at]), (window, span)


@pytest.mark.parametrize("window", [17, S + 1])
@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 64)])
def test_windowed_tc_query_is_independent_of_its_chunk_and_path(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int,
    window: int,
) -> None:  # fmt: skip
    """A prompt over 2S + 5 keys: its whole prefill within BF16 rounding of the twin; its
    bits and fp32 values the same on one lane and split, in prefill chunks of 33 (garbage
    and NaN past each), as decode steps (split) on both sides of the positions whose
    windows start at the first page and chunk boundaries, its last token included, and as
    a partial prefill batched behind a decode step and a whole prefill."""
    seq_len = 2 * S + 5
    others = [int(n) for n in rng.integers(1, 2 * block_size, size=2)]
    paged = WindowedTc(rng, shape(head_dim, group, 1), block_size, [seq_len, *others])
    whole_span = [(0, 0, seq_len)]
    one_lane = forced_grid(seq_len, 1, 1, group, 1, 1, ROWS_PER_CTA)
    got = paged.run(lib, whole_span, grid=one_lane, window=window)
    assert max_row_ulps(got.view(BF16), paged.twin(whole_span, window)) <= 2
    edges = {0, block_size - 1, block_size, seq_len - 1}
    for boundary in (block_size, S, 2 * S):  # windows starting just before and at it
        edges |= {pos for pos in (boundary + window - 2, boundary + window - 1) if pos < seq_len}
    for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
        with fp32_probe(lib, probe):
            whole = paged.run(lib, whole_span, grid=one_lane, window=window)
            assert np.array_equal(paged.run(lib, whole_span, window=window), whole), probe
            pieces = []
            for first in range(0, seq_len, 33):
                last = min(first + 33, seq_len)
                cache = paged.with_garbage_after(rng, 0, last)
                pieces.append(paged.run(lib, [(0, first, last)], cache, window=window))
            assert np.array_equal(np.concatenate(pieces), whole), probe
            for pos in sorted(edges):
                cache = paged.with_garbage_after(rng, 0, pos + 1)
                step = paged.run(lib, [(0, pos, pos + 1)], cache, window=window)
                assert np.array_equal(step, whole[pos : pos + 1]), (probe, "decode", pos)
            first = int(rng.integers(1, seq_len))
            spans = [(1, others[0] - 1, others[0]), (2, 0, others[1]), (0, first, seq_len)]
            batched = paged.run(lib, spans, window=window)
            assert np.array_equal(batched[-(seq_len - first) :], whole[first:]), probe


@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"), [(64, 4, 16), (64, 4, 64), (128, 3, 32)]
)
def test_windowed_tc_split_matches_on_every_grid(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int
) -> None:
    """Decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys and two random lengths (batch 7),
    and a prefill chunk whose rows' windows start in two chunks (some CTAs' rows taking
    different first chunks), with windows of 17 (at 3S + 7 keys, one chunk seen: the lanes
    past it have none) and S + 1: within BF16 rounding of the twin, and the same bits and
    fp32 values on split_grid's grid, one lane (merged in shared memory) and other lane and
    head-part counts (the workspace's counters left zero), with the CTAs run last to first
    or one warp at a time ahead of the rest, and each decode step alone."""
    contexts = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    paged = WindowedTc(rng, shape(head_dim, group, 1), block_size, contexts)
    decode = [(b, n - 1, n) for b, n in enumerate(contexts)]
    prefill = [(4, 3 * S - 38, 3 * S + 2)]  # window S + 1: first visible keys 2S - 38 .. 2S + 1
    grids = [(1, 1), (1, 2), (group, 3), (group, 4)]
    for window in (17, S + 1):
        for spans in (decode, prefill):
            got = paged.run(lib, spans, window=window)
            assert max_row_ulps(got.view(BF16), paged.twin(spans, window)) <= 2, window
        for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
            with fp32_probe(lib, probe):
                for spans in (decode, prefill):
                    want = paged.run(lib, spans, window=window)
                    num_tokens = sum(last - first for _, first, last in spans)
                    for parts, lanes in grids:
                        grid = forced_grid(num_tokens, len(spans), 1, group, parts, lanes,
                                           ROWS_PER_CTA)  # fmt: skip
                        got = paged.run(lib, spans, grid=grid, window=window)
                        assert np.array_equal(got, want), (window, probe, spans, parts, lanes)
                want = paged.run(lib, decode, window=window)
                with reversed_ctas(lib):
                    assert np.array_equal(paged.run(lib, decode, window=window), want), window
                for order in (1, 2):
                    with warp_schedule(lib, order):
                        got = paged.run(lib, decode, window=window)
                        assert np.array_equal(got, want), (window, "warps", order)
                for i, span in enumerate(decode):
                    got = paged.run(lib, [span], window=window)
                    assert np.array_equal(got, want[i : i + 1]), (window, probe, span)


@pytest.mark.parametrize("block_size", [16, 64])
def test_windowed_tc_deep_ring_gives_the_normal_rings_bits(
    lib: ctypes.CDLL, rng: np.random.Generator, block_size: int
) -> None:
    """The deep ring and the normal one compute the same fp32 values (fp32_probe) under a
    window, on split grids of 2 and 3 lanes: decode steps (batch 7) and a prefill chunk
    crossing the 3S boundary."""
    group = 4
    contexts = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    paged = WindowedTc(rng, shape(128, group, 2), block_size, contexts)
    decode = [(b, n - 1, n) for b, n in enumerate(contexts)]
    prefill = [(4, 3 * S - 20, 3 * S + 7)]
    with fp32_probe(lib):
        for window in (17, S + 1):
            for spans in (decode, prefill):
                num_tokens = sum(last - first for _, first, last in spans)
                for parts, lanes in [(1, 2), (group, 3)]:
                    grid = forced_grid(num_tokens, len(spans), 2, group, parts, lanes, ROWS_PER_CTA)
                    want = paged.run(lib, spans, grid=grid, deep=False, window=window)
                    got = paged.run(lib, spans, grid=grid, deep=True, window=window)
                    assert np.array_equal(got, want), (window, spans, parts, lanes)


@pytest.mark.parametrize(("head_dim", "block_size", "group"), [(64, 16, 3), (128, 64, 4)])
def test_windowed_tc_shared_page_gives_the_bits_of_one_warp(
    lib: ctypes.CDLL, lib_coop: ctypes.CDLL, rng: np.random.Generator, head_dim: int,
    block_size: int, group: int,
) -> None:  # fmt: skip
    """The shared-page build (REPRISE_ATTN_COOP) under a window: decode steps on split grids
    (the deep ring, all four warps on a page) and a launch that also holds prefills give
    the default build's fp32 values (fp32_probe); the shared page does run."""
    contexts = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    paged = WindowedTc(rng, shape(head_dim, group, 2), block_size, contexts)
    decode = [(b, n - 1, n) for b, n in enumerate(contexts)]
    mixed = [*decode[:3], (3, 0, contexts[3]), (4, contexts[4] - 5, contexts[4])]
    for window in (17, S + 1):
        for spans, parts, lanes in ((decode, 1, 2), (decode, group, 3), (mixed, 1, 3)):
            num_tokens = sum(last - first for _, first, last in spans)
            grid = forced_grid(num_tokens, len(spans), 2, group, parts, lanes, ROWS_PER_CTA)
            with fp32_probe(lib), fp32_probe(lib_coop):
                want = paged.run(lib, spans, grid=grid, deep=True, window=window)
                lib_coop.emu_mma_past_warp0()
                got = paged.run(lib_coop, spans, grid=grid, deep=True, window=window)
                assert lib_coop.emu_mma_past_warp0() > 0  # the shared page ran
            assert np.array_equal(got, want), (window, len(spans), parts, lanes)
    got = paged.run(lib_coop, decode, window=17)
    assert max_row_ulps(got.view(BF16), paged.twin(decode, 17)) <= 2


@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 32)])
def test_windowed_tc_shorter_chunks_match_their_twin(
    lib_chunk64: ctypes.CDLL, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
    head_dim: int, group: int, block_size: int,
) -> None:  # fmt: skip
    """The 64-key chunk build (REPRISE_KV_CHUNK=64), its launches planned and the twin cut
    at 64 keys, under windows around its chunk: decode steps at 1, C - 1, C, C + 1 and
    3C + 7 keys (split) within BF16 rounding of the twin and bit for bit on one lane and
    other grids; a prefill's rows (split and one lane) bit-equal their decode steps."""
    from reprise.cuda import attention, attention_kernel

    c = 64
    monkeypatch.setattr(attention, "KV_CHUNK", c)
    monkeypatch.setattr(attention_kernel, "KV_CHUNK", c)
    contexts = [1, c - 1, c, c + 1, 3 * c + 7]
    paged = WindowedTc(rng, shape(head_dim, group, 1), block_size, contexts)
    decode = [(b, n - 1, n) for b, n in enumerate(contexts)]
    prefill = (4, 0, 3 * c + 7)
    for window in (17, c - 1, c + 1):
        got = paged.run(lib_chunk64, decode, window=window)
        assert max_row_ulps(got.view(BF16), paged.twin(decode, window)) <= 2, window
        whole = paged.run(lib_chunk64, [prefill], window=window)
        assert max_row_ulps(whole.view(BF16), paged.twin([prefill], window)) <= 2, window
        with fp32_probe(lib_chunk64):
            want = paged.run(lib_chunk64, decode, window=window)
            for parts, lanes in [(1, 1), (1, 2), (group, 3)]:
                grid = forced_grid(5, 5, 1, group, parts, lanes, ROWS_PER_CTA)
                got = paged.run(lib_chunk64, decode, grid=grid, window=window)
                assert np.array_equal(got, want), (window, parts, lanes)
            whole = paged.run(lib_chunk64, [prefill], window=window)
            one_lane = forced_grid(prefill[2], 1, 1, group, 1, 1, ROWS_PER_CTA)
            got = paged.run(lib_chunk64, [prefill], grid=one_lane, window=window)
            assert np.array_equal(got, whole), window
            for pos in (0, c - 1, c, c + window - 1, 2 * c + 1, 3 * c + 6):
                step = paged.run(lib_chunk64, [(4, pos, pos + 1)], window=window)
                assert np.array_equal(step, whole[pos : pos + 1]), (window, pos)


@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 32)])
def test_windowed_tc_exp_builds(
    lib: ctypes.CDLL, lib_expf: ctypes.CDLL, lib_exp_select: ctypes.CDLL,
    rng: np.random.Generator, head_dim: int, group: int, block_size: int,
) -> None:  # fmt: skip
    """Rows whose window starts past a page their CTA runs hold m = -inf through it: no
    exp(-inf - -inf) in either arithmetic. The build with a select around each key's
    exponential (REPRISE_ATTN_EXP_SELECT) computes the default build's fp32 values, and the
    natural-expf build (REPRISE_ATTN_EXPF) is within BF16 rounding of the twin, on decode
    steps (split, the deep ring) and on prefill chunks (one lane and split) whose warps
    hold rows with different first pages and chunks."""
    paged = WindowedTc(rng, shape(head_dim, group, 2), block_size, SPLIT_CONTEXTS)
    cache = paged.with_garbage_after(rng, 4, 3 * S + 7)
    decode = [(b, n - 1, n) for b, n in enumerate(SPLIT_CONTEXTS)]
    span = (4, 3 * S - 40, 3 * S + 7)
    one_lane = forced_grid(span[2] - span[1], 1, 2, group, 1, 1, ROWS_PER_CTA)
    cases = [(decode, None), ([span], None), ([span], one_lane)]
    for window in (1, 17, S + 1):
        for spans, grid in cases:
            with fp32_probe(lib), fp32_probe(lib_exp_select):
                want = paged.run(lib, spans, cache, grid=grid, window=window)
                got = paged.run(lib_exp_select, spans, cache, grid=grid, window=window)
            assert np.array_equal(got, want), (window, spans, grid)
            got = paged.run(lib_expf, spans, cache, grid=grid, window=window)
            assert max_row_ulps(got.view(BF16), paged.twin(spans, window)) <= 2, (window, spans)


def test_a_window_no_shorter_than_the_sequence_changes_no_bit(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """Decode steps, prefill chunks and a whole prefill (split and one lane): a window of
    the longest sequence's length, or longer, gives the launch without one exactly (its
    fp32 values too); a window shorter than a sequence changes that sequence's rows."""
    paged = WindowedTc(rng, shape(64, 3, 2), 16, CONTEXTS)
    longest = max(CONTEXTS)
    one_lane = forced_grid(sum(last - first for _, first, last in SPANS), len(SPANS), 2, 3, 1, 1,
                           ROWS_PER_CTA)  # fmt: skip
    for grid in (None, one_lane):
        with fp32_probe(lib):
            full = paged.run(lib, SPANS, grid=grid)
            for window in (longest, longest + 1, 2**31 - 1):
                got = paged.run(lib, SPANS, grid=grid, window=window)
                assert np.array_equal(got, full), (grid, window)
        full = paged.run(lib, SPANS, grid=grid)
        assert np.array_equal(paged.run(lib, SPANS, grid=grid, window=longest), full), grid
        windowed = paged.run(lib, SPANS, grid=grid, window=S // 2)
        for (_, _, last), at in zip(SPANS, rows_of(SPANS), strict=True):
            bound = last > S // 2  # the window binds the span's last row
            assert np.array_equal(windowed[at], full[at]) != bound, (grid, last)
