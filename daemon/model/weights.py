"""Load a Llama-family checkpoint (safetensors, one file or a sharded set) as BF16.

Tensors stored as BF16, F16 or F32 are rounded to BF16 once, on load. Q, K and
V are fused into one projection, and so are gate and up, so each layer runs
two GEMMs where a naive port runs five; a family with q, k and v biases (Qwen2)
has them fused the same way, and one with q and k norms (Qwen3) keeps them per layer;
Granite's scalar multipliers are folded into the weights (`_folded`), Gemma's norm
weights offset by one (`_unit_offset_norms`), and a partial
rotary embedding's dimensions reordered in q and k alike (`_rotary_ordered`); a mixture
of experts' layers hold their experts stacked, each one's gate and up fused
(`ExpertWeights`). A missing
tensor or a wrong shape is an error that names it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...cuda.dtypes import BF16
from ...cuda.rope import rotary_permutation
from .config import ModelConfig
from .safetensors_io import load_safetensors


class WeightsError(ValueError):
    """A checkpoint whose tensors do not fit its config."""


@dataclass(slots=True)
class LayerWeights:
    attn_norm: np.ndarray | None  # [hidden]; None: OLMo 2's (family.post_norms)
    qkv_proj: np.ndarray  # [q_size + 2 * kv_size, hidden]
    o_proj: np.ndarray  # [hidden, q_size]
    mlp_norm: np.ndarray | None  # [hidden]; likewise
    gate_up_proj: np.ndarray | None  # [2 * intermediate, hidden]; None: a sparse layer's
    down_proj: np.ndarray | None  # [hidden, intermediate]
    qkv_bias: np.ndarray | None = None  # [q_size + 2 * kv_size]; families with config.qkv_bias
    q_norm: np.ndarray | None = None  # config.qk_norm_sizes; families with config.qk_norm
    k_norm: np.ndarray | None = None  # [head_dim]
    # Gemma's sandwich norms: of the attention's output and of the MLP's, each before
    # its residual add ([hidden]); None for the other families
    post_attn_norm: np.ndarray | None = None
    post_mlp_norm: np.ndarray | None = None
    experts: ExpertWeights | None = None  # a sparse layer's MLP (config.experts)


@dataclass(slots=True)
class ExpertWeights:
    """A mixture-of-experts MLP (experts.py): E experts, each gate and up fused as a dense
    layer's, and Qwen2-MoE's shared expert."""

    router: np.ndarray  # [E, hidden]
    gate_up: np.ndarray  # [E, 2 * expert intermediate, hidden]
    down: np.ndarray  # [E, hidden, expert intermediate]
    shared_gate_up: np.ndarray | None = None  # [2 * shared intermediate, hidden]
    shared_down: np.ndarray | None = None  # [hidden, shared intermediate]
    shared_gate: np.ndarray | None = None  # [1, hidden]: the shared expert's sigmoid gate


@dataclass(slots=True)
class LlamaWeights:
    embed_tokens: np.ndarray  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]; the embedding itself when tied


def open_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's checkpoint, memory-mapped, by name."""
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path / shard
            if not shard_path.is_file():
                raise WeightsError(f"{index_path} names shard {shard!r}, which is missing")
            tensors.update(load_safetensors(shard_path))
        return tensors
    single = path / "model.safetensors"
    if not single.is_file():
        raise WeightsError(
            f"{path} holds neither model.safetensors nor model.safetensors.index.json"
        )
    return load_safetensors(single)


def load_weights(
    path: Path | str, config: ModelConfig, progress: Callable[[int, int], None] | None = None
) -> LlamaWeights:
    """Read and check every tensor the config implies (`progress(done, total)` per layer),
    then lay them out for the forward: heads padded (ModelConfig.padded), rotary pairs
    ordered (`_rotary_ordered`), Granite's scalars folded (`_folded`)."""
    stored = config  # the checkpoint's shapes
    if config.checkpoint_head_dim is not None:
        stored = dataclasses.replace(config, head_dim=config.checkpoint_head_dim,
                                     rotary_dim=None, checkpoint_head_dim=None)  # fmt: skip
    weights = _read(Path(path), stored, progress)
    if config.checkpoint_head_dim is not None:
        _padded(weights, stored, config)
    if config.rotary_dim is not None or config.family.interleaved_rope:
        _rotary_ordered(weights, config)
    if config.family.gemma:
        _unit_offset_norms(weights)
    return _folded(weights, config) if config.family.scaled else weights


