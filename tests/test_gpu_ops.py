"""The small CUDA kernels against their NumPy twins, on fresh random inputs of the
default model's and Llama-3.1-8B's shapes, with every output poisoned first. And the
CuPy backend end to end on the default model: logits within BF16 tolerance of the
NumPy backend, and a sensible chat answer. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_support import dev, host, is_synthetic, needs_gpu, poisoned

from reprise.cuda.activation import silu_mul_ref
from reprise.cuda.dtypes import BF16, F32, to_bf16
from reprise.cuda.embedding import embed_ref
from reprise.cuda.kvcache import kv_cache_shape, kv_write_ref, rope_kv_write_ref
from reprise.cuda.rmsnorm import add_rmsnorm_ref, rmsnorm_ref
from reprise.cuda.rope import rope_ref, rope_table
from reprise.cuda.sampling import uniform

pytestmark = [
    pytest.mark.gpu,
    needs_gpu,
]

# (hidden, heads, kv_heads, head_dim, intermediate, vocab)
SHAPES = {
    "smollm2-135m": (576, 9, 3, 64, 1536, 49152),
    "llama-3.1-8b": (4096, 32, 8, 128, 14336, 128256),
}


def bf16_close(got: np.ndarray, want: np.ndarray, ulps: int = 1) -> None:
    """Every element within `ulps` BF16 ulps of the twin's (both BF16)."""
    assert got.dtype == BF16 == want.dtype
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any()
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(w), 1e-30))) - 7)
    assert np.all(np.abs(g - w) <= ulps * ulp + 1e-30), float(np.max(np.abs(g - w) / ulp))


def rows(rng: np.random.Generator, n: int, width: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((n, width)) * scale).astype(F32)


@pytest.mark.parametrize("shape", SHAPES)
def test_embed_is_an_exact_gather(cp, rng, shape: str) -> None:
    hidden, vocab = SHAPES[shape][0], SHAPES[shape][5]
    table = rows(rng, 1000, hidden).astype(BF16)
    ids = rng.integers(0, 1000, size=37).astype(np.int32)
    from reprise.cuda.launchers import embed

    out = embed(dev(table), dev(ids), out=poisoned((37, hidden), np.float32))
    assert np.array_equal(host(out), embed_ref(table, ids))
    assert vocab > 1000
    # p-tuning: ids >= 1000 (the table's rows) read the step's prompt-table rows
    prompt_rows = rows(rng, 5, hidden).astype(BF16)
    ids = rng.integers(0, 1005, size=37).astype(np.int32)
    ids[:2] = [1000, 1004]
    out = embed(dev(table), dev(ids), dev(prompt_rows), out=poisoned((37, hidden), np.float32))
    assert np.array_equal(host(out), embed_ref(table, ids, prompt_rows))


@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_and_add_rmsnorm_match_their_twins(cp, rng, shape: str) -> None:
    from reprise.cuda.launchers import add_rmsnorm, rmsnorm

    hidden = SHAPES[shape][0]
    x = rows(rng, 33, hidden, 3.0) * np.exp2(rng.integers(-4, 5, size=(33, 1))).astype(F32)
    weight = rows(rng, 1, hidden).astype(BF16)[0]
    out = rmsnorm(dev(x), dev(weight), 1e-5, out=poisoned((33, hidden), np.uint16))
    bf16_close(host(out), rmsnorm_ref(x, weight, 1e-5))
    delta = rows(rng, 33, hidden).astype(BF16)
    summed, normed = add_rmsnorm(dev(x), dev(delta), dev(weight), 1e-5)
    want_summed, want_normed = add_rmsnorm_ref(x, delta, weight, 1e-5)
    assert np.array_equal(host(summed), want_summed)  # one fp32 add: exact
    bf16_close(host(normed), want_normed)
    # a row's bits do not depend on the rows beside it
    alone = np.concatenate([host(rmsnorm(dev(x[i : i + 1]), dev(weight), 1e-5)) for i in range(33)])
    assert np.array_equal(alone.view(np.uint16), host(out).view(np.uint16))


