"""Synthetic models: Hugging Face model folders (of registry.py's families) of RANDOM
BF16 weights in the shape of a real model, so that speed and memory can be measured at scale without a model hub.

The folder loads like any other (config.json, sharded model.safetensors with its
index, tokenizer.json, tokenizer_config.json), and says what it is three times:
config.json's `reprise_synthetic`, the safetensors metadata, and a README.md.
Its text output is noise. The tokenizer is byte-level (256 byte tokens and the
special tokens); ids past it exist only as embedding rows, so prompts for
benchmarks are best given as token ids.

Weights are drawn N(0, 0.02) (as Hugging Face initialises Llama), biases N(0, 0.5)
(trained Qwen2 biases are that large and more, and zero ones would test nothing),
norms are 1, and a shard is written at a time, so writing an 8B folder holds ~2 GB in memory.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ...cuda.dtypes import BF16
from .config import ModelConfig
from .experts import read_experts
from .registry import family_of
from .safetensors_io import save_safetensors
from .weights import ExpertWeights, LayerWeights, LlamaWeights

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6}
PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "rms_norm_eps": 1e-5}
GRANITE = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "rms_norm_eps": 1e-5}
SMOLLM3 = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "rms_norm_eps": 1e-6}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "rms_norm_eps": 1e-6}  # fmt: skip
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "rms_norm_eps": 1e-5}
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
}
# Phi-4-mini's LongRoPE: 48 rotated pairs of each head, the factor lists its config's shape
# (short ones near 1, long ones rising to 32x for the low frequencies), not its values
PHI4_MINI_ROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i / 47 for i in range(48)],
    "long_factor": [round(32 ** (i / 47), 4) for i in range(48)],
    "original_max_position_embeddings": 4096,
}
# The architectures of the models named, as their Hugging Face config.json gives them
# (LlamaForCausalLM unless the entry names another).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0},
        "tie_word_embeddings": False,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "smollm2-135m": {  # the default model's shape, for machines that cannot fetch it
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
    },
    "tiny": {  # for tests: every feature of the big ones, in kilobytes
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 512},
        "tie_word_embeddings": False,
    },
    "qwen2-0.5b": {  # Qwen2-0.5B (and Qwen2.5-0.5B): q, k, v biases, tied embeddings
        **QWEN2,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 24,
    },
    "tiny-qwen2": {  # for tests: Qwen2's features (biases, tied, 1e6 theta) in kilobytes
        **QWEN2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 2,
    },
    "qwen3-0.6b": {  # Qwen3-0.6B: q and k norms, heads * head_dim past the hidden size
        **QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
    },
    "tiny-qwen3": {  # for tests: Qwen3's features (q and k norms, tied) in kilobytes
        **QWEN3,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
    },
    "phi-3-mini": {  # Phi-3-mini-4k-instruct: fused projections, a window of 2,047 of 4,096
        **PHI3,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 96,
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "sliding_window": 2047,
    },
    "tiny-phi3": {  # for tests: Phi-3's fused projections in kilobytes
        **PHI3,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
    "granite-3.3-8b": {  # Granite 3.3 8B Instruct: Llama's forward and four multipliers
        **GRANITE,
        "hidden_size": 4096,
        "intermediate_size": 12800,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 49155,
        "max_position_embeddings": 131072,
        "rope_theta": 10000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125,
        "logits_scaling": 16.0,
    },
    "tiny-granite": {  # for tests: Granite's multipliers in kilobytes
        **GRANITE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625,
        "logits_scaling": 8.0,
    },
    "smollm3-3b": {  # SmolLM3-3B: Llama's forward, every 4th layer without RoPE
        **SMOLLM3,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 65536,
        "rope_theta": 5000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "no_rope_layer_interval": 4,
    },
    "tiny-smollm3": {  # for tests: SmolLM3's layers without RoPE in kilobytes
        **SMOLLM3,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 2000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "no_rope_layers": [1, 0, 1, 0],
    },
    "mistral-7b-v0.1": {  # Mistral-7B-v0.1: a sliding window of 4,096 on every layer
        **MISTRAL,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "sliding_window": 4096,
    },
    "phi-4-mini": {  # Phi-4-mini-instruct: 3/4 of each head rotated, LongRoPE to 128k
        **PHI3,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 200064,
        "max_position_embeddings": 131072,
        "rope_theta": 10000.0,
        "rope_scaling": PHI4_MINI_ROPE,
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "sliding_window": None,
    },
    "gemma-3-1b": {  # gemma-3-1b-it: sandwich norms, GeGLU, 5 of 6 layers with a 512 window
        **GEMMA3,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    },
    "gemma-2-2b": {  # gemma-2-2b-it: soft-capped scores and logits, every other layer windowed
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "tiny-gemma3": {  # for tests: Gemma 3's layer in kilobytes (a window of 24, full layer 3)
        **GEMMA3,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 48,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "sliding_window": 24,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
    },
    "qwen3-30b-a3b": {  # Qwen3-30B-A3B: 128 experts of 768, 8 a token (3.3B active)
        **QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
    },
    "mixtral-8x7b": {  # Mixtral-8x7B-v0.1: 8 experts of 14,336, 2 a token (12.9B active)
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "rms_norm_eps": 1e-5,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "tiny-qwen3-moe": {  # for tests: Qwen3-MoE's experts (8 of 64, 2 a token) in kilobytes
        **QWEN3_MOE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
    "tiny-olmo2": {  # for tests: OLMo 2's post-norms and whole q and k norms in kilobytes
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "rms_norm_eps": 1e-6,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "tiny-olmoe": {  # for tests: OLMoE's experts (8 of 16, not renormalized), whole q and k norms
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "rms_norm_eps": 1e-5,
        "hidden_size": 128,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "num_experts": 16,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "clip_qkv": None,
    },
    "tiny-qwen2-moe": {  # for tests: Qwen2-MoE's shared expert, biases and a dense layer
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "rms_norm_eps": 1e-6,
        "hidden_size": 128,
        "intermediate_size": 192,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "num_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96,
        "mlp_only_layers": [1],
    },
}
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|eot_id|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|eot_id|>assistant\n{% endif %}"
)
SHARD_BYTES = 2 << 30
LABEL = "synthetic: random weights in the shape of {like}; its outputs are noise"


def synth_model(
    like: str,
    out: Path,
    *,
    seed: int = 0,
    num_layers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight model folder shaped like `like` (a key of SHAPES) to `out`."""
    if like not in SHAPES:
        raise ValueError(f"like must be one of {', '.join(SHAPES)}; got {like!r}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; give an empty or new folder")
    shape = dict(SHAPES[like])
    if num_layers is not None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer; got {num_layers!r}")
        shape["num_hidden_layers"] = num_layers
    out.mkdir(parents=True, exist_ok=True)
    label = LABEL.format(like=like)
    _write_weights(out, shape, label, np.random.default_rng(seed), progress)
    write_tokenizer(out, shape["vocab_size"])
    config = _config_json(shape, label)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "README.md").write_text(
        f"# Synthetic model ({like})\n\n{label.capitalize()}.\n\nWritten by "
        f"`reprise model synth --like {like}` (seed {seed}) to measure speed and memory "
        "at this size without a model hub. Do not use it for anything else.\n"
    )
    return out


