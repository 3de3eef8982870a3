"""The Phi-3 family (registry.py): Llama's forward, its checkpoint's q, k and v in one
`qkv_proj` and gate and up in one `gate_up_proj` (packed as the engine packs them), and
a sliding window on every layer. Against
transformers' own Phi3ForCausalLM on the same weights; chunked and cached bits kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_model_reference import (
    hf_logits,
    matches_transformers,
    rel_l2_rows,
    run_ours,
    save_widened,
)

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.modelinfo import model_info

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PHI3 = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip


def make_hf_phi3(out: Path, seed: int, **overrides) -> torch.nn.Module:
    """A random Phi3ForCausalLM saved as BF16 safetensors; returned in fp32 (same values),
    its weights widened as test_model_reference's are."""
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**PHI3, **overrides}))
    return save_widened(model, out, PHI3["vocab_size"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers_phi3(tmp_path: Path, tied: bool) -> None:
    ref = make_hf_phi3(tmp_path, seed=3 + tied, tie_word_embeddings=tied, sliding_window=None)
    prompt = np.random.default_rng(7).integers(0, PHI3["vocab_size"], size=150)
    want = hf_logits(ref, prompt)
    for chunks in ([150], [1, 40, 64, 45]):
        ours = run_ours(tmp_path, prompt, chunks)
        err = rel_l2_rows(ours, want)
        assert err.max() < 2e-2, err.max()  # test_model_reference's tolerance for Llama
        assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.95
    # the fused rows' order matters: gate and up swapped, transformers is far from us
    with torch.no_grad():
        for layer in ref.model.layers:
            w = layer.mlp.gate_up_proj.weight
            w.copy_(torch.cat([w[PHI3["intermediate_size"] :], w[: PHI3["intermediate_size"]]]))
    assert rel_l2_rows(ours, hf_logits(ref, prompt)).mean() > 10 * err.max()


def test_a_sliding_window_binds_past_itself(tmp_path: Path) -> None:
    """With a window of 64, a 150-token prompt's later rows see only their last 64 keys,
    as transformers' do; the context stays the model's, and model info names the window."""
    ref = make_hf_phi3(tmp_path, seed=5, sliding_window=64)
    config = ModelConfig.from_dir(tmp_path)
    assert config.max_position_embeddings == 512
    assert config.layer_windows == (64,) * PHI3["num_hidden_layers"]
    info = model_info(tmp_path)
    assert info["context_length"] == 512 and info["sliding_windows"] == "64 on every layer"
    assert info["architecture"] == "Phi3ForCausalLM"
    ours, prompt, err = matches_transformers(tmp_path, ref, PHI3["vocab_size"])
    full = make_hf_phi3(tmp_path / "full", seed=5, sliding_window=None)
    assert rel_l2_rows(ours[100:], hf_logits(full, prompt)[100:]).min() > 10 * err.max()


def test_a_window_at_least_the_context_changes_nothing(tmp_path: Path) -> None:
    make_hf_phi3(tmp_path, seed=6, sliding_window=600)
    config = ModelConfig.from_dir(tmp_path)
    assert config.max_position_embeddings == 512 and config.layer_windows is None
    assert model_info(tmp_path)["sliding_windows"] is None


def test_cached_and_chunked_bits_are_kept(tmp_path: Path) -> None:
    make_hf_phi3(tmp_path, seed=9, sliding_window=None)
    prompt = np.random.default_rng(9).integers(0, PHI3["vocab_size"], size=70).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
    fresh = Engine.from_pretrained(tmp_path, backend="numpy", enable_reuse=False)
    want = fresh.generate(prompt, params)
    engine = Engine.from_pretrained(tmp_path, backend="numpy", max_num_batched_tokens=16)
    engine.generate(prompt[:50], params)
    got = engine.generate(prompt, params)
    assert got.cached_tokens > 0 and got.token_ids == want.token_ids
    assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))
