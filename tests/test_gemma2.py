"""Gemma 2 (`Gemma2ForCausalLM`) against transformers' own class on the same weights.

Gemma 2 is Gemma 3's layer (test_gemma3.py: (1 + w) norms, sandwich norms, GeGLU, the
scaled embedding) without q and k norms or a second rope base, with every other layer
windowed and two tanh soft-caps: of the attention scores (after the scale, before the
mask: `paged_attention`'s softcap) and of the final logits (`softcap`, an op after the
lm_head). Within test_gemma3's bound in one chunk and in four, each cap mattering, bits
kept under chunking and reuse; the GPU backend (emulated) runs it at head_dim 64 and 256.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_gemma3 import IDS, far_off, matches, save_gemma
from test_model_reference import TINY, reuse_keeps_bits, run_ours
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy, synth_like  # noqa: F401 (a fixture)

from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

# sliding, full, sliding (transformers' default pattern), a window of 40 over 150 tokens;
# caps low enough to bind on this model's scores and logits
GEMMA2 = {**TINY, **IDS, "sliding_window": 40, "query_pre_attn_scalar": 24,
          "attn_logit_softcapping": 1.0, "final_logit_softcapping": 1.0}  # fmt: skip


def make(out: Path, seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Gemma2Config(**{**GEMMA2, **overrides})
    config._attn_implementation = "eager"  # the soft-cap is eager attention's
    return save_gemma(transformers.Gemma2ForCausalLM(config), out)


def test_gemma2_matches_transformers(tmp_path: Path) -> None:
    ref = make(tmp_path, seed=71)
    config = ModelConfig.from_dir(tmp_path)
    assert config.architecture == "Gemma2ForCausalLM" and not config.qk_norm
    assert config.layer_windows == (40, 0, 40) and config.local_rope_layers is None
    assert (config.attn_softcap, config.final_softcap) == (1.0, 1.0)
    _, prompt, err = matches(tmp_path, ref)
    reuse_keeps_bits(tmp_path, TINY["vocab_size"])
    # each cap binds: read without it, far from transformers
    import dataclasses

    from reprise.daemon.model import llama

    original = llama.LlamaModel.__init__
    for cap in ("attn_softcap", "final_softcap"):
        with pytest.MonkeyPatch.context() as mp:

            def init(self, config, w, backend, cap=cap):
                original(self, dataclasses.replace(config, **{cap: None}), w, backend)

            mp.setattr(llama.LlamaModel, "__init__", init)
            assert far_off(run_ours(tmp_path, prompt, [len(prompt)]), ref, prompt, err), cap


def test_the_default_caps_and_none() -> None:
    """transformers' defaults (50 and 30) where the config omits them; null turns one off."""
    raw = {"architectures": ["Gemma2ForCausalLM"], **TINY}
    config = ModelConfig.from_dict(raw)
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    config = ModelConfig.from_dict({**raw, "attn_logit_softcapping": None})
    assert (config.attn_softcap, config.final_softcap) == (None, 30.0)
    with pytest.raises(ModelConfigError, match="attn_softcap must be a number from"):
        ModelConfig.from_dict({**raw, "attn_logit_softcapping": -1.0})
    with pytest.raises(ModelConfigError, match="hidden_activation 'silu' is not supported"):
        ModelConfig.from_dict({**raw, "hidden_activation": "silu"})


def test_the_synthetic_gemma_2_2b_has_its_parameters() -> None:
    from reprise.daemon.model.synth import synth_config

    config = synth_config("gemma-2-2b")
    assert config.num_parameters() == 2_614_341_888  # gemma-2-2b-it's count
    assert config.layer_windows.count(4096) == 13 and config.attn_softcap == 50.0


@pytest.fixture(scope="module", params=[64, 256])
def gemma2_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 2 of head_dim 64 or 256, with low caps."""
    head_dim = request.param
    return synth_like(tmp_path_factory, "tiny-gemma3", seed=10, head_dim=head_dim,
                      num_attention_heads=256 // head_dim * 2, num_key_value_heads=1,
                      architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                      layer_types=None, attn_logit_softcapping=0.5,
                      final_logit_softcapping=1.0)  # fmt: skip


def test_the_gpu_backend_runs_gemma2(cupy_kind: str, gemma2_folder: Path) -> None:  # noqa: F811
    gpu_forward_matches_numpy(cupy_kind, gemma2_folder)
    config = ModelConfig.from_dir(gemma2_folder)
    assert config.attn_softcap == 0.5 and config.layer_windows == (24, 0, 24, 0)
