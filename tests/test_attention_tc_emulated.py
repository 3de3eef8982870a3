"""The tensor-core paged attention kernel (cuda/attention_tc.cu) on the CPU: compiled
by g++ against tests/kernel_emu (cuda_emu.h: a CTA's threads as host threads;
ptx_emu.h: ldmatrix, ldmatrix.trans, mma and cp.async by the PTX ISA's layouts and
group semantics), compared with its NumPy twin on fresh random inputs, and held to
DESIGN §4 bit for bit: a query's output is the same whether it runs with its whole
prompt, in a prefill chunk of any size (the slots past the chunk holding garbage
and NaN), as a decode step, or batched with other sequences; and whether its launch
takes the deep page ring (the split launches') or the normal one.

This checks the kernel's fragment layouts, masking, the page ring and the
invariance argument; not the tensor cores' arithmetic or the memory model (the
emulated mma sums in fp32 in k order), which tests/test_gpu_attention.py meets
on a device.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest
from conftest import emulation_or_skip
from test_kernels_emulated import (
    SPLIT_CONTEXTS,
    Paged,
    S,
    SplitBuffers,
    forced_grid,
    fp32_probe,
    max_row_ulps,
    poisoned,
    ptr,
    reversed_ctas,
    warp_schedule,
)

from reprise.cuda.attention_kernel import SplitGrid, kv_chunks, split_grid
from reprise.cuda.attention_tc_kernel import ROWS_PER_CTA, kernel_name, launch_variant, smem_bytes
from reprise.cuda.dtypes import BF16

pytestmark = pytest.mark.kernels

HEAD_DIMS = [64, 128]
BLOCK_SIZES = [16, 32, 64]
GROUPS = [1, 3, 4]  # 3: smollm2-135m; 4: Llama-3.1-8B
CHUNKS = [7, 16, 33]  # prefill chunk sizes; decode steps (chunks of 1) apart


@pytest.fixture(scope="module")
def lib(emu_lib: ctypes.CDLL) -> ctypes.CDLL:
    return emu_lib


class PagedTc(Paged):
    """Paged sequences (stale slots holding garbage and NaN) run through attention_tc.cu."""

    def run(self, lib: ctypes.CDLL, spans: list[tuple[int, int, int]],
            cache: np.ndarray | None = None, grid: SplitGrid | None = None,
            deep: bool | None = None, reads: list[int] | None = None) -> np.ndarray:  # fmt: skip
        """The kernel's output for (sequence, first, last) query spans batched in one
        launch, on `grid` (None: split_grid's, as attention_tc_kernel plans it), into a
        poisoned buffer, with a poisoned workspace; the deep ring or not as `deep` says
        (None: as the launcher picks for the grid, launch_variant). With `reads` (a list),
        the queries and the spans' own keys and values (positions first .. last - 1: what
        the kernels just before write) are named unready to the emulation, and `reads`
        gets its counts of reads before the wait: [of those, of other bytes]."""
        q, tables, seq_lens, starts = self.inputs(spans)
        out = poisoned(q.shape)
        grid = self.planned_grid(spans) if grid is None else grid
        if deep is None:
            name, _ = launch_variant(self.head_dim, self.block_size, grid)
            deep = name == kernel_name(self.head_dim, self.block_size, deep=True)
        cache = self.cache if cache is None else cache
        if reads is not None:
            self.name_unready(lib, spans, q, cache)
        with SplitBuffers(q.shape[0], self.heads, self.head_dim, kv_chunks(tables.shape[1],
                          self.block_size)) as (workspace, counters):  # fmt: skip
            rc = lib.run_paged_attention_tc(
                self.head_dim, self.block_size, int(deep), *grid.grid,
                smem_bytes(self.head_dim, self.block_size, deep=deep), ptr(out), ptr(q), ptr(cache),
                ptr(tables), ptr(seq_lens), ptr(starts), ptr(workspace), ptr(counters), q.shape[0],
                len(spans), tables.shape[1], self.heads, self.kv_heads, 2, 1, grid.head_parts,
                grid.kv_lanes, ctypes.c_float(1 / np.sqrt(self.head_dim)),
            )  # fmt: skip
        assert rc == 0, rc
        if reads is not None:
            counts = np.zeros(2, np.uint64)
            lib.emu_unready_reads(ptr(counts))
            lib.set_unready(None, ctypes.c_ulonglong(0))
            reads[:] = counts.tolist()
        return out

    def name_unready(self, lib: ctypes.CDLL, spans: list[tuple[int, int, int]], q: np.ndarray,
                     cache: np.ndarray) -> None:  # fmt: skip
        """Name to the emulation (set_unready) the bytes the grid before a decode or
        prefill launch writes: the queries, and each span's keys and values at its own
        positions (layer 1 of the cache: the launches' layer)."""
        lib.set_unready(ptr(q), ctypes.c_ulonglong(q.nbytes))
        row = self.head_dim * cache.itemsize
        for b, first, last in spans:
            for pos in range(first, last):
                block, slot = self.tables[b][pos // self.block_size], pos % self.block_size
                for kv in (0, 1):
                    for head in range(self.kv_heads):
                        at = cache[block, 1, kv, head, slot].ctypes.data
                        lib.set_unready(ctypes.c_void_p(at), ctypes.c_ulonglong(row))

    def planned_grid(self, spans: list[tuple[int, int, int]]) -> SplitGrid:
        """split_grid's geometry for the spans batched in one launch."""
        q, tables, _, _ = self.inputs(spans)
        return split_grid(q.shape[0], len(spans), self.kv_heads, self.heads // self.kv_heads,
                          tables.shape[1], self.block_size, ROWS_PER_CTA)  # fmt: skip


def shape(head_dim: int, group: int, num_kv_heads: int) -> tuple[int, int, int]:
    return group * num_kv_heads, num_kv_heads, head_dim


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_tc_matches_its_twin(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, block_size: int, group: int
) -> None:
    """Decode steps, whole and partial prefills (some longer than a CTA's queries) in
    one launch: every element written, no NaN from the stale slots, and within BF16
    rounding of paged_attention_ref."""
    seq_lens = [1, block_size, 2 * block_size + 1, ROWS_PER_CTA // group + 9]
    seq_lens += [int(n) for n in rng.integers(2, 3 * block_size, size=2)]
    paged = PagedTc(rng, shape(head_dim, group, 2), block_size, seq_lens)
    spans = []
    for b, n in enumerate(seq_lens):
        q_len = [n, 1, n, n, int(rng.integers(1, n + 1)), 1][b]
        spans.append((b, n - q_len, n))
    got = paged.run(lib, spans)
    assert max_row_ulps(got.view(BF16), paged.twin(spans)) <= 2


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_tc_query_is_independent_of_its_batch(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, block_size: int, group: int
) -> None:
    """A query's bits are the same in its whole prefill, in chunks of 7, 16 and 33 with
    garbage past each chunk, as a decode step (a chunk of 1: every position of the
    first page, both sides of each page boundary, the last, and a random sample, to
    keep the emulation fast), and batched after other sequences. The prompt spans
    more pages than the kernel's ring holds."""
    seq_len = max(2 * block_size, 80) + 7
    others = [int(n) for n in rng.integers(1, 2 * block_size, size=2)]
    paged = PagedTc(rng, shape(head_dim, group, 1), block_size, [seq_len, *others])
    whole = paged.run(lib, [(0, 0, seq_len)])
    assert max_row_ulps(whole.view(BF16), paged.twin([(0, 0, seq_len)])) <= 2
    for chunk in CHUNKS:
        pieces = []
        for first in range(0, seq_len, chunk):
            last = min(first + chunk, seq_len)
            cache = paged.with_garbage_after(rng, 0, last)
            pieces.append(paged.run(lib, [(0, first, last)], cache))
        assert np.array_equal(np.concatenate(pieces), whole), chunk
    boundaries = np.arange(block_size, seq_len, block_size)
    decode = {*range(min(block_size, 8)), *boundaries, *(boundaries - 1), seq_len - 1}
    decode |= {int(p) for p in rng.choice(seq_len, 8, replace=False)}
    for pos in sorted(decode):
        step = paged.run(lib, [(0, pos, pos + 1)], paged.with_garbage_after(rng, 0, pos + 1))
        assert np.array_equal(step, whole[pos : pos + 1]), ("decode", pos)
    # behind a decode step and a whole prefill, its own span a partial prefill
    first = int(rng.integers(1, seq_len))
    spans = [(1, others[0] - 1, others[0]), (2, 0, others[1]), (0, first, seq_len)]
    batched = paged.run(lib, spans)
    assert np.array_equal(batched[-(seq_len - first) :], whole[first:])


@pytest.mark.parametrize("deep", [False, True], ids=["normal", "deep"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_tc_needs_exactly_its_shared_memory(
    lib: ctypes.CDLL, head_dim: int, block_size: int, deep: bool
) -> None:
    """The kernel checks its dynamic shared memory against its page ring (a launcher
    drift fails loudly, not by reading past the buffer): each entry point runs with
    smem_bytes and traps with 16 bytes less, so the launcher's num_stages and smem_bytes
    repeat the .cu's ring depths exactly; in a child process, since __trap aborts."""
    smem = smem_bytes(head_dim, block_size, deep=deep)
    lanes = 2 if deep else 1  # the deep ring's kernels run split launches only
    run = tc_launch_script(head_dim, block_size, deep, lanes)
    done = run_in_child(lib, f"print('ran', {run.format(smem=smem)}, flush=True)\n"
                             f"{run.format(smem=smem - 16)}\n")  # fmt: skip
    assert done.stdout == "ran 0\n", (done.stdout, done.stderr)
    assert done.returncode != 0 and "__trap()" in done.stderr, done.stderr


# --- the KV split: contexts around the chunk boundaries (S = KV_CHUNK) ---------------------


@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"), [(64, 4, 16), (64, 4, 64), (128, 3, 32)]
)
def test_attention_tc_split_decode_matches_its_twin_on_every_grid(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int
) -> None:
    """Decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys and two random lengths in one
    launch (split_grid's geometry: through the workspace), within BF16 rounding of the
    twin, and bit for bit the same on every other grid (one lane merging in shared
    memory, other lane and head-part counts), with the CTAs run last to first or one warp
    at a time ahead of the rest, and each row alone (batch 1 against batch 7)."""
    others = [int(n) for n in rng.integers(2, 2 * S, size=2)]
    paged = PagedTc(rng, shape(head_dim, group, 1), block_size, [*SPLIT_CONTEXTS, *others])
    spans = [(b, n - 1, n) for b, n in enumerate([*SPLIT_CONTEXTS, *others])]
    assert split_grid(7, 7, 1, group, max(map(len, paged.tables)), block_size, ROWS_PER_CTA).splits
    batched = paged.run(lib, spans)
    assert max_row_ulps(batched.view(BF16), paged.twin(spans)) <= 2
    for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
        with fp32_probe(lib, probe):
            want = paged.run(lib, spans) if probe else batched
            assert len(np.unique(want)) > 100
            for parts, lanes in [(1, 1), (1, 2), (group, 3), (group, 4)]:
                grid = forced_grid(7, 7, 1, group, parts, lanes, ROWS_PER_CTA)
                assert np.array_equal(paged.run(lib, spans, grid=grid), want), (probe, parts, lanes)
            with reversed_ctas(lib):
                assert np.array_equal(paged.run(lib, spans), want), (probe, "reversed")
            for order in (1, 2):  # one warp at a time ahead of the rest (shared merge state)
                with warp_schedule(lib, order):
                    assert np.array_equal(paged.run(lib, spans), want), (probe, "warps", order)
            for i, span in enumerate(spans):
                assert np.array_equal(paged.run(lib, [span]), want[i : i + 1]), (probe, span)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (128, 4)])
def test_attention_tc_reads_before_its_wait_only_what_no_running_grid_writes(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int
) -> None:
    """Launched as a programmatic dependent, the kernel starts its first pages' copies
    before its wait (pdl_enter): never the queries, nor the keys and values at a span's
    own positions (what rope_kv_write, the kernel before it, writes), even where a page
    starts exactly at a query; decode steps (split launches, the deep ring) and prefill
    chunks (one lane, the normal ring), on split_grid's grid and on one lane. The bits
    are those of the same launch with nothing named."""
    lens = [2 * block_size + 1, 5 * block_size, 3 * S + 7, S + 1, block_size]
    paged = PagedTc(rng, shape(head_dim, group, 1), block_size, lens)
    decode = [(b, n - 1, n) for b, n in enumerate(lens)]
    chunk = [(2, 2 * S - 5, 3 * S + 7), (3, block_size, S + 1)]  # prefill chunks
    early = 0
    for spans in (decode, chunk, decode[:1], decode[1:2]):
        for grid in (None, forced_grid(sum(e - f for _, f, e in spans), len(spans), 1, group, 1,
                                       1, ROWS_PER_CTA)):  # fmt: skip
            reads = [0, 0]
            got = paged.run(lib, spans, grid=grid, reads=reads)
            assert reads[0] == 0, (spans, grid, reads)
            assert np.array_equal(got, paged.run(lib, spans, grid=grid)), (spans, grid)
            early += reads[1]
    assert early > 0  # the copies before the wait happen


@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 32), (128, 4, 64)])
def test_attention_tc_long_decode_merges_across_load_batches_to_the_one_lane_bits(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int
) -> None:
    """The workspace merge reads a row's chunk states kMergeBatch (4) at a time, all loads
    of a batch before its merges (common.cuh, merge_chunks): decode steps at 4S + 1, 6S + 3
    and 9S + 5 keys (5, 7 and 10 chunks: a batch and a part, two and a part) split over 2
    and 3 lanes give the bits of the one-lane launch, which merges each chunk in shared
    memory as its pages end (fp32_probe), and the twin's within BF16 rounding."""
    seq_lens = [4 * S + 1, 6 * S + 3, 9 * S + 5]
    paged = PagedTc(rng, shape(head_dim, group, 1), block_size, seq_lens)
    spans = [(b, n - 1, n) for b, n in enumerate(seq_lens)]
    assert max_row_ulps(paged.run(lib, spans).view(BF16), paged.twin(spans)) <= 2
    with fp32_probe(lib):
        want = paged.run(lib, spans, grid=forced_grid(3, 3, 1, group, 1, 1, ROWS_PER_CTA))
        for lanes in (2, 3):
            grid = forced_grid(3, 3, 1, group, 1, lanes, ROWS_PER_CTA)
            assert np.array_equal(paged.run(lib, spans, grid=grid), want), lanes
        assert np.array_equal(paged.run(lib, spans), want), "split_grid's grid"


