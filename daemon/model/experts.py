"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE): their settings,
read from a config.json as transformers reads them.

A sparse layer's MLP is E experts (each a SwiGLU MLP of its own intermediate size), of
which a router picks k per token (cuda/moe.py: the routing, the grouped GEMMs and the
weighted sum). Qwen's configs may keep some layers dense (`mlp_only_layers`,
`decoder_sparse_step`), and Qwen2-MoE adds a shared expert every token runs, gated by a
sigmoid of its own one-row projection.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .registry import ModelConfigError

# each layout's names for: the experts' count, their intermediate size, and the chosen
# weights' normalization (None: always normalized, as Mixtral's router does)
_KEYS = {
    "mixtral": ("num_local_experts", "intermediate_size", None),
    "qwen2_moe": ("num_experts", "moe_intermediate_size", "norm_topk_prob"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size", "norm_topk_prob"),
    "granitemoe": ("num_local_experts", "intermediate_size", None),  # softmax of the top k
    "olmoe": ("num_experts", "intermediate_size", "norm_topk_prob"),  # Qwen3-MoE's tensors
}
# transformers' defaults where a config omits a field (MixtralConfig, Qwen2MoeConfig,
# Qwen3MoeConfig, GraniteMoeConfig, OlmoeConfig)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "granitemoe": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8},
}
MAX_EXPERTS = 256  # what the routing kernels take (cuda/moe.cu's kMaxExperts)
MAX_TOP_K = 32


@dataclass(slots=True, frozen=True)
class ExpertsConfig:
    num_experts: int
    top_k: int  # experts a token takes
    intermediate_size: int  # each expert's
    normalize: bool  # the chosen experts' weights divided by their sum (norm_topk_prob)
    sparse_layers: tuple[bool, ...]  # per layer: its MLP is the experts (else dense)
    shared_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts <= MAX_EXPERTS:
            raise ModelConfigError(
                f"the number of experts must be from 1 to {MAX_EXPERTS}; got {self.num_experts}"
            )
        if not 1 <= self.top_k <= min(self.num_experts, MAX_TOP_K):
            raise ModelConfigError(
                f"num_experts_per_tok must be from 1 to {min(self.num_experts, MAX_TOP_K)} "
                f"(at most the {self.num_experts} experts); got {self.top_k}"
            )
        if self.intermediate_size < 1 or self.shared_intermediate_size < 0:
            raise ModelConfigError(
                f"the experts' intermediate sizes must be positive; got {self.intermediate_size}"
                f" and {self.shared_intermediate_size}"
            )

    def num_parameters(self, hidden: int) -> int:
        """One sparse layer's MLP: the router, the experts, the shared expert and its gate."""
        shared = 3 * hidden * self.shared_intermediate_size
        shared += hidden * (self.shared_intermediate_size > 0)
        return hidden * self.num_experts * (1 + 3 * self.intermediate_size) + shared

    def active_parameters(self, hidden: int) -> int:
        """What one token reads of a sparse layer's MLP: the router, k experts, the shared."""
        shared = 3 * hidden * self.shared_intermediate_size
        shared += hidden * (self.shared_intermediate_size > 0)
        return hidden * (self.num_experts + 3 * self.top_k * self.intermediate_size) + shared


def read_experts(raw: Mapping[str, Any], layout: str) -> ExpertsConfig:
    """The experts of a config.json of `layout` (registry.ModelFamily.experts)."""
    count_key, size_key, norm_key = _KEYS[layout]
    raw = dict(raw)
    for alias in ("num_experts", "num_local_experts"):  # transformers' attribute_map:
        if alias in raw and count_key not in raw:  # either name, as 5.x writes Qwen3-MoE's
            raw[count_key] = raw[alias]
    raw = {**_DEFAULTS[layout], **raw}
    num_layers = int(raw["num_hidden_layers"])
    try:
        num_experts, size = int(raw[count_key]), int(raw[size_key])
        top_k = int(raw["num_experts_per_tok"])
    except KeyError as e:
        raise ModelConfigError(f"config.json lacks required field {e.args[0]!r}") from None
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = raw.get("mlp_only_layers") or []
    if step < 1 or not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ModelConfigError(
            f"decoder_sparse_step must be >= 1 and mlp_only_layers a list of layer indices; "
            f"got {step} and {dense!r}"
        )
    # transformers' rule (Qwen2MoeDecoderLayer): sparse unless listed, every step-th layer
    sparse = tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
    )
    if not any(sparse):
        raise ModelConfigError("no layer of this config has experts: run it as its dense family")
    shared = 0
    if layout == "qwen2_moe":
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
    return ExpertsConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=size,
        normalize=True if norm_key is None else bool(raw.get(norm_key, False)),
        sparse_layers=sparse,
        shared_intermediate_size=shared,
    )
