"""Writing GGUF files in tests, as llama.cpp's converter lays them out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np


def write_gguf(
    path: Path,
    arch: str,
    kv: dict[str, Any],
    tensors: dict[str, np.ndarray],
    quantized: bool = True,
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, array in tensors.items():
        if quantized and _quantizable(name, array):
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def text_model_kv(config: Any) -> dict[str, Any]:
    """The keys llama.cpp's converter writes for any text model (TextModel's
    set_gguf_parameters), from a transformers config, without the architecture prefix; a
    family's own keys (rope, experts) go beside them."""
    return {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
    }


def _quantizable(name: str, array: np.ndarray) -> bool:
    """What llama.cpp's converter quantizes: matrices and stacked experts whose rows are
    whole Q8_0 blocks, but a router (`ffn_gate_inp`), which it keeps in F32."""
    whole = array.ndim in (2, 3) and array.shape[-1] % 32 == 0
    return whole and not name.endswith("ffn_gate_inp.weight")


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `permute` of a Llama's Q and K rows (convert_hf_to_gguf.py), written out
    independently of the converter's inverse."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, -1)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def split_gguf(source: Path, path: Path, max_tensors: int) -> list[Path]:
    """`source` cut into shards as llama.cpp's gguf-split (and gguf-py's `split_max_tensors`)
    cut one: its metadata in the first, at most `max_tensors` tensors each, each tensor's
    bytes as they were, named `<path's stem>-00001-of-0000N.gguf` beside `path`."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer's own, and the reader's header fields
        kind = field.types[0]
        sub_kind = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    count = len(writer.tensors)  # one dict of tensors a shard
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return [path.with_name(f"{path.stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def set_gguf_value(path: Path, key: str, value: int) -> None:
    """Overwrite a scalar metadata value of a GGUF file in place (gguf_set_metadata's way)."""
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()