@pytest.fixture(scope="module")
def lib_expf(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The emulation with the softmax's exponentials as the accurate expf of natural-unit
    scores, the kernel's softmax before base 2 (REPRISE_ATTN_EXPF=1: bench_gpu_kernels' `tc expf`)."""
    return emulation_or_skip(tmp_path_factory.mktemp("emu_expf"), "-DREPRISE_ATTN_EXPF=1")


@pytest.mark.parametrize("build", ["base2", "expf"])
@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 4, 16), (128, 1, 64)])
def test_attention_tc_split_prefill_rows_equal_their_decode_steps(
    request: pytest.FixtureRequest, lib: ctypes.CDLL, rng: np.random.Generator,
    head_dim: int, group: int, block_size: int, build: str,
) -> None:  # fmt: skip
    """A prompt's rows from a prefill (whole over S + 1 keys, or the chunk crossing the 3S
    boundary with garbage past it; rows of one warp seeing different chunk counts) bit-equal
    the same positions as decode steps (split through the workspace), and match the twin;
    the chunk batched behind decode steps too. The prefills run on split_grid's grid
    (split: merged from the workspace) and on one lane (merged in shared memory, as a
    long prefill's grid is), to the same bits. In the default build (base 2) and in the
    natural-expf one the benchmark times beside it."""
    if build == "expf":
        lib = request.getfixturevalue("lib_expf")
    paged = PagedTc(rng, shape(head_dim, group, 1), block_size, SPLIT_CONTEXTS)
    whole_len, long_len = S + 1, 3 * S + 7
    first = 3 * S - 20
    cache = paged.with_garbage_after(rng, 4, long_len)
    assert max_row_ulps(paged.run(lib, [(3, 0, whole_len)]).view(BF16),
                        paged.twin([(3, 0, whole_len)])) <= 2  # fmt: skip
    assert max_row_ulps(paged.run(lib, [(4, first, long_len)], cache).view(BF16),
                        paged.twin([(4, first, long_len)])) <= 2  # fmt: skip
    for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
        with fp32_probe(lib, probe):
            whole = paged.run(lib, [(3, 0, whole_len)])
            for span, with_cache in (((3, 0, whole_len), None), ((4, first, long_len), cache)):
                one_lane = forced_grid(span[2] - span[1], 1, 1, group, 1, 1, ROWS_PER_CTA)
                assert paged.planned_grid([span]).splits  # so the two grids merge apart
                got = paged.run(lib, [span], with_cache, grid=one_lane)
                assert np.array_equal(got, paged.run(lib, [span], with_cache)), (probe, span)
            for order in (1, 2):  # one warp at a time ahead of the rest
                with warp_schedule(lib, order):
                    assert np.array_equal(paged.run(lib, [(3, 0, whole_len)]), whole), order
            for pos in (0, S - 2, S - 1, S):
                step = paged.run(lib, [(3, pos, pos + 1)])
                assert np.array_equal(step, whole[pos : pos + 1]), (probe, pos)
            chunk = paged.run(lib, [(4, first, long_len)], cache)
            for pos in (first, 3 * S - 1, 3 * S, long_len - 1):
                step = paged.run(
                    lib, [(4, pos, pos + 1)], paged.with_garbage_after(rng, 4, pos + 1)
                )
                assert np.array_equal(step, chunk[pos - first : pos - first + 1]), (probe, pos)
            spans = [(0, 0, 1), (2, S - 1, S), (4, first, long_len)]
            assert np.array_equal(paged.run(lib, spans, cache)[2:], chunk), probe


# --- the deep ring (split launches): the normal ring's bits --------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (128, 4)])
def test_attention_tc_deep_ring_gives_the_normal_rings_bits(
    lib: ctypes.CDLL, rng: np.random.Generator, head_dim: int, group: int, block_size: int
) -> None:
    """The deep ring changes only when pages are copied, so it computes the normal
    ring's fp32 values (fp32_probe: then its BF16 outputs are those too): decode steps
    at 1, S - 1, S, S + 1 and 3S + 7 keys and two random lengths, batch 7 and each alone
    (batch 1), on split_grid's grid (where it splits: the deep kernels run split launches
    only) and other split ones, 2 and 3 lanes (so a lane's ring runs across its chunks'
    ends); a prefill chunk crossing the 3S boundary (rows of several warps seeing
    different chunk counts), split. Within BF16 rounding of the twin."""
    seq_lens = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    paged = PagedTc(rng, shape(head_dim, group, 2), block_size, seq_lens)
    decode = [(b, n - 1, n) for b, n in enumerate(seq_lens)]
    prefill = [(4, 3 * S - 20, 3 * S + 7)]
    for spans in (decode, prefill):
        got = paged.run(lib, spans, deep=True)
        assert max_row_ulps(got.view(BF16), paged.twin(spans)) <= 2
        assert len(np.unique(got)) > 100
    # the spans, and the (head parts, lanes) of the grids besides split_grid's, which
    # splits batch 7 and the prefill chunk but not a short sequence alone (its narrow
    # table holds one chunk); lanes past the last chunk exit at once
    cases = [(decode, [(group, 3), (1, 2)]), (prefill, [(1, 2)])]
    cases += [([span], [(group, 3), (1, 2)]) for span in decode]
    with fp32_probe(lib):
        for spans, forced in cases:
            planned = paged.planned_grid(spans)
            assert planned.splits or len(spans) == 1, planned
            num_tokens = sum(last - first for _, first, last in spans)
            others = [forced_grid(num_tokens, len(spans), 2, group, parts, lanes, ROWS_PER_CTA)
                      for parts, lanes in forced]  # fmt: skip
            for grid in [planned, *others] if planned.splits else others:
                want = paged.run(lib, spans, grid=grid, deep=False)
                got = paged.run(lib, spans, grid=grid, deep=True)
                assert np.array_equal(got, want), (spans, grid)


# --- the builds the benchmark times beside the kernel -------------------------------------


@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 32)])
def test_attention_tc_base2_and_expf_builds_both_match_the_twin_but_not_each_other(
    lib: ctypes.CDLL, lib_expf: ctypes.CDLL, rng: np.random.Generator,
    head_dim: int, group: int, block_size: int,
) -> None:  # fmt: skip
    """The two arithmetics of the softmax (base 2 with ex2.approx, the default; natural
    units with the accurate expf, REPRISE_ATTN_EXPF=1) each give BF16 outputs within
    BF16 rounding of the twin, on decode steps (split) and a prefill (one lane), and
    different fp32 values behind them (fp32_probe): the define reaches the arithmetic."""
    seq_lens = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    paged = PagedTc(rng, shape(head_dim, group, 2), block_size, seq_lens)
    decode = [(b, n - 1, n) for b, n in enumerate(seq_lens)]
    prefill = [(4, 0, 3 * S + 7)]
    one_lane = forced_grid(3 * S + 7, 1, 2, group, 1, 1, ROWS_PER_CTA)
    differ = 0
    for spans, grid in ((decode, None), (prefill, one_lane)):
        outs = [paged.run(build, spans, grid=grid) for build in (lib, lib_expf)]
        for out in outs:
            assert max_row_ulps(out.view(BF16), paged.twin(spans)) <= 2
        with fp32_probe(lib), fp32_probe(lib_expf):
            base2, expf = (paged.run(build, spans, grid=grid) for build in (lib, lib_expf))
        differ += int(np.count_nonzero(base2 != expf))
    assert differ > 0


@pytest.fixture(scope="module")
def lib_exp_select(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The emulation with a select around each key's exponential, as before 2026-11-27
    (REPRISE_ATTN_EXP_SELECT=1; bench_gpu_kernels' `tc sel` takes it with the natural
    expf)."""
    return emulation_or_skip(
        tmp_path_factory.mktemp("emu_exp_select"), "-DREPRISE_ATTN_EXP_SELECT=1"
    )


