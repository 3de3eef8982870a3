"""The InternLM2 family (registry.py): Llama's forward in its own checkpoint layout (its
tensor names, and q, k and v in one `wqkv` whose rows go KV head by KV head: the group's
query heads, then the key head, then the value head, as its modeling code splits them).
transformers has no InternLM2 class (the checkpoints carry their own code), so the
reference is transformers' LlamaForCausalLM on the same weights, written out as an
InternLM2 checkpoint: the logits within the Llama bound, the packing's order mattering,
and InternLM2.5's dynamic rope scaling taken as plain RoPE within its context.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_model_reference import (
    TINY,
    hf_logits,
    rel_l2_rows,
    reuse_keeps_bits,
    run_ours,
    save_widened,
)

from reprise.daemon.model.config import ModelConfig, ModelConfigError
from reprise.daemon.model.safetensors_io import load_safetensors, save_safetensors
from reprise.daemon.model.synth import write_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference


def internlm2_config(**extra) -> dict:
    return {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
            "vocab_size": TINY["vocab_size"], "hidden_size": TINY["hidden_size"],
            "intermediate_size": TINY["intermediate_size"],
            "num_hidden_layers": TINY["num_hidden_layers"],
            "num_attention_heads": TINY["num_attention_heads"],
            "num_key_value_heads": TINY["num_key_value_heads"],
            "max_position_embeddings": TINY["max_position_embeddings"],
            "rms_norm_eps": TINY["rms_norm_eps"], "rope_theta": TINY["rope_theta"],
            "hidden_act": "silu", "bias": False, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **extra}  # fmt: skip


def as_internlm2(llama: Path, out: Path, *, grouped: bool = True, **config) -> None:
    """The Llama checkpoint in `llama` written as InternLM2 writes its own (`grouped`:
    wqkv's rows KV head by KV head; False: q, k and v one after another, a wrong layout)."""
    t = load_safetensors(llama / "model.safetensors")
    heads, kv_heads = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    group, d, h = heads // kv_heads, TINY["hidden_size"] // heads, TINY["hidden_size"]
    tensors = {"model.tok_embeddings.weight": t["model.embed_tokens.weight"],
               "model.norm.weight": t["model.norm.weight"], "output.weight": t["lm_head.weight"]}  # fmt: skip
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v = (t[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
        if grouped:
            wqkv = np.concatenate(
                [q.reshape(kv_heads, group, d, h), k.reshape(kv_heads, 1, d, h),
                 v.reshape(kv_heads, 1, d, h)], axis=1,
            ).reshape(-1, h)  # fmt: skip
        else:
            wqkv = np.concatenate([q, k, v])
        tensors |= {
            p + "attention.wqkv.weight": np.ascontiguousarray(wqkv),
            p + "attention.wo.weight": t[p + "self_attn.o_proj.weight"],
            p + "feed_forward.w1.weight": t[p + "mlp.gate_proj.weight"],
            p + "feed_forward.w3.weight": t[p + "mlp.up_proj.weight"],
            p + "feed_forward.w2.weight": t[p + "mlp.down_proj.weight"],
            p + "attention_norm.weight": t[p + "input_layernorm.weight"],
            p + "ffn_norm.weight": t[p + "post_attention_layernorm.weight"],
        }
    out.mkdir(parents=True)
    save_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(internlm2_config(**config)))
    write_tokenizer(out, TINY["vocab_size"])


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(41)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    return folder, save_widened(model, folder, TINY["vocab_size"])


def test_logits_match_the_same_weights_as_llama(tmp_path: Path, llama) -> None:
    folder, ref = llama
    as_internlm2(folder, tmp_path / "m")
    config = ModelConfig.from_dir(tmp_path / "m")
    assert config.architecture == "InternLM2ForCausalLM" and config.head_dim == 16
    prompt = np.random.default_rng(12).integers(0, TINY["vocab_size"], size=150)
    ours = run_ours(tmp_path / "m", prompt, [150])
    want = hf_logits(ref, prompt)
    err = rel_l2_rows(ours, want)
    assert err.max() < 2e-2, err.max()  # test_model_reference's bound
    # the very bits the Llama checkpoint gives: the same weights, the same forward
    assert np.array_equal(ours.view(np.uint32), run_ours(folder, prompt, [150]).view(np.uint32))
    # wqkv's grouping matters: q, k and v read one after another are far off
    as_internlm2(folder, tmp_path / "flat", grouped=False)
    assert rel_l2_rows(run_ours(tmp_path / "flat", prompt, [150]), want).mean() > 10 * err.max()


def test_internlm2_5s_dynamic_scaling_and_the_cache(tmp_path: Path, llama) -> None:
    """InternLM2.5's config: rope_scaling dynamic (plain RoPE within the context); the
    engine keeps its bits cached and chunked."""
    folder, _ = llama
    as_internlm2(folder, tmp_path / "m", rope_scaling={"type": "dynamic", "factor": 2.0})
    assert ModelConfig.from_dir(tmp_path / "m").rope_scaling is None
    prompt = np.random.default_rng(13).integers(0, TINY["vocab_size"], size=100)
    assert np.array_equal(run_ours(tmp_path / "m", prompt, [100]).view(np.uint32),
                          run_ours(folder, prompt, [100]).view(np.uint32))  # fmt: skip
    reuse_keeps_bits(tmp_path / "m", TINY["vocab_size"])


def test_a_bias_is_refused() -> None:
    with pytest.raises(ModelConfigError, match=r"bias=true is not supported"):
        ModelConfig.from_dict(internlm2_config(bias=True))
    by_type = {k: v for k, v in internlm2_config().items() if k != "architectures"}
    assert ModelConfig.from_dict(by_type).architecture == "InternLM2ForCausalLM"