def _config_json(shape: dict[str, Any], label: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        **shape,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 256,
        "eos_token_id": [257, 258],
        "reprise_synthetic": label,
    }


def synth_config(like: str, *, num_layers: int | None = None) -> ModelConfig:
    """The config of `like`'s shape, as `synth_model` writes it."""
    if like not in SHAPES:
        raise ValueError(f"like must be one of {', '.join(SHAPES)}; got {like!r}")
    shape = dict(SHAPES[like])
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    return ModelConfig.from_dict(_config_json(shape, LABEL.format(like=like)))


def synth_in_memory(
    like: str, *, seed: int = 0, num_layers: int | None = None
) -> tuple[ModelConfig, LlamaWeights]:
    """Random weights in `like`'s shape without a folder, for speed runs that need no
    file: an 8B model in seconds, not minutes. Every layer shares one set of host
    tensors (the backend still makes each layer a copy of its own), and the values are
    BF16 of magnitude in [2**-7, 2**-6) with random signs and mantissas, drawn as bits.
    Speed does not depend on the values; nothing but speed should be read from it."""
    config = synth_config(like, num_layers=num_layers)
    rng = np.random.default_rng(seed)

    def rand(*dims: int) -> np.ndarray:
        bits = rng.integers(0, 1 << 16, size=dims, dtype=np.uint16)
        return ((bits & 0x807F) | 0x3C00).view(BF16)  # sign, mantissa random; exponent 2**-7

    h, inter = config.hidden_size, config.intermediate_size
    ones = np.ones(h, dtype=BF16)
    experts = None
    if (moe := config.experts) is not None:
        shared = moe.shared_intermediate_size
        experts = ExpertWeights(
            router=rand(moe.num_experts, h),
            gate_up=rand(moe.num_experts, 2 * moe.intermediate_size, h),
            down=rand(moe.num_experts, h, moe.intermediate_size),
            shared_gate_up=rand(2 * shared, h) if shared else None,
            shared_down=rand(h, shared) if shared else None,
            shared_gate=rand(1, h) if shared else None,
        )
    post_norms = config.family.post_norms  # OLMo 2's: no input norms
    q_norm_size, k_norm_size = config.qk_norm_sizes
    dense = LayerWeights(
        attn_norm=None if post_norms else ones,
        qkv_proj=rand(config.q_size + 2 * config.kv_size, h),
        o_proj=rand(h, config.q_size),
        mlp_norm=None if post_norms else ones,
        gate_up_proj=rand(2 * inter, h),
        down_proj=rand(h, inter),
        qkv_bias=rand(config.q_size + 2 * config.kv_size) if config.qkv_bias else None,
        q_norm=np.ones(q_norm_size, dtype=BF16) if config.qk_norm else None,
        k_norm=np.ones(k_norm_size, dtype=BF16) if config.qk_norm else None,
        post_attn_norm=ones if config.family.gemma or post_norms else None,
        post_mlp_norm=ones if config.family.gemma or post_norms else None,
    )
    sparse = dataclasses.replace(dense, gate_up_proj=None, down_proj=None, experts=experts)
    layers = [sparse if is_sparse else dense for is_sparse in _sparse_layers(config)]
    embed = rand(config.vocab_size, h)
    lm_head = embed if config.tie_word_embeddings else rand(config.vocab_size, h)
    return config, LlamaWeights(embed, layers, ones, lm_head)