@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 32), (64, 1, 64)]
)
def test_attention_tc_exp_without_a_select_gives_the_selects_bits(
    lib: ctypes.CDLL, lib_exp_select: ctypes.CDLL, rng: np.random.Generator,
    head_dim: int, group: int, block_size: int,
) -> None:  # fmt: skip
    """A masked key's p is exp(-inf) = +0, the +0 the select gave, and a seen key's the
    same exponential: so both builds compute the same fp32 values (fp32_probe), on decode steps
    at 1, S - 1, S, S + 1 and 3S + 7 keys batched (split, deep ring) and each alone, and
    on prefills, whole and a chunk crossing the 3S boundary with garbage and NaN past it,
    on split_grid's grid and on one lane (the normal ring, rows of one warp seeing
    different keys of a page and different chunks)."""
    seq_lens = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    paged = PagedTc(rng, shape(head_dim, group, 2), block_size, seq_lens)
    cache = paged.with_garbage_after(rng, 4, 3 * S + 7)
    decode = [(b, n - 1, n) for b, n in enumerate(seq_lens)]
    cases = [(decode, None), *(([span], None) for span in decode)]
    for span in [(3, 0, S + 1), (4, 3 * S - 20, 3 * S + 7)]:
        one_lane = forced_grid(span[2] - span[1], 1, 2, group, 1, 1, ROWS_PER_CTA)
        cases += [([span], None), ([span], one_lane)]
    for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
        for spans, grid in cases:
            with fp32_probe(lib, probe), fp32_probe(lib_exp_select, probe):
                got = paged.run(lib, spans, cache, grid=grid)
                want = paged.run(lib_exp_select, spans, cache, grid=grid)
            assert np.array_equal(got, want), (probe, spans, grid)
            if not probe:
                assert max_row_ulps(got.view(BF16), paged.twin(spans)) <= 2



