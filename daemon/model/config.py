"""Model configuration read from a Hugging Face `config.json`.

Only what the forward pass needs, validated on load: the family comes from the
registry (registry.py), and an unsupported architecture or option is an error that
names it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...cuda.attention import SOFTCAP_RANGE
from ...cuda.rope import LinearScaling, Llama3Scaling, LongRopeScaling, RopeScaling, YarnScaling
from .experts import ExpertsConfig, read_experts
from .registry import (
    ModelConfigError,
    ModelFamily,
    family_named,
    family_of,
    gemma_layer_types,
    is_bare,
    olmo3_layer_types,
    text_part,
)

__all__ = ["ModelConfig", "ModelConfigError"]


@dataclass(slots=True, frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"  # a key of registry.FAMILIES
    # each layer's sliding window (a query sees the last this many keys; 0: all keys), as
    # transformers applies them (registry.ModelFamily.windows); None: no window binds
    # within max_position_embeddings
    layer_windows: tuple[int, ...] | None = None
    # Granite's (registry.ModelFamily.scaled): the embedding's output and each layer's
    # attention and MLP outputs are multiplied by these, the logits divided by
    # logits_scaling (weights.py folds them into the weights), and attention scores are
    # scaled by attention_multiplier instead of 1 / sqrt(head_dim)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # SmolLM3's (registry.ModelFamily.nope): whether each layer rotates its queries and
    # keys (RoPE); None: every layer does
    rope_layers: tuple[bool, ...] | None = None
    # a partial rotary embedding's rotated dimensions of each head (Phi-4-mini's
    # partial_rotary_factor); None: all of them
    rotary_dim: int | None = None
    # the checkpoint's head_dim where head_dim is padded past it (`padded`); None: not
    checkpoint_head_dim: int | None = None
    # the MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU,
    # transformers' gelu_pytorch_tanh)
    activation: str = "silu"
    # Gemma's: the embedding's rows (not a prompt table's) times bf16(embed_scale), rounded
    # to BF16, as transformers scales them; None: unscaled
    embed_scale: float | None = None
    # Gemma 3's: the layers that rotate by `local_rope_theta`, unscaled (its sliding
    # layers), where the others use rope_theta and rope_scaling; None: every layer the latter
    local_rope_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None
    # Gemma 2's tanh soft-capping: of the attention scores (c * tanh(s / c), after the
    # scale) and of the final logits; None: none
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # a mixture-of-experts model's experts (Mixtral, Qwen2-MoE, Qwen3-MoE): its sparse
    # layers' MLP; None: every MLP dense (of intermediate_size)
    experts: ExpertsConfig | None = None

    def __post_init__(self) -> None:
        family_named(self.architecture)  # refuses an unregistered one
        for field in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"{field} must be a positive integer; got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"head_dim must be even for rotary embeddings; got {self.head_dim}"
            )
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"rms_norm_eps must be > 0; got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ModelConfigError(f"rope_theta must be > 0; got {self.rope_theta}")
        for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                      "logits_scaling"):  # fmt: skip
            value = getattr(self, field)
            if value is not None and not (isinstance(value, float) and 0 < value < math.inf):
                raise ModelConfigError(f"{field} must be a finite number > 0; got {value!r}")

        if self.rotary_dim is not None and not (
            0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ModelConfigError(
                f"the rotated dimensions (head_dim x partial_rotary_factor) must be even and "
                f"in (0, {self.head_dim}); got {self.rotary_dim}"
            )
        if self.activation not in ("silu", "gelu_tanh"):
            raise ModelConfigError(f"activation must be silu or gelu_tanh; got {self.activation!r}")
        low, high = SOFTCAP_RANGE  # what the attention kernels take
        for field in ("attn_softcap", "final_softcap"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, float) and low <= value <= high):
                raise ModelConfigError(
                    f"{field} must be a number from {low} to {high}; got {value!r}"
                )
        if self.embed_scale is not None and not 0 < self.embed_scale < math.inf:
            raise ModelConfigError(
                f"embed_scale must be a finite number > 0; got {self.embed_scale}"
            )
        if self.local_rope_layers is not None and (
            len(self.local_rope_layers) != self.num_layers
            or self.local_rope_theta is None
            or not self.local_rope_theta > 0
        ):
            raise ModelConfigError(
                f"local_rope_layers needs one entry a layer ({self.num_layers}) and a "
                f"local_rope_theta > 0; got {self.local_rope_layers}, {self.local_rope_theta}"
            )
        if self.experts is not None and len(self.experts.sparse_layers) != self.num_layers:
            raise ModelConfigError(
                f"the experts' sparse_layers has {len(self.experts.sparse_layers)} entries "
                f"for {self.num_layers} layers"
            )
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise ModelConfigError(
                f"rope_layers has {len(self.rope_layers)} entries for {self.num_layers} layers"
            )
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.num_layers:
                raise ModelConfigError(
                    f"layer_windows has {len(self.layer_windows)} entries for "
                    f"{self.num_layers} layers"
                )
            if any(not isinstance(w, int) or w < 0 for w in self.layer_windows):
                raise ModelConfigError(
                    f"a sliding window must be a positive integer; got {self.layer_windows}"
                )

    def padded(self, head_dim: int) -> ModelConfig:
        """This model with each head padded to `head_dim` dimensions of zeros (weights.py
        pads q, k and v's rows and o_proj's columns): the same attention, bit for bit,
        since the zeros add exact zeros to every score and output sum, and the padding
        rotates as a partial rotary embedding's passed-through dimensions. The scores'
        scale stays the checkpoint's. For kernels built for fewer head sizes (the GPU's
        64 and 128: Phi-3-mini's 96 runs as 128)."""
        if self.qk_norm or self.family.interleaved_rope:  # a norm would count the zeros
            raise ModelConfigError(
                f"a head_dim of {self.head_dim} with q and k norms or interleaved rotary "
                "pairs cannot be padded"
            )
        assert head_dim > self.head_dim and self.checkpoint_head_dim is None
        return dataclasses.replace(
            self,
            head_dim=head_dim,
            rotary_dim=self.rotary_dim or self.head_dim,
            attention_multiplier=self.attention_scale,
            checkpoint_head_dim=self.head_dim,
        )

    @property
    def shared_window(self) -> int | None:
        """The window every layer applies, where they share one; None without a window
        or where the layers' differ."""
        windows = set(self.layer_windows or (0,))
        return (windows.pop() or None) if len(windows) == 1 else None

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by: 1 / sqrt(head_dim), or Granite's own."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def family(self) -> ModelFamily:
        return family_named(self.architecture)

    @property
    def qkv_bias(self) -> bool:
        """q, k and v projections carry a bias (the family's option)."""
        return self.family.qkv_bias

    @property
    def qk_norm(self) -> bool:
        """Each query and key head is RMS-normalized before RoPE (the family's option)."""
        return self.family.qk_norm

    @property
    def qk_norm_sizes(self) -> tuple[int, int]:
        """The q_norm and k_norm weights' lengths: head_dim, or all the query heads' and
        all the key heads' dimensions (OLMo's, `family.qk_norm_whole`)."""
        if self.family.qk_norm_whole:
            return self.q_size, self.kv_size
        return self.head_dim, self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token occupies across all layers (K and V)."""
        return self.num_layers * 2 * self.kv_size * dtype_bytes

    def num_parameters(self, *, active: bool = False) -> int:
        """Every parameter; with `active`, those one token reads (a mixture of experts'
        k chosen experts, not all E)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = self.q_size + 2 * self.kv_size
        per_layer = h * qkv + self.q_size * h + 2 * h + qkv * self.qkv_bias
        per_layer += sum(self.qk_norm_sizes) * self.qk_norm
        per_layer += 2 * h * self.family.gemma  # the sandwich norms
        sparse = self.experts.sparse_layers if self.experts else (False,) * self.num_layers
        mlps = sum(3 * h * i for is_sparse in sparse if not is_sparse)
        if self.experts is not None:
            count = self.experts.active_parameters if active else self.experts.num_parameters
            mlps += sum(sparse) * count(h)
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + mlps + h + lm_head

    @classmethod
    def from_dict(cls, raw: dict[str, Any], max_model_len: int | None = None) -> ModelConfig:
        """The config of `raw` (a config.json's fields). `max_model_len`: the context the
        engine will run (None: the model's), which picks longrope's factor list: past
        original_max_position_embeddings the long one, and then the context is the
        model's; else the short one, and the context stops at the original (a fixed
        choice, so every position keeps its rotation: transformers switches lists by
        the length of the sequence at hand)."""
        raw = text_part(raw)  # a multimodal checkpoint's language model
        family = family_of(raw)
        family.check(raw)
        gemma: dict[str, Any] = {}
        if family.gemma:  # its activation was checked; its rope read apart
            raw, gemma = _gemma(raw, family.architecture == "Gemma3ForCausalLM")
        if family.architecture == "Olmo3ForCausalLM":  # its rope by layer type
            theta = _rope_params(raw).get("rope_theta", 500_000.0)  # Olmo3Config's default
            raw, gemma = _rope_by_layer_type(raw, olmo3_layer_types(raw), theta, theta)
        if not family.gemma:
            act = raw.get("hidden_act", "silu")
            if act != "silu":
                raise ModelConfigError(f"hidden_act {act!r} is not supported; only 'silu'")
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            context = int(raw.get("max_position_embeddings", 2048))
            head_dim = int(raw.get("head_dim") or hidden // heads)
            rotary_dim = _rotary_dim(raw, head_dim)
            scaling = _rope_scaling(raw, rotary_dim or head_dim, context, max_model_len)
            if isinstance(scaling, LongRopeScaling) and not scaling.long:
                context = _original_context(raw)
            elif isinstance(scaling, YarnScaling):  # vLLM's rule: the original, stretched
                context = int(scaling.original_max_position_embeddings * scaling.factor)
            elif isinstance(scaling, LinearScaling) and not family.gemma:
                # (Gemma 3's max_position_embeddings is already the scaled context)
                context = int(context * scaling.factor)
            windows = _layer_windows(family.windows(raw), context)  # those that bind in it
            eos = raw.get("eos_token_id")
            return cls(
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                vocab_size=int(raw["vocab_size"]),
                max_position_embeddings=context,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_params(raw).get("rope_theta", 10000.0)),
                rope_scaling=scaling,
                # a bare model has no lm_head: its embedding stands in (registry.BARE_MODELS)
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)) or is_bare(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                architecture=family.architecture,
                layer_windows=windows,
                **(_multipliers(raw) if family.scaled else {}),
                rope_layers=_rope_layers(raw) if family.nope else None,
                rotary_dim=rotary_dim,
                **gemma,
                experts=None if family.experts is None else read_experts(raw, family.experts),
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"config.json has a field of the wrong type: {e}") from None

    @classmethod
    def from_dir(
        cls,
        path: Path | str,
        max_model_len: int | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> ModelConfig:
        """The folder's config.json, `overrides` replacing its fields (vLLM's hf_overrides),
        read as from_dict reads it."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelConfigError(f"{config_path} not found: not a Hugging Face model folder")
        with open(config_path) as f:
            return cls.from_dict({**json.load(f), **(overrides or {})}, max_model_len)


def _layer_windows(windows: tuple[int, ...], context: int) -> tuple[int, ...] | None:
    """The family's windows, but 0 for one that never binds within the context (a query
    sees at most `context` keys); None where none binds."""
    binding = tuple(w if w < context else 0 for w in windows)
    return binding if any(binding) else None


def _rope_layers(raw: dict[str, Any]) -> tuple[bool, ...] | None:
    """SmolLM3's `no_rope_layers` (1 where a layer uses RoPE), or transformers' default:
    every `no_rope_layer_interval`-th layer (4th) without; None when every layer uses it."""
    num_layers = int(raw["num_hidden_layers"])
    given = raw.get("no_rope_layers")
    if given is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        layers = tuple((i + 1) % interval != 0 for i in range(num_layers))
        return None if all(layers) else layers
    if (
        not isinstance(given, list)
        or len(given) != num_layers
        or any(v not in (0, 1) or isinstance(v, float) for v in given)
    ):
        raise ModelConfigError(
            f"no_rope_layers must be a list of {num_layers} zeros and ones (one a layer)"
        )
    layers = tuple(bool(v) for v in given)
    return None if all(layers) else layers


def _gemma(raw: dict[str, Any], gemma3: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma's config as the Llama reading takes it, and its own fields. Gemma 3's rope
    settings come in two layouts: `rope_theta` and `rope_scaling` for the full layers with
    `rope_local_base_freq` for the sliding ones (transformers 4), or `rope_parameters` by
    layer type (transformers 5); each missing one takes transformers' default. Gemma 2
    has one rope and its soft-capping (transformers' defaults: 50 and 30)."""
    own = {
        "activation": "gelu_tanh",
        "embed_scale": float(int(raw["hidden_size"]) ** 0.5),
        "attention_multiplier": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
    }
    if not gemma3:
        caps = {"attn_softcap": raw.get("attn_logit_softcapping", 50.0),
                "final_softcap": raw.get("final_logit_softcapping", 30.0)}  # fmt: skip
        own |= {k: None if v is None else float(v) for k, v in caps.items()}
        flat = {**raw, "rms_norm_eps": raw.get("rms_norm_eps", 1e-6)}
        return flat | {"tie_word_embeddings": raw.get("tie_word_embeddings", True)}, own
    theta = raw.get("rope_theta", 1_000_000.0)
    local_theta = raw.get("rope_local_base_freq", 10_000.0)
    flat, local = _rope_by_layer_type(raw, gemma_layer_types(raw), theta, local_theta)
    flat.setdefault("rms_norm_eps", 1e-6)
    flat.setdefault("tie_word_embeddings", True)
    return flat, own | local


