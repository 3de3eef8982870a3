"""The persistent layer tail (decode_block.cu; decode_block_kernel.BY_DEFAULT, off until
this runs) on a GPU: its (summed, normed) bit-equal to the op-by-op path it replaces
(gemm_add_rmsnorm, swiglu, gemm_add_rmsnorm: on sm_90 the Hopper GEMM's launches on the
packed weights, gated where GATED_BY_DEFAULT packs gate_up so), at the default model's and
Llama-3.1-8B's shapes and a decode's rows, on a full grid and on a few CTAs; and an engine
with it on against one without. A file of its own, run last by scripts/gpu_followup.sh: a
grid barrier whose CTAs are not all resident would hang, and a hang must not cost the other
tests. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import dev, host, needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]
EPS = 1e-5
# (q_size, hidden, inter): SmolLM2-135M's, Llama-3.1-8B's
SHAPES = {"default": (576, 576, 1536), "8b": (4096, 4096, 14336)}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("gated", [False, True], ids=["plain-gate-up", "gated-gate-up"])
def test_the_persistent_tail_gives_the_op_by_op_bits(
    rng, shape: str, rows: int, gated: bool, monkeypatch
) -> None:
    """gated: gate_up packed for the gated epilogue (GATED_BY_DEFAULT on, sm_90), its rows
    interleaved: the op-by-op path then runs the gated epilogue (itself pending), the
    persistent tail pairs the interleaved columns."""
    from reprise.cuda import decode_block_kernel, gemm_sm90_plan
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.dtypes import BF16

    q_size, hidden, inter = SHAPES[shape]
    monkeypatch.setattr(gemm_sm90_plan, "GATED_BY_DEFAULT", gated)
    ops = CupyBackend()

    w_o = ops.linear_weight((rng.standard_normal((hidden, q_size)) * q_size**-0.5).astype(BF16))
    w_gu = ops.gate_up_weight(
        (rng.standard_normal((2 * inter, hidden)) * hidden**-0.5).astype(BF16)
    )
    w_down = ops.linear_weight((rng.standard_normal((hidden, inter)) * inter**-0.5).astype(BF16))
    if not decode_block_kernel.takes(rows, w_o, w_gu, w_down):
        pytest.skip(f"the tail does not take {rows} rows of {shape}'s weights (its shared memory)")
    attn = dev(rng.standard_normal((rows, q_size)).astype(BF16))
    residual = dev((rng.standard_normal((rows, hidden)) * 4).astype(np.float32))
    norms = [dev((1 + 0.25 * rng.standard_normal(hidden)).astype(BF16)) for _ in range(2)]
    summed1, x1 = ops.gemm_add_rmsnorm(attn, w_o, residual, norms[0], EPS)
    want = [
        host(a) for a in ops.gemm_add_rmsnorm(ops.swiglu(x1, w_gu), w_down, summed1, norms[1], EPS)
    ]
    for num_ctas in (None, 5, None):  # one CTA an SM, a few, again (counters left zero)
        got = decode_block_kernel.decode_tail(attn, w_o, w_gu, w_down, residual, *norms, EPS,
                                              num_ctas=num_ctas)  # fmt: skip
        for g, w, what in zip((host(a) for a in got), want, ("summed", "normed"), strict=True):
            dtype = np.uint32 if w.dtype == np.float32 else np.uint16
            assert np.array_equal(g.view(dtype), w.view(dtype)), (shape, rows, num_ctas, what)


# (heads, kv_heads, head_dim)
HEADS = {"default": (9, 3, 64), "8b": (32, 8, 128)}


def layer_weights(ops, rng, shape: str) -> tuple:
    """o_proj, gate_up, down_proj and the next qkv of `shape`, as `ops` loads them (on sm_90
    packed for the Hopper GEMM, gate_up gated where GATED_BY_DEFAULT is on)."""
    from reprise.cuda.dtypes import BF16

    q_size, hidden, inter = SHAPES[shape]
    heads, kv_heads, head_dim = HEADS[shape]

    def random(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) * k**-0.5).astype(BF16)

    return (ops.linear_weight(random(hidden, q_size)), ops.gate_up_weight(random(2 * inter, hidden)),
            ops.linear_weight(random(hidden, inter)),
            ops.linear_weight(random((heads + 2 * kv_heads) * head_dim, hidden)))  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_next_layers_head_gives_gemm_rope_kv_writes_bits(rng, shape: str, rows: int) -> None:
    """The tail with the next layer's head in its launch (decode_tail_qkv) against
    decode_tail then gemm_rope_kv_write (on sm_90 the Hopper GEMM's launch with or without
    its rope epilogue, as the plan takes it): the rotated queries, the residual stream and
    every byte of the cache."""
    from reprise.cuda import decode_block_kernel
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.dtypes import BF16
    from reprise.cuda.rope import rope_table

    q_size, hidden, _ = SHAPES[shape]
    heads, kv_heads, head_dim = HEADS[shape]
    ops = CupyBackend()
    w_o, w_gu, w_down, w_qkv = layer_weights(ops, rng, shape)
    if not decode_block_kernel.takes(rows, w_o, w_gu, w_down, w_qkv):
        pytest.skip(f"the tail does not take {rows} rows of {shape}'s weights")
    cos, sin = (dev(t) for t in rope_table(head_dim, 8192, 500000.0))
    positions = dev(rng.integers(0, 8000, rows).astype(np.int32))
    slots = dev(rng.choice(64 * 16, rows, replace=False).astype(np.int64))
    cache0 = rng.standard_normal((64, 3, 2, kv_heads, 16, head_dim)).astype(BF16)
    attn = dev(rng.standard_normal((rows, q_size)).astype(BF16))
    residual = dev((rng.standard_normal((rows, hidden)) * 4).astype(np.float32))
    norms = [dev((1 + 0.25 * rng.standard_normal(hidden)).astype(BF16)) for _ in range(2)]
    results = []
    for persistent in (False, True):
        cache = dev(cache0)
        rope = (positions, cos, sin, cache, 2, slots, heads)
        if persistent:
            head = decode_block_kernel.NextHead(w_qkv, decode_block_kernel.Rope(*rope))
            summed, q = decode_block_kernel.decode_tail(attn, w_o, w_gu, w_down, residual, *norms, EPS,
                                                        head=head)  # fmt: skip
        else:
            summed, x = ops.decode_tail(attn, w_o, w_gu, w_down, residual, *norms, EPS)
            q = ops.gemm_rope_kv_write(x, w_qkv, *rope)
        results.append([host(a) for a in (summed, q, cache)])
    for got, want, what in zip(results[1], results[0], ("summed", "q", "cache"), strict=True):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (shape, rows, what)


def test_the_persistent_tail_engine_changes_no_logit(default_model_dir, monkeypatch) -> None:
    """The default model with decode_block_kernel.BY_DEFAULT on (every decode step's
    layers persistent launches, captured in the CUDA graphs: from attention on where it
    splits, from o_proj on where it does not) against the default engine: the same tokens
    and logits bits for a prompt and its cached repeat, batch 1 and 3."""
    from reprise.cuda import decode_block_kernel
    from reprise.daemon import Engine, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, return_logits=True)
    prompts = [
        np.random.default_rng(s).integers(100, 49000, size=150 + 7 * s).tolist() for s in range(3)
    ]
    outs = []
    for on in (False, True):
        monkeypatch.setattr(decode_block_kernel, "BY_DEFAULT", on)
        engine = Engine.from_pretrained(default_model_dir, backend="cupy", num_device_blocks=128)
        outs.append(
            [engine.generate(prompts[0], params) for _ in range(2)]
            + engine.generate(prompts, [params] * 3)
        )
        del engine
    for got, want in zip(outs[1], outs[0], strict=True):
        assert got.token_ids == want.token_ids
        assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    "seq_lens", [[700], [300, 37, 2100], [37], [200, 5, 256]],
    ids=["alone", "three", "one-lane-alone", "one-lane-three"],
)  # fmt: skip
def test_the_layer_with_its_attention_gives_the_op_by_op_bits(rng, shape: str, seq_lens) -> None:
    """decode_layer (the layer's attention as virtual CTAs of the tensor-core kernel inside
    the persistent launch, then the tail and the next layer's head) against the tensor-core
    attention's own launch then decode_tail_qkv: the residual stream, the next layer's
    queries and every byte of the cache; and without the head (decode_tail). Short tables
    plan one lane: the standalone launch runs the one-lane kernel, the layer its split
    kernel's body with the lone lane merging through the workspace."""
    from test_decode_block_emulated import attention_case

    from reprise.cuda import decode_block_kernel
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.dtypes import BF16
    from reprise.cuda.rope import rope_table

    q_size, hidden, _ = SHAPES[shape]
    heads, kv_heads, head_dim = HEADS[shape]
    rows = len(seq_lens)
    ops = CupyBackend(attention="tensor-cores")
    w_o, w_gu, w_down, w_qkv = layer_weights(ops, rng, shape)
    case = attention_case(
        rng, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=32
    )
    cos, sin = (dev(t) for t in rope_table(head_dim, 8192, 500000.0))
    positions = dev(np.array(seq_lens, dtype=np.int32))
    slots = dev(rng.choice(case["cache"].shape[0] * 32, rows, replace=False).astype(np.int64))
    residual = dev((rng.standard_normal((rows, hidden)) * 4).astype(np.float32))
    norms = [dev((1 + 0.25 * rng.standard_normal(hidden)).astype(BF16)) for _ in range(2)]
    if not decode_block_kernel.takes(rows, w_o, w_gu, w_down, w_qkv):
        pytest.skip(f"the tail does not take {rows} rows of {shape}'s weights")
    for with_head in (True, False):
        results = []
        for persistent in (False, True):
            cache = dev(case["cache"])
            attention = decode_block_kernel.Attention(
                dev(case["q"]), cache, case["layer"], dev(case["block_tables"]), dev(case["seq_lens"]),
                dev(case["query_start_loc"]), case["scale"],
            )  # fmt: skip
            rope = (positions, cos, sin, cache, 2, slots, heads)
            head = (
                decode_block_kernel.NextHead(w_qkv, decode_block_kernel.Rope(*rope))
                if with_head
                else None
            )
            if persistent:
                assert decode_block_kernel.layer_plan(attention, rows) is not None
                out = decode_block_kernel.decode_layer(attention, w_o, w_gu, w_down, residual, *norms, EPS,
                                                       head=head)  # fmt: skip
            else:
                attn = ops.paged_attention(*attention).reshape(rows, q_size)
                tail = (w_o, w_gu, w_down, residual, *norms, EPS)
                out = (
                    ops.decode_tail_qkv(attn, *tail, w_qkv, *rope)
                    if with_head
                    else ops.decode_tail(attn, *tail)
                )
            results.append([host(a) for a in (*out, cache)])
        for got, want, what in zip(
            results[1], results[0], ("summed", "q or normed", "cache"), strict=True
        ):
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
                shape,
                seq_lens,
                with_head,
                what,
            )