def _read(
    path: Path, config: ModelConfig, progress: Callable[[int, int], None] | None
) -> LlamaWeights:
    """The checkpoint's tensors, checked against `config`, in the Llama layout (q, k and
    v fused, gate and up fused), each head's dimensions in the checkpoint's order."""
    tensors = open_checkpoint(path)
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size

    def take(name: str, shape: tuple[int, ...], transposed: bool = False) -> np.ndarray:
        # transposed: a stack [E, N, K] may be stored [E, K, N] (Qwen3-VL-MoE's experts,
        # as the hub holds them), told apart by its shape; where N == K it is taken as
        # [E, N, K] (transformers 5's and our GGUF converter's; every released
        # Qwen3-VL-MoE has N != K)
        # saved from the bare model (registry.BARE_MODELS), or a multimodal model's language
        # model (registry.MULTIMODAL), as transformers writes it or as it holds it
        bare = name.removeprefix("model.")
        for stored in (bare, "language_model." + name, "model.language_model." + bare):
            if name not in tensors and stored in tensors:
                name = stored
        if name not in tensors:
            raise WeightsError(f"checkpoint in {path} lacks tensor {name!r}")
        t = tensors[name]
        if transposed and shape[1] != shape[2] and t.shape == (shape[0], shape[2], shape[1]):
            t = np.swapaxes(t, 1, 2)
        if t.shape != shape:
            raise WeightsError(f"tensor {name!r} has shape {t.shape}; the config implies {shape}")
        if t.dtype not in (BF16, np.float16, np.float32):
            raise WeightsError(f"tensor {name!r} has dtype {t.dtype}; expected BF16, F16 or F32")
        return np.ascontiguousarray(t.astype(BF16, copy=False))

    if config.family.internlm2:
        return _internlm2(take, config, progress)
    q_kv_sizes = {"q": config.q_size, "k": config.kv_size, "v": config.kv_size}
    fused, gemma = config.family.fused, config.family.gemma
    # the MLP's input norm; Gemma's post_attention_layernorm is its attention's output's
    mlp_norm = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
    # OLMo 2 normalizes outputs alone: its post_attention_layernorm is the attention's
    # output's, as Gemma's, and it has no input norms
    post_norms = config.family.post_norms
    q_norm_size, k_norm_size = config.qk_norm_sizes
    embed = take("model.embed_tokens.weight", (vocab, h))
    sparse = config.experts.sparse_layers if config.experts else (False,) * config.num_layers
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        dense = not sparse[i]
        layers.append(
            LayerWeights(
                attn_norm=None if post_norms else take(p + "input_layernorm.weight", (h,)),
                qkv_proj=take(attn + "qkv_proj.weight", (sum(q_kv_sizes.values()), h))
                if fused  # Phi-3's: q, k and v rows in that order, as we pack them
                else np.concatenate(
                    [take(f"{attn}{x}_proj.weight", (n, h)) for x, n in q_kv_sizes.items()]
                ),
                o_proj=take(attn + "o_proj.weight", (h, config.q_size)),
                mlp_norm=None if post_norms else take(p + mlp_norm + ".weight", (h,)),
                gate_up_proj=None
                if not dense
                else take(p + "mlp.gate_up_proj.weight", (2 * inter, h))
                if fused  # gate rows, then up rows, as we pack them
                else _gate_up(take, p + "mlp.", inter, h),
                down_proj=take(p + "mlp.down_proj.weight", (h, inter)) if dense else None,
                experts=None if dense else _experts(take, tensors, p, config),
                qkv_bias=np.concatenate(
                    [take(f"{attn}{x}_proj.bias", (n,)) for x, n in q_kv_sizes.items()]
                )
                if config.qkv_bias
                else None,
                q_norm=take(attn + "q_norm.weight", (q_norm_size,)) if config.qk_norm else None,
                k_norm=take(attn + "k_norm.weight", (k_norm_size,)) if config.qk_norm else None,
                post_attn_norm=take(p + "post_attention_layernorm.weight", (h,))
                if gemma or post_norms
                else None,
                post_mlp_norm=take(p + "post_feedforward_layernorm.weight", (h,))
                if gemma or post_norms
                else None,
            )
        )
        if progress is not None:
            progress(i + 1, config.num_layers)
    lm_head = embed if config.tie_word_embeddings else take("lm_head.weight", (vocab, h))
    return LlamaWeights(embed, layers, take("model.norm.weight", (h,)), lm_head)


def _gate_up(take: Callable[[str, tuple[int, ...]], np.ndarray], p: str, inter: int,
             h: int, names: tuple[str, str] = ("gate_proj", "up_proj")) -> np.ndarray:  # fmt: skip
    """A SwiGLU MLP's gate and up projections under prefix `p`, fused: gate rows first."""
    return np.concatenate([take(f"{p}{names[0]}.weight", (inter, h)),
                           take(f"{p}{names[1]}.weight", (inter, h))])  # fmt: skip