def _sparse_layers(config: ModelConfig) -> tuple[bool, ...]:
    return config.experts.sparse_layers if config.experts else (False,) * config.num_layers


def tensor_shapes(shape: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's Hugging Face name and shape, in file order."""
    family = family_of({"architectures": ["LlamaForCausalLM"], **shape})
    qkv_bias = family.qkv_bias
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q_size = shape["num_attention_heads"] * shape["head_dim"]
    kv_size = shape["num_key_value_heads"] * shape["head_dim"]
    yield "model.embed_tokens.weight", (shape["vocab_size"], hidden)
    sparse = _sparse_layers(ModelConfig.from_dict(_config_json(shape, "")))
    for idx in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{idx}."
        if not family.post_norms:  # OLMo 2 normalizes no layer input
            yield prefix + "input_layernorm.weight", (hidden,)
        if family.fused:  # Phi-3's checkpoints: q, k, v in one; gate and up in one
            yield prefix + "self_attn.qkv_proj.weight", (q_size + 2 * kv_size, hidden)
        else:
            yield prefix + "self_attn.q_proj.weight", (q_size, hidden)
            yield prefix + "self_attn.k_proj.weight", (kv_size, hidden)
            yield prefix + "self_attn.v_proj.weight", (kv_size, hidden)
        if qkv_bias:
            yield prefix + "self_attn.q_proj.bias", (q_size,)
            yield prefix + "self_attn.k_proj.bias", (kv_size,)
            yield prefix + "self_attn.v_proj.bias", (kv_size,)
        if family.qk_norm:  # over each head, or over all of them (OLMo's)
            whole = family.qk_norm_whole
            yield prefix + "self_attn.q_norm.weight", (q_size if whole else shape["head_dim"],)
            yield prefix + "self_attn.k_norm.weight", (kv_size if whole else shape["head_dim"],)
        yield prefix + "self_attn.o_proj.weight", (hidden, q_size)
        yield prefix + "post_attention_layernorm.weight", (hidden,)
        if family.gemma:  # sandwich norms: post_attention_layernorm is the attention's output's
            yield prefix + "pre_feedforward_layernorm.weight", (hidden,)
        if family.gemma or family.post_norms:
            yield prefix + "post_feedforward_layernorm.weight", (hidden,)
        if sparse[idx]:  # its experts alone (no dense down_proj)
            yield from _expert_shapes(prefix, family.experts, shape)
            continue
        if family.fused:
            yield prefix + "mlp.gate_up_proj.weight", (2 * inter, hidden)
        else:
            yield prefix + "mlp.gate_proj.weight", (inter, hidden)
            yield prefix + "mlp.up_proj.weight", (inter, hidden)
        yield prefix + "mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    if not shape["tie_word_embeddings"]:
        yield "lm_head.weight", (shape["vocab_size"], hidden)


def _expert_shapes(
    prefix: str, layout: str | None, shape: dict[str, Any]
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A sparse layer's tensors, as the released checkpoints name them (weights._experts)."""
    assert layout is not None
    experts = read_experts(shape, layout)
    hidden, inter = shape["hidden_size"], experts.intermediate_size
    mlp = prefix + (
        "mlp." if layout in ("qwen2_moe", "qwen3_moe", "olmoe") else "block_sparse_moe."
    )
    if layout == "granitemoe":  # stacked
        yield mlp + "router.layer.weight", (experts.num_experts, hidden)
        yield mlp + "input_linear.weight", (experts.num_experts, 2 * inter, hidden)
        yield mlp + "output_linear.weight", (experts.num_experts, hidden, inter)
        return
    yield mlp + "gate.weight", (experts.num_experts, hidden)
    gate, up, down = ("w1", "w3", "w2") if layout == "mixtral" else ("gate_proj", "up_proj",
                                                                     "down_proj")  # fmt: skip
    for e in range(experts.num_experts):
        yield f"{mlp}experts.{e}.{gate}.weight", (inter, hidden)
        yield f"{mlp}experts.{e}.{up}.weight", (inter, hidden)
        yield f"{mlp}experts.{e}.{down}.weight", (hidden, inter)
    if shared := experts.shared_intermediate_size:
        yield mlp + "shared_expert.gate_proj.weight", (shared, hidden)
        yield mlp + "shared_expert.up_proj.weight", (shared, hidden)
        yield mlp + "shared_expert.down_proj.weight", (hidden, shared)
        yield mlp + "shared_expert_gate.weight", (1, hidden)


def _write_weights(
    out: Path,
    shape: dict[str, Any],
    label: str,
    rng: np.random.Generator,
    progress: Callable[[int, int], None] | None,
) -> None:
    tensors = list(tensor_shapes(shape))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:
        nbytes = 2 * int(np.prod(dims))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    weight_map: dict[str, str] = {}
    done = 0
    for idx, shard in enumerate(shards):
        file_name = f"model-{idx + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {name: _random_tensor(name, dims, rng) for name, dims in shard}
        save_safetensors(out / file_name, arrays, {"format": "pt", "reprise_synthetic": label})
        weight_map.update(dict.fromkeys(arrays, file_name))
        done += len(shard)
        if progress is not None:
            progress(done, len(tensors))
    total = sum(2 * int(np.prod(dims)) for _, dims in tensors)
    index = {
        "metadata": {"total_size": total, "reprise_synthetic": label},
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _random_tensor(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype=BF16)
    std = np.float32(0.5 if name.endswith(".bias") else 0.02)
    return (rng.standard_normal(dims, dtype=np.float32) * std).astype(BF16)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level tokenizer: ids 0-255 are the bytes, then the special tokens."""
    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    byte_tokens.sort(key=lambda t: ord(t))
    assert len(byte_tokens) == 256
    vocab = {token: idx for idx, token in enumerate(byte_tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    assert tokenizer.get_vocab_size() == 256 + len(SPECIAL_TOKENS) <= vocab_size
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": SPECIAL_TOKENS[0],
                "eos_token": SPECIAL_TOKENS[2],
                "add_bos_token": True,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
