"""The third model family, Mistral (registry.py): Llama's forward under its own
architecture name, an explicit head_dim (Mistral-Nemo's shape: heads * head_dim is not
the hidden size) included, against transformers' own MistralForCausalLM on the same
weights. Its sliding window: test_sliding_window_models.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_model_reference import TINY, hf_logits, rel_l2_rows, run_ours

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.synth import write_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def make_hf_mistral(out: Path, seed: int, **overrides) -> torch.nn.Module:
    """A random MistralForCausalLM saved as BF16 safetensors; returned in fp32 (same
    values), weights widened as test_model_reference does."""
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    return model.float().eval()


@pytest.mark.parametrize("overrides", [{}, {"head_dim": 24}], ids=["plain", "head_dim"])
def test_logits_match_transformers_mistral(tmp_path: Path, overrides: dict) -> None:
    ref = make_hf_mistral(tmp_path, seed=11, **overrides)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["MistralForCausalLM"] and raw["model_type"] == "mistral"
    config = ModelConfig.from_dir(tmp_path)
    assert config.architecture == "MistralForCausalLM" and not config.qkv_bias
    assert config.head_dim == overrides.get("head_dim", 16)
    prompt = np.random.default_rng(7).integers(0, TINY["vocab_size"], size=150)
    ours = run_ours(tmp_path, prompt, [150])
    want = hf_logits(ref, prompt)
    err = rel_l2_rows(ours, want)
    assert err.max() < 2e-2, err.max()  # test_model_reference's tolerance for Llama
    assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.95
    # chunked, the same bits; and the engine runs it
    assert np.array_equal(
        ours.view(np.uint32), run_ours(tmp_path, prompt, [9, 64, 77]).view(np.uint32)
    )
    write_tokenizer(tmp_path, TINY["vocab_size"])
    out = Engine.from_pretrained(tmp_path, backend="numpy").generate(
        prompt.tolist()[:40], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )
    assert len(out.token_ids) == 4


@pytest.mark.parametrize(
    ("window", "binds"),
    [(None, False), (512, False), (4096, False), (511, True), (64, True)],
)
def test_a_sliding_window_shorter_than_the_context_binds_on_every_layer(
    window: int | None, binds: bool
) -> None:
    """max_position_embeddings is 512 here: a window of at least that never binds; a
    shorter one applies to every layer, and the context stays the model's."""
    raw = {**TINY, "architectures": ["MistralForCausalLM"], "sliding_window": window}
    config = ModelConfig.from_dict(raw)
    assert config.architecture == "MistralForCausalLM"
    assert config.max_position_embeddings == 512
    assert config.layer_windows == ((window,) * TINY["num_hidden_layers"] if binds else None)
