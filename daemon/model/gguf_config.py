"""config.json for a GGUF file, from its metadata (`hf_config`): its family's Hugging Face
config (gguf_families.py), with what llama.cpp sets in its code rather than reads from the
file written in. It guarantees:

- a Granite or Granite MoE file's four scales become its config's multipliers; what
  llama.cpp sets in its code for a Gemma file (the sliding pattern, the local rope base, the
  score scale) and for SmolLM3 (its layers without RoPE) is written into config.json;
- an olmo2 file with a sliding window becomes an Olmo3ForCausalLM: its layer types, window
  and rope by layer type in config.json (`_olmo3_config`; the NOTE above it);
- a Llama 3 file's `rope_freqs.weight` (its per-frequency rope scaling) becomes the
  `llama3` rope_scaling that gives the same factors, checked against every one
  (`llama3_rope_scaling`); a phi3 file's LongRoPE factors become its `longrope`
  rope_scaling (`longrope_scaling`);
- a mixture of experts' routing and sizes are gguf_experts.py's (`experts_config`);
- what config.json cannot say faithfully (partial rotary but a phi3 file's, a rope scaling
  the forward lacks, LongRoPE factors without their original context, a Granite file
  without RoPE, an olmo2 sliding pattern that does not fit its layers, a clamp of q, k and
  v in an olmo2 or olmoe file) raises `ValueError` naming the offending value; gguf_convert
  builds the config before it writes anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .gguf_experts import experts_config
from .gguf_families import OLMO3, family_of
from .gguf_files import optional_int, require_int, require_number

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


def hf_config(
    meta: dict[str, Any], tensor_names: set[str], rope_freqs: np.ndarray | None = None
) -> dict[str, Any]:
    """The Hugging Face config a GGUF's metadata describes (its architecture's class);
    `rope_freqs` is the file's `rope_freqs.weight`, if it has one."""
    arch = meta["general.architecture"]
    family = family_of(meta)

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
    config: dict[str, Any] = {
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
        config |= _olmo3_config(meta, key, config) if family is OLMO3 else {}
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


def longrope_scaling(meta: dict[str, Any], long: np.ndarray, short: np.ndarray) -> dict[str, Any]:
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
