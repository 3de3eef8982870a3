"""Read and write safetensors files with NumPy, BF16 included.

The `safetensors` package's NumPy API has no bfloat16; this module reads the
format directly (8-byte little-endian header length, a JSON header, then the
raw tensor bytes) and maps BF16 through `ml_dtypes`. Reads are memory-mapped,
so opening a shard costs nothing until a tensor is touched.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read as one."""


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """Return (tensor entries by name, byte offset of the data section)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > _MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header of {header_len} bytes is implausibly large")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + header_len


def load_safetensors(path: Path | str) -> dict[str, np.ndarray]:
    """Map every tensor of one file as a read-only NumPy array (no copy)."""
    path = Path(path)
    header, data_start = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        dtype_name = entry.get("dtype")
        if dtype_name not in _DTYPES:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has dtype {dtype_name!r}; "
                f"supported: {', '.join(sorted(_DTYPES))}"
            )
        dtype = _DTYPES[dtype_name]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected or data_start + end > data.size:
            raise SafetensorsError(
                f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but shape {shape} "
                f"of {dtype_name} needs {expected} bytes"
            )
        raw = data[data_start + begin : data_start + end]
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors


def save_safetensors(
    path: Path | str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write tensors (C order, little-endian) to one safetensors file."""
    specs = {name: TensorSpec(np.dtype(a.dtype), tuple(a.shape)) for name, a in tensors.items()}
    save_safetensors_streamed(path, specs, lambda name: tensors[name], metadata)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def save_safetensors_streamed(
    path: Path | str,
    specs: Mapping[str, TensorSpec],
    produce: Callable[[str], np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write one safetensors file whose tensors are made one at a time, in `specs`' order,
    by `produce(name)`, so at most one is in memory (a converted 8B model never is whole).
    Raises SafetensorsError when a produced tensor's dtype or shape is not its spec's."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, spec in specs.items():
        if spec.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {spec.dtype} cannot be written")
        header[name] = {
            "dtype": _NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, spec in specs.items():
            array = np.ascontiguousarray(produce(name))
            if array.dtype != spec.dtype or tuple(array.shape) != spec.shape:
                raise SafetensorsError(
                    f"tensor {name!r}: made {array.dtype} {array.shape}, "
                    f"declared {spec.dtype} {spec.shape}"
                )
            f.write(array.reshape(-1).view(np.uint8).data)  # no copy, BF16 too
