"""Convert a Llama GGUF file into a Hugging Face model folder.

`convert_gguf` reads a GGUF whose `general.architecture` is `llama` and writes
`config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json` and `README.md`. It guarantees:

- every tensor is dequantized to float32 by `gguf.quants` and rounded once to
  BF16 (round to nearest even), under Hugging Face names and shapes
  `[out_features, in_features]`;
- llama.cpp's row permutation of the Q and K projections is undone, so the
  weights use Hugging Face's half-split rotary layout;
- the tokenizer splits text the way llama.cpp does for the file's
  `tokenizer.ggml.pre`, keeps every GGUF token id, and matches control and
  user-defined tokens whole;
- anything it cannot convert faithfully (another architecture, tokenizer
  model or pre-tokenizer, partial rotary, llama3 rope frequencies) raises
  `ValueError` naming the offending value, before anything is written.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from .safetensors_io import save_safetensors

# Bump whenever the output of `convert_gguf` changes, so prepared folders are redone.
CONVERTER_VERSION = 1

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token types

# llama.cpp's BPE pre-tokenizer regexes (llama-vocab.cpp), applied one after another.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, progress: bool = True, source: str | None = None
) -> None:
    """Write a Hugging Face Llama folder for `gguf_path` into `out_dir` (created if needed).

    `source` is an optional line of provenance (e.g. the package the file came from) for README.md.
    """
    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{gguf_path}: general.architecture is {arch!r}; only 'llama' can be converted"
        )
    tensor_names = {t.name for t in reader.tensors}
    config = llama_config(meta, tensor_names)
    tokenizer = build_tokenizer(meta)
    hf_names = {name: _hf_name(name) for name in tensor_names}

    out_dir.mkdir(parents=True, exist_ok=True)
    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(
        reader.tensors, desc="converting", unit="tensor", disable=not progress, leave=False
    ):
        weights[hf_names[tensor.name]] = _convert_tensor(tensor, config)
    save_safetensors(out_dir / "model.safetensors", weights, {"format": "pt"})

    token_ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", token_ids)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta, config))
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    (out_dir / "README.md").write_text(_readme(meta, gguf_path.name, counts, source))


def read_metadata(source: Path | gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata field of a GGUF file as a Python str, bool, number or list of them."""
    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source)
    return {name: _field_value(field) for name, field in reader.fields.items()}


