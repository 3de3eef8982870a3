"""The experts of llama.cpp's mixture-of-experts GGUF files: Mixtral (its `llama`
architecture with `llama.expert_count` > 0), `qwen2moe`, `qwen3moe`, `qwen3vlmoe` (Qwen3-VL-MoE's
text model: Qwen3-MoE's experts), `granitemoe` (Granite MoE) and `olmoe` (OLMoE: Qwen3-MoE's
tensors).

llama.cpp's converter stacks each layer's experts, one tensor per projection:
`ffn_gate_exps` and `ffn_up_exps` [E, I, H] and `ffn_down_exps` [E, H, I] (NumPy order),
beside the router `ffn_gate_inp` [E, H]; Qwen2-MoE adds its shared expert
(`ffn_{gate,up,down}_shexp`) and that expert's gate `ffn_gate_inp_shexp` ([H], or [1, H]
unsqueezed). Granite MoE's checkpoint fuses gate and up (`input_linear`), which llama.cpp's
converter splits into the two stacks. gguf_convert.py writes them as weights.py reads them
(gguf_config.py their config.json), and guarantees:

- each layer's experts stacked: `experts.gate_up_proj` [E, 2I, H] (an expert's gate rows,
  then its up rows, as transformers holds them) and `experts.down_proj` [E, H, I], under
  `block_sparse_moe.` (Mixtral) or `mlp.` (Qwen, OLMoE); Granite MoE's as its checkpoint names
  them: `block_sparse_moe.input_linear.weight` (gate rows, then up rows),
  `output_linear.weight` and the router `router.layer.weight`; made one expert at a time
  (`join_experts`: one expert's projection in float32 beside the BF16 output), rounded as
  every tensor is;
- config.json runs the model as llama.cpp does (`experts_config`): the top k of the
  router's softmax, their weights renormalized for Mixtral, Qwen3-MoE, Qwen3-VL-MoE and
  Granite MoE and not for Qwen2-MoE or OLMoE, as llama.cpp's code fixes it for these
  architectures (it reads no `expert_weights_norm`, `expert_weights_scale` or
  `expert_gating_func` for them); the experts' sizes from `expert_feed_forward_length` and
  `expert_shared_feed_forward_length`, else llama.cpp's defaults (feed_forward_length /
  expert_used_count, and feed_forward_length), Mixtral's, Granite MoE's and OLMoE's experts
  of feed_forward_length;
- what llama.cpp would not run, or this converter cannot, is refused (`experts_config`,
  `check_expert_tensors`), in a ValueError naming the key or tensor: a layer without
  experts (a dense MLP: transformers' mlp_only_layers), experts one tensor each (llama.cpp's
  files before it stacked them), a missing expert tensor, and Granite MoE's shared expert
  (GraniteMoeShared: `expert_shared_feed_forward_length`, `ffn_*_shexp`), which no family
  here runs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .gguf_files import dequantized, optional_int, require_int

_ROUTED = {
    "ffn_gate_inp.weight": "gate.weight",
    "ffn_gate_exps.weight": "experts.gate_up_proj",
    "ffn_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}
# Granite MoE's checkpoint names (transformers 5 renames them in memory): gate and up one tensor
_GRANITE = {
    "ffn_gate_inp.weight": "router.layer.weight",
    "ffn_gate_exps.weight": "input_linear.weight",
    "ffn_up_exps.weight": "input_linear.weight",
    "ffn_down_exps.weight": "output_linear.weight",
}
_SHARED = {
    "ffn_gate_inp_shexp.weight": "shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "shared_expert.down_proj.weight",
}
# GGUF tensors that make one Hugging Face tensor, joined along dim 1 in this order
JOINED = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
# a Hugging Face tensor that is one row, [1, H], where llama.cpp stores a vector
ROW_VECTORS = ("shared_expert_gate.weight",)
# a block's dense MLP, and the per-expert tensors of llama.cpp's older Mixtral files
_DENSE = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
# GraniteMoeShared's shared expert, as llama.cpp's converter writes it into a granitemoe file
_GRANITE_SHARED = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_shexp\.weight")


def expert_layer_names(layout: str) -> dict[str, str]:
    """GGUF name within a block -> Hugging Face name within a layer, for a layout's experts
    ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "olmoe": registry.ModelFamily.experts)."""
    prefix = "block_sparse_moe." if layout in ("mixtral", "granitemoe") else "mlp."
    names = _GRANITE if layout == "granitemoe" else _ROUTED
    names = names | (_SHARED if layout == "qwen2_moe" else {})
    return {gguf_name: prefix + hf_name for gguf_name, hf_name in names.items()}


def experts_config(
    meta: dict[str, Any], arch: str, layout: str, feed_forward: int | None
) -> dict[str, Any]:
    """config.json's fields for the experts of a file of `arch` (its metadata `meta`, its
    feed_forward_length if it has one), as transformers' config of `layout` names them."""

    def key(name: str) -> str:
        return f"{arch}.{name}"

    num_experts = require_int(meta, key("expert_count"))
    top_k = require_int(meta, key("expert_used_count"))
    if num_experts < 1 or top_k < 1:  # llama.cpp's loaders refuse them too
        raise ValueError(
            f"{key('expert_count')} is {num_experts} and {key('expert_used_count')} {top_k}; "
            "a file with experts needs both above 0"
        )
    # llama.cpp's granite loader: a shared expert where this key is above 0
    if layout == "granitemoe" and optional_int(meta, key("expert_shared_feed_forward_length"), 0):
        raise _granite_shared(arch, key("expert_shared_feed_forward_length"))
    if layout in ("mixtral", "granitemoe", "olmoe"):  # llama.cpp's llama, granite, olmoe: n_ff
        size = require_int(meta, key("feed_forward_length"))
        if layout == "olmoe":
            # OlmoeConfig's intermediate_size is an expert's: llama.cpp's converter writes it
            # as feed_forward_length, its olmoe loader sizes the experts by it, and its graph
            # calls build_moe_ffn with norm_w false (the top k's softmax weights as they are)
            return {"num_experts": num_experts, "num_experts_per_tok": top_k,
                    "intermediate_size": size, "norm_topk_prob": False}  # fmt: skip
        fields: dict[str, Any] = {"num_local_experts": num_experts, "num_experts_per_tok": top_k,
                  "intermediate_size": size}  # fmt: skip
        return fields | ({"sliding_window": None} if layout == "mixtral" else {})
    size = optional_int(meta, key("expert_feed_forward_length"), (feed_forward or 0) // top_k)
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": size,
        # llama.cpp's build_moe_ffn: norm_w true for qwen3moe and qwen3vlmoe, false for
        # qwen2moe
        "norm_topk_prob": layout == "qwen3_moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "intermediate_size": size if feed_forward is None else feed_forward,
    }
    if layout == "qwen2_moe":
        shared = optional_int(meta, key("expert_shared_feed_forward_length"), feed_forward or 0)
        fields["shared_expert_intermediate_size"] = shared
    if size < 1 or fields.get("shared_expert_intermediate_size", 1) < 1:
        raise ValueError(
            f"a {arch} file without {key('expert_feed_forward_length')}"
            + (f" or {key('expert_shared_feed_forward_length')}" if layout == "qwen2_moe" else "")
            + f" needs {key('feed_forward_length')} to size its experts (llama.cpp's default)"
        )
    return fields