@pytest.mark.parametrize("shape", SHAPES)
def test_rope_is_bit_exact_with_its_twin(cp, rng, shape: str) -> None:
    """Strided input rows, as the slices of the fused QKV output the model passes."""
    from reprise.cuda.launchers import rope

    _, heads, kv_heads, head_dim, _, _ = SHAPES[shape]
    cos, sin = rope_table(head_dim, 4096, 500000.0)
    qkv = rows(rng, 19, (heads + 2 * kv_heads) * head_dim).astype(BF16)
    positions = rng.integers(0, 4096, size=19).astype(np.int32)
    q = dev(qkv)[:, : heads * head_dim].reshape(19, heads, head_dim)
    out = rope(
        q, dev(positions), dev(cos), dev(sin), out=poisoned((19, heads, head_dim), np.uint16)
    )
    want = rope_ref(qkv[:, : heads * head_dim].reshape(19, heads, head_dim), positions, cos, sin)
    assert np.array_equal(host(out).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("shape", SHAPES)
def test_kv_write_fills_exactly_its_slots(cp, rng, shape: str) -> None:
    from reprise.cuda.launchers import kv_write

    _, heads, kv_heads, head_dim, _, _ = SHAPES[shape]
    block_size, num_blocks, layers = 16, 9, 3
    cache = (
        rng.standard_normal(kv_cache_shape(num_blocks, layers, kv_heads, block_size, head_dim))
    ).astype(BF16)
    slots = rng.choice(num_blocks * block_size, size=21, replace=False).astype(np.int64)
    qkv = rows(rng, 21, (heads + 2 * kv_heads) * head_dim).astype(BF16)
    k_end = (heads + kv_heads) * head_dim
    k = qkv[:, heads * head_dim : k_end].reshape(21, kv_heads, head_dim).copy()
    v_dev = dev(qkv)[:, k_end:].reshape(21, kv_heads, head_dim)  # strided, as in the model
    got = dev(cache)
    kv_write(got, 1, dev(k), v_dev, dev(slots))
    want = cache.copy()
    kv_write_ref(want, 1, k, qkv[:, k_end:].reshape(21, kv_heads, head_dim), slots)
    assert np.array_equal(host(got).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("shape", SHAPES)
def test_rope_kv_write_is_its_twin_bit_for_bit(cp, rng, shape: str) -> None:
    """The fused rope + KV write (what the model runs) against rope_kv_write_ref: the
    queries and every cache byte equal, on strided rows, other slots untouched."""
    from reprise.cuda.launchers import rope_kv_write

    _, heads, kv_heads, head_dim, _, _ = SHAPES[shape]
    block_size, num_blocks, layers = 16, 9, 3
    cache = rng.standard_normal(kv_cache_shape(num_blocks, layers, kv_heads, block_size, head_dim))
    cache = cache.astype(BF16)
    slots = rng.choice(num_blocks * block_size, size=21, replace=False).astype(np.int64)
    width = (heads + 2 * kv_heads) * head_dim
    wide = rows(rng, 21, width + 64).astype(BF16)  # rows strided, as slices are
    positions = rng.integers(0, 8192, 21).astype(np.int32)
    cos, sin = rope_table(head_dim, 8192, 500000.0)
    qkv = dev(wide)[:, :width].reshape(21, heads + 2 * kv_heads, head_dim)
    got = dev(cache)
    q = rope_kv_write(qkv, dev(positions), dev(cos), dev(sin), got, 2, dev(slots), heads)
    want = cache.copy()
    want_q = rope_kv_write_ref(wide[:, :width].reshape(21, heads + 2 * kv_heads, head_dim),
                               positions, cos, sin, want, 2, slots, heads)  # fmt: skip
    assert np.array_equal(host(q).view(np.uint16), want_q.view(np.uint16))
    assert np.array_equal(host(got).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("shape", SHAPES)
def test_silu_mul_matches_its_twin(cp, rng, shape: str) -> None:
    from reprise.cuda.launchers import silu_mul

    inter = SHAPES[shape][4]
    gate_up = (rng.standard_normal((5, 2 * inter)) * 4).astype(BF16)
    out = silu_mul(dev(gate_up), out=poisoned((5, inter), np.uint16))
    bf16_close(host(out), silu_mul_ref(gate_up))


def test_argmax_takes_the_lowest_id_on_ties(cp, rng) -> None:
    """Six rows (argmax_split: each over 32 CTAs) and twelve (a CTA a row), each twice on
    the stream (the split's counters left zero): np.argmax's ids, ties to the lowest."""
    from reprise.cuda.launchers import ARGMAX_SPLIT_MAX_ROWS, argmax

    logits = rows(rng, 12, 128256, 3.0)
    logits[1, [5, 70000, 128255]] = 100.0  # ties
    logits[2, :] = 0.0
    logits[3, -1] = np.inf
    for n in (6, 12):
        assert (n <= ARGMAX_SPLIT_MAX_ROWS) == (n == 6)
        for _ in range(2):
            got = host(argmax(dev(logits[:n]), out=poisoned((n,), np.int32)))
            assert got.tolist() == np.argmax(logits[:n], axis=1).tolist()
            assert got[1] == 5 and got[2] == 0


def test_device_sampling_draws_the_twins_tokens_and_ignores_its_batch(cp, rng) -> None:
    """Seeded draws on the device (sort of 64-bit keys, then sample_sorted) against the
    NumPy backend's sample_ref on the same logits: equal but for draws on a boundary of
    the running sum (expf vs NumPy's exp), and each row's token the same alone."""
    from dataclasses import fields

    from reprise.cuda.backend import NumpyBackend
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.sampling import Draws

    vocab, n = 128256, 48
    logits = rows(rng, n, vocab, 4.0)
    logits[1::4] = np.round(logits[1::4])  # coarse: ties rank by id
    logits[2, :7] = -0.0
    cases = [(t, k, p) for t in (0.6, 1.0, 1.7) for k in (vocab, 1, 40) for p in (1.0, 0.8)]
    params = [cases[r % len(cases)] for r in range(n)]
    draws = Draws(
        temperature=np.array([t for t, _, _ in params], np.float32),
        top_k=np.array([k for _, k, _ in params], np.int32),
        top_p=np.array([p for _, _, p in params], np.float32),
        min_p=np.array([(0.0, 0.05, 0.3)[r % 3] for r in range(n)], np.float32),
        seeds=rng.integers(0, 2**64, size=n, dtype=np.uint64),
        positions=rng.integers(0, 2**20, size=n).astype(np.int64),
    )
    want = NumpyBackend.sample(logits, draws)
    gpu = CupyBackend()
    got = host(gpu.sample(dev(logits), draws))
    assert np.mean(got == want) >= 0.95, (got.tolist(), want.tolist())
    assert (got >= 0).all()
    sub = Draws(**{f.name: getattr(draws, f.name)[1::2] for f in fields(Draws)})
    alone = host(gpu.sample(dev(np.ascontiguousarray(logits[1::2])), sub))
    assert np.array_equal(alone, got[1::2])  # every other row alone: the same tokens


def test_penalties_equal_the_twin_bit_for_bit(cp, rng) -> None:
    """The backend's penalize on the device (add_logit_bias, apply_penalties, then
    apply_token_mask): each listed logit the twin's fp32 bits (explicitly rounded ops, no
    FMA), masked ones -inf, the others untouched, each row the same alone."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.penalties import LogitBias, Penalties, TokenMask, mask_words, penalize_ref

    n, vocab = 16, 128256
    logits = rows(rng, n, vocab, 4.0)
    sizes = rng.integers(0, 3000, n)
    ids = np.concatenate([rng.choice(vocab, size=k, replace=False) for k in sizes])
    bias_sizes = rng.integers(0, 300, n)
    bias_ids = np.concatenate([rng.choice(vocab, size=k, replace=False) for k in bias_sizes])
    bias = LogitBias(
        offsets=np.cumsum([0, *bias_sizes]).astype(np.int32),
        ids=bias_ids.astype(np.int32),
        values=rng.uniform(-100, 100, bias_ids.size).astype(F32),
    )
    penalties = Penalties(
        repetition=rng.uniform(0.5, 2.0, n).astype(F32),
        frequency=rng.uniform(-2, 2, n).astype(F32),
        presence=rng.uniform(-2, 2, n).astype(F32),
        token_offsets=np.cumsum([0, *sizes]).astype(np.int32),
        token_ids=ids.astype(np.int32),
        output_counts=rng.integers(0, 5, ids.size).astype(np.int32),
        bias=bias,
        mask=TokenMask(rng.integers(0, 2**32, (n, mask_words(vocab)), dtype=np.uint32)),
    )
    penalties.mask.words[::2] = 0xFFFFFFFF  # every other row unconstrained
    want = logits.copy()
    penalize_ref(want, penalties)
    gpu = CupyBackend()
    got = dev(logits)
    gpu.penalize(got, penalties)
    assert np.array_equal(host(got).view(np.uint32), want.view(np.uint32))
    one, b = slice(*penalties.token_offsets[3:5]), slice(*bias.offsets[3:5])
    row_3 = Penalties(
        *(p[3:4] for p in (penalties.repetition, penalties.frequency, penalties.presence)),
        token_offsets=np.array([0, one.stop - one.start], np.int32),
        token_ids=penalties.token_ids[one],
        output_counts=penalties.output_counts[one],
        bias=LogitBias(np.array([0, b.stop - b.start], np.int32), bias.ids[b], bias.values[b]),
        mask=TokenMask(penalties.mask.words[3:4].copy()),
    )
    alone = dev(np.ascontiguousarray(logits[3:4]))
    gpu.penalize(alone, row_3)
    assert np.array_equal(host(alone)[0].view(np.uint32), want[3].view(np.uint32))


def test_philox_uniforms_equal_the_twin(cp, rng) -> None:
    from reprise.cuda.launchers import philox_uniform

    seeds = rng.integers(0, 2**64, size=300, dtype=np.uint64)
    seeds[:3] = [0, 1, 2**64 - 1]
    positions = rng.integers(0, 2**40, size=300).astype(np.int64)
    got = host(philox_uniform(dev(seeds), dev(positions)))
    want = np.array([uniform(int(s), int(p)) for s, p in zip(seeds, positions, strict=True)], F32)
    assert np.array_equal(got, want)


@pytest.mark.model
def test_cupy_backend_logits_match_numpy_backend_and_transformers(default_model_dir: Path) -> None:
    from reprise.daemon import Engine, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, return_logits=True, ignore_eos=True)
    prompt = "The capital of France is"
    gpu_engine = Engine.from_pretrained(default_model_dir, backend="cupy")
    assert gpu_engine.runner.model.ops.name == "cupy"
    gpu = gpu_engine.generate(prompt, params)
    cpu = Engine.from_pretrained(default_model_dir, backend="numpy").generate(prompt, params)
    assert rel_l2(gpu.logits[0], cpu.logits[0]) < 3e-2
    assert gpu.token_ids[:3] == cpu.token_ids[:3]

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    with torch.no_grad():
        ids = torch.tensor([gpu.prompt_token_ids], device="cuda")
        want = hf(ids).logits[0, -1].float().cpu().numpy()
    assert rel_l2(gpu.logits[0], want) < 3e-2

    if is_synthetic(default_model_dir):
        return  # random weights: the numbers above compare, an answer would be noise
    answer = gpu_engine.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=40, temperature=0),
    )
    assert "Paris" in answer.text and answer.finish_reason == "stop"


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_to_bf16_round_trip(cp, rng) -> None:
    x = to_bf16(rows(rng, 3, 7))
    assert np.array_equal(host(dev(x)).view(np.uint16), x.view(np.uint16))
