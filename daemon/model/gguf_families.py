"""The GGUF architectures `convert_gguf` reads, as one table: for each, the Hugging Face
class and model_type it becomes, its tensors' names (GGUF name within a block -> Hugging
Face name within a layer), whether llama.cpp permuted its Q and K rows, and its experts'
layout (gguf_experts.py).

`family_of` gives a file's family by its `general.architecture`, but Mixtral for a `llama`
file with `llama.expert_count` > 0 and OLMo 3 for an `olmo2` file with
`olmo2.attention.sliding_window` > 0. It guarantees:

- a qwen3vl or qwen3vlmoe file becomes a Qwen3ForCausalLM or Qwen3MoeForCausalLM (its text
  model; config.json as plain Qwen3's and Qwen3-MoE's, the M-RoPE the plain rotation it
  is on text, the router normalizing: the NOTE at `FAMILIES`);
- `permuted_qk` holds for a Llama, a Mixtral, a Granite, a Granite MoE and SmolLM3, the
  families whose Q and K llama.cpp permutes (no other family's);
- a family's `layer_names` name every tensor of a block it may hold: gguf_convert refuses
  any other (a tensor the family lacks, as a Qwen3-VL reranker's `cls_out`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gguf_experts import expert_layer_names
from .gguf_files import optional_int

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_MLP_NAMES = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# a Llama block but its MLP (which the MoE families' experts replace)
_ATTENTION_NAMES = {k: v for k, v in _LAYER_NAMES.items() if k not in _MLP_NAMES}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rope scaling, folded into config.json


_GEMMA_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm.weight"},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


# Qwen2's and Qwen3's blocks but their MLPs (their MoE families' too)
_QWEN2_LAYER_NAMES = {
    **_ATTENTION_NAMES,
    **{f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"},
}
_QWEN3_LAYER_NAMES = {
    **_ATTENTION_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# OLMo 2's block (llama.cpp's olmo2 loader): no input norms; q and k norms one RMSNorm over
# all the heads (weights of heads x head_dim, as stored); the attention's and the MLP's
# outputs normalized before each residual add (olmo2.cpp's attn_post_norm and
# ffn_post_norm, llama-arch.cpp's post_attention_norm and post_ffw_norm)
_PRE_NORMS = ("attn_norm.weight", "ffn_norm.weight")
_OLMO2_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k not in _PRE_NORMS},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


@dataclass(frozen=True, slots=True)
class Family:
    architecture: str  # config.json's
    # GGUF name within a block -> Hugging Face name within a layer (two GGUF tensors may
    # make one: gguf_experts.JOINED)
    layer_names: dict[str, str]
    permuted_qk: bool  # llama.cpp interleaved the rotary pairs of Q and K's rows
    model_type: str | None = None  # config.json's; None: the GGUF architecture's name
    experts: str | None = None  # the experts' layout (registry.ModelFamily.experts)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", _LAYER_NAMES, permuted_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", {**_LAYER_NAMES, **_QWEN2_LAYER_NAMES}, permuted_qk=False),
    "qwen3": Family("Qwen3ForCausalLM", {**_LAYER_NAMES, **_QWEN3_LAYER_NAMES}, permuted_qk=False),
    # Granite: Llama's tensors (Q and K permuted, as llama.cpp's converter treats it as a
    # Llama) and four scalars in the metadata (gguf_config._GRANITE_SCALES)
    "granite": Family("GraniteForCausalLM", _LAYER_NAMES, permuted_qk=True),
    # SmolLM3: Llama's tensors; llama.cpp leaves RoPE out of every 4th layer by a constant
    # of its own (no key in the file), which config.json says as no_rope_layer_interval
    "smollm3": Family("SmolLM3ForCausalLM", _LAYER_NAMES, permuted_qk=True),
    # Phi-3: q, k and v in one matrix, gate and up in one (gate rows first), stored as the
    # Hugging Face checkpoint fuses them; llama.cpp permutes neither (NeoX rotary)
    "phi3": Family(
        "Phi3ForCausalLM",
        {
            "attn_norm.weight": "input_layernorm.weight",
            "attn_qkv.weight": "self_attn.qkv_proj.weight",
            "attn_output.weight": "self_attn.o_proj.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "ffn_up.weight": "mlp.gate_up_proj.weight",
            "ffn_down.weight": "mlp.down_proj.weight",
        },
        permuted_qk=False,
    ),
    # Gemma 3 (its text model): sandwich norms, q and k norms, every norm weight stored as
    # 1 + w (llama.cpp's converter adds its norm_shift; gguf_convert._convert_tensor takes it
    # off)
    "gemma3": Family("Gemma3ForCausalLM", _GEMMA_LAYER_NAMES, permuted_qk=False),
    # Gemma 2: the same tensors but q and k norms, its soft-caps in the metadata
    "gemma2": Family("Gemma2ForCausalLM", _GEMMA_LAYER_NAMES, permuted_qk=False),
    # Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention, every layer's MLP experts
    # (gguf_experts.py), Qwen2-MoE's with a gated shared expert
    "qwen2moe": Family(
        "Qwen2MoeForCausalLM",
        {**_QWEN2_LAYER_NAMES, **expert_layer_names("qwen2_moe")},
        permuted_qk=False,
        model_type="qwen2_moe",
        experts="qwen2_moe",
    ),
    "qwen3moe": Family(
        "Qwen3MoeForCausalLM",
        {**_QWEN3_LAYER_NAMES, **expert_layer_names("qwen3_moe")},
        permuted_qk=False,
        model_type="qwen3_moe",
        experts="qwen3_moe",
    ),
    # Qwen3-VL's and Qwen3-VL-MoE's text models, as llama.cpp writes them (the vision tower
    # goes to a separate mmproj file): Qwen3's and Qwen3-MoE's tensors, written as those
    # families (see the NOTE below)
    "qwen3vl": Family(
        "Qwen3ForCausalLM",
        {**_LAYER_NAMES, **_QWEN3_LAYER_NAMES},
        permuted_qk=False,
        model_type="qwen3",
    ),
    "qwen3vlmoe": Family(
        "Qwen3MoeForCausalLM",
        {**_QWEN3_LAYER_NAMES, **expert_layer_names("qwen3_moe")},
        permuted_qk=False,
        model_type="qwen3_moe",
        experts="qwen3_moe",
    ),
    # Granite MoE: Granite's attention (Q and K permuted: llama.cpp's GraniteMoeModel is a
    # LlamaModel) and scalars, every layer's experts (gguf_experts.py)
    "granitemoe": Family(
        "GraniteMoeForCausalLM",
        {**_ATTENTION_NAMES, **expert_layer_names("granitemoe")},
        permuted_qk=True,
        experts="granitemoe",
    ),
    # OLMo 2 and OLMoE: Q and K as the checkpoint holds them. convert_hf_to_gguf.py's
    # Olmo2Model and OlmoeModel keep TextModel's tensors (only OlmoModel, OLMo 1's,
    # permutes as LlamaModel does), and llama_model_rope_type (llama-model.cpp) gives
    # LLM_ARCH_OLMO2 and LLM_ARCH_OLMOE LLAMA_ROPE_TYPE_NEOX: pairs half a head apart,
    # Hugging Face's layout. OLMoE's block is Qwen3-MoE's (input_layernorm, the MLP's
    # input norm as ffn_norm, whole q and k norms), its experts stacked as Qwen2MoeModel
    # stacks them (gguf_experts.py)
    "olmo2": Family("Olmo2ForCausalLM", _OLMO2_LAYER_NAMES, permuted_qk=False),
    "olmoe": Family(
        "OlmoeForCausalLM",
        {**_QWEN3_LAYER_NAMES, **expert_layer_names("olmoe")},
        permuted_qk=False,
        experts="olmoe",
    ),
}
# NOTE: a qwen3vl or qwen3vlmoe file is converted to the text model alone. llama.cpp's
# M-RoPE (IMROPE, `rope.dimension_sections`) gives a text token its position on the
# first three axes, so it is the plain rotation transformers' Qwen3-VL runs on text, but
# for the pairs the interleaved sections leave to the fourth axis (position 0 on text):
# with Qwen3-VL's [24, 20, 20, 0], pairs 61 and 62 of 64, the two lowest frequencies,
# which transformers rotates by the position and llama.cpp does not. This converter
# follows transformers (the checkpoint's own forward). `n_deepstack_layers` adds visual
# features to the first layers' outputs, zero on text: nothing of it is written.

# Mixtral, as llama.cpp's converter writes it: a `llama` file with `llama.expert_count` > 0,
# Q and K permuted as a Llama's
_MIXTRAL = Family(
    "MixtralForCausalLM",
    {**_ATTENTION_NAMES, **expert_layer_names("mixtral")},
    permuted_qk=True,
    model_type="mixtral",
    experts="mixtral",
)
# OLMo 3, as llama.cpp's converter writes it: an `olmo2` file with
# `olmo2.attention.sliding_window` > 0 (Olmo2Model registers Olmo3ForCausalLM too), OLMo 2's
# tensors
OLMO3 = Family("Olmo3ForCausalLM", _OLMO2_LAYER_NAMES, permuted_qk=False, model_type="olmo3")
# Phi-3's LongRoPE (the 128k models, Phi-4-mini): per-frequency factors, long and short
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_of(meta: dict[str, Any]) -> Family:
    arch = meta["general.architecture"]
    if arch == "llama" and optional_int(meta, "llama.expert_count", 0) > 0:
        return _MIXTRAL
    if arch == "olmo2" and optional_int(meta, "olmo2.attention.sliding_window", 0) > 0:
        return OLMO3
    return FAMILIES[arch]
