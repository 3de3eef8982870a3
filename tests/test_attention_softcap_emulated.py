"""Gemma 2's attention logit soft-capping (paged_attention_ref's `softcap`): with a cap
c > 0 each score, already scaled, becomes c * tanh(s / c) before the mask and the softmax,
as attention.py's softcap_scores defines it in fp32 (r = fp32(1 / c); c * tanh(s * r),
each product rounded).

The twin against float64 capped attention (a cap of 50 on loud queries, and one of 2
that binds on every score), with and without a sliding window, and its bits still
independent of the batch and the chunking. Both kernels in the emulation (attention.cu,
head_dim 64, 128 and 256; attention_tc.cu, 64 and 128): within BF16 rounding of the twin,
and a query's bits (its fp32 values too, fp32_probe) independent of its batch, its chunk
of the prompt, its path (prefill or decode), the split grid and the ring; the shared-page
build computes the default build's values. Cap 0 is no cap: the bits of a launch that
never set one. The GPU backend's fused layer paths refuse a cap (the layer runs op by op).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
import test_attention_tc_emulated as tc_tests
from test_attention_tc_emulated import shape
from test_cupy_emulated import emulated
from test_decode_block_emulated import SHAPES as TAIL_SHAPES
from test_decode_block_emulated import attention_case, operands
from test_kernels_emulated import (
    SPLIT_CONTEXTS,
    S,
    forced_grid,
    fp32_probe,
    max_row_ulps,
    reversed_ctas,
    warp_schedule,
)
from test_ops import _fill_sequences, rel_l2
from test_sliding_window_emulated import Windowed
from test_sliding_window_tc_emulated import WindowedTc

from reprise.cuda import attention, decode_block_kernel
from reprise.cuda.attention import paged_attention_ref, softcap_scores
from reprise.cuda.attention_kernel import SOFTCAP_RANGE, check_softcap
from reprise.cuda.attention_tc_kernel import ROWS_PER_CTA
from reprise.cuda.dtypes import BF16, F32

# (cap, factor on the queries): 50 (Gemma 2's) on queries 16 times louder (exact in BF16),
# whose scores reach past it; 2, which binds on nearly every score at the model's scale
CAPS = [(50.0, 16), (2.0, 1)]
CAP_IDS = ["cap50-loud", "cap2"]

lib_coop = tc_tests.lib_coop  # the shared-page build (a module fixture: built once here)
__all__ = ["emulated"]  # a fixture, used by name


@pytest.fixture(scope="module")
def lib(emu_lib: ctypes.CDLL) -> Iterator[ctypes.CDLL]:
    emu_lib.set_attention_softcap.argtypes = [ctypes.c_float]
    yield emu_lib
    emu_lib.set_attention_softcap(0.0)


def louder(queries: list[np.ndarray], factor: int) -> list[np.ndarray]:
    """The queries times a power of 2: exact in BF16."""
    return [(q.astype(np.float32) * factor).astype(BF16) for q in queries]


# --- the twin ----------------------------------------------------------------------------


def dense_capped(q, keys, values, q_positions, scale, softcap, window=0):  # float64, causal, GQA
    num_heads, num_kv = q.shape[1], keys.shape[1]
    group = num_heads // num_kv
    out = np.zeros(q.shape)
    key_pos = np.arange(len(keys))[None]
    visible = key_pos <= q_positions[:, None]
    if window:
        visible &= key_pos > q_positions[:, None] - window
    for h in range(num_heads):
        s = q[:, h] @ keys[:, h // group].T * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ values[:, h // group]
    return out


def test_softcap_scores_is_its_fp32_definition() -> None:
    """fp32(c * t), t = tanh(fp32(s * fp32(1 / c))) rounded to fp32, elementwise: the same
    bits for a score whatever array it sits in; odd, bounded by c, the identity near 0."""
    rng = np.random.default_rng(0)
    s = (rng.standard_normal(4099) * 40).astype(F32)
    for c in (50.0, 2.0):
        got = softcap_scores(s, F32.type(c))
        r = F32.type(1.0) / F32.type(c)
        t = np.array([np.tanh(np.float64(F32.type(x * r))) for x in s]).astype(F32)
        assert got.dtype == F32 and np.array_equal(got, (t * F32.type(c)).astype(F32))
        assert np.array_equal(softcap_scores(s[1:][::2].copy(), F32.type(c)), got[1:][::2])
        assert np.array_equal(softcap_scores(-s, F32.type(c)), -got)
        assert np.all(np.abs(got) <= c) and np.abs(got).max() > 0.99 * c
    tiny = np.array([1e-3, -2e-4], F32)
    assert np.allclose(softcap_scores(tiny, F32.type(50.0)), tiny, rtol=1e-6)


@pytest.mark.parametrize(("softcap", "factor"), CAPS, ids=CAP_IDS)
@pytest.mark.parametrize(("block_size", "window"), [(16, 0), (64, S + 1)])
def test_capped_twin_matches_dense_float64(
    rng: np.random.Generator, block_size: int, softcap: float, factor: int, window: int
) -> None:
    """Decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys, a prefill over 2S + 5 keys and a
    chunk of 40 queries ending at 3S + 2: within 1 % (relative L2) of float64 capped
    attention, and far from uncapped attention (the cap binds)."""
    specs = [(1, 1), (S - 1, 1), (S, 1), (S + 1, 1), (3 * S + 7, 1), (2 * S + 5, 2 * S + 5),
             (3 * S + 2, 40)]  # fmt: skip
    cache, block_tables, keys, values, qs = _fill_sequences(rng, block_size, specs)
    qs = louder(qs, factor)
    scale = 1 / np.sqrt(32)
    q = np.concatenate(qs)
    starts = np.cumsum([0] + [ql for _, ql in specs]).astype(np.int32)
    seq_lens = np.array([s for s, _ in specs], dtype=np.int32)
    out = paged_attention_ref(q, cache, 1, block_tables, seq_lens, starts, scale, window, softcap)
    for b, (seq_len, q_len) in enumerate(specs):
        args = (qs[b].astype(np.float64), keys[b].astype(np.float64),
                values[b].astype(np.float64), np.arange(seq_len - q_len, seq_len), scale)  # fmt: skip
        got = out[starts[b] : starts[b + 1]]
        assert rel_l2(got, dense_capped(*args, softcap, window)) < 1e-2, b
        if seq_len > 1 and (window == 0 or window > 1):
            assert rel_l2(got, dense_capped(*args, 0.0, window)) > 0.1, b  # the cap binds


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """KV_CHUNK of 32 keys, so that short sequences span many chunks."""
    monkeypatch.setattr(attention, "KV_CHUNK", 32)
    return 32


def test_capped_twin_query_is_independent_of_its_batch_and_chunking(
    rng: np.random.Generator, small_chunks: int
) -> None:
    """Under a cap (and a window), a batch of decodes and whole and partial prefills against
    each span alone, its prompt in chunks of 7 and each last row as a decode step, over
    many KV chunks; cap 0 gives the bits of a call without the argument."""
    seq_lens = [int(n) for n in rng.integers(1, 6 * small_chunks, size=5)]
    cache, block_tables, _, _, qs = _fill_sequences(rng, 16, [(n, n) for n in seq_lens])
    qs = louder(qs, 8)
    firsts = [int(rng.choice([0, n - 1, rng.integers(0, n)])) for n in seq_lens]
    spans = [(b, first, n) for b, (first, n) in enumerate(zip(firsts, seq_lens, strict=True))]

    def run(spans: list[tuple[int, int, int]], *cap: float, window: int = 40) -> np.ndarray:
        lens = [last - first for _, first, last in spans]
        q = np.concatenate([qs[b][first:last] for b, first, last in spans])
        return paged_attention_ref(q, cache, 1, block_tables[[b for b, _, _ in spans]],
                                   np.array([n for _, _, n in spans], np.int32),
                                   np.cumsum([0, *lens]).astype(np.int32), 0.125, window, *cap)  # fmt: skip

    batched = run(spans, 50.0)
    assert np.array_equal(run(spans, 0.0).view(np.uint16), run(spans).view(np.uint16))
    assert not np.array_equal(batched.view(np.uint16), run(spans).view(np.uint16))
    starts = np.cumsum([0] + [last - first for _, first, last in spans])
    for i, (b, first, last) in enumerate(spans):
        want = batched[starts[i] : starts[i + 1]].view(np.uint16)
        assert np.array_equal(run([(b, first, last)], 50.0).view(np.uint16), want), b
        pieces = [run([(b, s, min(s + 7, last))], 50.0) for s in range(first, last, 7)]
        assert np.array_equal(np.concatenate(pieces).view(np.uint16), want), b
        assert np.array_equal(run([(b, last - 1, last)], 50.0).view(np.uint16), want[-1:]), b


# --- attention.cu --------------------------------------------------------------------------


class Capped(Windowed):
    """Windowed's sequences under a soft cap: the kernel's set by the emulation's
    set_attention_softcap (the launch's last argument), the twin's `softcap`."""

    def emulated(self, lib: ctypes.CDLL, spans: list[tuple[int, int, int]], cache=None,
                 grid=None, *, window: int = 0, softcap: float = 0.0) -> np.ndarray:  # fmt: skip
        lib.set_attention_softcap(softcap)
        try:
            return super().emulated(lib, spans, cache, grid, window=window)
        finally:
            lib.set_attention_softcap(0.0)

    def twin(self, spans: list[tuple[int, int, int]], *, window: int = 0,
             softcap: float = 0.0) -> np.ndarray:  # fmt: skip
        q, tables, seq_lens, starts = self.inputs(spans)
        scale = 1 / np.sqrt(self.head_dim)
        return paged_attention_ref(q, self.cache, 1, tables, seq_lens, starts, scale, window,
                                   softcap)  # fmt: skip


# decode steps at SPLIT_CONTEXTS, a prefill chunk of 40 queries ending at 3S + 2 and a whole
# prefill over 70 keys: batch 7
CONTEXTS = [*SPLIT_CONTEXTS, 3 * S + 2, 70]
SPANS = [*((b, n - 1, n) for b, n in enumerate(SPLIT_CONTEXTS)), (5, 3 * S - 38, 3 * S + 2),
         (6, 0, 70)]  # fmt: skip
STARTS = np.cumsum([0] + [last - first for _, first, last in SPANS])


@pytest.mark.kernels
@pytest.mark.parametrize(("softcap", "factor"), CAPS, ids=CAP_IDS)
@pytest.mark.parametrize(
    ("shape_", "block_size"), [((4, 1, 64), 16), ((6, 2, 128), 64), ((4, 2, 256), 32)]
)
def test_capped_attention_matches_its_twin_alone_and_batched(
    lib: ctypes.CDLL, rng: np.random.Generator, shape_: tuple[int, int, int], block_size: int,
    softcap: float, factor: int,
) -> None:  # fmt: skip
    """Decode steps (split), a prefill chunk with garbage and NaN past it and a whole
    prefill in one launch, without a window and with one of 17: within BF16 rounding of
    the capped twin and far from the uncapped one; each span alone gives the batch's bits
    (cap 2, no window). Cap 0 after a capped launch gives the bits of the launch before any
    cap was set."""
    paged = Capped(rng, shape_, block_size, CONTEXTS)
    paged.queries = louder(paged.queries, factor)
    cache = paged.with_garbage_after(rng, 5, 3 * S + 2)
    plain = paged.emulated(lib, SPANS, cache)
    for window in (0, 17):
        cap = {"window": window, "softcap": softcap}
        batched = paged.emulated(lib, SPANS, cache, **cap)
        assert max_row_ulps(batched.view(BF16), paged.twin(SPANS, **cap)) <= 2
        assert max_row_ulps(batched.view(BF16), paged.twin(SPANS, window=window)) > 8  # it binds
        if window or factor != 1:  # each span alone: once a shape
            continue
        for i, span in enumerate(SPANS):
            alone = paged.emulated(lib, [span], cache, softcap=softcap)
            assert np.array_equal(alone, batched[STARTS[i] : STARTS[i + 1]]), span
    assert np.array_equal(paged.emulated(lib, SPANS, cache, softcap=0.0), plain)


@pytest.mark.kernels
@pytest.mark.parametrize(
    ("shape_", "block_size"), [((4, 1, 64), 16), ((6, 2, 128), 32), ((4, 2, 256), 64)]
)
def test_capped_split_decode_gives_the_same_values_on_every_grid(
    lib: ctypes.CDLL, rng: np.random.Generator, shape_: tuple[int, int, int], block_size: int
) -> None:
    """Decode steps at SPLIT_CONTEXTS and two random lengths under a cap of 2, with no
    window and one of S + 1: the same fp32 values (fp32_probe) on split_grid's grid, one
    lane, other lane and head-part counts, the CTAs run last to first and each row alone."""
    others = [int(n) for n in rng.integers(2, 2 * S, size=2)]
    paged = Capped(rng, shape_, block_size, [*SPLIT_CONTEXTS, *others])
    spans = [(b, len(q) - 1, len(q)) for b, q in enumerate(paged.queries)]
    heads, kv_heads, _ = shape_
    group = heads // kv_heads
    for window in (0, S + 1):
        got = paged.emulated(lib, spans, window=window, softcap=2.0)
        assert max_row_ulps(got.view(BF16), paged.twin(spans, window=window, softcap=2.0)) <= 2
        with fp32_probe(lib):
            want = paged.emulated(lib, spans, window=window, softcap=2.0)
            assert len(np.unique(want)) > 100
            for parts, lanes in [(1, 1), (1, 2), (group, 3), (group, 8)]:
                grid = forced_grid(7, 7, kv_heads, group, parts, lanes)
                got = paged.emulated(lib, spans, grid=grid, window=window, softcap=2.0)
                assert np.array_equal(got, want), (window, parts, lanes)
            with reversed_ctas(lib):
                got = paged.emulated(lib, spans, window=window, softcap=2.0)
                assert np.array_equal(got, want), (window, "reversed")
            for i, span in enumerate(spans):
                got = paged.emulated(lib, [span], window=window, softcap=2.0)
                assert np.array_equal(got, want[i : i + 1]), (window, span)


@pytest.mark.kernels
@pytest.mark.parametrize(("shape_", "block_size"), [((4, 1, 64), 16), ((2, 1, 256), 64)])
def test_capped_prefill_rows_equal_their_decode_steps(
    lib: ctypes.CDLL, rng: np.random.Generator, shape_: tuple[int, int, int], block_size: int
) -> None:
    """A prompt over S + 40 keys under a cap of 50 (loud queries), with no window and one
    of 40: its whole prefill within BF16 rounding of the twin; the same fp32 values on one
    lane and split_grid's grid, in prefill chunks of 48 (garbage past each) and as decode
    steps (split) around the page and chunk boundaries."""
    seq_len = S + 40
    paged = Capped(rng, shape_, block_size, [seq_len])
    paged.queries = louder(paged.queries, 16)
    whole_span = (0, 0, seq_len)
    heads, kv_heads, _ = shape_
    one_lane = forced_grid(seq_len, 1, kv_heads, heads // kv_heads, 1, 1)
    for window in (0, 40):
        cap = {"window": window, "softcap": 50.0}
        got = paged.emulated(lib, [whole_span], **cap)
        assert max_row_ulps(got.view(BF16), paged.twin([whole_span], **cap)) <= 2
        with fp32_probe(lib):
            whole = paged.emulated(lib, [whole_span], **cap)
            assert np.array_equal(paged.emulated(lib, [whole_span], grid=one_lane, **cap), whole)
            pieces = []
            for first in range(0, seq_len, 48):
                last = min(first + 48, seq_len)
                garbage = paged.with_garbage_after(rng, 0, last)
                pieces.append(paged.emulated(lib, [(0, first, last)], garbage, **cap))
            assert np.array_equal(np.concatenate(pieces), whole), window
            for pos in (0, block_size, S - 1, S, S + window, seq_len - 1):
                garbage = paged.with_garbage_after(rng, 0, pos + 1)
                step = paged.emulated(lib, [(0, pos, pos + 1)], garbage, **cap)
                assert np.array_equal(step, whole[pos : pos + 1]), (window, pos)


# --- attention_tc.cu -----------------------------------------------------------------------


class CappedTc(WindowedTc):
    """WindowedTc's sequences under a soft cap (set_attention_softcap; the twin's)."""

    def run(self, lib: ctypes.CDLL, spans: list[tuple[int, int, int]], cache=None, grid=None,
            deep: bool | None = None, *, window: int = 0, softcap: float = 0.0) -> np.ndarray:  # fmt: skip
        lib.set_attention_softcap(softcap)
        try:
            return super().run(lib, spans, cache, grid, deep, window=window)
        finally:
            lib.set_attention_softcap(0.0)

    def twin(self, spans: list[tuple[int, int, int]], window: int = 0,
             softcap: float = 0.0) -> np.ndarray:  # fmt: skip
        q, tables, seq_lens, starts = self.inputs(spans)
        scale = 1 / np.sqrt(self.head_dim)
        return paged_attention_ref(q, self.cache, 1, tables, seq_lens, starts, scale, window,
                                   softcap)  # fmt: skip


@pytest.mark.kernels
@pytest.mark.parametrize(("softcap", "factor"), CAPS, ids=CAP_IDS)
@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 64), (128, 1, 32)]
)
def test_capped_tc_matches_its_twin(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int,
    softcap: float, factor: int,
) -> None:  # fmt: skip
    """Decode steps (split, the deep ring), a prefill chunk with garbage and NaN past it and
    a whole prefill in one launch, without a window and with one of S + 1: within BF16
    rounding of the capped twin and far from the uncapped one; the same bits on one lane
    (merged in shared memory, the normal ring); each span alone gives the batch's bits (cap
    2, no window). Cap 0 after a capped launch gives the bits of the launch before any cap
    was set."""
    paged = CappedTc(rng, shape(head_dim, group, 2), block_size, CONTEXTS)
    paged.queries = louder(paged.queries, factor)
    cache = paged.with_garbage_after(rng, 5, 3 * S + 2)
    one_lane = forced_grid(int(STARTS[-1]), len(SPANS), 2, group, 1, 1, ROWS_PER_CTA)
    assert paged.planned_grid(SPANS).splits
    plain = paged.run(lib, SPANS, cache)
    for window in (0, S + 1):
        cap = {"window": window, "softcap": softcap}
        batched = paged.run(lib, SPANS, cache, **cap)
        assert max_row_ulps(batched.view(BF16), paged.twin(SPANS, **cap)) <= 2
        assert max_row_ulps(batched.view(BF16), paged.twin(SPANS, window)) > 8  # it binds
        assert np.array_equal(paged.run(lib, SPANS, cache, grid=one_lane, **cap), batched)
        if window or factor != 1:  # each span alone: once a shape
            continue
        for i, span in enumerate(SPANS):
            alone = paged.run(lib, [span], cache, **cap)
            assert np.array_equal(alone, batched[STARTS[i] : STARTS[i + 1]]), span
    assert np.array_equal(paged.run(lib, SPANS, cache, softcap=0.0), plain)


@pytest.mark.kernels
@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 4, 16), (128, 3, 32)])
def test_capped_tc_split_gives_the_same_values_on_every_grid_and_ring(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int
) -> None:
    """Decode steps at SPLIT_CONTEXTS and two random lengths under a cap of 2, with no
    window and one of 17: the same fp32 values (fp32_probe) on split_grid's grid (the deep
    ring), the normal ring on it, one lane, other lane and head-part counts, the CTAs run
    last to first, one warp at a time ahead of the rest, and each row alone."""
    contexts = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    paged = CappedTc(rng, shape(head_dim, group, 1), block_size, contexts)
    decode = [(b, n - 1, n) for b, n in enumerate(contexts)]
    for window in (0, 17):
        cap = {"window": window, "softcap": 2.0}
        got = paged.run(lib, decode, **cap)
        assert max_row_ulps(got.view(BF16), paged.twin(decode, **cap)) <= 2
        with fp32_probe(lib):
            want = paged.run(lib, decode, **cap)
            assert np.array_equal(paged.run(lib, decode, deep=False, **cap), want), window
            for parts, lanes in [(1, 1), (1, 2), (group, 3), (group, 8)]:
                grid = forced_grid(7, 7, 1, group, parts, lanes, ROWS_PER_CTA)
                got = paged.run(lib, decode, grid=grid, **cap)
                assert np.array_equal(got, want), (window, parts, lanes)
            with reversed_ctas(lib):
                assert np.array_equal(paged.run(lib, decode, **cap), want), window
            with warp_schedule(lib, 2):
                assert np.array_equal(paged.run(lib, decode, **cap), want), window
            for i, span in enumerate(decode):
                got = paged.run(lib, [span], **cap)
                assert np.array_equal(got, want[i : i + 1]), (window, span)


@pytest.mark.kernels
@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 64)])
def test_capped_tc_query_is_independent_of_its_chunk_and_path(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int
) -> None:
    """A prompt over S + 40 keys under a cap of 50 (loud queries), with no window and one
    of 40: its whole prefill within BF16 rounding of the twin; the same fp32 values on one
    lane and split, in prefill chunks of 33 (garbage past each), as decode steps (split)
    around the page and chunk boundaries, and as a partial prefill batched behind a decode
    step and a whole prefill."""
    seq_len = S + 40
    others = [int(n) for n in rng.integers(1, 2 * block_size, size=2)]
    paged = CappedTc(rng, shape(head_dim, group, 1), block_size, [seq_len, *others])
    paged.queries = louder(paged.queries, 16)
    whole_span = [(0, 0, seq_len)]
    one_lane = forced_grid(seq_len, 1, 1, group, 1, 1, ROWS_PER_CTA)
    for window in (0, 40):
        cap = {"window": window, "softcap": 50.0}
        got = paged.run(lib, whole_span, **cap)
        assert max_row_ulps(got.view(BF16), paged.twin(whole_span, **cap)) <= 2
        with fp32_probe(lib):
            whole = paged.run(lib, whole_span, grid=one_lane, **cap)
            assert np.array_equal(paged.run(lib, whole_span, **cap), whole), window
            pieces = []
            for first in range(0, seq_len, 33):
                last = min(first + 33, seq_len)
                cache = paged.with_garbage_after(rng, 0, last)
                pieces.append(paged.run(lib, [(0, first, last)], cache, **cap))
            assert np.array_equal(np.concatenate(pieces), whole), window
            for pos in (0, block_size - 1, block_size, S - 1, S, S + window, seq_len - 1):
                cache = paged.with_garbage_after(rng, 0, pos + 1)
                step = paged.run(lib, [(0, pos, pos + 1)], cache, **cap)
                assert np.array_equal(step, whole[pos : pos + 1]), (window, pos)
            first = int(rng.integers(1, seq_len))
            spans = [(1, others[0] - 1, others[0]), (2, 0, others[1]), (0, first, seq_len)]
            batched = paged.run(lib, spans, **cap)
            assert np.array_equal(batched[-(seq_len - first) :], whole[first:]), window


@pytest.mark.kernels
def test_capped_tc_shared_page_gives_the_bits_of_one_warp(
    lib: ctypes.CDLL, lib_coop: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """The shared-page build (REPRISE_ATTN_COOP) under caps of 2 and 50 (loud queries), no
    window and one of 17: decode steps on split grids (the deep ring, all four warps on a
    page) give the default build's fp32 values; the shared page does run."""
    lib_coop.set_attention_softcap.argtypes = [ctypes.c_float]
    group = 4
    contexts = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    paged = CappedTc(rng, shape(64, group, 2), 16, contexts)
    quiet = paged.queries
    decode = [(b, n - 1, n) for b, n in enumerate(contexts)]
    runs = [(CAPS[0], 0, (1, 2)), (CAPS[1], 17, (group, 3))]  # (cap, loudness), window, grid
    for (softcap, factor), window, (parts, lanes) in runs:
        paged.queries = louder(quiet, factor)
        grid = forced_grid(7, 7, 2, group, parts, lanes, ROWS_PER_CTA)
        cap = {"window": window, "softcap": softcap}
        with fp32_probe(lib), fp32_probe(lib_coop):
            want = paged.run(lib, decode, grid=grid, deep=True, **cap)
            lib_coop.emu_mma_past_warp0()
            got = paged.run(lib_coop, decode, grid=grid, deep=True, **cap)
            assert lib_coop.emu_mma_past_warp0() > 0  # the shared page ran
        assert np.array_equal(got, want), (softcap, window)
        got = paged.run(lib_coop, decode, grid=grid, deep=True, **cap)
        assert max_row_ulps(got.view(BF16), paged.twin(decode, **cap)) <= 2


