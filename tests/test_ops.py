"""Each NumPy twin against an independent float64 formulation, on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

from reprise.cuda.activation import silu_mul_ref
from reprise.cuda.attention import paged_attention_ref
from reprise.cuda.dtypes import BF16
from reprise.cuda.embedding import embed_ref
from reprise.cuda.gemm import gemm_ref
from reprise.cuda.kvcache import kv_cache_shape, kv_write_ref
from reprise.cuda.rmsnorm import add_rmsnorm_ref, rmsnorm_ref
from reprise.cuda.rope import Llama3Scaling, rope_inv_freq, rope_ref, rope_table

BF16_EPS = 2.0**-8  # half an ulp of BF16's 8-bit significand, relative


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(BF16)


def test_embed_gathers_exact_rows(rng: np.random.Generator) -> None:
    table = bf16(rng, 100, 24)
    ids = rng.integers(0, 100, size=37)
    out = embed_ref(table, ids)
    assert out.dtype == np.float32
    assert np.array_equal(out, table.astype(np.float64)[ids])


def test_rmsnorm_matches_float64(rng: np.random.Generator) -> None:
    x = rng.standard_normal((33, 576)).astype(np.float32) * 3
    w = bf16(rng, 576)
    out = rmsnorm_ref(x, w, 1e-5)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * w.astype(np.float64)
    assert out.dtype == BF16
    err = np.abs(out.astype(np.float64) - want) / (np.abs(want) + 1e-30)
    assert err.max() <= 1.01 * BF16_EPS * 2  # one rounding to BF16, fp32 math on top


def test_add_rmsnorm_adds_in_fp32(rng: np.random.Generator) -> None:
    residual = rng.standard_normal((5, 64)).astype(np.float32)
    delta = bf16(rng, 5, 64)
    w = bf16(rng, 64)
    summed, normed = add_rmsnorm_ref(residual, delta, w, 1e-6)
    assert summed.dtype == np.float32
    assert np.array_equal(summed, residual + delta.astype(np.float32))
    assert np.array_equal(normed, rmsnorm_ref(summed, w, 1e-6))


def test_gemm_matches_float64_and_rounds_once(rng: np.random.Generator) -> None:
    x, w = bf16(rng, 17, 256), bf16(rng, 96, 256)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    out = gemm_ref(x, w)
    assert out.dtype == BF16 and out.shape == (17, 96)
    assert rel_l2(out, want) < 2 * BF16_EPS
    logits = gemm_ref(x, w, out_f32=True)
    assert logits.dtype == np.float32
    assert rel_l2(logits, want) < 1e-6
    # widening the weight beforehand (the NumPy backend's fast path) changes nothing
    assert np.array_equal(gemm_ref(x, w.astype(np.float32), out_f32=True), logits)


def test_silu_mul_matches_float64(rng: np.random.Generator) -> None:
    gu = bf16(rng, 9, 2 * 80, scale=3)
    g, u = gu[:, :80].astype(np.float64), gu[:, 80:].astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    out = silu_mul_ref(gu)
    assert out.shape == (9, 80) and out.dtype == BF16
    assert rel_l2(out, want) < 2 * BF16_EPS


@pytest.mark.parametrize("scaling", [None, Llama3Scaling(8.0, 1.0, 4.0, 64)])
def test_rope_is_a_rotation_by_position(
    rng: np.random.Generator, scaling: Llama3Scaling | None
) -> None:
    head_dim, theta = 64, 10000.0
    cos, sin = rope_table(head_dim, 512, theta, scaling)
    x = bf16(rng, 20, 3, head_dim)
    positions = rng.integers(0, 512, size=20)
    out = rope_ref(x, positions, cos, sin)
    # independent float64 formulation: the half-split pairs (i, i + half) as complex numbers
    half = head_dim // 2
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    z = x[..., :half].astype(np.float64) + 1j * x[..., half:].astype(np.float64)
    z = z * np.exp(1j * positions[:, None, None] * inv_freq)
    want = np.concatenate([z.real, z.imag], axis=-1)
    assert rel_l2(out, want) < 2 * BF16_EPS
    # norms of each pair are preserved up to BF16 rounding
    assert np.allclose(
        np.abs(z),
        np.hypot(out[..., :half].astype(np.float64), out[..., half:].astype(np.float64)),
        rtol=1e-2,
    )


def test_llama3_scaling_divides_low_frequencies_only() -> None:
    plain = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    wavelen = 2 * np.pi / plain
    assert np.allclose(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    assert np.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    medium = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert medium.any()
    assert np.all((scaled[medium] <= plain[medium]) & (scaled[medium] >= plain[medium] / 8))


def test_kv_write_fills_exactly_its_slots(rng: np.random.Generator) -> None:
    cache = np.full(kv_cache_shape(6, 2, 3, 4, 8), np.nan, dtype=BF16)
    slots = rng.permutation(24)[:7]
    k, v = bf16(rng, 7, 3, 8), bf16(rng, 7, 3, 8)
    kv_write_ref(cache, 1, k, v, slots)
    for t, slot in enumerate(slots):
        assert np.array_equal(cache[slot // 4, 1, 0, :, slot % 4], k[t])
        assert np.array_equal(cache[slot // 4, 1, 1, :, slot % 4], v[t])
    written = np.zeros(cache.shape, dtype=bool)
    written[slots // 4, 1, :, :, slots % 4] = True
    assert np.isnan(cache.astype(np.float32)[~written]).all()  # nothing else touched


def _dense_attention(q, keys, values, q_positions, window=0):  # float64, causal, GQA
    num_heads, num_kv = q.shape[1], keys.shape[1]
    group = num_heads // num_kv
    out = np.zeros(q.shape)
    key_pos = np.arange(len(keys))[None]
    visible = key_pos <= q_positions[:, None]
    if window:  # transformers' sliding_window_overlay: kv_idx > q_idx - window
        visible &= key_pos > q_positions[:, None] - window
    for h in range(num_heads):
        s = q[:, h] @ keys[:, h // group].T / np.sqrt(q.shape[-1])
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ values[:, h // group]
    return out


def _fill_sequences(rng, block_size, seq_specs, num_heads=6, num_kv=2, head_dim=32, num_layers=2):
    """Random K/V for each (seq_len, q_len) in a shuffled block pool; returns the op's inputs."""
    total_blocks = sum(-(-s // block_size) for s, _ in seq_specs) + 3
    cache = np.zeros(kv_cache_shape(total_blocks, num_layers, num_kv, block_size, head_dim), BF16)
    free = list(rng.permutation(total_blocks))
    tables, keys, values, qs = [], [], [], []
    for seq_len, q_len in seq_specs:
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        k, v = bf16(rng, seq_len, num_kv, head_dim), bf16(rng, seq_len, num_kv, head_dim)
        pos = np.arange(seq_len)
        kv_write_ref(
            cache, 1, k, v, np.asarray(table)[pos // block_size] * block_size + pos % block_size
        )
        tables.append(table)
        keys.append(k)
        values.append(v)
        qs.append(bf16(rng, q_len, num_heads, head_dim))
    width = max(len(t) for t in tables)
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    return cache, block_tables, keys, values, qs


@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_matches_dense_float64(rng: np.random.Generator, block_size: int) -> None:
    specs = [(1, 1), (45, 45), (70, 1), (33, 7), (block_size * 2, block_size)]
    cache, block_tables, keys, values, qs = _fill_sequences(rng, block_size, specs)
    q = np.concatenate(qs)
    starts = np.cumsum([0] + [ql for _, ql in specs]).astype(np.int32)
    seq_lens = np.array([s for s, _ in specs], dtype=np.int32)
    out = paged_attention_ref(q, cache, 1, block_tables, seq_lens, starts, 1 / np.sqrt(32))
    assert out.dtype == BF16 and out.shape == q.shape
    for b, (seq_len, q_len) in enumerate(specs):
        want = _dense_attention(
            qs[b].astype(np.float64),
            keys[b].astype(np.float64),
            values[b].astype(np.float64),
            np.arange(seq_len - q_len, seq_len),
        )
        assert rel_l2(out[starts[b] : starts[b + 1]], want) < 1e-2, b


def test_paged_attention_query_independent_of_chunking(rng: np.random.Generator) -> None:
    """A query's output is bit-identical whether it runs with its whole prompt, in a
    chunk of any size, or alone as a decode step."""
    seq_len = 75
    cache, block_tables, _, _, qs = _fill_sequences(rng, 16, [(seq_len, seq_len)])
    q = qs[0]

    def run(first: int, last: int) -> np.ndarray:  # queries at positions [first, last)
        return paged_attention_ref(
            q[first:last],
            cache,
            1,
            block_tables,
            np.array([last], np.int32),
            np.array([0, last - first], np.int32),
            1 / np.sqrt(32),
        )

    whole = run(0, seq_len)
    for chunk in (1, 7, 16, 32, 50):
        pieces = np.concatenate([run(s, min(s + chunk, seq_len)) for s in range(0, seq_len, chunk)])
        assert np.array_equal(pieces.view(np.uint16), whole.view(np.uint16)), chunk