@pytest.mark.parametrize(
    "seq_lens", [[700], [300, 37, 2100], [37]], ids=["alone", "three", "one-lane"]
)
@pytest.mark.parametrize("last_head", [False, True], ids=["last-norm", "last-head"])
def test_layers_in_one_launch_give_the_layer_by_layer_bits(rng, seq_lens, last_head) -> None:
    """decode_layers at the default model's shapes (four layers in one launch: each its
    attention, its tail and the next layer's head; the residual stream carried in shared
    memory, the later layers' queries through the launch's own buffer) against the same
    layers one at a time op by op (layer_by_layer on CupyBackend, the flag off): the
    residual stream, the last layer's normed rows or queries, and every byte of the cache.
    Each head writes its sequence's last slot, which the next layer's attention reads: what
    one CTA wrote, another reads after a grid barrier, on a real memory hierarchy (the
    emulator has no stale L1 to show)."""
    from test_decode_block_emulated import attention_case, last_positions

    from reprise.cuda import decode_block_kernel
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.dtypes import BF16
    from reprise.cuda.protocol import layer_by_layer
    from reprise.cuda.rope import rope_table

    _, hidden, _ = SHAPES["default"]
    heads, kv_heads, head_dim = HEADS["default"]
    rows, count, first = len(seq_lens), 4, 1
    ops = CupyBackend(attention="tensor-cores")
    case = attention_case(rng, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          block_size=32, layers=first + count + 1)  # fmt: skip
    layers = []
    for i in range(count):
        w_o, w_gu, w_down, w_qkv = layer_weights(ops, rng, "default")
        norms = [dev((1 + 0.25 * rng.standard_normal(hidden)).astype(BF16)) for _ in range(2)]
        head = w_qkv if i < count - 1 or last_head else None
        layers.append(decode_block_kernel.LayerWeights(w_o, w_gu, w_down, *norms, head))
    cos, sin = (dev(t) for t in rope_table(head_dim, 8192, 100000.0))
    positions, slots = (dev(a) for a in last_positions(case, 32))
    residual = dev((rng.standard_normal((rows, hidden)) * 4).astype(np.float32))
    results = []
    for persistent in (False, True, True):  # twice: the counters and barrier left zero
        cache = dev(case["cache"])
        attention = decode_block_kernel.Attention(
            dev(case["q"]), cache, first, dev(case["block_tables"]), dev(case["seq_lens"]),
            dev(case["query_start_loc"]), case["scale"],
        )  # fmt: skip
        rope = (positions, cos, sin, cache, slots, heads)
        if persistent:
            assert decode_block_kernel.layer_plan(attention, rows) is not None
            assert decode_block_kernel.layers_take(attention, layers)
            out = decode_block_kernel.decode_layers(
                attention, layers, residual, EPS,
                rope=decode_block_kernel.Rope(*rope[:4], first + 1, *rope[4:]),
            )  # fmt: skip
        else:
            out = layer_by_layer(ops, tuple(attention), layers, residual, EPS, rope)
        results.append([host(a) for a in (*out, cache)])
    for run in results[1:]:
        for got, want, what in zip(
            run, results[0], ("summed", "normed or q", "cache"), strict=True
        ):
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (seq_lens, what)