def check_expert_tensors(names: set[str], arch: str, layout: str, num_layers: int) -> None:
    """Raise ValueError, naming the tensor, unless every block of the file holds its
    layout's experts and nothing of a dense MLP, as llama.cpp loads the architecture."""
    for name in sorted(names):
        if layout == "granitemoe" and _GRANITE_SHARED.fullmatch(name):
            raise _granite_shared(arch, f"tensor {name!r}")
        if _PER_EXPERT.fullmatch(name):
            raise ValueError(
                f"GGUF tensor {name!r}: experts one tensor each, as llama.cpp's older "
                "Mixtral files store them; convert a file with the experts stacked "
                "(ffn_gate_exps, ffn_up_exps, ffn_down_exps), as llama.cpp writes them now"
            )
    for block in range(num_layers):
        for part in _DENSE:
            if f"blk.{block}.{part}" in names:
                raise ValueError(
                    f"GGUF tensor 'blk.{block}.{part}': a dense MLP in a {arch} file with "
                    "experts (a layer without them: transformers' mlp_only_layers); llama.cpp "
                    "gives every layer of this architecture experts, and so does this converter"
                )
        for part in expert_layer_names(layout):
            if f"blk.{block}.{part}" not in names:
                raise ValueError(f"a {arch} file with experts lacks tensor 'blk.{block}.{part}'")


def _granite_shared(arch: str, what: str) -> ValueError:
    return ValueError(
        f"a {arch} file with {what}: a shared expert, as llama.cpp writes GraniteMoeShared's; "
        "GraniteMoeSharedForCausalLM is not supported (Granite MoE without one is)"
    )


def join_experts(parts: Sequence[Any], shape: tuple[int, ...]) -> np.ndarray:
    """GGUF tensors of stacked experts (`parts`, each [E, rows, cols] in NumPy order)
    dequantized and rounded to BF16 one expert at a time, joined along dim 1 into `shape`."""
    out = np.empty(shape, dtype=ml_dtypes.bfloat16)  # [E, sum of the parts' rows, cols]
    for expert in range(shape[0]):
        row = 0
        for part in parts:
            weight = dequantized(part, expert)
            rows = weight.size // shape[2]
            if weight.size != rows * shape[2] or row + rows > shape[1]:
                raise ValueError(
                    f"{part.name}: expert {expert} dequantized {weight.shape}; the output "
                    f"{shape} has no room for it"
                )
            out[expert, row : row + rows] = weight.reshape(rows, shape[2]).astype(out.dtype)
            row += rows
        assert row == shape[1], (row, shape)
    return out
