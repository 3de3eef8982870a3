"""Convert a GGUF file of a Llama, Qwen2, Qwen3, Phi-3, Granite, SmolLM3, Gemma 2,
Gemma 3, OLMo 2, OLMo 3, Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE or OLMoE model, or of
Qwen3-VL's or Qwen3-VL-MoE's text model, into a Hugging Face model folder.

`convert_gguf` reads a GGUF whose `general.architecture` is `llama` (Mixtral: `llama` with
`llama.expert_count` > 0), `qwen2`, `qwen3`, `phi3`, `granite`, `smollm3`, `gemma2`,
`gemma3`, `olmo2` (OLMo 3: `olmo2` with `olmo2.attention.sliding_window` > 0), `qwen2moe`,
`qwen3moe`, `granitemoe`, `olmoe`, `qwen3vl` or `qwen3vlmoe` and writes `config.json`,
`generation_config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`
and `README.md`. It guarantees:

- a model llama.cpp's gguf-split cut into shards, given by any of them, converts as one
  (gguf_files.open_shards checks the set): every file but README.md (which names the
  shards) is byte for byte the one the same model in one file gives;
- every tensor is dequantized to float32 by `gguf.quants` and rounded once to
  BF16 (round to nearest even), under Hugging Face names and shapes
  `[out_features, in_features]`, one tensor in memory at a time (stacked experts one
  expert at a time);
- a mixture of experts' tensors and config.json are gguf_experts.py's: each layer's experts
  stacked as weights.py reads them (gate and up joined), the routing as llama.cpp runs it;
- a qwen3vl or qwen3vlmoe file becomes a Qwen3ForCausalLM or Qwen3MoeForCausalLM (its text
  model; config.json as plain Qwen3's and Qwen3-MoE's, the M-RoPE the plain rotation it
  is on text, the router normalizing: the NOTE at `_FAMILIES`);
- llama.cpp's row permutation of a Llama's (and a Mixtral's, a Granite's, a Granite MoE's
  and SmolLM3's) Q and K projections is undone, so the weights use Hugging Face's
  half-split rotary layout (llama.cpp permutes no other family's); a Granite or Granite MoE
  file's four scales become its config's multipliers; a Gemma file's norm weights lose the 1 llama.cpp added (in float32, then rounded), and
  what llama.cpp sets in its code (the sliding pattern, the local rope base, the score
  scale) is written into config.json;
- an olmo2 file with a sliding window becomes an Olmo3ForCausalLM: its layer types, window
  and rope by layer type in config.json (`_olmo3_config`; the NOTE above it);
- a Llama 3 file's `rope_freqs.weight` (its per-frequency rope scaling) becomes the
  `llama3` rope_scaling that gives the same factors, checked against every one;
- the tokenizer is gguf_tokenizer's (byte-level or SentencePiece BPE as llama.cpp
  tokenizes, every token id kept);
- anything it cannot convert faithfully (another architecture, tokenizer model or
  pre-tokenizer, partial rotary, a rope scaling the forward lacks, Phi-3's LongRoPE, a
  Granite file without RoPE, a layer without experts or per-expert tensors in a file with
  experts, Granite MoE's shared expert, an olmo2 sliding pattern that does not fit its
  layers, a clamp of q, k and v in an olmo2 or olmoe file, a tensor the family lacks, as a
  Qwen3-VL reranker's `cls_out`) raises `ValueError` naming the offending value, before anything
  is written.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from .gguf_experts import (
    JOINED,
    ROW_VECTORS,
    check_expert_tensors,
    expert_layer_names,
    experts_config,
    join_experts,
)
from .gguf_files import (
    dequantized,
    open_shards,
    optional_int,
    read_metadata,
    require_int,
    require_number,
)
from .gguf_tokenizer import build_tokenizer, end_token_ids, tokenizer_config
from .safetensors_io import TensorSpec, save_safetensors_streamed

# Bump whenever the output of `convert_gguf` changes, so prepared folders are redone.
CONVERTER_VERSION = 1

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
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rope scaling, folded into config.json


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
class _Family:
    architecture: str  # config.json's
    # GGUF name within a block -> Hugging Face name within a layer (two GGUF tensors may
    # make one: gguf_experts.JOINED)
    layer_names: dict[str, str]
    permuted_qk: bool  # llama.cpp interleaved the rotary pairs of Q and K's rows
    model_type: str | None = None  # config.json's; None: the GGUF architecture's name
    experts: str | None = None  # the experts' layout (registry.ModelFamily.experts)


_FAMILIES = {
    "llama": _Family("LlamaForCausalLM", _LAYER_NAMES, permuted_qk=True),
    "qwen2": _Family("Qwen2ForCausalLM", {**_LAYER_NAMES, **_QWEN2_LAYER_NAMES}, permuted_qk=False),
    "qwen3": _Family("Qwen3ForCausalLM", {**_LAYER_NAMES, **_QWEN3_LAYER_NAMES}, permuted_qk=False),
    # Granite: Llama's tensors (Q and K permuted, as llama.cpp's converter treats it as a
    # Llama) and four scalars in the metadata (`_GRANITE_SCALES`)
    "granite": _Family("GraniteForCausalLM", _LAYER_NAMES, permuted_qk=True),
    # SmolLM3: Llama's tensors; llama.cpp leaves RoPE out of every 4th layer by a constant
    # of its own (no key in the file), which config.json says as no_rope_layer_interval
    "smollm3": _Family("SmolLM3ForCausalLM", _LAYER_NAMES, permuted_qk=True),
    # Phi-3: q, k and v in one matrix, gate and up in one (gate rows first), stored as the
    # Hugging Face checkpoint fuses them; llama.cpp permutes neither (NeoX rotary)
    "phi3": _Family(
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
    # 1 + w (llama.cpp's converter adds its norm_shift; `_convert_tensor` takes it off)
    "gemma3": _Family("Gemma3ForCausalLM", _GEMMA_LAYER_NAMES, permuted_qk=False),
    # Gemma 2: the same tensors but q and k norms, its soft-caps in the metadata
    "gemma2": _Family("Gemma2ForCausalLM", _GEMMA_LAYER_NAMES, permuted_qk=False),
    # Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention, every layer's MLP experts
    # (gguf_experts.py), Qwen2-MoE's with a gated shared expert
    "qwen2moe": _Family(
        "Qwen2MoeForCausalLM",
        {**_QWEN2_LAYER_NAMES, **expert_layer_names("qwen2_moe")},
        permuted_qk=False,
        model_type="qwen2_moe",
        experts="qwen2_moe",
    ),
    "qwen3moe": _Family(
        "Qwen3MoeForCausalLM",
        {**_QWEN3_LAYER_NAMES, **expert_layer_names("qwen3_moe")},
        permuted_qk=False,
        model_type="qwen3_moe",
        experts="qwen3_moe",
    ),
    # Qwen3-VL's and Qwen3-VL-MoE's text models, as llama.cpp writes them (the vision tower
    # goes to a separate mmproj file): Qwen3's and Qwen3-MoE's tensors, written as those
    # families (see the NOTE below)
    "qwen3vl": _Family(
        "Qwen3ForCausalLM",
        {**_LAYER_NAMES, **_QWEN3_LAYER_NAMES},
        permuted_qk=False,
        model_type="qwen3",
    ),
    "qwen3vlmoe": _Family(
        "Qwen3MoeForCausalLM",
        {**_QWEN3_LAYER_NAMES, **expert_layer_names("qwen3_moe")},
        permuted_qk=False,
        model_type="qwen3_moe",
        experts="qwen3_moe",
    ),
    # Granite MoE: Granite's attention (Q and K permuted: llama.cpp's GraniteMoeModel is a
    # LlamaModel) and scalars, every layer's experts (gguf_experts.py)
    "granitemoe": _Family(
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
    "olmo2": _Family("Olmo2ForCausalLM", _OLMO2_LAYER_NAMES, permuted_qk=False),
    "olmoe": _Family(
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
_MIXTRAL = _Family(
    "MixtralForCausalLM",
    {**_ATTENTION_NAMES, **expert_layer_names("mixtral")},
    permuted_qk=True,
    model_type="mixtral",
    experts="mixtral",
)
# OLMo 3, as llama.cpp's converter writes it: an `olmo2` file with
# `olmo2.attention.sliding_window` > 0 (Olmo2Model registers Olmo3ForCausalLM too), OLMo 2's
# tensors
_OLMO3 = _Family("Olmo3ForCausalLM", _OLMO2_LAYER_NAMES, permuted_qk=False, model_type="olmo3")
# llama.cpp's olmo2 loader's sliding period where the file gives none as one number: every
# 4th layer full, the others sliding (Olmo3Config's default layer types too)
OLMO3_SLIDING_PERIOD = 4
# llama.cpp's constants for gemma3, set in its code, not read from the file: every 6th
# layer full, the others sliding and rotated by base 10,000 (gemma2: every other layer
# sliding, transformers' default too)
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# the layers of llama.cpp's 27B models, whose score scale is 1 / sqrt(hidden / heads)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's n_no_rope_layer_step for smollm3: every 4th layer without RoPE, set in its
# code, not read from the file
SMOLLM3_NO_ROPE_STEP = 4
# Granite's metadata key (after "granite.") -> its config.json field
_GRANITE_SCALES = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}
# Phi-3's LongRoPE (the 128k models, Phi-4-mini): per-frequency factors, long and short
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, progress: bool = True, source: str | None = None
) -> None:
    """Write a Hugging Face folder for `gguf_path` (a file, or any shard of a split model)
    into `out_dir` (created if needed).

    `source` is an optional line of provenance (e.g. the package the file came from) for README.md.
    """
    shards = open_shards(gguf_path)
    meta = read_metadata(shards.readers[0])  # a split model's metadata is its first shard's
    arch = meta.get("general.architecture")
    if arch not in _FAMILIES:
        raise ValueError(
            f"{gguf_path}: general.architecture is {arch!r}; supported: "
            + ", ".join(repr(a) for a in _FAMILIES)
        )
    family = _family_of(meta)
    tensors = {t.name: t for t in shards.tensors}
    longrope = [tensors.pop(name, None) for name in _LONGROPE]
    if any(t is not None for t in longrope) and (arch != "phi3" or None in longrope):
        present = [name for name, t in zip(_LONGROPE, longrope, strict=True) if t is not None]
        raise ValueError(
            f"{gguf_path}: a {arch} file with {' and '.join(present)}; LongRoPE factors are "
            f"read from phi3 files holding both {' and '.join(_LONGROPE)}"
        )
    rope_freqs = tensors.pop(_ROPE_FREQS, None)
    config = hf_config(meta, set(tensors), None if rope_freqs is None else dequantized(rope_freqs))
    if longrope[0] is not None:
        config["rope_scaling"] = _longrope_scaling(meta, *map(dequantized, longrope))
    if family.experts is not None:
        check_expert_tensors(set(tensors), arch, family.experts, config["num_hidden_layers"])
    tokenizer = build_tokenizer(meta)
    sources = _sources(tensors.values(), family)
    specs = {name: TensorSpec(np.dtype(ml_dtypes.bfloat16), _shape(name, parts))
             for name, parts in sources.items()}  # fmt: skip

    out_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(
        total=len(specs), desc="converting", unit="tensor", disable=not progress, leave=False
    )

    def produce(hf_name: str) -> np.ndarray:
        bar.update()
        return _convert_tensor(sources[hf_name], specs[hf_name].shape, config, family)

    with bar:
        save_safetensors_streamed(out_dir / "model.safetensors", specs, produce, {"format": "pt"})

    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": end_token_ids(meta),
        "pad_token_id": config["pad_token_id"],
    }
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        tokenizer_config(meta, config["max_position_embeddings"]),
    )
    counts = Counter(t.tensor_type.name for t in shards.tensors)
    names = [p.name for p in shards.paths]
    (out_dir / "README.md").write_text(_readme(meta, names, counts, source))


def hf_config(
    meta: dict[str, Any], tensor_names: set[str], rope_freqs: np.ndarray | None = None
) -> dict[str, Any]:
    """The Hugging Face config a GGUF's metadata describes (its architecture's class);
    `rope_freqs` is the file's `rope_freqs.weight`, if it has one."""
    arch = meta["general.architecture"]
    family = _family_of(meta)

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden_size = require_int(meta, key("embedding_length"))
    num_heads = require_int(meta, key("attention.head_count"))
    num_kv_heads = optional_int(meta, key("attention.head_count_kv"), num_heads)
    head_dim = optional_int(meta, key("attention.key_length"), hidden_size // num_heads)
    value_dim = optional_int(meta, key("attention.value_length"), head_dim)
    rope_dim = optional_int(meta, key("rope.dimension_count"), head_dim)
    # Phi-4-mini's partial rotary embedding: its rope dimension is 3/4 of the key length
    partial = arch == "phi3" and 0 < rope_dim < head_dim and rope_dim % 2 == 0
    if value_dim != head_dim or (rope_dim != head_dim and not partial):
        raise ValueError(
            f"key length {head_dim}, value length {value_dim} and rope dimension {rope_dim} "
            "differ; the forward needs them equal (a phi3 file's rope dimension may be less)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"head_count {num_heads} is not a multiple of head_count_kv {num_kv_heads}"
        )
    if arch in ("qwen2", "qwen2moe") and head_dim * num_heads != hidden_size:
        raise ValueError(
            f"key length {head_dim} x {num_heads} heads is not the hidden size {hidden_size}; "
            "a Qwen2 config cannot say so"
        )
    theta = _float32(meta.get(key("rope.freq_base"), 10000.0))
    rope_scaling = _rope_scaling(meta, key)
    if rope_freqs is not None:
        rope_scaling = llama3_rope_scaling(rope_freqs, theta, head_dim)
    num_layers = require_int(meta, key("block_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    # a Qwen MoE file may leave out feed_forward_length (no dense MLP to size)
    ffn_key = key("feed_forward_length")
    optional = family.experts in ("qwen2_moe", "qwen3_moe") and ffn_key not in meta
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type or arch,
        "hidden_size": hidden_size,
        "intermediate_size": None if optional else require_int(meta, ffn_key),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": require_int(meta, key("context_length")),
        # GGUF stores float32; print the shortest decimal that round-trips it (1e-05, not 9.99e-06).
        "rms_norm_eps": _float32(require_number(meta, key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "vocab_size": optional_int(meta, key("vocab_size"), len(tokens)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
    }
    if arch in ("granite", "granitemoe"):
        config |= _granite_scales(meta, key)
    if arch == "smollm3":
        config |= {"no_rope_layer_interval": SMOLLM3_NO_ROPE_STEP, "use_sliding_window": False}
    if family.experts is not None:
        config |= experts_config(meta, arch, family.experts, config["intermediate_size"])
    if arch in ("gemma2", "gemma3"):
        config |= _gemma_config(meta, key, config, arch)
    elif arch in ("llama", "granite", "smollm3"):  # MixtralConfig has no bias flags
        config |= {"attention_bias": False, "mlp_bias": False} if family.experts is None else {}
    elif arch == "granitemoe":
        config |= {"attention_bias": False}
    elif arch in ("olmo2", "olmoe"):
        config |= _olmo_config(meta, key, arch)
        config |= _olmo3_config(meta, key, config) if family is _OLMO3 else {}
    elif arch == "phi3":  # every layer's window, if the file has one
        window = meta.get(key("attention.sliding_window"))
        config |= {"sliding_window": None if window is None else int(window)}
        config |= {"partial_rotary_factor": rope_dim / head_dim} if partial else {}
    else:  # Qwen: every layer attends to the whole prefix
        config |= {"use_sliding_window": False, "sliding_window": None,
                   "max_window_layers": num_layers}  # fmt: skip
        config |= {"attention_bias": False} if family.architecture.startswith("Qwen3") else {}
    return config | {"torch_dtype": "bfloat16"}


def _granite_scales(meta: dict[str, Any], key: Callable[[str], str]) -> dict[str, Any]:
    """A granite or granitemoe file's scalars as config.json's multipliers (those it has).
    Raises ValueError for a file llama.cpp runs without RoPE (`rope.scaling.finetuned`
    false: its switch for Granite's layers without position embeddings)."""
    if meta.get(key("rope.scaling.finetuned"), True) is False:
        raise ValueError(
            f"{key('rope.scaling.finetuned')} is false: llama.cpp runs this file's attention "
            "without RoPE, which the forward lacks"
        )
    return {field: _float32(require_number(meta, key(name)))
            for name, field in _GRANITE_SCALES.items() if key(name) in meta}  # fmt: skip


def _olmo_config(meta: dict[str, Any], key: Callable[[str], str], arch: str) -> dict[str, Any]:
    """An olmo2 or olmoe file's own fields (an OLMo 3 file's too). Raises ValueError for a
    clamp of q, k and v, which none of their configs can say (`attention.clamp_kqv`: OLMo
    1's clip_qkv, which llama.cpp writes for its olmo architecture alone; neither
    olmo2.cpp's graph nor olmoe.cpp's clamps)."""
    if key("attention.clamp_kqv") in meta:
        raise ValueError(
            f"{key('attention.clamp_kqv')} is {meta[key('attention.clamp_kqv')]}: a clamp of "
            "q, k and v (clip_qkv), which the forward lacks"
        )
    return {"attention_bias": False} | ({"clip_qkv": None} if arch == "olmoe" else {})


# NOTE: OLMo 3 as llama.cpp writes and runs it. convert_hf_to_gguf.py's Olmo2Model writes
# `attention.sliding_window` (transformers' sliding_window as it is) and
# `attention.sliding_window_pattern`, one bool a layer from `layer_types` (True: sliding);
# TextModel writes the full layers' rope (`rope.freq_base`, any scaling) and the sliding
# layers' base as `rope.freq_base_swa`. llama.cpp's olmo2 loader windows layers only for a
# window above 0, and takes the pattern only as one number n (llama_hparams::set_swa_pattern:
# layer i slides where n is 0 or i % n < n - 1), else every 4th layer full: it skips the
# per-layer list. Its windows keep a key fewer than `window` positions back
# (is_masked_swa), as transformers' sliding_window does: the number is the same. olmo2.cpp
# rotates a sliding layer unscaled (freq_scale 1, no YaRN: Olmo3Config's default rope
# there), but by `rope.freq_base`, not `rope.freq_base_swa`. Where the file states the
# checkpoint's own choice (the list, the sliding base) this converter follows it, as
# transformers runs the checkpoint; where it is silent, llama.cpp's.
def _olmo3_config(
    meta: dict[str, Any], key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """An OLMo 3 file's layer types, window and rope by layer type (Olmo3Config's
    `rope_parameters`): the full layers' base and scaling, the sliding layers' default rope
    by `rope.freq_base_swa`, else the full layers' base. `rope_theta` and `rope_scaling`
    stay, the full layers' (transformers 4's Olmo3Config reads them). Raises ValueError
    for a pattern that does not fit the layers."""
    name = key("attention.sliding_window_pattern")
    pattern = meta.get(name, OLMO3_SLIDING_PERIOD)
    num_layers = config["num_hidden_layers"]
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(p, int) for p in pattern):
            raise ValueError(
                f"{name} is {pattern!r}; expected a bool for each of the {num_layers} layers"
            )
        sliding = [bool(p) for p in pattern]
    else:
        period = optional_int(meta, name, OLMO3_SLIDING_PERIOD)
        sliding = [period == 0 or i % period < period - 1 for i in range(num_layers)]
    theta, swa = config["rope_theta"], key("rope.freq_base_swa")
    local_theta = _float32(require_number(meta, swa)) if swa in meta else theta
    full = {"rope_type": "default", **(config["rope_scaling"] or {}), "rope_theta": theta}
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": require_int(meta, key("attention.sliding_window")),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
    }


def _gemma_config(
    meta: dict[str, Any], key: Callable[[str], str], config: dict[str, Any], arch: str
) -> dict[str, Any]:
    """A gemma2 or gemma3 file's text config, as llama.cpp runs it: a sliding window
    (`attention.sliding_window`; none without it) on every other layer (gemma2) or all but
    every 6th (gemma3, those layers rotated by base 10,000 unscaled); scores scaled by
    1 / sqrt(head_dim), but by 1 / sqrt(hidden / heads) on the 27B (its
    query_pre_attn_scalar: 144 and 168); gemma2's soft-caps from the file, else llama.cpp's
    defaults (50 and 30)."""
    window = meta.get(key("attention.sliding_window"))
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == GEMMA_27B_LAYERS[arch]:  # llama.cpp's LLM_TYPE_27B
        scalar = config["hidden_size"] // config["num_attention_heads"]
    own = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": None if window is None else int(window),
        "query_pre_attn_scalar": scalar,
        "attention_bias": False,
    }
    if arch == "gemma2":
        caps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
        return own | {field: _float32(meta.get(key(field), default))
                      for field, default in caps.items()}  # fmt: skip
    return own | {
        "model_type": "gemma3_text",
        "sliding_window_pattern": GEMMA3_SLIDING_PATTERN,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _longrope_scaling(meta: dict[str, Any], long: np.ndarray, short: np.ndarray) -> dict[str, Any]:
    """A phi3 file's LongRoPE as transformers' config writes it: its factor lists and the
    original context (`rope.scaling.original_context_length`). The attention factor is
    left to transformers' rule (from the two contexts), as the source config leaves it."""
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(
            "LongRoPE factors without phi3.rope.scaling.original_context_length: the context "
            "the short factors serve is unknown"
        )
    if long.shape != short.shape or long.ndim != 1:
        raise ValueError(f"LongRoPE factors of shapes {long.shape} and {short.shape}; want one")
    return {
        "rope_type": "longrope",
        "long_factor": [float(f) for f in long],
        "short_factor": [float(f) for f in short],
        "original_max_position_embeddings": int(original),
    }


def llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """Llama 3's rope scaling as one factor a frequency (the frequency is divided by it):
    1 for wavelengths under original / high, `factor` past original / low, and between
    them the interpolation Llama 3.1 defines (transformers' `_compute_llama3_parameters`)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    between = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, between)
    )


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The `llama3` rope_scaling whose factors are `factors` (a file's rope_freqs.weight):
    Llama 3.1's and 3.2's settings if they give them, else the two wavelengths fitted to the
    interpolated frequencies (only they and the factor matter). Raises ValueError when
    neither reproduces every factor to float32 precision."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(
            f"rope_freqs.weight has {factors.size} factors; head_dim {head_dim} needs {head_dim // 2}"
        )
    if np.all(factors == 1.0):
        return None
    factor = float(factors.max())
    candidates = [(factor, 1.0, 4.0, 8192.0)]
    between = (factors > 1.0) & (factors < factor)
    if factor > 1.0 and np.count_nonzero(between) >= 2:
        # smooth = (1/f - 1/factor) / (1 - 1/factor) is linear in 1/wavelength
        wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
        smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[between], smooth, 1)
        if intercept < 0 and slope > 0:
            low_wavelen = -slope / intercept
            high_wavelen = 1 / (1 / low_wavelen + 1 / slope)
            original = float(round(low_wavelen))  # with low_freq_factor 1, then as fitted
            candidates.append((factor, 1.0, round(original / high_wavelen, 4), original))
            candidates.append((factor, original / low_wavelen, original / high_wavelen, original))
    for factor_, low, high, original in candidates:
        made = llama3_rope_factors(theta, head_dim, factor_, low, high, original)
        if np.allclose(made, factors, rtol=1e-6, atol=0.0):
            return {
                "rope_type": "llama3",
                "factor": _float32(factor_),
                "low_freq_factor": float(low),
                "high_freq_factor": float(high),
                "original_max_position_embeddings": int(original),
            }
    raise ValueError(
        f"rope_freqs.weight (factors from {factors.min():g} to {factor:g}) matches no Llama 3 "
        "rope scaling; it cannot be expressed in config.json"
    )


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head)`: per head, rows go from interleaved rotary pairs
    back to the half-split order (first halves of all pairs, then second halves)."""
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _family_of(meta: dict[str, Any]) -> _Family:
    arch = meta["general.architecture"]
    if arch == "llama" and optional_int(meta, "llama.expert_count", 0) > 0:
        return _MIXTRAL
    if arch == "olmo2" and optional_int(meta, "olmo2.attention.sliding_window", 0) > 0:
        return _OLMO3
    return _FAMILIES[arch]


def _sources(tensors: Iterable[Any], family: _Family) -> dict[str, tuple[Any, ...]]:
    """Each Hugging Face tensor's GGUF tensors, in file order: one, or the experts' gate
    and up (gguf_experts.JOINED, in that order)."""
    sources: dict[str, list[Any]] = {}
    for tensor in tensors:
        sources.setdefault(_hf_name(tensor.name, family), []).append(tensor)
    for name, parts in sources.items():
        if len(parts) > 1:
            # NOTE: only JOINED names share a Hugging Face name (layer_names), one layer's each
            assert sorted(t.name.split(".", 2)[2] for t in parts) == sorted(JOINED), name
            parts.sort(key=lambda t: JOINED.index(t.name.split(".", 2)[2]))
    return {name: tuple(parts) for name, parts in sources.items()}


def _hf_name(gguf_name: str, family: _Family) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    block = len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit()
    if block and parts[2] in family.layer_names:
        return f"model.layers.{int(parts[1])}.{family.layer_names[parts[2]]}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face {family.architecture} counterpart"
    )


def _shape(hf_name: str, parts: tuple[Any, ...]) -> tuple[int, ...]:
    """The Hugging Face tensor's shape, `[out_features, in_features]` (outermost first)."""
    # GGUF lists dimensions innermost first; NumPy and Hugging Face outermost first.
    shapes = [tuple(int(d) for d in reversed(t.shape.tolist())) for t in parts]
    if hf_name.endswith(ROW_VECTORS):
        return (1, math.prod(shapes[0]))
    if len(parts) > 1:  # an expert's gate and up rows, joined along dim 1
        if len(set(shapes)) != 1 or len(shapes[0]) != 3:
            raise ValueError(
                f"{' and '.join(t.name for t in parts)} have shapes {shapes}; joined into "
                f"{hf_name}, they must be alike, each [experts, rows, columns]"
            )
        experts, rows, columns = shapes[0]
        return (experts, len(parts) * rows, columns)
    return shapes[0]


def _convert_tensor(
    parts: tuple[Any, ...], shape: tuple[int, ...], config: dict[str, Any], family: _Family
) -> np.ndarray:
    """Dequantized, un-permuted (a Llama's Q, K) and rounded to BF16, in NumPy shape; stacked
    experts one expert at a time (gguf_experts.join_experts)."""
    if len(shape) == 3:
        return join_experts(parts, shape)
    (tensor,) = parts
    weight = dequantized(tensor)
    if weight.size != math.prod(shape):
        raise ValueError(f"{tensor.name}: dequantized {weight.shape}, expected shape {shape}")
    weight = weight.reshape(shape)
    if family.permuted_qk and tensor.name.endswith(".attn_q.weight"):
        weight = unpermute_rows(weight, config["num_attention_heads"])
    elif family.permuted_qk and tensor.name.endswith(".attn_k.weight"):
        weight = unpermute_rows(weight, config["num_key_value_heads"])
    elif config["model_type"] in ("gemma2", "gemma3_text") and tensor.name.endswith("norm.weight"):
        weight = weight.astype(np.float32) - np.float32(1.0)  # llama.cpp's norm_shift off
    return weight.astype(ml_dtypes.bfloat16)


def _readme(
    meta: dict[str, Any], file_names: Sequence[str], counts: Counter[str], source: str | None
) -> str:
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
    first = file_names[0]
    others = f" and its {len(file_names) - 1} other shards" if len(file_names) > 1 else ""
    lines = [
        f"# {meta.get('general.name', first)}\n",
        f"Converted by reprise (converter version {CONVERTER_VERSION}) from `{first}`{others}."
        + (f" Source: {source}." if source else ""),
        f"\nIts tensors ({kinds}) were dequantized and rounded to BF16, so these weights carry",
        "the quantization error: this is not the original BF16 checkpoint.\n",
    ]
    for key in ("organization", "license", "source.url", "url"):
        if meta.get(f"general.{key}") is not None:
            lines.append(f"- {key}: {meta[f'general.{key}']}")
    return "\n".join(lines) + "\n"


def _rope_scaling(meta: dict[str, Any], key: Callable[[str], str]) -> dict[str, Any] | None:
    """The metadata's rope scaling as transformers' config writes it: none, `linear`, or
    `yarn` (its original context and betas from the file); others refused. Llama 3's
    comes as rope_freqs.weight instead (hf_config)."""
    kind = meta.get(key("rope.scaling.type"), "none")
    factor = meta.get(key("rope.scaling.factor"))
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    original = meta.get(key("rope.scaling.original_context_length"))
    attn = meta.get(key("rope.scaling.attn_factor"))
    if kind == "yarn" and attn is not None and float(attn) != 1.0:
        # llama.cpp scales yarn's own attention factor by it, where transformers' config
        # replaces that factor: neither reading has a reference here, so no guess
        raise ValueError(
            f"{key('rope.scaling.attn_factor')} is {float(attn):g}; a yarn attention factor "
            "other than 1 is not read, so this file is refused rather than run with other logits"
        )
    if kind == "yarn" and original is not None:
        betas = {name: float(meta[key(f"rope.scaling.yarn_{name}")])
                 for name in ("beta_fast", "beta_slow") if key(f"rope.scaling.yarn_{name}") in meta}  # fmt: skip
        return {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(original), **betas}  # fmt: skip
    raise ValueError(
        f"{key('rope.scaling.type')} is {kind!r} (factor {factor}); the forward implements "
        "linear, yarn (with rope.scaling.original_context_length) and Llama 3's"
    )


def _float32(value: float) -> float:
    return float(str(np.float32(value)))


def _write_json(path: Path, value: dict[str, Any] | Sequence[Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
