"""Two more families, each Llama's forward with one option, against transformers' own
classes on the same weights:

- Seed-OSS (`SeedOssForCausalLM`): Qwen2's bias on q, k and v under Llama's names;
- Helium (`HeliumForCausalLM`): rotary pairs interleaved (dimensions 2i and 2i + 1, as
  GPT-J pairs them), put where the kernels pair dimensions by reordering q's and k's
  dimensions as they load (weights._rotary_ordered; the same order on both keeps every
  q . k), so no kernel changes.

Each within test_model_reference's bound in one chunk and in four, its option mattering,
chunked and cached bits kept; the GPU backend (emulated) runs Helium.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_model_reference import (
    TINY,
    hf_logits,
    matches_transformers,
    rel_l2_rows,
    reuse_keeps_bits,
    save_widened,
)
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy, synth_like  # noqa: F401 (a fixture)

from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def make(kind: str, out: Path, seed: int, **overrides) -> torch.nn.Module:
    config_class, model_class = {
        "seed_oss": (transformers.SeedOssConfig, transformers.SeedOssForCausalLM),
        "helium": (transformers.HeliumConfig, transformers.HeliumForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    config = config_class(**{**TINY, **IDS, **overrides})
    return save_widened(model_class(config), out, TINY["vocab_size"])


def test_seed_oss_matches_transformers(tmp_path: Path) -> None:
    ref = make("seed_oss", tmp_path, seed=51)
    config = ModelConfig.from_dir(tmp_path)
    assert config.architecture == "SeedOssForCausalLM" and config.qkv_bias
    ours, prompt, err = matches_transformers(tmp_path, ref, TINY["vocab_size"])
    with torch.no_grad():  # the biases matter: without them transformers is far from us
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    assert rel_l2_rows(ours, hf_logits(ref, prompt)).mean() > 5 * err.max()
    reuse_keeps_bits(tmp_path, TINY["vocab_size"])


def test_helium_matches_transformers(tmp_path: Path) -> None:
    ref = make("helium", tmp_path, seed=52)
    assert ModelConfig.from_dir(tmp_path).architecture == "HeliumForCausalLM"
    _, prompt, err = matches_transformers(tmp_path, ref, TINY["vocab_size"])
    # the interleaved pairs matter: read in the checkpoint's order, far off
    from test_model_reference import run_ours

    from reprise.daemon.model import weights

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights, "_rotary_ordered", lambda w, c: None)
        unordered = run_ours(tmp_path, prompt, [len(prompt)])
    assert rel_l2_rows(unordered, hf_logits(ref, prompt)).mean() > 5 * err.max()
    reuse_keeps_bits(tmp_path, TINY["vocab_size"])


def test_what_the_forward_lacks_is_refused() -> None:
    seed = {"architectures": ["SeedOssForCausalLM"], **TINY}
    for field, message in [({"attention_out_bias": True}, "attention_out_bias=true"),
                           ({"mlp_bias": True}, "mlp_bias=true"),
                           ({"attention_bias": False}, "attention_bias=false")]:  # fmt: skip
        with pytest.raises(ModelConfigError, match=message):
            ModelConfig.from_dict({**seed, **field})
    helium = {"architectures": ["HeliumForCausalLM"], **TINY, "partial_rotary_factor": 0.5}
    with pytest.raises(ModelConfigError, match=r"partial_rotary_factor=0\.5"):
        ModelConfig.from_dict(helium)


@pytest.fixture(scope="module")
def helium_d64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Helium of head_dim 64 (the attention kernels take 64 and 128)."""
    return synth_like(tmp_path_factory, "tiny", seed=8, architectures=["HeliumForCausalLM"],
                      model_type="helium", rope_scaling=None)  # fmt: skip


def test_the_gpu_backend_runs_helium(
    cupy_kind: str,  # noqa: F811
    helium_d64: Path,
) -> None:
    gpu_forward_matches_numpy(cupy_kind, helium_d64)
