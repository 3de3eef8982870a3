"""The KV split of paged attention (issue 18): the twin's chunked merge, and the launch
geometry that spreads (query tile, KV head, KV chunk) work over CTAs.

The twin (paged_attention_ref) cuts each query's keys at multiples of KV_CHUNK, runs
each chunk's online softmax from a fresh state and merges the chunks in ascending order.
Here: it still matches float64 attention across chunk boundaries, a query's bits still do
not depend on its batch, its chunk of the prompt or its path (prefill or decode) when a
row spans many chunks (KV_CHUNK made small), and the chunking does reach the bits (so the
kernels must cut where the twin cuts). The kernels' side is in test_kernels_emulated.py
and test_attention_tc_emulated.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_invariance_ops import PagedSequences, bits
from test_kernels_compile import compiled, nvrtc_or_skip
from test_ops import _dense_attention, _fill_sequences, rel_l2

from reprise.cuda import attention, nvrtc
from reprise.cuda.attention import KV_CHUNK, paged_attention_ref
from reprise.cuda.attention_kernel import (
    PLANNED_CONTEXT,
    SPLIT_CTAS_PER_SM,
    SplitGrid,
    kv_chunks,
    num_work_items,
    split_grid,
    workspace_floats,
)
from reprise.cuda.attention_tc_kernel import ROWS_PER_CTA as TC_ROWS_PER_CTA
from reprise.cuda.attention_tc_kernel import THREADS_PER_CTA as TC_THREADS_PER_CTA
from reprise.cuda.attention_tc_kernel import kernel_name as attention_tc_kernel_name
from reprise.cuda.attention_tc_kernel import launch_variant as tc_launch_variant
from reprise.cuda.attention_tc_kernel import num_stages as tc_num_stages
from reprise.cuda.attention_tc_kernel import smem_bytes as tc_smem_bytes
from reprise.cuda.gemm_kernel import REFERENCE_SMS

S = KV_CHUNK


def test_kv_chunk_is_whole_pages_of_every_block_size() -> None:
    assert all(S % block_size == 0 for block_size in (16, 32, 64))
    assert kv_chunks(1, 16) == 1 and kv_chunks(S // 16, 16) == 1 and kv_chunks(S // 16 + 1, 16) == 2


@pytest.mark.parametrize("block_size", [16, 64])
def test_twin_matches_dense_float64_across_chunk_boundaries(
    rng: np.random.Generator, block_size: int
) -> None:
    """Decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys and a prefill over 2S + 5 keys."""
    specs = [(1, 1), (S - 1, 1), (S, 1), (S + 1, 1), (3 * S + 7, 1), (2 * S + 5, 2 * S + 5)]
    cache, block_tables, keys, values, qs = _fill_sequences(rng, block_size, specs)
    q = np.concatenate(qs)
    starts = np.cumsum([0] + [ql for _, ql in specs]).astype(np.int32)
    seq_lens = np.array([s for s, _ in specs], dtype=np.int32)
    out = paged_attention_ref(q, cache, 1, block_tables, seq_lens, starts, 1 / np.sqrt(32))
    for b, (seq_len, q_len) in enumerate(specs):
        want = _dense_attention(
            qs[b].astype(np.float64),
            keys[b].astype(np.float64),
            values[b].astype(np.float64),
            np.arange(seq_len - q_len, seq_len),
        )
        assert rel_l2(out[starts[b] : starts[b + 1]], want) < 1e-2, b


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """KV_CHUNK of 32 keys, so that the tests' short sequences span many chunks."""
    monkeypatch.setattr(attention, "KV_CHUNK", 32)
    return 32


@pytest.mark.parametrize("block_size", [16, 32])
def test_twin_query_independent_of_chunking_over_many_kv_chunks(
    rng: np.random.Generator, block_size: int, small_chunks: int
) -> None:
    """A query's bits are the same in its whole prompt, in prefill chunks of any size
    (garbage past each), and as a decode step, with its keys cut into up to 6 KV chunks."""
    seq_len = 5 * small_chunks + int(rng.integers(1, small_chunks))
    seqs = PagedSequences(rng, block_size, [seq_len])
    whole = seqs.run([(0, 0, seq_len)])
    for chunk in (1, 7, small_chunks, 50):
        pieces = [
            seqs.run(
                [(0, s, min(s + chunk, seq_len))],
                seqs.with_garbage_after(0, min(s + chunk, seq_len)),
            )
            for s in range(0, seq_len, chunk)
        ]
        assert np.array_equal(bits(np.concatenate(pieces)), bits(whole)), chunk