def llama_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The Hugging Face `LlamaForCausalLM` config that a llama GGUF's metadata describes."""
    hidden_size = _require_int(meta, "llama.embedding_length")
    num_heads = _require_int(meta, "llama.attention.head_count")
    num_kv_heads = _optional_int(meta, "llama.attention.head_count_kv", num_heads)
    head_dim = _optional_int(meta, "llama.attention.key_length", hidden_size // num_heads)
    value_dim = _optional_int(meta, "llama.attention.value_length", head_dim)
    rope_dim = _optional_int(meta, "llama.rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"key length {head_dim}, value length {value_dim} and rope dimension {rope_dim} "
            "differ; a Llama config needs them equal"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"head_count {num_heads} is not a multiple of head_count_kv {num_kv_heads}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "rope_freqs.weight (llama3 rope scaling) cannot be expressed; not supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": _require_int(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _require_int(meta, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _require_int(meta, "llama.context_length"),
        # GGUF stores float32; print the shortest decimal that round-trips it (1e-05, not 9.99e-06).
        "rms_norm_eps": _float32(_require_number(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "vocab_size": _optional_int(meta, "llama.vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE `Tokenizer` equivalent to llama.cpp's for this GGUF's vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"{len(token_types)} token types for {len(tokens)} tokens")
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise ValueError(
            "tokenizer.ggml.merges holds an entry that is not two space-separated tokens"
        )
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # on duplicates the first id wins, as in llama.cpp
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=True))
    tokenizer.add_special_tokens([_added(t, True) for t, kind in typed if kind == _TOKEN_CONTROL])
    tokenizer.add_tokens([_added(t, False) for t, kind in typed if kind == _TOKEN_USER_DEFINED])
    tokenizer.post_processor = _post_processor(meta)
    return tokenizer


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


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if suffix == "weight" and len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    if suffix == "weight" and stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.weight"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def _convert_tensor(tensor: Any, config: dict[str, Any]) -> np.ndarray:
    """Dequantized, un-permuted (Q, K) and rounded to BF16, in NumPy (outermost-first) shape."""
    # GGUF lists dimensions innermost first; NumPy and Hugging Face outermost first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weight = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if weight.size != int(np.prod(shape)):
        raise ValueError(f"{tensor.name}: dequantized {weight.shape}, expected shape {shape}")
    weight = weight.reshape(shape)
    if tensor.name.endswith(".attn_q.weight"):
        weight = unpermute_rows(weight, config["num_attention_heads"])
    elif tensor.name.endswith(".attn_k.weight"):
        weight = unpermute_rows(weight, config["num_key_value_heads"])
    return weight.astype(ml_dtypes.bfloat16)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":  # llama.cpp: \p{N} alone, then the GPT-2 regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "default":
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _DEFAULT_SPLITS]
        return pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    raise ValueError(
        f"tokenizer.ggml.pre is {pre!r}; supported pre-tokenizers: 'smollm', 'gpt-2', 'default'"
    )


def _post_processor(meta: dict[str, Any]) -> processors.PostProcessor:
    """ByteLevel offsets, plus BOS / EOS where `tokenizer.ggml.add_{bos,eos}_token` ask for them."""
    added: dict[str, tuple[str, int]] = {}
    for what in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{what}_token_id")
        if meta.get(f"tokenizer.ggml.add_{what}_token") and token_id is not None:
            added[what] = (meta["tokenizer.ggml.tokens"][token_id], token_id)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not added:
        return byte_level
    bos = [added["bos"][0]] if "bos" in added else []
    eos = [added["eos"][0]] if "eos" in added else []
    template = processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=list(added.values()),
    )
    return processors.Sequence([byte_level, template])


def _tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Special tokens by name and the chat template; added tokens live in tokenizer.json."""

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else meta["tokenizer.ggml.tokens"][token_id]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def _readme(meta: dict[str, Any], file_name: str, counts: Counter[str], source: str | None) -> str:
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
    lines = [
        f"# {meta.get('general.name', file_name)}\n",
        f"Converted by reprise (converter version {CONVERTER_VERSION}) from `{file_name}`."
        + (f" Source: {source}." if source else ""),
        f"\nIts tensors ({kinds}) were dequantized and rounded to BF16, so these weights carry",
        "the quantization error: this is not the original BF16 checkpoint.\n",
    ]
    for key in ("organization", "license", "source.url", "url"):
        if meta.get(f"general.{key}") is not None:
            lines.append(f"- {key}: {meta[f'general.{key}']}")
    return "\n".join(lines) + "\n"


def _field_value(field: Any) -> Any:
    def scalar(part: np.ndarray, kind: gguf.GGUFValueType) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    kinds = field.types
    if kinds and kinds[0] == gguf.GGUFValueType.ARRAY:
        if len(kinds) < 2:
            return []
        return [scalar(field.parts[i], kinds[1]) for i in field.data]
    return scalar(field.parts[field.data[0]], kinds[0])


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type", "none")
    factor = meta.get("llama.rope.scaling.factor")
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32(factor)}
    if kind == "yarn":
        original = _require_int(meta, "llama.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": _float32(factor),
            "original_max_position_embeddings": original,
        }
    raise ValueError(f"llama.rope.scaling.type is {kind!r}; supported: 'none', 'linear', 'yarn'")


def _float32(value: float) -> float:
    return float(str(np.float32(value)))


def _require_int(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"GGUF metadata {key} is {value!r}; expected one integer")
    return value


def _require_number(meta: dict[str, Any], key: str) -> float:
    value = meta.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"GGUF metadata {key} is {value!r}; expected one number")
    return float(value)


def _optional_int(meta: dict[str, Any], key: str, default: int) -> int:
    return default if key not in meta else _require_int(meta, key)


def _write_json(path: Path, value: dict[str, Any] | Sequence[Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