def _experts(
    take: Callable[..., np.ndarray],
    tensors: dict[str, np.ndarray],
    p: str,
    config: ModelConfig,
) -> ExpertWeights:
    """Layer `p`'s experts: one tensor per expert and projection, as the released
    checkpoints hold them (and transformers saves them), or the experts stacked
    (`experts.gate_up_proj` [E, 2I, hidden] and `experts.down_proj`, as transformers 5
    holds them in memory, or each transposed, as Qwen3-VL-MoE's checkpoints hold them)."""
    assert config.experts is not None
    h, cfg = config.hidden_size, config.experts
    num, inter = cfg.num_experts, cfg.intermediate_size
    layout = config.family.experts
    mlp = p + ("mlp." if layout in ("qwen2_moe", "qwen3_moe", "olmoe") else "block_sparse_moe.")
    names = ("w1", "w3", "w2") if layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    stacked = mlp + "experts.gate_up_proj"
    if layout == "granitemoe":  # stacked in the checkpoint, gate rows before up rows
        gate_up = take(mlp + "input_linear.weight", (num, 2 * inter, h))
        down = take(mlp + "output_linear.weight", (num, h, inter))
        return ExpertWeights(router=take(mlp + "router.layer.weight", (num, h)), gate_up=gate_up,
                             down=down)  # fmt: skip
    bare = stacked.removeprefix("model.")
    # under take's names: as written, bare, or a multimodal model's language model's
    if {
        stacked,
        bare,
        "language_model." + stacked,
        "model.language_model." + bare,
    } & tensors.keys():
        gate_up = take(stacked, (num, 2 * inter, h), True)
        down = take(mlp + "experts.down_proj", (num, h, inter), True)
    else:
        gate_up = np.stack([_gate_up(take, f"{mlp}experts.{e}.", inter, h, names[:2])
                            for e in range(num)])  # fmt: skip
        down = np.stack([take(f"{mlp}experts.{e}.{names[2]}.weight", (h, inter))
                         for e in range(num)])  # fmt: skip
    weights = ExpertWeights(router=take(mlp + "gate.weight", (num, h)), gate_up=gate_up,
                            down=down)  # fmt: skip
    if shared := cfg.shared_intermediate_size:
        weights.shared_gate_up = _gate_up(take, mlp + "shared_expert.", shared, h)
        weights.shared_down = take(mlp + "shared_expert.down_proj.weight", (h, shared))
        weights.shared_gate = take(mlp + "shared_expert_gate.weight", (1, h))
    return weights


def _internlm2(
    take: Callable[[str, tuple[int, ...]], np.ndarray],
    config: ModelConfig,
    progress: Callable[[int, int], None] | None,
) -> LlamaWeights:
    """InternLM2's checkpoint (its tensor names; `wqkv` rows KV head by KV head: the
    group's query heads, the key head, the value head) in the Llama layout."""
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    d, kv_heads, group = (
        config.head_dim,
        config.num_kv_heads,
        config.num_heads // config.num_kv_heads,
    )
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        wqkv = take(p + "attention.wqkv.weight", (kv_heads * (group + 2) * d, h))
        by_head = wqkv.reshape(kv_heads, group + 2, d, h)
        qkv = np.concatenate([by_head[:, :group].reshape(-1, h), by_head[:, group].reshape(-1, h),
                              by_head[:, group + 1].reshape(-1, h)])  # fmt: skip
        layers.append(
            LayerWeights(
                attn_norm=take(p + "attention_norm.weight", (h,)),
                qkv_proj=np.ascontiguousarray(qkv),
                o_proj=take(p + "attention.wo.weight", (h, config.q_size)),
                mlp_norm=take(p + "ffn_norm.weight", (h,)),
                gate_up_proj=np.concatenate(
                    [
                        take(p + "feed_forward.w1.weight", (inter, h)),
                        take(p + "feed_forward.w3.weight", (inter, h)),
                    ]
                ),
                down_proj=take(p + "feed_forward.w2.weight", (h, inter)),
            )
        )
        if progress is not None:
            progress(i + 1, config.num_layers)
    embed = take("model.tok_embeddings.weight", (vocab, h))
    lm_head = embed if config.tie_word_embeddings else take("output.weight", (vocab, h))
    return LlamaWeights(embed, layers, take("model.norm.weight", (h,)), lm_head)