def test_twin_query_independent_of_its_batch_over_many_kv_chunks(
    rng: np.random.Generator, small_chunks: int
) -> None:
    """Batch 7 (decodes, partial and whole prefills, in a random order) against each
    span alone; and the work cut in other ways (budgets of pages and rows)."""
    seq_lens = [int(n) for n in rng.integers(1, 8 * small_chunks, size=7)]
    seqs = PagedSequences(rng, 16, seq_lens)
    spans = []
    for b, seq_len in enumerate(seq_lens):
        q_len = int(rng.choice([1, seq_len, rng.integers(1, seq_len + 1)]))
        spans.append((b, seq_len - q_len, seq_len))
    batched = seqs.run(spans)
    starts = np.cumsum([0] + [last - first for _, first, last in spans])
    for i, (b, first, last) in enumerate(spans):
        got = batched[starts[i] : starts[i + 1]]
        assert np.array_equal(bits(seqs.run([(b, first, last)])), bits(got)), b
        assert np.array_equal(bits(seqs.run([(b, last - 1, last)])), bits(got[-1:])), b


def test_the_chunking_reaches_the_bits(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cut at 32 keys the merge rounds differently from one long recurrence (so every
    kernel path must cut where the twin does), and both are attention."""
    seq_len = 300
    cache, block_tables, keys, values, qs = _fill_sequences(rng, 16, [(seq_len, seq_len)])

    def run() -> np.ndarray:
        return paged_attention_ref(qs[0], cache, 1, block_tables, np.array([seq_len], np.int32),
                                   np.array([0, seq_len], np.int32), 1 / np.sqrt(32))  # fmt: skip

    monkeypatch.setattr(attention, "KV_CHUNK", 32)
    small = run()
    monkeypatch.setattr(attention, "KV_CHUNK", 1 << 20)
    whole = run()
    assert not np.array_equal(bits(small), bits(whole))
    assert np.array_equal(bits(small[:32]), bits(whole[:32]))  # one chunk: no merge at all
    want = _dense_attention(qs[0].astype(np.float64), keys[0].astype(np.float64),
                            values[0].astype(np.float64), np.arange(seq_len))  # fmt: skip
    assert rel_l2(small, want) < 1e-2 and rel_l2(whole, want) < 1e-2


# --- launch geometry ----------------------------------------------------------------------


def test_batch_one_decode_at_2k_context_fills_a_wave() -> None:
    """Llama-3.1-8B (8 KV heads, groups of 4) decoding one sequence of 2,048 keys: at least
    one CTA with work per SM of the reference H100, whatever the table's width (the
    graphs' tables span max_model_len, 131,072 keys)."""
    for block_size in (16, 32, 64):
        for context in (PLANNED_CONTEXT, 4096, 131072):
            grid = split_grid(1, 1, 8, 4, context // block_size, block_size)
            assert grid.busy_ctas(PLANNED_CONTEXT) >= REFERENCE_SMS, (block_size, context, grid)
            assert grid.splits
    # the group split goes down to single query heads there
    assert split_grid(1, 1, 8, 4, 128, 16) == SplitGrid(1, 8, 4, 8)


def test_the_grid_covers_every_chunk_and_stays_within_the_table() -> None:
    for num_seqs in (1, 2, 3, 5, 8, 16, 17, 64, 256):
        for width in (1, 7, 128, 8192):
            grid = split_grid(num_seqs, num_seqs, 8, 4, width, 16)
            assert grid.num_work_items == num_work_items(num_seqs, num_seqs, 4 // grid.head_parts)
            assert 1 <= grid.kv_lanes <= kv_chunks(width, 16)
            assert 4 % grid.head_parts == 0 and grid.grid[1] <= 65535
            assert grid.num_ctas >= min(REFERENCE_SMS, grid.busy_ctas(1) * kv_chunks(width, 16))


def test_large_batches_and_prefills_take_one_lane() -> None:
    """At or over a wave of (query tile, KV head) CTAs nothing is split: no workspace."""
    assert not split_grid(17, 17, 8, 4, 8192, 16).splits
    assert not split_grid(256, 256, 8, 4, 8192, 16).splits
    prefill = split_grid(4096, 1, 8, 4, 256, 16)
    assert prefill == SplitGrid(4096 // 8, 8, 1, 1)


def test_the_workspace_holds_a_state_per_token_head_and_chunk() -> None:
    assert workspace_floats(3, 32, 128, 8) == 3 * 32 * 8 * 130


def test_the_tensor_core_launcher_takes_the_deep_ring_exactly_when_the_launch_splits() -> None:
    """launch_variant: the deep entry point and its shared memory exactly when the grid
    has kv_lanes > 1 (small decode batches), the normal one otherwise (large batches,
    prefills, a table of one chunk); both seen. A split grid holds at most
    SPLIT_CTAS_PER_SM CTAs an SM of REFERENCE_SMS, so the deep kernels, which hold that
    many, run it in one round."""
    seen = set()
    for num_seqs, num_tokens in [(1, 1), (2, 2), (7, 7), (16, 16), (17, 17), (64, 64), (1, 4096)]:
        for width in (1, 8, 128, 4096):
            for block_size in (16, 32, 64):
                grid = split_grid(num_tokens, num_seqs, 8, 4, width, block_size, TC_ROWS_PER_CTA)
                deep = grid.kv_lanes > 1
                seen.add(deep)
                if deep:
                    assert grid.num_ctas <= SPLIT_CTAS_PER_SM * REFERENCE_SMS, grid
                for head_dim in (64, 128):
                    want = (attention_tc_kernel_name(head_dim, block_size, deep=deep),
                            tc_smem_bytes(head_dim, block_size, deep=deep))  # fmt: skip
                    assert tc_launch_variant(head_dim, block_size, grid) == want, grid
    assert seen == {False, True}
    # Llama-3.1-8B decoding one sequence (bench/results/2026-11-27-h100), and a batch of 17
    batch_1 = split_grid(1, 1, 8, 4, 131072 // 32, 32, TC_ROWS_PER_CTA)
    assert tc_launch_variant(128, 32, batch_1) == ("paged_attention_tc_d128_b32_deep", 69632)
    assert batch_1.num_ctas == 256  # 8 lanes of 32 head slots: 2 CTAs an SM of 132, one round
    batch_17 = split_grid(17, 17, 8, 4, 131072 // 32, 32, TC_ROWS_PER_CTA)
    assert tc_launch_variant(128, 32, batch_17) == ("paged_attention_tc_d128_b32", 69632)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_the_deep_ring_holds_128_keys_and_3_pages_within_sm80s_shared_memory(
    block_size: int,
) -> None:
    """The deep ring: at least 128 keys and 3 pages in the ring (2 or more pages in flight
    while one is read), and its kernels' dynamic shared memory is the ring alone (split
    launches only: no area for a thread's merged chunks), at most 160 KiB a CTA, under
    sm_80's opt-in limit (163 KiB) as under sm_90's (227 KiB); the normal ring stays as
    it was, with that area."""
    stages = tc_num_stages(block_size, deep=True)
    assert stages * block_size >= 128 and stages >= 3, stages
    assert tc_num_stages(block_size) == {16: 4, 32: 2, 64: 2}[block_size]
    for head_dim in (64, 128):
        page = 2 * block_size * (head_dim + 8) * 2  # K and V, BF16 rows of head_dim + 8
        assert tc_smem_bytes(head_dim, block_size, deep=True) == stages * page <= 160 * 1024
        merged = TC_THREADS_PER_CTA * (head_dim // 2 + 4) * 4
        assert tc_smem_bytes(head_dim, block_size) == tc_num_stages(block_size) * page + merged


# --- the kernels' side of the contract ----------------------------------------------------


@pytest.mark.parametrize("name", ["attention.cu", "attention_tc.cu"])
def test_the_kernels_cut_where_the_twin_cuts(name: str) -> None:
    """kKvChunk repeats KV_CHUNK: no bitwise test against the twin could see a kernel
    cutting elsewhere (their sums differ in rounding anyway), but every path of that
    kernel would then disagree with the twin's definition, and size the workspace wrong."""
    source = nvrtc.kernel_source(nvrtc.KERNEL_DIR / name)  # its headers in (attention_tc.cuh)
    chunk = re.findall(r"constexpr int kKvChunk = (\d+);", source)
    if not chunk:  # attention_tc.cu: a benchmark may build another (REPRISE_KV_CHUNK)
        assert "constexpr int kKvChunk = REPRISE_KV_CHUNK;" in source
        chunk = re.findall(r"#ifndef REPRISE_KV_CHUNK\n#define REPRISE_KV_CHUNK (\d+)\n", source)
    assert chunk == [str(KV_CHUNK)]


@pytest.mark.kernels
@pytest.mark.parametrize("arch", nvrtc.ARCHS)
@pytest.mark.parametrize(
    ("name", "defines"),
    [("attention.cu", ""), ("attention_tc.cu", ""), ("attention_tc.cu", "REPRISE_ATTN_COOP 1")],
)
def test_attention_kernels_do_not_spill(name: str, defines: str, arch: str) -> None:
    """Registers and local memory of every attention entry point, read from the cubin
    (printed for the record): no stack frame anywhere, so nothing spills; and what holds
    the tensor-core kernels' occupancy (_tc_registers_do_not_hold_occupancy); the
    tensor-core kernel also as attention_tc_kernel.COOP builds it (the shared page)."""
    nvrtc_or_skip(arch)
    source = nvrtc.kernel_source(nvrtc.KERNEL_DIR / name)  # common.cuh pasted in
    source = (f"#define {defines}\n" if defines else "") + source
    resources = nvrtc.kernel_resources(compiled(source, name, arch).cubin)
    assert set(resources) == set(nvrtc.kernel_names(source))
    for kernel, used in sorted(resources.items()):
        print(f"{arch} {kernel}: {used.registers} registers, {used.local_bytes} B local")
        assert 0 < used.registers <= 255, (kernel, used)
        assert used.local_bytes == 0, (kernel, used)
    if name == "attention_tc.cu":
        _tc_registers_do_not_hold_occupancy(resources, arch)


# What an SM holds (CUDA's occupancy calculator, compute capability 8.0 and 9.0): 64K
# registers, given out 256 a warp; shared memory, less 1 KB reserved for each CTA. An
# sm_90 cubin counts that 1 KB in the kernel's static shared memory already (its
# .nv.shared.reserved section); an sm_80 cubin does not.
SM_REGISTERS = 65536
SM_SHARED_BYTES = {"sm_80": 164 * 1024, "sm_90": 228 * 1024}
CTA_RESERVED_SHARED_BYTES = 1024
RESERVED_IN_CUBIN = {"sm_80": 0, "sm_90": CTA_RESERVED_SHARED_BYTES}


def ctas_by_registers(registers: int, threads: int) -> int:
    per_warp = -(-registers * 32 // 256) * 256
    return SM_REGISTERS // per_warp // (threads // 32)


def ctas_by_shared_memory(shared_bytes: int, arch: str) -> int:
    """`shared_bytes`: the CTA's own, static and dynamic, without the reserve."""
    return SM_SHARED_BYTES[arch] // (shared_bytes + CTA_RESERVED_SHARED_BYTES)


def _tc_registers_do_not_hold_occupancy(resources: dict[str, nvrtc.Resources], arch: str) -> None:
    """The tensor-core kernels' CTAs an SM holds, by registers and by shared memory
    (printed): d128_b32 (Llama-3.1-8B's head and page) fits 3 CTAs in registers, at most
    168 a thread, and no head_dim 128 kernel is held by its registers below what its
    shared memory allows; nor any deep-ring kernel below the split's SPLIT_CTAS_PER_SM
    (its launches, split ones, aim at that many CTAs an SM)."""
    for head_dim in (64, 128):
        for block_size in (16, 32, 64):
            for deep in (False, True):
                kernel = attention_tc_kernel_name(head_dim, block_size, deep=deep)
                used = resources[kernel]
                static = used.shared_bytes - RESERVED_IN_CUBIN[arch]
                shared = tc_smem_bytes(head_dim, block_size, deep=deep) + static
                by_registers = ctas_by_registers(used.registers, TC_THREADS_PER_CTA)
                by_shared = ctas_by_shared_memory(shared, arch)
                print(
                    f"{arch} {kernel}: {used.registers} registers, {shared} B shared, CTAs "
                    f"{by_registers} by registers, {by_shared} by shared memory"
                )
                if deep:
                    assert by_registers >= min(by_shared, SPLIT_CTAS_PER_SM), (kernel, used)
                elif head_dim == 128:
                    assert by_registers >= by_shared, (kernel, used, shared)
    d128_b32 = resources[attention_tc_kernel_name(128, 32)]
    assert d128_b32.registers <= 168, d128_b32  # 3 CTAs: 65,536 / (3 * 128), in 8s
    for block_size in (16, 32):  # head_dim 256: the normal ring, one CTA an SM, by both
        used = resources[attention_tc_kernel_name(256, block_size)]
        shared = tc_smem_bytes(256, block_size) + used.shared_bytes - RESERVED_IN_CUBIN[arch]
        assert (
            ctas_by_shared_memory(shared, arch)
            == 1
            <= ctas_by_registers(used.registers, TC_THREADS_PER_CTA)
        )
        assert attention_tc_kernel_name(256, block_size, deep=True) not in resources
