"""A model folder's vital statistics, for `reprise model info`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ...cuda.rope import LinearScaling, Llama3Scaling, LongRopeScaling, RopeScaling, YarnScaling
from .config import ModelConfig
from .safetensors_io import read_header


def checkpoint_dtypes(path: Path) -> Counter[str]:
    """Number of parameters stored in each dtype across the folder's safetensors files."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    counts: Counter[str] = Counter()
    for shard in shards:
        header, _ = read_header(path / shard)
        for entry in header.values():
            num = 1
            for dim in entry["shape"]:
                num *= int(dim)
            counts[entry["dtype"]] += num
    return counts


def model_info(path: Path | str) -> dict[str, object]:
    path = Path(path)
    config = ModelConfig.from_dir(path)
    raw = json.loads((path / "config.json").read_text())
    dtypes = checkpoint_dtypes(path)
    scaling = config.rope_scaling
    return {
        "path": str(path.resolve()),
        "architecture": ", ".join(raw.get("architectures") or [raw.get("model_type", "?")]),
        "parameters": config.num_parameters(),
        "stored_dtype": "+".join(sorted(dtypes, key=lambda d: -dtypes[d])),
        "compute_dtype": "bfloat16",
        "layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "context_length": config.max_position_embeddings,
        # each layer's sliding window (0: full attention), where one binds
        "sliding_windows": _windows(config.layer_windows),
        "rope_theta": config.rope_theta,
        "rope_scaling": _scaling(scaling),
        # a partial rotary embedding's rotated dimensions of each head
        "rotary_dim": config.rotary_dim,
        "tied_embeddings": config.tie_word_embeddings,
        "qkv_bias": config.qkv_bias,
        "qk_norm": config.qk_norm,
        # SmolLM3's: the layers (from 0) that do not rotate their queries and keys
        "layers_without_rope": [i for i, r in enumerate(config.rope_layers or ()) if not r],
        # Granite's scalars, when not Llama's
        "multipliers": _multipliers(config),
        "mlp_activation": config.activation,
        # Gemma 3's: the sliding layers' own rope base (the others' is rope_theta)
        "local_rope_theta": config.local_rope_theta,
        # Gemma 2's tanh soft-caps of the attention scores and the final logits
        "soft_caps": None
        if config.attn_softcap is None and config.final_softcap is None
        else {"scores": config.attn_softcap, "logits": config.final_softcap},
        # a mixture of experts': how many, how many a token takes, their size, which layers
        "experts": _experts(config),
        "fill_in_the_middle": _fim(path),
        "kv_cache_bytes_per_token": config.kv_bytes_per_token(),
    }


def _experts(config: ModelConfig) -> dict[str, object] | None:
    if (moe := config.experts) is None:
        return None
    return {
        "experts": moe.num_experts,
        "per_token": moe.top_k,
        "intermediate_size": moe.intermediate_size,
        "normalized_weights": moe.normalize,
        "shared_expert_size": moe.shared_intermediate_size or None,
        "dense_layers": [i for i, sparse in enumerate(moe.sparse_layers) if not sparse],
        "active_parameters": config.num_parameters(active=True),
    }


def _multipliers(config: ModelConfig) -> dict[str, float] | None:
    if not config.family.scaled:
        return None
    return {"embedding": config.embedding_multiplier, "residual": config.residual_multiplier,
            "attention": config.attention_scale, "logits_divisor": config.logits_scaling}  # fmt: skip


def _fim(path: Path) -> str | None:
    """The fill-in-the-middle tokens the vocabulary holds (fim.py), as one string."""
    from tokenizers import Tokenizer

    from .fim import find_fim

    try:
        vocabulary = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab()
    except Exception:  # tokenizers raises a bare Exception for a bad file
        return None  # no readable tokenizer.json: nothing to say here
    fim = find_fim(vocabulary)
    return None if fim is None else " ".join(t for t in fim.as_wire() if t)


def _windows(windows: tuple[int, ...] | None) -> str | None:
    """Layer windows in short: "4096 on every layer", or "512 on layers 0-4, 6-10, ..."."""
    if windows is None:
        return None
    by_size: dict[int, list[int]] = {}
    for idx, window in enumerate(windows):
        if window:
            by_size.setdefault(window, []).append(idx)
    if len(by_size) == 1 and len(next(iter(by_size.values()))) == len(windows):
        return f"{windows[0]} on every layer"
    return "; ".join(f"{size} on layers {_spans(idxs)}" for size, idxs in by_size.items())


def _spans(idxs: list[int]) -> str:
    """[0, 1, 2, 4] -> "0-2, 4"."""
    spans: list[list[int]] = []
    for idx in idxs:
        if spans and spans[-1][1] == idx - 1:
            spans[-1][1] = idx
        else:
            spans.append([idx, idx])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _scaling(scaling: RopeScaling | None) -> str | None:
    """The rope scaling in short: its type, factor and (longrope) the list in use."""
    if scaling is None:
        return None
    if isinstance(scaling, LongRopeScaling):
        which = "long" if scaling.long else "short"
        return f"longrope ({which} factors, attention x{scaling.attention_factor:.4g})"
    kind = {Llama3Scaling: "llama3", LinearScaling: "linear", YarnScaling: "yarn"}[type(scaling)]
    return f"{kind} x{scaling.factor:g}"
