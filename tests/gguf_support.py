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
        if quantized and array.ndim == 2 and array.shape[1] % 32 == 0:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `permute` of a Llama's Q and K rows (convert_hf_to_gguf.py), written out
    independently of the converter's inverse."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, -1)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