def _padded(weights: LlamaWeights, stored: ModelConfig, config: ModelConfig) -> None:
    """Each head of `weights` (read as `stored`) padded to config.head_dim, in place:
    q's, k's and v's rows of the padding are zeros, and so are o_proj's columns for v's
    padding. The padding then rotates as a partial rotary embedding's passed-through
    dimensions (config.rotary_dim: _rotary_ordered)."""
    d, padded = stored.head_dim, config.head_dim
    heads = config.num_heads + 2 * config.num_kv_heads
    for layer in weights.layers:
        rows = layer.qkv_proj.reshape(heads, d, -1)
        grown = np.zeros((heads, padded, rows.shape[-1]), dtype=rows.dtype)
        grown[:, :d] = rows
        layer.qkv_proj = grown.reshape(heads * padded, -1)
        if layer.qkv_bias is not None:
            bias = np.zeros((heads, padded), dtype=layer.qkv_bias.dtype)
            bias[:, :d] = layer.qkv_bias.reshape(heads, d)
            layer.qkv_bias = bias.reshape(-1)
        cols = layer.o_proj.reshape(layer.o_proj.shape[0], config.num_heads, d)
        wide = np.zeros((cols.shape[0], config.num_heads, padded), dtype=cols.dtype)
        wide[..., :d] = cols
        layer.o_proj = wide.reshape(cols.shape[0], -1)


def _reorder_heads(layer: LayerWeights, config: ModelConfig, order: np.ndarray) -> None:
    """q's and k's heads of `layer` each in `order` (in place; v untouched)."""
    d = config.head_dim
    heads = config.num_heads + config.num_kv_heads
    rows = np.concatenate([head * d + order for head in range(heads)])
    rows = np.concatenate([rows, np.arange(heads * d, config.q_size + 2 * config.kv_size)])
    layer.qkv_proj = np.ascontiguousarray(layer.qkv_proj[rows])
    if layer.qkv_bias is not None:
        layer.qkv_bias = np.ascontiguousarray(layer.qkv_bias[rows])


def _rotary_ordered(weights: LlamaWeights, config: ModelConfig) -> None:
    """Each query and key head's dimensions reordered (in place) so that the rotary pairs
    sit where the rope kernels pair dimensions (i, i + head_dim / 2): a partial rotary
    embedding's (rope.rotary_permutation), or Helium's interleaved ones (2i, 2i + 1:
    the even dimensions, then the odd). The same order for q and k keeps every q . k,
    and v is untouched, so attention's output is the checkpoint's; the cache holds keys
    in this order."""
    d = config.head_dim
    if config.family.interleaved_rope:
        assert config.rotary_dim is None, "interleaved and partial rotary pairs at once"
        order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    else:
        assert config.rotary_dim is not None, "called for a partial or interleaved rotary only"
        order = rotary_permutation(d, config.rotary_dim)
    for layer in weights.layers:
        _reorder_heads(layer, config, order)
        # a norm over each head, or over all of them (OLMo); q's and k's come together
        if layer.q_norm is not None and layer.k_norm is not None:
            layer.q_norm, layer.k_norm = (
                w.reshape(-1, d)[:, order].reshape(-1) for w in (layer.q_norm, layer.k_norm)
            )


def _unit_offset_norms(weights: LlamaWeights) -> None:
    """Gemma's RMSNorms scale by (1 + w): each norm weight replaced by 1 + w (in place),
    rounded to BF16 once, so the norm kernels stay Llama's. transformers multiplies by
    1 + w in fp32, so the two agree within that rounding, not bit for bit."""

    def offset(w: np.ndarray) -> np.ndarray:
        return (w.astype(np.float32) + np.float32(1.0)).astype(BF16)

    names = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")
    for layer in weights.layers:
        for name in names:
            if getattr(layer, name) is not None:  # Gemma 2 has no q and k norms
                setattr(layer, name, offset(getattr(layer, name)))
    weights.final_norm = offset(weights.final_norm)


def _folded(weights: LlamaWeights, config: ModelConfig) -> LlamaWeights:
    """Granite's scalars folded into the weights, so the forward stays Llama's: the
    embedding times embedding_multiplier (as transformers multiplies its BF16 output, in
    fp32 rounded once), o_proj and down_proj (every expert's, Granite MoE's) times
    residual_multiplier, the lm_head
    divided by logits_scaling (a copy of the embedding's rows when tied). Folded weights
    are rounded to BF16 once; transformers rounds the product instead, so the two agree
    within BF16 rounding, not bit for bit."""

    def scaled(w: np.ndarray, factor: float) -> np.ndarray:
        if factor == 1.0:
            return w
        return (w.astype(np.float32) * np.float32(factor)).astype(BF16)

    rm = config.residual_multiplier
    for layer in weights.layers:
        layer.o_proj = scaled(layer.o_proj, rm)
        if layer.experts is not None:  # Granite MoE's: every expert's down projection
            layer.experts.down = scaled(layer.experts.down, rm)
        else:
            assert layer.down_proj is not None
            layer.down_proj = scaled(layer.down_proj, rm)
    lm_head = scaled(weights.lm_head, 1.0 / config.logits_scaling)
    embed = scaled(weights.embed_tokens, config.embedding_multiplier)
    return LlamaWeights(embed, weights.layers, weights.final_norm, lm_head)