def _rope_by_layer_type(
    raw: dict[str, Any], layer_types: list[str], theta: float, local_theta: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rope settings by layer type (Gemma 3's and OLMo 3's): the full layers' (maybe
    scaled; `theta` where none is given) read as one model's `rope_parameters`, and the
    sliding layers', default rope alone (`local_theta` where none is given), as
    ModelConfig.local_rope_layers and local_rope_theta. Either `rope_parameters` by layer
    type (transformers 5) or `rope_theta` and `rope_scaling` for the full layers."""
    params = raw.get("rope_parameters") or {}
    by_type = isinstance(params, dict) and bool(
        {"full_attention", "sliding_attention"} & set(params)
    )
    full = dict(params.get("full_attention") or {}) if by_type else dict(params)
    sliding = dict(params.get("sliding_attention") or {}) if by_type else {}
    if raw.get("rope_scaling"):
        full.update(raw["rope_scaling"])
    full.setdefault("rope_theta", theta)
    if sliding.get("rope_type", "default") != "default":
        raise ModelConfigError(
            f"rope type {sliding['rope_type']!r} on the sliding layers is not supported"
        )
    local_theta = float(sliding.get("rope_theta", local_theta))
    flat = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta")}
    flat["rope_parameters"] = full
    local = tuple(kind == "sliding_attention" for kind in layer_types)
    return flat, {
        "local_rope_layers": local if any(local) else None,
        "local_rope_theta": local_theta if any(local) else None,
    }


def _multipliers(raw: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scalars, as transformers' GraniteConfig defaults them."""
    attention = raw.get("attention_multiplier")
    return {
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
        "attention_multiplier": None if attention is None else float(attention),
        "logits_scaling": float(raw.get("logits_scaling", 1.0)),
    }


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either layout: `rope_theta` + `rope_scaling` (transformers 4)
    or one `rope_parameters` dict (transformers 5)."""
    params = dict(raw.get("rope_parameters") or {})
    if "rope_theta" in raw:
        params.setdefault("rope_theta", raw["rope_theta"])
    if raw.get("rope_scaling"):
        params.update(raw["rope_scaling"])
    return params


def _rotary_dim(raw: dict[str, Any], head_dim: int) -> int | None:
    """The rotated dimensions of a head under `partial_rotary_factor` (transformers'
    int(head_dim x factor)), or None where all are."""
    factor = _rope_params(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor in (None, 1, 1.0):
        return None
    factor = float(factor)
    if not 0 < factor <= 1:
        raise ModelConfigError(f"partial_rotary_factor must be in (0, 1]; got {factor}")
    return int(head_dim * factor)


def _original_context(raw: dict[str, Any]) -> int:
    params = _rope_params(raw)
    original = params.get("original_max_position_embeddings")
    if original is None:
        original = raw.get("original_max_position_embeddings")
    if original is None:
        raise ModelConfigError("rope_scaling lacks 'original_max_position_embeddings'")
    return int(original)


def _rope_scaling(
    raw: dict[str, Any], dim: int, context: int, max_model_len: int | None
) -> RopeScaling | None:
    """The config's rope scaling over `dim` rotated dimensions of a head. `dynamic`
    (NTK) is none: transformers scales its frequencies only for a sequence longer than
    max_position_embeddings, the context here."""
    params = _rope_params(raw)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "su":  # Phi-3's first configs' name for longrope
        kind = "longrope"
    if kind == "dynamic":
        _positive(params, "factor")
        return None
    if kind == "default":
        return None
    try:
        if kind == "llama3":
            return Llama3Scaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        if kind == "linear":
            return LinearScaling(_positive(params, "factor"))
        if kind == "yarn":
            return _yarn(params, raw, context)
        if kind == "longrope":
            return _longrope(params, raw, dim, context, max_model_len)
    except KeyError as e:
        raise ModelConfigError(f"rope_scaling of type {kind} lacks {e.args[0]!r}") from None
    raise ModelConfigError(
        f"rope_scaling type {kind!r} is not supported; only 'llama3', 'linear', 'yarn', "
        "'longrope' and 'dynamic'"
    )


def _positive(params: dict[str, Any], key: str) -> float:
    value = float(params[key])
    if not 0 < value < math.inf:
        raise ModelConfigError(f"rope_scaling's {key} must be a finite number > 0; got {value}")
    return value


def _yarn(params: dict[str, Any], raw: dict[str, Any], context: int) -> YarnScaling:
    """transformers' `_compute_yarn_parameters`: its defaults, and its attention factor."""
    original = _original_context(raw)
    factor = params.get("factor")
    factor = context / original if factor is None else _positive(params, "factor")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    given, m, m_all = (params.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim"))
    if given is not None:
        attention = float(given)
    elif m and m_all:
        attention = mscale(factor, float(m)) / mscale(factor, float(m_all))
    else:
        attention = mscale(factor)
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=attention,
        truncate=bool(params.get("truncate", True)),
    )


def _longrope(
    params: dict[str, Any], raw: dict[str, Any], dim: int, context: int, max_model_len: int | None
) -> LongRopeScaling:
    """transformers' `_compute_longrope_parameters`, its list picked once (from_dict)."""
    original = _original_context(raw)
    long = max_model_len is not None and max_model_len > original
    factors = tuple(float(f) for f in params["long_factor" if long else "short_factor"])
    if len(factors) != dim // 2 or not all(0 < f < math.inf for f in factors):
        raise ModelConfigError(
            f"rope_scaling's {'long' if long else 'short'}_factor must hold {dim // 2} finite "
            f"numbers > 0 (one a rotated pair); got {len(factors)}"
        )
    factor = params.get("factor")
    factor = context / original if factor is None else float(factor)
    given = params.get("attention_factor")
    if given is not None:
        attention = float(given)
    else:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(factors, attention, long)
