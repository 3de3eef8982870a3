"""The model families this engine runs, by the name a Hugging Face config.json gives them.

A family is one entry: the `architectures[0]` (or, without it, the `model_type`) it
answers to, the options its forward pass needs beyond the Llama one (today: a bias on
the q, k and v projections, an RMSNorm of each query and key head, fused projections in
the checkpoint, Granite's scalar multipliers, SmolLM3's layers without RoPE, InternLM2's
checkpoint layout, Gemma's layer, a mixture-of-experts MLP), the sliding
window transformers would apply to each layer (the attention takes it: a query sees the
window's last keys, config.ModelConfig.layer_windows), and the checks that refuse
a config whose options the forward does not implement.
`ModelConfig.from_dict` looks the family up first, so an unknown architecture is refused
in one line that names it and the supported ones, before any weight is read. Every
family runs through the one forward (llama.py) and reads the same tensor names
(weights.py); its options say which extra tensors exist.

Adding a family: an entry in FAMILIES, its options as ModelConfig fields, their
tensors in weights.py and synth.py, and a test against transformers' own class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class ModelConfigError(ValueError):
    """A config.json that describes a model this engine cannot run."""


@dataclass(frozen=True, slots=True)
class ModelFamily:
    architecture: str  # config.json's architectures[0], e.g. "LlamaForCausalLM"
    model_type: str  # config.json's model_type, e.g. "llama"
    qkv_bias: bool  # q_proj, k_proj and v_proj carry a `.bias` (added before RoPE)
    check: Callable[[Mapping[str, Any]], None]  # raises ModelConfigError on what we lack
    # q_norm and k_norm: an RMSNorm over head_dim of each query and key head, before RoPE
    qk_norm: bool = False
    # the sliding window transformers applies to each layer under this config (0: none)
    windows: Callable[[Mapping[str, Any]], tuple[int, ...]] = lambda raw: ()
    # q, k and v in one `qkv_proj`, gate and up in one `gate_up_proj` (Phi-3's checkpoints)
    fused: bool = False
    # Granite's four scalars (embedding, residual and attention multipliers, logits
    # scaling): read into ModelConfig, folded into the weights (weights.py) and the scale
    scaled: bool = False
    # SmolLM3's `no_rope_layers` (1: the layer rotates its queries and keys, 0: it does
    # not): read into ModelConfig.rope_layers, the others' rotation by identity tables
    nope: bool = False
    # Helium's rotary pairs: dimensions 2i and 2i + 1 of a head (GPT-J's layout), put
    # where the kernels pair them as q and k load (weights.py)
    interleaved_rope: bool = False
    # InternLM2's checkpoint layout: its own tensor names, q, k and v in one `wqkv` whose
    # rows go KV head by KV head (its group's query heads, then its key, then its value);
    # weights.py reads them into the Llama layout
    internlm2: bool = False
    # Gemma's layer (2 and 3): RMSNorm weights w applied as (1 + w), the attention's and
    # the MLP's outputs each normalized before the residual add ("sandwich" norms), a GELU
    # (tanh) gated MLP, the embedding scaled by sqrt(hidden_size); Gemma 3's sliding layers
    # rotate by their own unscaled rope base (ModelConfig.local_rope_theta), Gemma 2's
    # scores and logits are tanh soft-capped (ModelConfig.attn_softcap, final_softcap)
    gemma: bool = False
    # OLMo's q_norm and k_norm (with qk_norm): one RMSNorm over all the query heads'
    # dimensions and one over all the key heads', not one a head
    qk_norm_whole: bool = False
    # OLMo 2's layer: no input norms (a layer's input is the residual stream in BF16), the
    # attention's and the MLP's outputs each normalized before the residual add
    post_norms: bool = False
    # a mixture-of-experts MLP (experts.py), by its checkpoint layout: "mixtral"
    # (block_sparse_moe, experts' w1, w2, w3), "qwen2_moe" (mlp.gate, mlp.experts.N's
    # gate, up and down projections, and a gated shared expert), "qwen3_moe" (the
    # same without the shared expert), "olmoe" (Qwen3-MoE's tensors) or "granitemoe"
    # (block_sparse_moe's experts stacked: input_linear, output_linear, router.layer);
    # None: a dense MLP
    experts: str | None = None


def _check_llama(raw: Mapping[str, Any]) -> None:
    # NOTE: Llama's attention_bias puts a bias on o_proj too, which the forward lacks.
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelConfigError(f"{flag}=true is not supported")


def _num_layers(raw: Mapping[str, Any]) -> int:
    return int(raw.get("num_hidden_layers", 0))


def _window(raw: Mapping[str, Any]) -> int:
    window = int(raw["sliding_window"])
    if window < 1:
        raise ModelConfigError(f"sliding_window must be a positive integer; got {window}")
    return window


def _typed_windows(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """`sliding_window` on the layers `layer_types` marks "sliding_attention"."""
    layer_types = raw.get("layer_types") or []
    if len(layer_types) != _num_layers(raw):
        raise ModelConfigError(
            f"layer_types has {len(layer_types)} entries for {_num_layers(raw)} layers"
        )
    window = _window(raw)
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


def _qwen2_windows(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """Qwen2's windows where transformers applies them: with use_sliding_window, to the
    layers `layer_types` marks "sliding_attention", or else those from max_window_layers
    on (transformers' Qwen2Config)."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return ()
    if raw.get("layer_types") is not None:
        return _typed_windows(raw)
    first = int(raw.get("max_window_layers", 28))
    window = _window(raw)
    return tuple(window if i >= first else 0 for i in range(_num_layers(raw)))


def _every_layer_window(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """Mistral's and Phi-3's: a `sliding_window` applies to every layer."""
    window = raw.get("sliding_window")
    return () if window is None else (_window(raw),) * _num_layers(raw)


def _use_sliding_windows(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """Qwen3-MoE's: with use_sliding_window, `sliding_window` on every layer."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return ()
    return (_window(raw),) * _num_layers(raw)


def _qwen2_moe_windows(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """Qwen2-MoE's: with use_sliding_window, the layers `layer_types` marks
    "sliding_attention", or else (Qwen2MoeConfig's default) the even-indexed layers
    below max_window_layers."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return ()
    if raw.get("layer_types") is not None:
        return _typed_windows(raw)
    first = int(raw.get("max_window_layers", 28))
    window = _window(raw)
    return tuple(window if i % 2 == 0 and i < first else 0 for i in range(_num_layers(raw)))


def _check_mixtral(raw: Mapping[str, Any]) -> None:
    """Mixtral is Mistral's attention with experts (router jitter is training's)."""


def _check_mistral(raw: Mapping[str, Any]) -> None:
    """Mistral is Llama's forward (an explicit head_dim too, as Mistral-Nemo's)."""
    _check_llama(raw)


def _check_qwen3(raw: Mapping[str, Any]) -> None:
    """Qwen3's attention_bias puts a bias on o_proj too (the forward has none there)."""
    if raw.get("attention_bias"):
        raise ModelConfigError("attention_bias=true is not supported")


def _check_olmo(raw: Mapping[str, Any]) -> None:
    """OLMo 2 and OLMoE: Llama's attention with q and k normalized whole; OLMoE's
    clip_qkv (a clamp of q, k and v) is not in the forward."""
    _check_qwen3(raw)
    if raw.get("clip_qkv") is not None:
        raise ModelConfigError(f"clip_qkv={raw['clip_qkv']} is not supported (only null)")


def _check_granite(raw: Mapping[str, Any]) -> None:
    """Granite (3.x, dense) is Llama's forward with four scalar multipliers."""
    _check_llama(raw)


def _smollm3_windows(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """SmolLM3's windows where transformers applies them: with use_sliding_window, to
    the layers `layer_types` marks "sliding_attention", or else to those without RoPE
    (transformers' SmolLM3Config)."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return ()
    if raw.get("layer_types") is not None:
        return _typed_windows(raw)
    interval = int(raw.get("no_rope_layer_interval", 4))
    rotates = raw.get("no_rope_layers")
    if rotates is None:
        rotates = [(i + 1) % interval != 0 for i in range(_num_layers(raw))]
    window = _window(raw)
    return tuple(0 if rotate else window for rotate in rotates)


def _check_seed_oss(raw: Mapping[str, Any]) -> None:
    """Seed-OSS is Qwen2's forward (a bias on q, k and v) under Llama's names."""
    if not raw.get("attention_bias", True):
        raise ModelConfigError("attention_bias=false is not supported (Seed-OSS's q, k, v bias)")
    for flag in ("attention_out_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelConfigError(f"{flag}=true is not supported")


def _check_helium(raw: Mapping[str, Any]) -> None:
    """Helium is Llama's forward with interleaved rotary pairs, on every dimension."""
    _check_llama(raw)
    factor = raw.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise ModelConfigError(f"partial_rotary_factor={factor} is not supported for Helium")


def _check_internlm2(raw: Mapping[str, Any]) -> None:
    """InternLM2 (2 and 2.5) is Llama's forward; its `bias` puts biases on wqkv and wo."""
    if raw.get("bias"):
        raise ModelConfigError("bias=true is not supported (a bias on wqkv and wo)")


def gemma_layer_types(raw: Mapping[str, Any]) -> list[str]:
    """Gemma's layer types: `layer_types`, or transformers' default, every `pattern`-th
    layer full and the others sliding: Gemma 3's older `sliding_window_pattern` (6 when
    absent), Gemma 2's every other layer."""
    given = raw.get("layer_types")
    if given is not None:
        return list(given)
    gemma3 = family_of(raw).architecture == "Gemma3ForCausalLM"
    pattern = int(raw.get("sliding_window_pattern", 6)) if gemma3 else 2
    if pattern < 1:
        raise ModelConfigError(f"sliding_window_pattern must be >= 1; got {pattern}")
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(_num_layers(raw))
    ]


def olmo3_layer_types(raw: Mapping[str, Any]) -> list[str]:
    """OLMo 3's layer types: `layer_types`, or transformers' default (Olmo3Config: every
    fourth layer full, the others sliding)."""
    given = raw.get("layer_types")
    if given is not None:
        return list(given)
    return [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(_num_layers(raw))
    ]


def _olmo3_windows(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """OLMo 3's windows: `sliding_window` (4,096 where absent, Olmo3Config's) on its
    sliding layers."""
    window = raw.get("sliding_window", 4096)
    if window is None:
        return ()
    return _typed_windows({**raw, "sliding_window": window, "layer_types": olmo3_layer_types(raw)})


def _gemma_windows(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """Gemma's windows: `sliding_window` on its sliding layers."""
    if raw.get("sliding_window") is None:
        return ()
    return _typed_windows({**raw, "layer_types": gemma_layer_types(raw)})


def _check_gemma2(raw: Mapping[str, Any]) -> None:
    """Gemma 2: Gemma 3's layer without q and k norms, its scores and logits soft-capped."""
    _check_gemma(raw, "Gemma 2")


def _check_gemma3(raw: Mapping[str, Any]) -> None:
    """Gemma 3 (text) with no soft-capping and causal attention, as it is released."""
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(field) is not None:
            raise ModelConfigError(f"{field}={raw[field]} is not supported for Gemma 3")
    _check_gemma(raw, "Gemma 3")


def _check_gemma(raw: Mapping[str, Any], name: str) -> None:
    kinds = set(gemma_layer_types(raw)) - {"sliding_attention", "full_attention"}
    if kinds:
        raise ModelConfigError(f"layer_types {sorted(kinds)} are not supported")
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention=true is not supported")
    if raw.get("attention_bias"):
        raise ModelConfigError("attention_bias=true is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelConfigError(
            f"hidden_activation {act!r} is not supported for {name}; only 'gelu_pytorch_tanh'"
        )


def _check_phi3(raw: Mapping[str, Any]) -> None:
    """Phi-3 is Llama's forward with fused projections (Phi-4-mini's partial rotary
    embedding: config.ModelConfig.rotary_dim)."""


FAMILIES: dict[str, ModelFamily] = {
    family.architecture: family
    for family in (
        ModelFamily("LlamaForCausalLM", "llama", qkv_bias=False, check=_check_llama),
        ModelFamily(
            "Qwen2ForCausalLM",
            "qwen2",
            qkv_bias=True,
            check=lambda raw: None,
            windows=_qwen2_windows,
        ),
        ModelFamily(
            "MistralForCausalLM",
            "mistral",
            qkv_bias=False,
            check=_check_mistral,
            windows=_every_layer_window,
        ),
        ModelFamily(
            "Qwen3ForCausalLM",
            "qwen3",
            qkv_bias=False,
            check=_check_qwen3,
            qk_norm=True,
            windows=_qwen2_windows,
        ),
        ModelFamily(
            "Phi3ForCausalLM",
            "phi3",
            qkv_bias=False,
            check=_check_phi3,
            windows=_every_layer_window,
            fused=True,
        ),
        ModelFamily(
            "GraniteForCausalLM", "granite", qkv_bias=False, check=_check_granite, scaled=True
        ),
        ModelFamily(
            "SmolLM3ForCausalLM",
            "smollm3",
            qkv_bias=False,
            check=_check_llama,
            windows=_smollm3_windows,
            nope=True,
        ),
        ModelFamily("SeedOssForCausalLM", "seed_oss", qkv_bias=True, check=_check_seed_oss),
        ModelFamily(
            "HeliumForCausalLM",
            "helium",
            qkv_bias=False,
            check=_check_helium,
            interleaved_rope=True,
        ),
        ModelFamily(
            "InternLM2ForCausalLM",
            "internlm2",
            qkv_bias=False,
            check=_check_internlm2,
            internlm2=True,
        ),
        ModelFamily(
            "Gemma2ForCausalLM",
            "gemma2",
            qkv_bias=False,
            check=_check_gemma2,
            windows=_gemma_windows,
            gemma=True,
        ),
        ModelFamily(
            "Gemma3ForCausalLM",
            "gemma3_text",
            qkv_bias=False,
            check=_check_gemma3,
            qk_norm=True,
            windows=_gemma_windows,
            gemma=True,
        ),
        ModelFamily(
            "Olmo2ForCausalLM",
            "olmo2",
            qkv_bias=False,
            check=_check_olmo,
            qk_norm=True,
            qk_norm_whole=True,
            post_norms=True,
        ),
        ModelFamily(  # OLMo 2's layer, windows on its sliding layers, their own rope
            "Olmo3ForCausalLM",
            "olmo3",
            qkv_bias=False,
            check=_check_olmo,
            qk_norm=True,
            windows=_olmo3_windows,
            qk_norm_whole=True,
            post_norms=True,
        ),
        ModelFamily(
            "MixtralForCausalLM",
            "mixtral",
            qkv_bias=False,
            check=_check_mixtral,
            windows=_every_layer_window,
            experts="mixtral",
        ),
        ModelFamily(
            "Qwen2MoeForCausalLM",
            "qwen2_moe",
            qkv_bias=True,
            check=lambda raw: None,
            windows=_qwen2_moe_windows,
            experts="qwen2_moe",
        ),
        ModelFamily(
            "GraniteMoeForCausalLM",
            "granitemoe",
            qkv_bias=False,
            check=_check_granite,
            scaled=True,
            experts="granitemoe",
        ),
        ModelFamily(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            qkv_bias=False,
            check=_check_qwen3,
            qk_norm=True,
            windows=_use_sliding_windows,
            experts="qwen3_moe",
        ),
        ModelFamily(
            "OlmoeForCausalLM",
            "olmoe",
            qkv_bias=False,
            check=_check_olmo,
            qk_norm=True,
            qk_norm_whole=True,
            experts="olmoe",  # Qwen3-MoE's tensors, its experts' size as intermediate_size
        ),
    )
}


# A bare model (transformers' XModel: no lm_head; an embedding model's checkpoint, as
# E5-Mistral's `MistralModel`) is its family's; it runs with its embedding as the
# lm_head (config.py ties them), so its embeddings are right and its text means nothing.
BARE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


# A multimodal checkpoint whose language model is a family's: its `text_config` read as
# that family's, each field it omits at transformers' default for the text config class
# (the released configs give only what differs), the outer config's token ids where the
# text config has none; weights.py reads the text weights under the language model's
# prefix and leaves the vision tower. Only text is served.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {  # transformers' Gemma3TextConfig
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
# Qwen2-VL's and Qwen2.5-VL's text model is Qwen2's (transformers' Qwen2VLTextConfig and
# Qwen2_5_VLTextConfig), Qwen3-VL's Qwen3's (Qwen3VLTextConfig). Their M-RoPE rotates each
# frequency by one of three position ids (time, height, width); a text token's three are
# its position, so on text it is the plain rotation, as transformers' config reads
# `mrope` (rope_type default). The Qwen2 VL configs on the hub hold the text fields at
# the top level, not in a text_config.
QWEN2_VL_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152_064,
    "hidden_size": 8192,
    "intermediate_size": 29_568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
}
QWEN3_VL_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151_936,
    "hidden_size": 4096,
    "intermediate_size": 22_016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 128_000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500_000.0,
    "tie_word_embeddings": False,
}
# Qwen3-VL-MoE's text model is Qwen3-MoE's (Qwen3VLMoeTextConfig), its router always
# normalizing the chosen experts' weights (no norm_topk_prob field: one set here)
QWEN3_VL_MOE_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151_936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 128_000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500_000.0,
    "tie_word_embeddings": True,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "norm_topk_prob": True,
}
MULTIMODAL = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", GEMMA3_TEXT_DEFAULTS),
    "Qwen2VLForConditionalGeneration": ("Qwen2ForCausalLM", QWEN2_VL_TEXT_DEFAULTS),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2ForCausalLM", QWEN2_VL_TEXT_DEFAULTS),
    "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", QWEN3_VL_TEXT_DEFAULTS),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3MoeForCausalLM", QWEN3_VL_MOE_TEXT_DEFAULTS),
}
# the multimodal configs whose text fields may sit at the top level (no text_config)
_FLAT_TEXT = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# outer fields the text model takes where its text_config lacks them
_OUTER_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")


def text_part(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` itself, or a multimodal config's text model as its family reads it."""
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in MULTIMODAL:
        return dict(raw)
    family, defaults = MULTIMODAL[archs[0]]
    text = raw.get("text_config")
    if text is None and archs[0] in _FLAT_TEXT:
        text = {k: v for k, v in raw.items() if k not in ("vision_config", "architectures")}
    if not isinstance(text, Mapping):
        raise ModelConfigError(f"{archs[0]}'s config.json lacks its text_config")
    outer = {k: raw[k] for k in _OUTER_FIELDS if k in raw}
    if "num_local_experts" in text and "num_experts" not in text:  # transformers 5's alias
        text = {**text, "num_experts": text["num_local_experts"]}
    tied = [m["tie_word_embeddings"] for m in (raw, text) if "tie_word_embeddings" in m]
    text = {**defaults, **outer, **text, "architectures": [family]}
    if "norm_topk_prob" in defaults:  # a router that always normalizes (Qwen3-VL-MoE's)
        text["norm_topk_prob"] = defaults["norm_topk_prob"]
    if tied:  # the outer config's, as transformers 5 reads it; Qwen2 VL's tied if either
        # says so (transformers 5's reading of a pre-v5 save, which put it in text_config)
        flat = archs[0] in _FLAT_TEXT
        text["tie_word_embeddings"] = any(bool(t) for t in tied) if flat else bool(tied[0])
    if _is_mrope(text.get("rope_scaling")) or _is_mrope(text.get("rope_parameters")):
        scaling = "rope_scaling" if _is_mrope(text.get("rope_scaling")) else "rope_parameters"
        params = {k: v for k, v in text[scaling].items()
                  if k not in ("type", "rope_type", "mrope_section", "mrope_interleaved")}  # fmt: skip
        text[scaling] = {**params, "rope_type": "default"}
    return text


def _is_mrope(params: Any) -> bool:
    """A Qwen VL's M-RoPE settings (the plain rotation on text: QWEN2_VL_TEXT_DEFAULTS)."""
    return isinstance(params, Mapping) and (
        "mrope_section" in params or params.get("type", params.get("rope_type")) == "mrope"
    )


def supported_architectures() -> tuple[str, ...]:
    return (*FAMILIES, *MULTIMODAL, *BARE_MODELS)


def is_bare(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json names a bare model (BARE_MODELS)."""
    archs = raw.get("architectures") or []
    return bool(archs) and archs[0] in BARE_MODELS


def family_of(raw: Mapping[str, Any]) -> ModelFamily:
    """The family of a config.json (parsed): by `architectures[0]`, or by `model_type`
    when it names none. Raises ModelConfigError naming it and the supported ones."""
    archs = raw.get("architectures") or []
    if archs:
        family = FAMILIES.get(BARE_MODELS.get(archs[0], archs[0]))
        name = archs[0]
    else:
        by_type = {f.model_type: f for f in FAMILIES.values()}
        family = by_type.get(raw.get("model_type", ""))
        name = raw.get("model_type")
    if family is None:
        raise ModelConfigError(
            f"unsupported architecture {name!r}; supported: {', '.join(supported_architectures())}"
        )
    return family


def family_named(architecture: str) -> ModelFamily:
    """The family registered under `architecture` (a ModelConfig's own field)."""
    return family_of({"architectures": [architecture]})
