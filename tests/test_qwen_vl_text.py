"""The language model of Qwen's vision-language checkpoints, served as text: Qwen2-VL's
and Qwen2.5-VL's (Qwen2's layers) and Qwen3-VL's (Qwen3's), against transformers' own
`...ForConditionalGeneration` forward on token ids alone.

Their M-RoPE rotates each frequency by one of a token's three position ids (time,
height, width); a text token's three are its position, so on text it is the plain
rotation, and config.json's `mrope` reads as the default rope. The hub's Qwen2 VL
configs hold the text fields at the top level; transformers 5 writes a text_config;
both read alike. The vision tower is never read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_model_reference import TINY, hf_logits, rel_l2_rows, reuse_keeps_bits, run_ours

from reprise.daemon.model.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

TEXT = {**TINY, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
VISION = {
    "Qwen2VL": dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
    "Qwen2_5_VL": dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        out_hidden_size=96,
        intermediate_size=32,
        fullatt_block_indexes=[0],
    ),
    "Qwen3VL": dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        out_hidden_size=96,
        intermediate_size=32,
        deepstack_visual_indexes=[0],
    ),
}
FAMILY = {"Qwen2VL": "Qwen2ForCausalLM", "Qwen2_5_VL": "Qwen2ForCausalLM",
          "Qwen3VL": "Qwen3ForCausalLM"}  # fmt: skip


def make(out: Path, name: str, seed: int, **text_changes) -> torch.nn.Module:
    """A random `name` VL model, widened as test_model_reference widens its models, saved
    as BF16 with a synthetic tokenizer; returned in fp32 (the same values)."""
    from test_model_reference import save_widened

    torch.manual_seed(seed)
    text = {**TEXT, **text_changes}
    # M-RoPE's sections of a 16-dim head's 8 frequencies (time, height, width)
    text["rope_parameters"] = {"rope_type": "mrope" if name != "Qwen3VL" else "default",
                               "mrope_section": [2, 3, 3], "rope_theta": 1e6,
                               **({"mrope_interleaved": True} if name == "Qwen3VL" else {})}  # fmt: skip
    config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=VISION[name])
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config)
    return save_widened(model, out, TINY["vocab_size"])


def text_logits(ref: torch.nn.Module, prompt: np.ndarray) -> np.ndarray:
    return hf_logits(ref, prompt)


@pytest.mark.parametrize("name", list(VISION))
def test_the_language_model_matches_transformers_on_text(tmp_path: Path, name: str) -> None:
    """Our forward on the folder against transformers' fp32 forward of the whole model on
    ids (within the Llama bound, one chunk and four), the family the text's, and bits
    kept under reuse."""
    ref = make(tmp_path, name, seed=91)
    config = ModelConfig.from_dir(tmp_path)
    assert config.architecture == FAMILY[name] and config.rope_scaling is None
    assert config.num_layers == TINY["num_hidden_layers"] and config.head_dim == 16
    prompt = np.random.default_rng(7).integers(0, TINY["vocab_size"], size=120)
    want = text_logits(ref, prompt)
    for chunks in ([120], [1, 40, 64, 15]):
        ours = run_ours(tmp_path, prompt, chunks)
        err = rel_l2_rows(ours, want)
        assert err.max() < 2e-2, err.max()
        assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.95
    reuse_keeps_bits(tmp_path, TINY["vocab_size"])


def test_the_hubs_flat_qwen2_vl_config_reads_as_its_text_config(tmp_path: Path) -> None:
    """Qwen2.5-VL's config.json as the hub holds it (the text fields at the top level,
    rope_scaling `mrope` with its sections, tie_word_embeddings outside) reads as the
    text_config transformers 5 writes."""
    ref = make(tmp_path, "Qwen2_5_VL", seed=92, tie_word_embeddings=True)
    nested = json.loads((tmp_path / "config.json").read_text())
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    theta = text.pop("rope_parameters", {}).get("rope_theta", 1e6)
    flat |= {k: v for k, v in text.items() if k not in ("tie_word_embeddings",)}
    flat |= {"rope_theta": theta, "tie_word_embeddings": True,
             "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(flat))
    config = ModelConfig.from_dir(tmp_path)
    assert config.architecture == "Qwen2ForCausalLM" and config.tie_word_embeddings
    assert config.rope_theta == theta and config.rope_scaling is None
    prompt = np.random.default_rng(3).integers(0, TINY["vocab_size"], size=60)
    err = rel_l2_rows(run_ours(tmp_path, prompt, [60]), text_logits(ref, prompt))
    assert err.max() < 2e-2, err.max()


@pytest.mark.parametrize("hub_layout", [False, True], ids=["as-saved", "hub-transposed"])
def test_qwen3_vl_moe_serves_its_mixture_of_experts(tmp_path: Path, hub_layout: bool) -> None:
    """Qwen3-VL-MoE's language model is Qwen3-MoE's, its router always normalizing (its
    config has no norm_topk_prob): as transformers saves it, and with each expert stack
    transposed as the hub's checkpoints hold them ([E, hidden, 2I] and [E, I, hidden]),
    told apart by shape; within test_moe's bound of transformers' forward on ids."""
    from test_moe import matches

    from reprise.daemon.model.safetensors_io import load_safetensors, save_safetensors

    torch.manual_seed(93)
    text = {**TEXT, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
            "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                "mrope_section": [2, 3, 3], "mrope_interleaved": True}}  # fmt: skip
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=VISION["Qwen3VL"])
    from test_model_reference import save_widened

    model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    with torch.no_grad():  # its routers start at zero: every expert tied
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.05)
    ref = save_widened(model, tmp_path, TINY["vocab_size"])
    if hub_layout:
        path = tmp_path / "model.safetensors"
        tensors = load_safetensors(path)
        stacks = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert stacks and tensors[stacks[0]].shape[1] != tensors[stacks[0]].shape[2]
        # copies: the file is memory-mapped, and rewritten below
        flipped = {k: np.array(np.swapaxes(v, 1, 2) if k in stacks else v, copy=True)
                   for k, v in tensors.items()}  # fmt: skip
        del tensors
        path.unlink()
        save_safetensors(path, flipped, {"format": "pt"})
    ours = ModelConfig.from_dir(tmp_path)
    assert ours.architecture == "Qwen3MoeForCausalLM" and ours.experts.normalize
    assert ours.experts.num_experts == 6 and ours.experts.intermediate_size == 40
    matches(tmp_path, ref)