@pytest.fixture(scope="module")
def lib_chunk64(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The emulation with KV chunks of 64 keys (REPRISE_KV_CHUNK=64: bench_gpu_kernels'
    `tc chunk64`)."""
    return emulation_or_skip(tmp_path_factory.mktemp("emu_chunk64"), "-DREPRISE_KV_CHUNK=64")


@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (128, 4, 32)])
def test_attention_tc_shorter_chunks_match_their_twin_and_keep_design_4(
    lib: ctypes.CDLL, lib_chunk64: ctypes.CDLL, rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch, head_dim: int, group: int, block_size: int,
) -> None:  # fmt: skip
    """The build the benchmark times as `tc chunk64`, its launches planned and the twin
    cut at 64 keys (attention.KV_CHUNK and attention_kernel.KV_CHUNK patched): decode
    steps at 1, C - 1, C, C + 1 and 3C + 7 keys (C = 64; split through the workspace)
    within BF16 rounding of the twin, and bit for bit on one lane and on other grids; a
    prefill's rows (crossing 3 chunk boundaries; split and one lane) bit-equal the same
    positions' decode steps; and, past one chunk, other fp32 values than the default
    build under its own 256-key plan (the define reaches the arithmetic)."""
    from reprise.cuda import attention, attention_kernel

    c = 64
    contexts = [1, c - 1, c, c + 1, 3 * c + 7]
    paged = PagedTc(rng, shape(head_dim, group, 1), block_size, contexts)
    decode = [(b, n - 1, n) for b, n in enumerate(contexts)]
    with fp32_probe(lib):
        default = paged.run(lib, decode)
    monkeypatch.setattr(attention, "KV_CHUNK", c)
    monkeypatch.setattr(attention_kernel, "KV_CHUNK", c)
    got = paged.run(lib_chunk64, decode)
    assert max_row_ulps(got.view(BF16), paged.twin(decode)) <= 2
    prefill = (4, 0, 3 * c + 7)
    whole = paged.run(lib_chunk64, [prefill])
    assert max_row_ulps(whole.view(BF16), paged.twin([prefill])) <= 2
    for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
        with fp32_probe(lib_chunk64, probe):
            want = paged.run(lib_chunk64, decode)
            for parts, lanes in [(1, 1), (1, 2), (group, 3)]:
                grid = forced_grid(5, 5, 1, group, parts, lanes, ROWS_PER_CTA)
                assert np.array_equal(paged.run(lib_chunk64, decode, grid=grid), want), (parts, lanes)
            whole = paged.run(lib_chunk64, [prefill])
            one_lane = forced_grid(prefill[2], 1, 1, group, 1, 1, ROWS_PER_CTA)
            assert np.array_equal(paged.run(lib_chunk64, [prefill], grid=one_lane), whole), probe
            for pos in (0, c - 1, c, 2 * c + 1, 3 * c + 6):
                step = paged.run(lib_chunk64, [(4, pos, pos + 1)])
                assert np.array_equal(step, whole[pos : pos + 1]), (probe, pos)
            if probe:
                # 1, c - 1 and c keys are one chunk in either build; c + 1 and 3c + 7 are not
                assert np.array_equal(want[:3], default[:3])
                assert (want[3] != default[3]).any() and (want[4] != default[4]).any()

@pytest.fixture(scope="module")
def lib_coop(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The emulation with the shared page (REPRISE_ATTN_COOP=1: bench_gpu_kernels' `tc coop`,
    the engine's with attention_tc_kernel.COOP)."""
    built = emulation_or_skip(tmp_path_factory.mktemp("emu_coop"), "-DREPRISE_ATTN_COOP=1")
    built.emu_mma_past_warp0.restype = ctypes.c_ulonglong
    return built


@pytest.mark.parametrize(
    ("head_dim", "block_size", "group"),
    [(64, 16, 3), (64, 32, 3), (64, 64, 1), (128, 16, 4), (128, 32, 4), (128, 64, 4)],
)
def test_the_shared_page_gives_the_bits_of_one_warp(
    lib: ctypes.CDLL, lib_coop: ctypes.CDLL, rng: np.random.Generator, head_dim: int,
    block_size: int, group: int,
) -> None:  # fmt: skip
    """The deep kernels built with the shared page (all four warps on each page of a CTA
    whose rows fit one m16 tile): decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys and
    two random lengths on split grids (the deep ring) give the default build's outputs
    bit for bit, and its fp32 values (fp32_probe), under every thread schedule and in
    both CTA orders; the warps past the first do run mma there (none do in the default
    build: warp 0 runs a decode's pages alone); and a launch that also holds a prefill
    (CTAs of more than 16 rows: the default page step in this build too) equals the
    default build's."""
    lib.emu_mma_past_warp0.restype = ctypes.c_ulonglong
    contexts = [*SPLIT_CONTEXTS, *(int(n) for n in rng.integers(2, 2 * S, size=2))]
    kv_heads = 2
    paged = PagedTc(rng, shape(head_dim, group, kv_heads), block_size, contexts)
    decode = [(b, n - 1, n) for b, n in enumerate(contexts)]
    mixed = [*decode[:3], (3, 0, contexts[3]), (4, contexts[4] - 5, contexts[4])]
    grids = [
        forced_grid(len(decode), len(decode), kv_heads, group, 1, 2, ROWS_PER_CTA),
        forced_grid(len(decode), len(decode), kv_heads, group, group, 3, ROWS_PER_CTA),
    ]
    for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
        for grid in grids:
            with fp32_probe(lib, probe):
                lib.emu_mma_past_warp0()
                want = paged.run(lib, decode, grid=grid, deep=True)
                assert lib.emu_mma_past_warp0() == 0  # warp 0 alone in the default build
            with fp32_probe(lib_coop, probe):
                lib_coop.emu_mma_past_warp0()
                got = paged.run(lib_coop, decode, grid=grid, deep=True)
                assert lib_coop.emu_mma_past_warp0() > 0  # the shared page ran
            assert np.array_equal(got, want), (probe, grid)
        with fp32_probe(lib_coop, probe):
            for order in (1, 2):
                with warp_schedule(lib_coop, order):
                    got = paged.run(lib_coop, decode, grid=grids[0], deep=True)
                    assert np.array_equal(got, want), order
            with reversed_ctas(lib_coop):
                assert np.array_equal(paged.run(lib_coop, decode, grid=grids[0], deep=True), want)
    mixed_grid = forced_grid(sum(last - first for _, first, last in mixed), len(mixed), kv_heads,
                             group, 1, 3, ROWS_PER_CTA)  # fmt: skip
    with fp32_probe(lib), fp32_probe(lib_coop):
        want = paged.run(lib, mixed, grid=mixed_grid, deep=True)
        assert np.array_equal(paged.run(lib_coop, mixed, grid=mixed_grid, deep=True), want)
    assert max_row_ulps(paged.run(lib_coop, decode).view(BF16), paged.twin(decode)) <= 2


@pytest.mark.parametrize("ablate", [1, 2], ids=["notail", "nomath"])
def test_the_ablation_builds_leave_out_what_their_rows_say(
    tmp_path_factory: pytest.TempPathFactory, lib: ctypes.CDLL, rng: np.random.Generator,
    ablate: int,
) -> None:  # fmt: skip
    """bench_gpu_kernels' timing-only builds (REPRISE_ATTN_ABLATE): on split decode steps at
    1, S - 1, S, S + 1 and 3S + 7 keys (the deep ring, 3 lanes), `tc notail` (1) writes no
    output at all (every element still poisoned: no fence, count or merge ran) and `tc
    nomath` (2) writes every element but none the default build writes (no page's math ran,
    the merge did); the default build writes every element, within 2 ulps of the twin."""
    built = emulation_or_skip(tmp_path_factory.mktemp(f"emu_ablate{ablate}"),
                              f"-DREPRISE_ATTN_ABLATE={ablate}")  # fmt: skip
    group, kv_heads = 4, 2
    paged = PagedTc(rng, shape(128, group, kv_heads), 32, SPLIT_CONTEXTS)
    decode = [(b, n - 1, n) for b, n in enumerate(SPLIT_CONTEXTS)]
    grid = forced_grid(len(decode), len(decode), kv_heads, group, 1, 3, ROWS_PER_CTA)
    want = paged.run(lib, decode, grid=grid, deep=True)
    assert max_row_ulps(want.view(BF16), paged.twin(decode)) <= 2
    poison = poisoned(want.shape)
    assert not (want == poison).any()
    got = paged.run(built, decode, grid=grid, deep=True)
    if ablate == 1:
        assert np.array_equal(got, poison)
    else:
        assert not (got == poison).any() and not (got == want).any()


def test_attention_tc_deep_ring_traps_on_one_lane(lib: ctypes.CDLL) -> None:
    """A deep-ring kernel has no shared memory for merging chunks itself, so a one-lane
    launch (which would) traps instead of writing past its buffer; in a child process,
    since __trap aborts."""
    run = tc_launch_script(64, 16, True, 1)
    done = run_in_child(lib, run.format(smem=smem_bytes(64, 16, deep=True)) + "\n")
    assert done.returncode != 0 and "__trap()" in done.stderr, done.stderr


def tc_launch_script(head_dim: int, block_size: int, deep: bool, lanes: int) -> str:
    """The source of one launch of a tensor-core entry point on a (1, lanes) grid, one
    token of one sequence, its dynamic shared memory `{smem}` (str.format), for
    run_in_child."""
    return (
        f"lib.run_paged_attention_tc({head_dim}, {block_size}, {int(deep)}, 1, {lanes}, {{smem}},"
        " p(z), p(z), p(z), p(i), p(i[1:]), p(i), p(z), p(z), 1, 1, 1, 1, 1, 2, 1, 1,"
        f" {lanes}, ctypes.c_float(0.125))"
    )


def run_in_child(lib: ctypes.CDLL, body: str) -> subprocess.CompletedProcess[str]:
    """`body` run in a child process (a __trap aborts the process) with the emulator
    library `lib`, zeroed buffers z (uint16) and i ([0, 1], int32) and p (a pointer)."""
    script = (
        "import ctypes, numpy as np\n"
        f"lib = ctypes.CDLL({lib._name!r})\n"
        "z = np.zeros(1 << 16, np.uint16); i = np.array([0, 1], np.int32)\n"
        "p = lambda a: a.ctypes.data_as(ctypes.c_void_p)\n"
    ) + body
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