# --- the launchers and the GPU backend -----------------------------------------------------


def test_the_launchers_take_a_cap_of_zero_or_a_normal_number() -> None:
    """0 (no cap), or c from 2^-64 to 2^64 (c, 1 / c and the cap's products stay normal
    fp32 numbers); anything else is refused, naming it."""
    low, high = SOFTCAP_RANGE
    for good in (0, 0.0, 50.0, np.float32(2.0), low, high):
        check_softcap(good)
    for bad in (-1.0, float("nan"), float("inf"), low / 2, high * 2, "50", None):
        with pytest.raises(ValueError, match="softcap"):
            check_softcap(bad)  # type: ignore[arg-type]


@pytest.mark.kernels
def test_a_capped_layer_runs_op_by_op_on_the_gpu_backend(
    emulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the emulated CuPy, with the persistent layer on: a layer whose attention tuple
    holds a cap (9 entries: ..., window, softcap) is not planned for decode_block.cu (whose
    attention runs no cap), so attention_tail and attention_layers launch the capped
    attention, then the tail's ops, and launch no persistent layer: the bits of
    paged_attention(*attention) then decode_tail, the attention within BF16 rounding of the
    NumPy backend's (its twin with the cap). decode_layer refuses a capped attention even
    when handed a plan."""
    from reprise.cuda.backend import NumpyBackend
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host

    monkeypatch.setattr(decode_block_kernel, "BY_DEFAULT", True)
    monkeypatch.setattr(decode_block_kernel, "_num_sms", lambda device: 16)
    launched: list[str] = []  # the persistent launches' entry points
    launch = decode_block_kernel._launch
    monkeypatch.setattr(decode_block_kernel, "_launch",
                        lambda name, *args: launched.append(name) or launch(name, *args))  # fmt: skip
    rng = np.random.default_rng(11)
    q_size, hidden, inter = TAIL_SHAPES["emulated"]
    case = attention_case(rng, [300, 37, 700])
    d = operands(rng, 3, q_size, hidden, inter)
    q = louder([case["q"]], 16)[0]
    host_attention = (q, case["cache"], case["layer"], case["block_tables"], case["seq_lens"],
                      case["query_start_loc"], case["scale"], 0, 50.0)  # fmt: skip
    attention = tuple(to_device(x) if isinstance(x, np.ndarray) else x for x in host_attention)
    tail = (*(to_device(d[k]) for k in ("w_o", "w_gate_up", "w_down", "residual", "mlp_norm",
                                        "next_norm")), 1e-5)  # fmt: skip
    ops = CupyBackend(attention="tensor-cores")
    plan = ops._layer_plan(attention[:8], tail)
    assert plan is not None  # without the cap, the layer would run in one persistent launch
    assert ops._layer_plan(attention, tail) is None

    summed, normed = ops.attention_tail(attention, tail)
    layers = [(*tail[:3], *tail[4:6], None)]
    rope = (None, None, None, attention[1], None, 6)  # no head: unused
    summed_l, normed_l = ops.attention_layers(attention, layers, tail[3], 1e-5, rope)
    assert not [name for name in launched if name.startswith("decode_layer")], launched
    attn = ops.paged_attention(*attention)
    want = ops.decode_tail(attn.reshape(3, -1), *tail)
    for got in ((summed, normed), (summed_l, normed_l)):
        assert np.array_equal(to_host(got[0], bf16=False), to_host(want[0], bf16=False))
        assert np.array_equal(to_host(got[1]).view(np.uint16), to_host(want[1]).view(np.uint16))
    twin, uncapped = (
        NumpyBackend().paged_attention(*a) for a in (host_attention, host_attention[:8])
    )
    assert max_row_ulps(to_host(attn).view(BF16), twin) <= 2
    assert max_row_ulps(to_host(attn).view(BF16), uncapped) > 8  # the cap binds
    capped = decode_block_kernel.Attention(*attention)
    with pytest.raises(ValueError, match="soft cap"):
        decode_block_kernel.decode_layer(capped, *tail, plan=plan)
    assert not [name for name in launched if name.startswith("decode_layer")], launched
