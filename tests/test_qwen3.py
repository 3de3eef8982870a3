"""The Qwen3 family (registry.py): Llama's forward plus an RMSNorm of each query and key
head before RoPE (`head_rmsnorm`). Its twin against the definition, its kernel in the
emulator against the twin, the forward against transformers' own Qwen3ForCausalLM on the
same weights (as close as transformers' own BF16 forward is), synthetic folders, reuse
invariance, and the GPU backend's whole forward through the emulated CuPy."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
from test_model_reference import TINY, hf_logits, rel_l2_rows, run_ours
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy  # noqa: F401 (a fixture)

from reprise.cuda.dtypes import BF16
from reprise.cuda.rmsnorm import head_rmsnorm_ref, rmsnorm_ref
from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.config import ModelConfig, ModelConfigError
from reprise.daemon.model.modelinfo import model_info
from reprise.daemon.model.synth import SHAPES, synth_model, tensor_shapes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QWEN3 = {**TINY, "rope_theta": 1e6, "rms_norm_eps": 1e-6}


def test_the_family_and_its_refusals() -> None:
    config = ModelConfig.from_dict({**QWEN3, "architectures": ["Qwen3ForCausalLM"]})
    assert config.qk_norm and not config.qkv_bias
    assert ModelConfig.from_dict({**QWEN3, "model_type": "qwen3"}).qk_norm
    assert not ModelConfig.from_dict({**QWEN3, "model_type": "qwen2"}).qk_norm
    with pytest.raises(ModelConfigError, match="attention_bias=true is not supported"):
        ModelConfig.from_dict({**QWEN3, "model_type": "qwen3", "attention_bias": True})
    windowed = ModelConfig.from_dict({**QWEN3, "model_type": "qwen3", "use_sliding_window": True,
                                      "sliding_window": 64, "max_window_layers": 0})  # fmt: skip
    assert windowed.layer_windows == (64,) * QWEN3["num_hidden_layers"]
    assert windowed.max_position_embeddings == QWEN3["max_position_embeddings"]


def test_the_twin_normalizes_each_query_and_key_head(rng: np.random.Generator) -> None:
    """Each query head by q_weight, each key head by k_weight, as rmsnorm_ref does a row;
    values untouched; against the definition in float64 (within a BF16 rounding)."""
    tokens, heads, kv_heads, head_dim = 5, 6, 2, 64
    qkv = (rng.standard_normal((tokens, heads + 2 * kv_heads, head_dim)) * 3).astype(BF16)
    q_w, k_w = (rng.standard_normal((2, head_dim)) * 0.5 + 1).astype(BF16)
    out = head_rmsnorm_ref(qkv, q_w, k_w, heads, 1e-6)
    assert np.array_equal(out[:, heads + kv_heads :].view(np.uint16),
                          qkv[:, heads + kv_heads :].view(np.uint16))  # fmt: skip
    x = qkv.astype(np.float64)
    for part, weight in ((slice(0, heads), q_w), (slice(heads, heads + kv_heads), k_w)):
        exact = x[:, part] / np.sqrt((x[:, part] ** 2).mean(-1, keepdims=True) + 1e-6)
        exact *= weight.astype(np.float64)
        assert np.abs(out[:, part].astype(np.float64) - exact).max() <= 2**-7 * np.abs(exact).max()
        rows = qkv[:, part].reshape(-1, head_dim)
        assert np.array_equal(out[:, part].reshape(-1, head_dim).view(np.uint16),
                              rmsnorm_ref(rows, weight, 1e-6).view(np.uint16))  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_the_kernel_matches_its_twin(emu_lib: ctypes.CDLL, rng: np.random.Generator,
                                     head_dim: int) -> None:  # fmt: skip
    """In place: queries and keys within one BF16 ulp of the twin (rmsnorm's tree), the
    values' bits kept."""
    tokens, heads, kv_heads = 7, 4, 2
    qkv = (rng.standard_normal((tokens, heads + 2 * kv_heads, head_dim))
           * np.exp2(rng.integers(-3, 4, (tokens, heads + 2 * kv_heads, 1)))).astype(BF16)  # fmt: skip
    q_w, k_w = rng.standard_normal((2, head_dim)).astype(BF16)
    want = head_rmsnorm_ref(qkv, q_w, k_w, heads, 1e-6)
    got = qkv.copy()
    ptr = ctypes.c_void_p
    emu_lib.run_head_rmsnorm(tokens, ptr(got.ctypes.data), ptr(q_w.ctypes.data),
                             ptr(k_w.ctypes.data), heads, kv_heads, head_dim,
                             ctypes.c_float(1e-6))  # fmt: skip
    bits, ref = got.view(np.uint16).astype(np.int32), want.view(np.uint16).astype(np.int32)
    assert np.abs(bits - ref).max() <= 1
    assert np.array_equal(bits[:, heads + kv_heads :], ref[:, heads + kv_heads :])


def make_hf_qwen3(out: Path, seed: int, **overrides) -> tuple[torch.nn.Module, np.ndarray]:
    """A random Qwen3ForCausalLM saved as BF16 safetensors: returned in fp32 (the same
    values), with transformers' own BF16 forward's logits of PROMPT (its rounding error,
    the yardstick for ours)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**QWEN3, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    with torch.no_grad():
        bf16 = model(torch.tensor(PROMPT[None])).logits[0].float().numpy()
    return model.float().eval(), bf16


PROMPT = np.random.default_rng(7).integers(0, TINY["vocab_size"], size=150)


@pytest.mark.parametrize(
    "overrides", [{}, {"head_dim": 24}, {"tie_word_embeddings": True}], ids=["plain", "d24", "tied"]
)
def test_logits_match_transformers_qwen3(tmp_path: Path, overrides: dict) -> None:
    ref, bf16 = make_hf_qwen3(tmp_path, seed=5, **overrides)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3ForCausalLM"]
    ours = run_ours(tmp_path, PROMPT, [150])
    want = hf_logits(ref, PROMPT)
    err = rel_l2_rows(ours, want)
    # as close to the fp32 forward as transformers' own BF16 one is (or the Llama tolerance)
    assert err.max() <= max(2e-2, rel_l2_rows(bf16, want).max()), err.max()
    assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.95
    # the norms matter: with their weights at one, transformers is far from us
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    assert rel_l2_rows(ours, hf_logits(ref, PROMPT)).mean() > 5 * err.max()
    chunked = run_ours(tmp_path, PROMPT, [1, 16, 33, 100])
    assert np.array_equal(ours.view(np.uint32), chunked.view(np.uint32))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny-qwen3", tmp_path_factory.mktemp("synth") / "tiny-qwen3", seed=3)


def test_a_synthetic_qwen3_runs_in_the_engine_as_transformers_does(tiny_qwen3: Path) -> None:
    raw = json.loads((tiny_qwen3 / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and raw["model_type"] == "qwen3"
    index = json.loads((tiny_qwen3 / "model.safetensors.index.json").read_text())
    assert "model.layers.1.self_attn.k_norm.weight" in index["weight_map"]
    info = model_info(tiny_qwen3)
    assert info["architecture"] == "Qwen3ForCausalLM" and info["qk_norm"] is True
    assert info["parameters"] == sum(
        int(np.prod(d)) for _, d in tensor_shapes(SHAPES["tiny-qwen3"])
    )
    engine = Engine.from_pretrained(
        tiny_qwen3, backend="numpy", num_device_blocks=32, block_size=16
    )
    prompt = np.random.default_rng(0).integers(0, 1024, size=50).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
    first, second = engine.generate(prompt, params), engine.generate(prompt, params)
    assert second.cached_tokens == 48 and second.token_ids == first.token_ids
    assert np.array_equal(second.logits.view(np.uint32), first.logits.view(np.uint32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        want = hf(torch.tensor([prompt + first.token_ids[:5]])).logits[0, -6:].numpy()
    assert rel_l2_rows(first.logits, want).max() < 2e-2
    assert first.token_ids == want.argmax(-1).tolist()


def test_qwen3_06b_has_the_model_cards_parameter_counts() -> None:
    """Qwen3-0.6B's card: 0.6B parameters, 0.44B of them not the (tied) embedding; the
    config's count (q and k norms included) is its tensors'."""
    from reprise.daemon.model import synth

    config = synth.synth_config("qwen3-0.6b")
    total = sum(int(np.prod(d)) for _, d in tensor_shapes(SHAPES["qwen3-0.6b"]))
    assert config.num_parameters() == total
    assert round(total / 1e9, 1) == 0.6
    assert round((total - config.vocab_size * config.hidden_size) / 1e9, 2) == 0.44


def test_the_gpu_backend_runs_qwen3(cupy_kind: str, tiny_qwen3: Path) -> None:  # noqa: F811
    """CupyBackend (emulated here, or a real device), head_rmsnorm's kernel included: the
    same tokens as NumPy, logits within a few BF16 ulps; graphs keep eager decode's bits."""
    gpu_forward_matches_numpy(cupy_kind, tiny_qwen3)
