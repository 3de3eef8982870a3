"""The CUDA kernels' logic on the CPU: each `.cu` file compiled by g++ against a host
emulation of CUDA (tests/kernel_emu/cuda_emu.h: a CTA's threads as host threads,
shuffles and barriers emulated; for the GEMM's inline PTX, ptx_emu.h: ldmatrix, mma
and cp.async by the PTX ISA's layouts and group semantics) and compared with its
NumPy twin, and the attention kernel and the GEMM held to their invariance.

This checks indexing, masking, reductions and the invariance argument without a
GPU; it does not reproduce device arithmetic (host expf) or the memory model: the
GPU tests (tests/test_gpu_*.py) do that on a device.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from reprise.cuda.activation import silu_mul_ref
from reprise.cuda.attention import KV_CHUNK, paged_attention_ref
from reprise.cuda.attention_kernel import (
    SplitGrid,
    kv_chunks,
    num_work_items,
    split_grid,
    workspace_floats,
)
from reprise.cuda.dtypes import BF16, F32
from reprise.cuda.embedding import embed_ref
from reprise.cuda.gemm import gemm_ref
from reprise.cuda.gemm_kernel import (
    CONFIGS,
    Launch,
    TileConfig,
    launch_plan,
    split_k,
    split_length,
    tile_config,
)
from reprise.cuda.kvcache import kv_cache_shape, kv_write_ref, rope_kv_write_ref
from reprise.cuda.penalties import (
    LogitBias,
    Penalties,
    TokenMask,
    apply_token_mask_ref,
    mask_words,
    penalize_ref,
)
from reprise.cuda.rmsnorm import add_rmsnorm_ref, rmsnorm_ref
from reprise.cuda.rope import rope_ref, rope_table
from reprise.cuda.sampling import sample_ref, uniform

pytestmark = pytest.mark.kernels
EMU = Path(__file__).parent / "kernel_emu"


# How a CTA's threads take turns in the emulation (cuda_emu.h's g_warp_major): every
# thread in turn, or one warp at a time as far as it goes alone, first to last or last to
# first. Every kernel here runs under each: a kernel whose warps reuse shared memory
# (a reduction's scratch) without a barrier between gives other bits under one of them.
SCHEDULES = {"threads": 0, "warps": 1, "warps_reversed": 2}


@pytest.fixture(scope="module", params=list(SCHEDULES.values()), ids=list(SCHEDULES))
def lib(emu_lib: ctypes.CDLL, request: pytest.FixtureRequest) -> Iterator[ctypes.CDLL]:
    emu_lib.set_warp_major(request.param)
    try:
        yield emu_lib
    finally:
        emu_lib.set_warp_major(0)


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype in (BF16, np.uint16) else np.uint32)


def max_ulps(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference in BF16 ulps of the twin's value."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any()
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(w), 1e-30))) - 7)
    return float(np.max(np.abs(g - w) / ulp))


def max_row_ulps(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference in BF16 ulps of the largest |value| of its row (the scale
    the row's sums were formed at: a small element of a cancelling sum moves further)."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any()
    scale = np.max(np.abs(w), axis=-1, keepdims=True)
    ulp = np.exp2(np.floor(np.log2(np.maximum(scale, 1e-30))) - 7)
    return float(np.max(np.abs(g - w) / ulp))


def poisoned(shape: tuple[int, ...], dtype: type = np.uint16) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    out.view(np.uint8).fill(0xFF)
    return out


# 576 and 4,096: a row held in registers (3 and 16 elements a thread); 100: threads with
# no element; 4,097 and 8,448: past what the registers hold, the looping path
@pytest.mark.parametrize("hidden", [100, 576, 4096, 4097, 8448])
def test_rmsnorm(lib: ctypes.CDLL, rng: np.random.Generator, hidden: int) -> None:
    x = (rng.standard_normal((5, hidden)) * np.exp2(rng.integers(-4, 5, (5, 1)))).astype(F32)
    weight = rng.standard_normal(hidden).astype(BF16)
    out = poisoned((5, hidden))
    lib.run_rmsnorm(5, ptr(x), ptr(weight), ptr(out), hidden, ctypes.c_float(1e-5))
    assert max_ulps(out.view(BF16), rmsnorm_ref(x, weight, 1e-5)) <= 1
    delta = rng.standard_normal((5, hidden)).astype(BF16)
    summed, normed = np.empty_like(x), poisoned((5, hidden))
    args = (ptr(x), ptr(delta), ptr(weight), ptr(summed), ptr(normed), hidden, ctypes.c_float(1e-5))
    lib.run_add_rmsnorm(5, *args)
    want_summed, want_normed = add_rmsnorm_ref(x, delta, weight, 1e-5)
    assert np.array_equal(summed, want_summed)
    assert max_ulps(normed.view(BF16), want_normed) <= 1


def test_rope_on_strided_rows(lib: ctypes.CDLL, rng: np.random.Generator) -> None:
    heads, kv_heads, head_dim = 9, 3, 64
    cos, sin = rope_table(head_dim, 4096, 100000.0)
    qkv = rng.standard_normal((7, (heads + 2 * kv_heads) * head_dim)).astype(BF16)
    positions = rng.integers(0, 4096, 7).astype(np.int32)
    out = poisoned((7, heads, head_dim))
    lib.run_rope(7, heads, ptr(qkv), ctypes.c_longlong(qkv.shape[1]), ptr(positions), ptr(cos),
                 ptr(sin), ptr(out), head_dim)  # fmt: skip
    want = rope_ref(qkv[:, : heads * head_dim].reshape(7, heads, head_dim), positions, cos, sin)
    assert np.array_equal(out, bits(want))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (4, 4, 128)])
def test_rope_kv_write_is_rope_then_kv_write(
    lib: ctypes.CDLL, rng: np.random.Generator, heads: int, kv_heads: int, head_dim: int
) -> None:
    """The fused kernel against its twin (rope_kv_write_ref) and against the two kernels it
    replaces, run here too: the same queries and the same cache bytes, bit for bit, on
    strided rows, slots spread over blocks, and every other slot left as it was."""
    tokens, layers, layer, block_size, num_blocks = 11, 3, 1, 16, 5
    cos, sin = rope_table(head_dim, 4096, 500000.0)
    width = (heads + 2 * kv_heads) * head_dim
    rows = rng.standard_normal((tokens, width + 40)).astype(BF16)  # 40 columns past each row
    qkv = rows[:, :width].reshape(tokens, heads + 2 * kv_heads, head_dim)
    positions = rng.integers(0, 4096, tokens).astype(np.int32)
    slots = rng.choice(num_blocks * block_size, tokens, replace=False).astype(np.int64)
    shape = kv_cache_shape(num_blocks, layers, kv_heads, block_size, head_dim)
    start = rng.standard_normal(shape).astype(BF16)
    fused_cache, q_out = start.copy(), poisoned((tokens, heads, head_dim))
    lib.run_rope_kv_write(tokens, heads, kv_heads, ptr(rows), ctypes.c_longlong(rows.shape[1]),
                          ptr(positions), ptr(cos), ptr(sin), ptr(q_out), ptr(slots),
                          ptr(fused_cache), layer, layers, block_size, head_dim)  # fmt: skip
    want_cache = start.copy()
    want_q = rope_kv_write_ref(qkv, positions, cos, sin, want_cache, layer, slots, heads)
    assert np.array_equal(q_out, bits(want_q))
    assert np.array_equal(bits(fused_cache), bits(want_cache))
    # the two kernels it replaces, on the same inputs: the same bits
    apart_cache, q_apart = start.copy(), poisoned((tokens, heads, head_dim))
    k_rot = poisoned((tokens, kv_heads, head_dim))
    stride = ctypes.c_longlong(rows.shape[1])
    lib.run_rope(tokens, heads, ptr(rows), stride, ptr(positions), ptr(cos), ptr(sin), ptr(q_apart),
                 head_dim)  # fmt: skip
    k_view = rows[:, heads * head_dim :]
    lib.run_rope(tokens, kv_heads, ptr(k_view), stride, ptr(positions), ptr(cos), ptr(sin),
                 ptr(k_rot), head_dim)  # fmt: skip
    v_view = rows[:, (heads + kv_heads) * head_dim :]
    lib.run_kv_write(tokens, kv_heads, ptr(k_rot), ptr(v_view), ctypes.c_longlong(kv_heads * head_dim),
                     stride, ptr(slots), ptr(apart_cache), layer, layers, block_size, head_dim)  # fmt: skip
    assert np.array_equal(q_apart, q_out)
    assert np.array_equal(bits(apart_cache), bits(fused_cache))
    untouched = np.ones(num_blocks * block_size, bool)
    untouched[slots] = False
    per_slot = bits(fused_cache)[:, layer].transpose(0, 3, 1, 2, 4)  # [blocks, bs, 2, kv, hd]
    per_slot_start = bits(start)[:, layer].transpose(0, 3, 1, 2, 4)
    flat = per_slot.reshape(num_blocks * block_size, -1)
    assert np.array_equal(
        flat[untouched], per_slot_start.reshape(num_blocks * block_size, -1)[untouched]
    )
    other_layers = [i for i in range(layers) if i != layer]
    assert np.array_equal(bits(fused_cache)[:, other_layers], bits(start)[:, other_layers])


def test_silu_mul_embed_and_kv_write(lib: ctypes.CDLL, rng: np.random.Generator) -> None:
    gate_up = (rng.standard_normal((3, 2 * 1536)) * 4).astype(BF16)
    out = poisoned((3, 1536))
    lib.run_silu_mul(ptr(gate_up), ptr(out), ctypes.c_longlong(3), 1536, 5)
    assert max_ulps(out.view(BF16), silu_mul_ref(gate_up)) <= 1

    table = rng.standard_normal((100, 576)).astype(BF16)
    ids = rng.integers(0, 100, 9).astype(np.int32)
    rows = poisoned((9, 576), np.float32)
    unscaled = ctypes.c_float(1.0)  # embed's scale: none (tests/test_gemma_ops.py scales)
    lib.run_embed(9, ptr(table), ptr(ids), ptr(table), ptr(rows), 576, 100, unscaled)
    assert np.array_equal(rows, embed_ref(table, ids))
    # p-tuning: ids >= vocab read the step's prompt-table rows
    prompt_rows = rng.standard_normal((5, 576)).astype(BF16)
    ids = rng.integers(0, 105, 9).astype(np.int32)
    ids[[0, 4]] = [104, 100]
    rows = poisoned((9, 576), np.float32)
    lib.run_embed(9, ptr(table), ptr(ids), ptr(prompt_rows), ptr(rows), 576, 100, unscaled)
    assert np.array_equal(rows, embed_ref(table, ids, prompt_rows))

    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    cache = rng.standard_normal(kv_cache_shape(6, 3, kv_heads, block_size, head_dim)).astype(BF16)
    want = cache.copy()
    slots = rng.choice(6 * block_size, 11, replace=False).astype(np.int64)
    qkv = rng.standard_normal((11, (heads + 2 * kv_heads) * head_dim)).astype(BF16)
    k_end = (heads + kv_heads) * head_dim
    k = np.ascontiguousarray(qkv[:, heads * head_dim : k_end]).reshape(11, kv_heads, head_dim)
    v = qkv[:, k_end:]  # strided rows, as the model hands them over
    lib.run_kv_write(11, kv_heads, ptr(k), ptr(v), ctypes.c_longlong(kv_heads * head_dim),
                     ctypes.c_longlong(qkv.shape[1]), ptr(slots), ptr(cache), 1, 3, block_size,
                     head_dim)  # fmt: skip
    kv_write_ref(want, 1, k, v.reshape(11, kv_heads, head_dim), slots)
    assert np.array_equal(bits(cache), bits(want))


def test_argmax_and_philox(lib: ctypes.CDLL, rng: np.random.Generator) -> None:
    logits = (rng.standard_normal((4, 5000)) * 3).astype(F32)
    logits[1, [7, 4000]] = 50.0  # a tie: the lower id
    logits[2] = 0.0
    out = np.full(4, -1, np.int32)
    lib.run_argmax(4, ptr(logits), ctypes.c_longlong(5000), 5000, ptr(out))
    assert out.tolist() == np.argmax(logits, axis=1).tolist()

    seeds = rng.integers(0, 2**64, 300, dtype=np.uint64)
    seeds[:2] = [0, 2**64 - 1]
    positions = rng.integers(0, 2**40, 300).astype(np.int64)
    draws = np.empty(300, F32)
    lib.run_philox_uniform(ptr(seeds), ptr(positions), ptr(draws), 300)
    want = [uniform(int(s), int(p)) for s, p in zip(seeds, positions, strict=True)]
    assert np.array_equal(draws, np.array(want, F32))


@pytest.mark.parametrize("vocab", [4097, 3 * 4096, 49152 + 5])
def test_argmax_split_gives_argmax_ids(
    lib: ctypes.CDLL, rng: np.random.Generator, vocab: int
) -> None:
    """argmax_split (a row over ceil(vocab / slice) CTAs, the last combining their bests)
    gives argmax's ids, CTAs in launch order or last to first, on rows whose best sits
    in the last, partial slice, ties across slices (the lowest id), a tie of -0.0 and
    +0.0, NaNs beside the best, and rows of only NaN or only -inf; and np.argmax's where
    no NaN is. Its counters are left zero."""
    from reprise.cuda.launchers import ARGMAX_SLICE, ARGMAX_SPLIT_MAX_ROWS, argmax_slices

    rows = ARGMAX_SPLIT_MAX_ROWS
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(F32)
    logits[0, vocab - 1] = 40.0  # the last slice's last id
    logits[1, [vocab - 1, 5, ARGMAX_SLICE - 1]] = 50.0  # a tie across slices: id 5
    logits[2] = -1.0
    logits[2, [vocab - 1, 9]] = [0.0, -0.0]  # equal, in two slices: the lower id, 9
    logits[3, rng.integers(0, vocab, 50)] = np.nan
    logits[3, 77] = 60.0
    logits[4] = np.nan
    logits[5] = -np.inf
    logits[6, :ARGMAX_SLICE] = np.nan  # a whole slice of NaN
    slices = argmax_slices(rows, vocab)
    assert slices == -(-vocab // ARGMAX_SLICE) > 1 and argmax_slices(rows + 1, vocab) == 1
    want = np.full(rows, -1, np.int32)
    lib.run_argmax(rows, ptr(logits), ctypes.c_longlong(vocab), vocab, ptr(want))
    for m in (1, rows):
        for reverse in (False, True):
            part_v = np.full(m * slices, np.nan, F32)
            part_i = np.full(m * slices, -7, np.int32)
            counters = np.zeros(m, np.uint32)
            out = np.full(m, -1, np.int32)
            with reversed_ctas(lib) if reverse else contextlib.nullcontext():
                lib.run_argmax_split(m, ptr(logits), ctypes.c_longlong(vocab), vocab, ARGMAX_SLICE,
                                     ptr(part_v), ptr(part_i), ptr(counters), ptr(out))  # fmt: skip
            assert out.tolist() == want[:m].tolist(), (m, reverse)
            assert not counters.any()
    no_nan = [r for r in range(rows) if not np.isnan(logits[r]).any()]
    assert want[no_nan].tolist() == np.argmax(logits[no_nan], axis=1).tolist()
    assert want[:6].tolist() == [vocab - 1, 5, 9, 77, 0, 0]  # NaN row: 0; -inf row: the first


def test_apply_penalties_is_the_twin_bit_for_bit(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """Rows of random penalties (one neutral, one listing nothing) on random logits with
    signed zeros and infinities: every element the twin's bits, unlisted ones untouched."""
    rows, vocab = 6, 3001
    logits = (rng.standard_normal((rows, vocab)) * 6).astype(F32)
    logits[:, :4] = [0.0, -0.0, np.inf, -np.inf]
    sizes = [int(rng.integers(4, 400)) for _ in range(rows)]
    sizes[3] = 0
    ids = [rng.choice(np.arange(4, vocab), size=n, replace=False) for n in sizes]  # distinct
    ids[0][:4] = [0, 1, 2, 3]  # the zeros and infinities
    penalties = Penalties(
        repetition=rng.uniform(0.3, 3.0, rows).astype(F32),
        frequency=rng.uniform(-2, 2, rows).astype(F32),
        presence=rng.uniform(-2, 2, rows).astype(F32),
        token_offsets=np.cumsum([0, *sizes]).astype(np.int32),
        token_ids=np.concatenate(ids).astype(np.int32),
        output_counts=rng.integers(0, 6, sum(sizes)).astype(np.int32),
    )
    penalties.repetition[1], penalties.frequency[1], penalties.presence[1] = 1, 0, 0
    want = logits.copy()
    penalize_ref(want, penalties)
    got = logits.copy()
    lib.run_apply_penalties(rows, ptr(got), vocab, ptr(penalties.token_offsets),
                            ptr(penalties.token_ids), ptr(penalties.output_counts),
                            ptr(penalties.repetition), ptr(penalties.frequency),
                            ptr(penalties.presence))  # fmt: skip
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(want[0], logits[0])  # something was penalized
    assert np.array_equal(got[3].view(np.uint32), logits[3].view(np.uint32))


