"""Convert a GGUF file of a Llama, Qwen2, Qwen3, Phi-3, Granite, SmolLM3, Gemma 2,
Gemma 3, OLMo 2, OLMo 3, Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE or OLMoE model, or of
Qwen3-VL's or Qwen3-VL-MoE's text model, into a Hugging Face model folder.

`convert_gguf` reads a GGUF whose `general.architecture` is `llama` (Mixtral: `llama` with
`llama.expert_count` > 0), `qwen2`, `qwen3`, `phi3`, `granite`, `smollm3`, `gemma2`,
`gemma3`, `olmo2` (OLMo 3: `olmo2` with `olmo2.attention.sliding_window` > 0), `qwen2moe`,
`qwen3moe`, `granitemoe`, `olmoe`, `qwen3vl` or `qwen3vlmoe` and writes `config.json`,
`generation_config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`
and `README.md`. The families and their tensors' names are gguf_families.py's, config.json
is gguf_config.py's (each says what it guarantees). It guarantees:

- a model llama.cpp's gguf-split cut into shards, given by any of them, converts as one
  (gguf_files.open_shards checks the set): every file but README.md (which names the
  shards) is byte for byte the one the same model in one file gives;
- every tensor is dequantized to float32 by `gguf.quants` and rounded once to
  BF16 (round to nearest even), under Hugging Face names and shapes
  `[out_features, in_features]`, one tensor in memory at a time (stacked experts one
  expert at a time);
- a mixture of experts' tensors and config.json are gguf_experts.py's: each layer's experts
  stacked as weights.py reads them (gate and up joined), the routing as llama.cpp runs it;
- llama.cpp's row permutation of a Llama's (and a Mixtral's, a Granite's, a Granite MoE's
  and SmolLM3's) Q and K projections is undone, so the weights use Hugging Face's
  half-split rotary layout (llama.cpp permutes no other family's); a Gemma file's norm
  weights lose the 1 llama.cpp added (in float32, then rounded);
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from .gguf_config import hf_config, longrope_scaling
from .gguf_experts import JOINED, ROW_VECTORS, check_expert_tensors, join_experts
from .gguf_families import FAMILIES, GLOBAL_NAMES, LONGROPE, ROPE_FREQS, Family, family_of
from .gguf_files import dequantized, open_shards, read_metadata
from .gguf_tokenizer import build_tokenizer, end_token_ids, tokenizer_config
from .safetensors_io import TensorSpec, save_safetensors_streamed

# Bump whenever the output of `convert_gguf` changes, so prepared folders are redone.
CONVERTER_VERSION = 1


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
    if arch not in FAMILIES:
        raise ValueError(
            f"{gguf_path}: general.architecture is {arch!r}; supported: "
            + ", ".join(repr(a) for a in FAMILIES)
        )
    family = family_of(meta)
    tensors = {t.name: t for t in shards.tensors}
    longrope = [tensors.pop(name, None) for name in LONGROPE]
    if any(t is not None for t in longrope) and (arch != "phi3" or None in longrope):
        present = [name for name, t in zip(LONGROPE, longrope, strict=True) if t is not None]
        raise ValueError(
            f"{gguf_path}: a {arch} file with {' and '.join(present)}; LongRoPE factors are "
            f"read from phi3 files holding both {' and '.join(LONGROPE)}"
        )
    rope_freqs = tensors.pop(ROPE_FREQS, None)
    config = hf_config(meta, set(tensors), None if rope_freqs is None else dequantized(rope_freqs))
    long, short = longrope
    if long is not None and short is not None:  # both or neither by now
        config["rope_scaling"] = longrope_scaling(meta, dequantized(long), dequantized(short))
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


def _sources(tensors: Iterable[Any], family: Family) -> dict[str, tuple[Any, ...]]:
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


def _hf_name(gguf_name: str, family: Family) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
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
    parts: tuple[Any, ...], shape: tuple[int, ...], config: dict[str, Any], family: Family
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


def _write_json(path: Path, value: dict[str, Any] | Sequence[Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