def test_logit_bias_then_penalties_are_the_twin_bit_for_bit(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """add_logit_bias then apply_penalties (as the CuPy backend launches them) against
    penalize_ref with a bias: rows biasing tokens they also penalize, tokens they do not,
    the zeros and infinities, and none; every element the twin's bits."""
    rows, vocab = 5, 2003
    logits = (rng.standard_normal((rows, vocab)) * 6).astype(F32)
    logits[:, :4] = [0.0, -0.0, np.inf, -np.inf]
    penalized = [rng.choice(vocab, int(rng.integers(1, 200)), replace=False) for _ in range(rows)]
    biased = [rng.choice(vocab, int(rng.integers(1, 300)), replace=False) for _ in range(rows)]
    biased[0][:4] = [0, 1, 2, 3]
    biased[1] = penalized[1][: max(1, penalized[1].size // 2)]  # each also penalized
    biased[4] = biased[4][:0]  # no bias
    values = np.concatenate([rng.uniform(-100, 100, ids.size) for ids in biased]).astype(F32)
    values[:2] = [-0.0, 1e-30]  # the signed zero and a tiny bias on the zeros
    offsets = np.cumsum([0, *(i.size for i in biased)]).astype(np.int32)
    bias = LogitBias(offsets=offsets, ids=np.concatenate(biased).astype(np.int32), values=values)
    penalties = Penalties(
        repetition=rng.uniform(0.3, 3.0, rows).astype(F32),
        frequency=rng.uniform(-2, 2, rows).astype(F32),
        presence=rng.uniform(-2, 2, rows).astype(F32),
        token_offsets=np.cumsum([0, *(i.size for i in penalized)]).astype(np.int32),
        token_ids=np.concatenate(penalized).astype(np.int32),
        output_counts=rng.integers(0, 6, sum(i.size for i in penalized)).astype(np.int32),
        bias=bias,
    )
    want = logits.copy()
    penalize_ref(want, penalties)
    got = logits.copy()
    lib.run_add_logit_bias(rows, ptr(got), vocab, ptr(bias.offsets), ptr(bias.ids),
                           ptr(bias.values))  # fmt: skip
    lib.run_apply_penalties(rows, ptr(got), vocab, ptr(penalties.token_offsets),
                            ptr(penalties.token_ids), ptr(penalties.output_counts),
                            ptr(penalties.repetition), ptr(penalties.frequency),
                            ptr(penalties.presence))  # fmt: skip
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    unbiased = logits.copy()
    penalize_ref(unbiased, dataclasses.replace(penalties, bias=None))
    changed = [r for r in range(rows) if not np.array_equal(want[r], unbiased[r])]
    assert changed == [0, 1, 2, 3]  # the bias moved every row that has one


@pytest.mark.parametrize("vocab", [1000, 1024, 5003])
def test_token_mask_is_the_twin_bit_for_bit(
    lib: ctypes.CDLL, rng: np.random.Generator, vocab: int
) -> None:
    """apply_token_mask against its twin: rows keeping a few tokens (the last word's
    partial bits included), half of them, all of them (untouched), none; kept logits keep
    their bits (zeros, infinities and NaN included), the others become -inf."""
    rows, words = 6, mask_words(vocab)
    logits = (rng.standard_normal((rows, vocab)) * 6).astype(F32)
    logits[:, :4] = [0.0, -0.0, np.inf, np.nan]
    keep = np.zeros((rows, vocab), dtype=bool)
    keep[0, rng.choice(vocab, 5, replace=False)] = True
    keep[0, [0, 1, 2, 3, vocab - 1]] = True  # the odd values and the last token
    keep[1] = rng.random(vocab) < 0.5
    keep[2] = True  # unconstrained
    keep[4, vocab - 1] = True  # one token, in the last word
    keep[5, 31:33] = True  # across a word boundary; row 3 keeps nothing
    packed = np.packbits(keep, axis=1, bitorder="little")  # little-endian bytes of each word
    buf = np.zeros((rows, 4 * words), np.uint8)
    buf[:, : packed.shape[1]] = packed
    mask = TokenMask(words=buf.view(np.uint32).copy())
    if vocab % 32:
        mask.words[:, -1] |= np.uint32(0xFFFFFFFF) << np.uint32(vocab % 32)  # bits past vocab
    want = logits.copy()
    apply_token_mask_ref(want, mask)
    got = logits.copy()
    lib.run_apply_token_mask(rows, ptr(got), vocab, ptr(mask.words), words)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(np.isneginf(want) & ~np.isneginf(logits), ~keep)
    assert np.array_equal(want[keep].view(np.uint32), logits[keep].view(np.uint32))


@pytest.mark.parametrize("vocab", [1000, 5003])
def test_sample_sorted_walks_the_ranks_as_the_twin(
    lib: ctypes.CDLL, rng: np.random.Generator, vocab: int
) -> None:
    """sample_sorted on the twin's ranking (the launcher sorts on the device) draws the
    twin's token, min_p's cut included; only expf against NumPy's exp may differ, in the
    last bit, which can move a draw that lands on a boundary of the running sum."""
    cases = [(t, k, p) for t in (0.7, 1.3) for k in (None, 1, 50, 999) for p in (1.0, 0.9, 0.5)]
    min_ps = (0.0, 0.001, 0.05, 0.5)
    rows = len(cases) * 4
    logits = np.empty((rows, vocab), F32)
    for r in range(rows):
        if r % 2:  # coarse values: many ties, which rank by id
            logits[r] = rng.integers(-8, 9, vocab) * 0.5
        else:
            logits[r] = rng.standard_normal(vocab) * 4
    params = [cases[r % len(cases)] for r in range(rows)]
    seeds = rng.integers(0, 2**63, rows, dtype=np.uint64)
    ranked = np.empty_like(logits)
    ids = np.empty((rows, vocab), np.int32)
    for r, (t, _, _) in enumerate(params):
        scaled = logits[r] / F32.type(t)
        ids[r] = np.argsort(-scaled, kind="stable")
        ranked[r] = scaled[ids[r]]
    top_k = np.array([vocab if k is None else k for _, k, _ in params], np.int32)
    top_p = np.array([p for _, _, p in params], F32)
    min_p = np.array([min_ps[(r // len(cases)) % len(min_ps)] for r in range(rows)], F32)
    uniforms = np.array([uniform(int(s), 7) for s in seeds], F32)
    cum = np.empty_like(logits)
    out = np.full(rows, -1, np.int32)
    lib.run_sample_sorted(rows, ptr(ranked), ptr(ids), ptr(top_k), ptr(top_p), ptr(min_p),
                          ptr(uniforms), ptr(cum), vocab, ptr(out))  # fmt: skip
    want = [
        sample_ref(logits[r], temperature=t, top_k=k, top_p=p, min_p=float(min_p[r]),
                   seed=int(seeds[r]), position=7)
        for r, (t, k, p) in enumerate(params)
    ]  # fmt: skip
    assert (out >= 0).all()
    assert np.mean(out == np.array(want)) >= 0.95, (out.tolist(), want)
    # min_p cut: a row's draw is never below min_p of its top (relative to the scaled top)
    for r in range(rows):
        scaled = logits[r] / F32.type(params[r][0])
        assert np.exp(scaled[out[r]] - scaled.max()) >= min_p[r] * (1 - 1e-6)
    for r in np.flatnonzero(out != np.array(want)):  # only a draw on a boundary may move
        probs = np.exp(ranked[r, : int(top_k[r])] - ranked[r, 0], dtype=F32)
        kept = int(np.argmax(probs < min_p[r])) if (probs < min_p[r]).any() else probs.size
        running = np.cumsum(probs[:kept], dtype=F32)
        gaps = np.abs(running - uniforms[r] * running[-1]) / running[-1]
        assert gaps.min() < 1e-5, (r, params[r], gaps.min())


class SplitBuffers:
    """A split launch's workspace (poisoned: NaN) and counters (zero), each followed by
    GUARD elements; on exit, the guards are intact and every counter is zero again."""

    def __init__(self, num_tokens: int, num_heads: int, head_dim: int, max_chunks: int) -> None:
        size = workspace_floats(num_tokens, num_heads, head_dim, max_chunks)
        self.workspace = poisoned((size + GUARD,), np.float32)
        self.counters = np.zeros(4096 + GUARD, np.uint32)

    def __enter__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.workspace, self.counters

    def __exit__(self, *exc: object) -> None:
        assert np.array_equal(bits(self.workspace[-GUARD:]), bits(poisoned((GUARD,), np.float32)))
        assert not self.counters.any(), "the last lane of each CTA group leaves its counter zero"


@contextlib.contextmanager
def fp32_probe(lib: ctypes.CDLL, on: bool = True) -> Iterator[None]:
    """While on, __fdiv_rn returns an 8-bit hash of its operands (cuda_emu.h), so that
    attention's output shows its fp32 acc and denom: two runs whose outputs are equal
    then computed the same fp32 values (but for a 1 in 256 collision an element)."""
    lib.set_fdiv_probe(int(on))
    try:
        yield
    finally:
        lib.set_fdiv_probe(0)


@contextlib.contextmanager
def reversed_ctas(lib: ctypes.CDLL) -> Iterator[None]:
    lib.set_reversed_ctas(1)
    try:
        yield
    finally:
        lib.set_reversed_ctas(0)


@contextlib.contextmanager
def warp_schedule(lib: ctypes.CDLL, order: int) -> Iterator[None]:
    """Launches under SCHEDULES' `order` (one warp at a time: 1 first to last, 2 last to
    first), then back to the module's."""
    lib.set_warp_major(order)
    try:
        yield
    finally:
        lib.set_warp_major(0)


def forced_grid(num_tokens: int, num_seqs: int, kv_heads: int, group: int, head_parts: int,
                kv_lanes: int, rows_per_cta: int = 32) -> SplitGrid:  # fmt: skip
    """A geometry other than split_grid's: any must give the same bits."""
    work = num_work_items(num_tokens, num_seqs, group // head_parts, rows_per_cta)
    return SplitGrid(work, kv_heads, head_parts, kv_lanes)


class Paged:
    """Random sequences in a shuffled pool whose free and stale slots hold garbage and NaN."""

    def __init__(self, rng: np.random.Generator, shape: tuple[int, int, int], block_size: int,
                 seq_lens: list[int]) -> None:  # fmt: skip
        self.heads, self.kv_heads, self.head_dim = shape
        self.block_size = block_size
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
        self.cache = rng.standard_normal(kv_cache_shape(num_blocks, 2, self.kv_heads, block_size,
                                                        self.head_dim)).astype(BF16)  # fmt: skip
        self.cache.reshape(-1)[rng.random(self.cache.size) < 0.01] = np.nan  # stale NaN
        free = list(rng.permutation(num_blocks))
        self.tables = [[int(free.pop()) for _ in range(-(-n // block_size))] for n in seq_lens]
        self.queries = [
            rng.standard_normal((n, self.heads, self.head_dim)).astype(BF16) for n in seq_lens
        ]
        for table, n in zip(self.tables, seq_lens, strict=True):
            kv = (rng.standard_normal((2, n, self.kv_heads, self.head_dim)) * 2).astype(BF16)
            pos = np.arange(n)
            kv_write_ref(
                self.cache,
                1,
                kv[0],
                kv[1],
                np.asarray(table)[pos // block_size] * block_size + pos % block_size,
            )

    def inputs(self, spans: list[tuple[int, int, int]]) -> tuple:
        width = max(len(self.tables[b]) for b, _, _ in spans)
        tables = np.array(
            [self.tables[b] + [0] * (width - len(self.tables[b])) for b, _, _ in spans], np.int32
        )
        q = np.concatenate([self.queries[b][first:last] for b, first, last in spans])
        seq_lens = np.array([last for _, _, last in spans], np.int32)
        starts = np.cumsum([0] + [last - first for _, first, last in spans]).astype(np.int32)
        return q, tables, seq_lens, starts

    def emulated(self, lib: ctypes.CDLL, spans: list[tuple[int, int, int]],
                 cache: np.ndarray | None = None, grid: SplitGrid | None = None) -> np.ndarray:  # fmt: skip
        """attention.cu's output for (sequence, first, last) query spans batched in one
        launch, on `grid` (None: split_grid's, as the launcher plans it), into a poisoned
        buffer, with a poisoned workspace."""
        q, tables, seq_lens, starts = self.inputs(spans)
        out = poisoned(q.shape)
        group = self.heads // self.kv_heads
        if grid is None:
            grid = split_grid(q.shape[0], len(spans), self.kv_heads, group, tables.shape[1],
                              self.block_size)  # fmt: skip
        with SplitBuffers(q.shape[0], self.heads, self.head_dim, kv_chunks(tables.shape[1],
                          self.block_size)) as (workspace, counters):  # fmt: skip
            rc = lib.run_paged_attention(
                self.head_dim, self.block_size, *grid.grid, ptr(out), ptr(q),
                ptr(self.cache if cache is None else cache), ptr(tables), ptr(seq_lens),
                ptr(starts), ptr(workspace), ptr(counters), q.shape[0], len(spans), tables.shape[1],
                self.heads, self.kv_heads, 2, 1, grid.head_parts, grid.kv_lanes,
                ctypes.c_float(1 / np.sqrt(self.head_dim)),
            )  # fmt: skip
        assert rc == 0
        return out

    def with_garbage_after(self, rng: np.random.Generator, b: int, last: int) -> np.ndarray:
        """The cache as a prefill chunk ending at `last` sees it: sequence b's slots from
        `last` on not yet written, holding large values and NaN."""
        cache = self.cache.copy()
        end = len(self.tables[b]) * self.block_size
        garbage_shape = (end - last, self.kv_heads, self.head_dim)
        garbage = (rng.standard_normal(garbage_shape) * 50).astype(BF16)
        garbage[::3, :, :5] = np.nan
        pos = np.arange(last, end)
        slots = np.asarray(self.tables[b])[pos // self.block_size] * self.block_size
        kv_write_ref(cache, 1, garbage, garbage[::-1], slots + pos % self.block_size)
        return cache

    def twin(self, spans: list[tuple[int, int, int]]) -> np.ndarray:
        q, tables, seq_lens, starts = self.inputs(spans)
        return paged_attention_ref(
            q, self.cache, 1, tables, seq_lens, starts, 1 / np.sqrt(self.head_dim)
        )


@pytest.mark.parametrize(
    ("shape", "block_size"),
    [((9, 3, 64), 16), ((9, 3, 64), 64), ((8, 2, 128), 32), ((4, 2, 256), 16)],
)
def test_attention_matches_its_twin_and_is_invariant(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int], block_size: int
) -> None:
    seq_lens = [int(n) for n in rng.integers(1, 48, size=3)] + [2 * block_size + 3]
    paged = Paged(rng, shape, block_size, seq_lens)
    spans = [(b, int(rng.integers(0, n)), n) for b, n in enumerate(seq_lens)]
    batched = paged.emulated(lib, spans)
    assert max_row_ulps(batched.view(BF16), paged.twin(spans)) <= 2
    starts = np.cumsum([0] + [last - first for _, first, last in spans])
    for i, (b, first, last) in enumerate(spans):
        got = batched[starts[i] : starts[i + 1]]
        assert np.array_equal(paged.emulated(lib, [(b, first, last)]), got), (b, "alone")
        for chunk in (5, 16):
            pieces = [
                paged.emulated(lib, [(b, s, min(s + chunk, last))])
                for s in range(first, last, chunk)
            ]
            assert np.array_equal(np.concatenate(pieces), got), (b, chunk)


# The KV split: contexts around the chunk boundaries (S = KV_CHUNK keys a chunk).
S = KV_CHUNK
SPLIT_CONTEXTS = [1, S - 1, S, S + 1, 3 * S + 7]


def split_case(rng: np.random.Generator, shape: tuple[int, int, int], block_size: int) -> Paged:
    """Sequences of SPLIT_CONTEXTS keys, and two more of random lengths."""
    others = [int(n) for n in rng.integers(2, 2 * S, size=2)]
    return Paged(rng, shape, block_size, [*SPLIT_CONTEXTS, *others])


@pytest.mark.parametrize(
    ("shape", "block_size"),
    [((4, 1, 64), 16), ((4, 1, 64), 64), ((6, 2, 128), 32), ((4, 2, 256), 64)],
)
def test_attention_split_decode_matches_its_twin_on_every_grid(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int], block_size: int
) -> None:
    """Decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys batched in one launch (7 rows,
    split_grid's geometry: chunk states through the workspace, merged by each CTA group's
    last lane), within BF16 rounding of the twin; and bit for bit the same on every
    other grid: one lane merging in registers, other lane and head-part counts, the
    CTAs run last to first (another lane merges), and each row alone (batch 1)."""
    paged = split_case(rng, shape, block_size)
    spans = [(b, n - 1, n) for b, n in enumerate(paged_lens(paged))]
    heads, kv_heads, _ = shape
    group = heads // kv_heads
    planned = split_grid(7, 7, kv_heads, group, max(map(len, paged.tables)), block_size)
    assert planned.splits
    batched = paged.emulated(lib, spans)
    assert max_row_ulps(batched.view(BF16), paged.twin(spans)) <= 2
    for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
        with fp32_probe(lib, probe):
            want = paged.emulated(lib, spans) if probe else batched
            assert len(np.unique(want)) > 100
            for parts, lanes in [(1, 1), (1, 2), (group, 3), (group, 4)]:
                grid = forced_grid(7, 7, kv_heads, group, parts, lanes)
                got = paged.emulated(lib, spans, grid=grid)
                assert np.array_equal(got, want), (probe, parts, lanes)
            with reversed_ctas(lib):
                assert np.array_equal(paged.emulated(lib, spans), want), (probe, "reversed")
            for i, span in enumerate(spans):
                got = paged.emulated(lib, [span])
                assert np.array_equal(got, want[i : i + 1]), (probe, "alone", span)


def paged_lens(paged: Paged) -> list[int]:
    return [q.shape[0] for q in paged.queries]


@pytest.mark.parametrize(
    ("shape", "block_size"), [((4, 1, 64), 16), ((6, 2, 128), 64), ((4, 1, 256), 32)]
)
def test_attention_split_prefill_rows_equal_their_decode_steps(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int], block_size: int
) -> None:
    """A prompt's rows computed in a prefill (whole, or the chunk crossing the 3S
    boundary, garbage past it; rows of one CTA seeing different chunk counts) bit-equal
    the same positions as decode steps (split through the workspace), and the prefill's
    rows match the twin. The prefills run on split_grid's grid and on one lane (one CTA
    merging its rows' chunks in registers, as a long prefill's grid does), to the same bits."""
    paged = split_case(rng, shape, block_size)
    whole_len, long_len = S + 1, 3 * S + 7
    first = 3 * S - 20
    cache = paged.with_garbage_after(rng, 4, long_len)
    assert max_row_ulps(paged.emulated(lib, [(3, 0, whole_len)]).view(BF16),
                        paged.twin([(3, 0, whole_len)])) <= 2  # fmt: skip
    assert max_row_ulps(paged.emulated(lib, [(4, first, long_len)], cache).view(BF16),
                        paged.twin([(4, first, long_len)])) <= 2  # fmt: skip
    for probe in (False, True):  # the BF16 outputs, then the fp32 values behind them
        with fp32_probe(lib, probe):
            whole = paged.emulated(lib, [(3, 0, whole_len)])
            heads, kv_heads, _ = shape
            for span, with_cache in (((3, 0, whole_len), None), ((4, first, long_len), cache)):
                one_lane = forced_grid(span[2] - span[1], 1, kv_heads, heads // kv_heads, 1, 1)
                got = paged.emulated(lib, [span], with_cache, grid=one_lane)
                assert np.array_equal(got, paged.emulated(lib, [span], with_cache)), (probe, span)
            for pos in (0, S - 2, S - 1, S):
                step = paged.emulated(lib, [(3, pos, pos + 1)])
                assert np.array_equal(step, whole[pos : pos + 1]), (probe, pos)
            chunk = paged.emulated(lib, [(4, first, long_len)], cache)
            for pos in (first, 3 * S - 1, 3 * S, long_len - 1):
                garbage = paged.with_garbage_after(rng, 4, pos + 1)
                step = paged.emulated(lib, [(4, pos, pos + 1)], garbage)
                assert np.array_equal(step, chunk[pos - first : pos - first + 1]), (probe, pos)
            # the same chunk batched after decode steps, on a split grid
            spans = [(0, 0, 1), (2, S - 1, S), (4, first, long_len)]
            assert np.array_equal(paged.emulated(lib, spans, cache)[2:], chunk), probe


GEMM_SHAPES = [(5, 48, 37), (70, 208, 130), (130, 64, 257)]  # (M, K, N): tails in M, N and K
GUARD = 64  # poisoned elements past the output, which must stay poisoned


def emulated_gemm(
    lib: ctypes.CDLL, config: TileConfig | None, x: np.ndarray, w: np.ndarray, *, out_f32: bool,
    splits: int = 1, x_shift: int = 0, y_shift: int = 0,
) -> np.ndarray:  # fmt: skip
    """gemm.cu's entry points for `config` (None: the one gemm_kernel.gemm picks for M),
    launched as gemm_kernel.gemm launches them (launch_plan) with `splits` splits over K;
    `x_shift` / `y_shift` elements move x / y off 16-byte alignment (the plain-load and
    scalar-store routes). The output, and the split workspace, start poisoned."""
    (m, k), n = x.shape, w.shape[0]
    x_buf = np.empty(m * k + x_shift, np.uint16)
    x_buf[x_shift:] = x.view(np.uint16).reshape(-1)
    dtype = np.float32 if out_f32 else np.uint16
    y_buf = poisoned((m * n + y_shift + GUARD,), dtype)
    y = y_buf[y_shift : y_shift + m * n]
    plan = launch_plan(m, n, k, splits, out_f32=out_f32, config=config)
    length = split_length(k, splits)
    if not plan.split_workspace:
        rc = lib.run_gemm(
            plan.kernel.encode(), *plan.grid, plan.threads, plan.smem_bytes,
            ptr(x_buf[x_shift:]), ptr(w), ptr(y), m, n, k, length,
        )  # fmt: skip
        assert rc == 0, rc
    else:
        workspace = poisoned((splits * m * n + GUARD,), np.float32)
        counters = np.zeros(plan.grid[1] * -(-m // plan_config(plan).block_m) + GUARD, np.uint32)
        rc = lib.run_gemm_split(
            plan.kernel.encode(), *plan.grid, plan.threads, plan.smem_bytes,
            ptr(x_buf[x_shift:]), ptr(w), ptr(workspace), ptr(y), ptr(counters), m, n, k, length,
        )  # fmt: skip
        assert rc == 0, rc
        assert np.array_equal(bits(workspace[-GUARD:]), bits(poisoned((GUARD,), np.float32)))
        assert not counters.any(), "the last CTA of each tile leaves its counter zero"
    assert np.array_equal(bits(y_buf[:y_shift]), bits(poisoned((y_shift,), dtype)))
    assert np.array_equal(bits(y_buf[y_shift + m * n :]), bits(poisoned((GUARD,), dtype)))
    return y.reshape(m, n).view(F32 if out_f32 else BF16)


def plan_config(plan: Launch) -> TileConfig:
    return next(c for c in CONFIGS if plan.kernel.split("_")[2] == c.name)


def check_gemm(got: np.ndarray, x: np.ndarray, w: np.ndarray, *, out_f32: bool) -> None:
    """Within one BF16 rounding (BF16 out) or 1e-5 of the row's largest (fp32 out) of the
    twin: the emulated mma accumulates in fp32, the twin rounds an exact sum once."""
    want = gemm_ref(x, w, out_f32=out_f32)
    if not out_f32:
        assert max_row_ulps(got, want) <= 1
        return
    g, t = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any()
    scale = np.max(np.abs(t), axis=-1, keepdims=True)
    assert float(np.max(np.abs(g - t) / scale)) <= 1e-5


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_gemm_matches_its_twin(
    lib: ctypes.CDLL, rng: np.random.Generator, config: TileConfig, shape: tuple[int, int, int]
) -> None:
    m, k, n = shape
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-3, 4, (m, 1)))).astype(BF16)
    w = (rng.standard_normal((n, k)) * 0.5).astype(BF16)
    for out_f32 in (False, True):
        check_gemm(emulated_gemm(lib, config, x, w, out_f32=out_f32), x, w, out_f32=out_f32)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_gemm_unaligned_operands_take_the_same_values(
    lib: ctypes.CDLL, rng: np.random.Generator, config: TileConfig
) -> None:
    x = rng.standard_normal((19, 96)).astype(BF16)
    w = rng.standard_normal((42, 96)).astype(BF16)
    for out_f32 in (False, True):
        aligned = emulated_gemm(lib, config, x, w, out_f32=out_f32)
        check_gemm(aligned, x, w, out_f32=out_f32)
        shifted = emulated_gemm(lib, config, x, w, out_f32=out_f32, x_shift=1, y_shift=1)
        assert np.array_equal(bits(shifted), bits(aligned))


def test_gemm_row_is_independent_of_its_call(lib: ctypes.CDLL, rng: np.random.Generator) -> None:
    """Each row of an M = 70 call, under every tile config, bit-equals the row computed
    alone (M = 1, the config the launcher picks for it): padding rows, companion rows and
    the tiling never reach a row's result."""
    x = (rng.standard_normal((70, 208)) * np.exp2(rng.integers(-3, 4, (70, 1)))).astype(BF16)
    w = rng.standard_normal((37, 208)).astype(BF16)
    for out_f32 in (False, True):
        alone = np.concatenate([
            emulated_gemm(lib, None, x[i : i + 1], w, out_f32=out_f32) for i in range(70)
        ])  # fmt: skip
        check_gemm(alone, x, w, out_f32=out_f32)
        for config in CONFIGS:
            batched = emulated_gemm(lib, config, x, w, out_f32=out_f32)
            assert np.array_equal(bits(batched), bits(alone)), (config.name, out_f32)


def test_gemm_traps_when_the_launch_does_not_match_its_tile(lib: ctypes.CDLL) -> None:
    """The kernel checks its thread count and dynamic shared memory against its tile (a
    launcher drift fails loudly, not by reading past the buffer); here, in a child process,
    since __trap aborts."""
    config = tile_config(1)
    for threads, smem in (
        (config.num_threads, config.smem_bytes - 16),
        (2 * config.num_threads, config.smem_bytes),
    ):
        script = (
            "import ctypes, numpy as np\n"
            f"lib = ctypes.CDLL({lib._name!r})\n"
            "x = np.zeros(16, np.uint16); y = np.zeros(1, np.uint16)\n"
            "p = lambda a: a.ctypes.data_as(ctypes.c_void_p)\n"
            f"lib.run_gemm({config.kernel_name(False).encode()!r}, 1, 1, {threads}, {smem}, p(x), p(x), p(y), 1, 1, 16, 128)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and "__trap()" in done.stderr, (threads, smem, done.stderr)


# Split-K. K = 520 cuts into S = 1, 2 or 3 splits (lengths 640, 384, 256: the last split
# holds 136 and 8 elements), so partials, boundaries and the ragged tail all show.
SPLIT_K = 520


def test_the_split_counts_the_tests_use_cut_k_exactly() -> None:
    assert [split_length(SPLIT_K, s) for s in (1, 2, 3, 5)] == [640, 384, 256, 128]
    assert [-(-SPLIT_K // split_length(SPLIT_K, s)) for s in (1, 2, 3, 5)] == [1, 2, 3, 5]


# 5: past one batch of the last CTA's fold (common.cuh's kMergeBatch = 4)
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_split_gemm_matches_its_twin(
    lib: ctypes.CDLL, rng: np.random.Generator, config: TileConfig, splits: int
) -> None:
    """Every tile with S > 1 (the skinny one through the workspace and its last-CTA fold,
    the others folding in registers), odd M and N, against the exact-then-round-once twin:
    a fold of fp32 partials is one BF16 rounding away from it, like the plain chain."""
    m, n = 19, 75
    x = (rng.standard_normal((m, SPLIT_K)) * np.exp2(rng.integers(-3, 4, (m, 1)))).astype(BF16)
    w = (rng.standard_normal((n, SPLIT_K)) * 0.5).astype(BF16)
    for out_f32 in (False, True):
        got = emulated_gemm(lib, config, x, w, out_f32=out_f32, splits=splits)
        check_gemm(got, x, w, out_f32=out_f32)


def test_split_changes_the_order_so_every_route_must_split_alike(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """The reason the large-M tiles split as the skinny one does: the same rows under
    S = 1 and S = 3 differ in some bits (different fp32 orders), and each S gives the
    same bits on every tile."""
    x = (rng.standard_normal((16, SPLIT_K)) * np.exp2(rng.integers(-3, 4, (16, 1)))).astype(BF16)
    w = rng.standard_normal((64, SPLIT_K)).astype(BF16)
    by_split = {}
    for splits in (1, 3):
        results = [bits(emulated_gemm(lib, c, x, w, out_f32=True, splits=splits)) for c in CONFIGS]
        assert all(np.array_equal(r, results[0]) for r in results[1:]), splits
        by_split[splits] = results[0]
    assert not np.array_equal(by_split[1], by_split[3])


@pytest.mark.parametrize("splits", [1, 3])
def test_split_gemm_row_is_independent_of_m(
    lib: ctypes.CDLL, rng: np.random.Generator, splits: int
) -> None:
    """A row computed alone (M = 1: the skinny route, through the workspace when S > 1)
    bit-equals the same row inside M = 7 (skinny), 64 (mid) and 300 (big, folding in
    registers), all with the weight's one split count, as gemm launches them."""
    n = 37
    x = (rng.standard_normal((300, SPLIT_K)) * np.exp2(rng.integers(-3, 4, (300, 1)))).astype(BF16)
    w = rng.standard_normal((n, SPLIT_K)).astype(BF16)
    rows = [0, 5, 6, *rng.choice(np.arange(7, 300), size=3, replace=False)]
    assert [tile_config(m).name for m in (1, 7, 64, 300)] == ["skinny", "skinny", "mid", "big"]
    for out_f32 in (False, True):
        alone = {i: emulated_gemm(lib, None, x[i : i + 1], w, out_f32=out_f32, splits=splits)[0]
                 for i in rows}  # fmt: skip
        for m in (7, 64, 300):
            batched = emulated_gemm(lib, None, x[:m], w, out_f32=out_f32, splits=splits)
            check_gemm(batched, x[:m], w, out_f32=out_f32)
            for i in (r for r in rows if r < m):
                assert np.array_equal(bits(batched[i]), bits(alone[i])), (m, i, out_f32)


def test_split_gemm_does_not_depend_on_which_cta_finishes_last(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """On the skinny split route the tile's last CTA to count itself folds the partials:
    with the CTAs run last to first, another CTA (split 0, not S - 1) does it, and the
    bits are the same."""
    x = (rng.standard_normal((3, SPLIT_K)) * np.exp2(rng.integers(-3, 4, (3, 1)))).astype(BF16)
    w = rng.standard_normal((130, SPLIT_K)).astype(BF16)
    for out_f32 in (False, True):
        forward = emulated_gemm(lib, None, x, w, out_f32=out_f32, splits=3)
        lib.set_reversed_ctas(1)
        try:
            backward = emulated_gemm(lib, None, x, w, out_f32=out_f32, splits=3)
        finally:
            lib.set_reversed_ctas(0)
        assert np.array_equal(bits(forward), bits(backward)), out_f32
        check_gemm(forward, x, w, out_f32=out_f32)


def test_split_gemm_traps_on_a_split_length_off_its_tile(lib: ctypes.CDLL) -> None:
    """A split length that is not a whole number of the tile's k-tiles would cut a tile in
    two: the kernel refuses it (in a child process, since __trap aborts)."""
    config = CONFIGS[0]
    script = (
        "import ctypes, numpy as np\n"
        f"lib = ctypes.CDLL({lib._name!r})\n"
        "x = np.zeros(256, np.uint16); y = np.zeros(2, np.float32); c = np.zeros(4, np.uint32)\n"
        "p = lambda a: a.ctypes.data_as(ctypes.c_void_p)\n"
        f"lib.run_gemm_split(b'gemm_f32_skinny_split', 2, 1, {config.num_threads}, "
        f"{config.smem_bytes}, p(x), p(x), p(y), p(y), p(c), 1, 1, 256, 64)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "__trap()" in done.stderr, done.stderr


def test_split_k_splits_the_emulated_shapes_as_the_tests_do() -> None:
    """gemm itself cuts these narrow shapes into 3 splits (their grid is far from a wave,
    so split_k takes the most splits of at least 256 elements): S = 3 is the launched case."""
    assert split_k(37, SPLIT_K) == 3 and split_k(75, SPLIT_K) == 3
