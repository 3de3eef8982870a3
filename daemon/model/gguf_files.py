"""A GGUF model's files: one file, or the shards llama.cpp's `gguf-split` cut it into.

A split model is `<prefix>-00001-of-0000N.gguf` to `<prefix>-0000N-of-0000N.gguf` in one
folder (llama.cpp's `llama_split_path`); every shard carries `split.no` (0-based),
`split.count` and `split.tensors.count` (the tensors of all shards), the first one the
model's metadata too, each some of its tensors. `open_shards` guarantees:

- any shard stands for the whole set, returned first shard first; a file that is not split
  (no `split.count` above 1) is a model of one file, whatever its name;
- every shard's split keys agree with its name, so with the others', and the shards hold
  `split.tensors.count` tensors, no name twice; else ValueError naming the file and the
  value (a missing shard by its path), before any tensor is read;
- tensor data stays memory-mapped, read when a tensor is dequantized.

`read_metadata` gives a file's metadata as Python values; `require_int`, `require_number`
and `optional_int` read one key of it, or raise ValueError naming the key and its value;
`dequantized` reads a tensor's values (or one expert's of stacked experts) as float32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf

# llama.cpp's `llama_split_path`: "%s-%05d-of-%05d.gguf" (prefix, shard number from 1, count)
_SHARD_NAME = re.compile(r"(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf")


@dataclass(frozen=True, slots=True)
class GGUFShards:
    """The files of one model, first shard first: one for a model that is not split."""

    paths: tuple[Path, ...]
    readers: tuple[gguf.GGUFReader, ...]  # NOTE: the first one holds the model's metadata

    @property
    def tensors(self) -> list[gguf.ReaderTensor]:
        """Every shard's tensors, in shard order."""
        return [tensor for reader in self.readers for tensor in reader.tensors]


def open_gguf(path: Path) -> gguf.GGUFReader:
    """The file's reader (memory-mapped), or ValueError naming a file that is not one GGUF."""
    import gguf  # NOTE: here, not at the top: a safetensors model loads without the package

    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"{path} cannot be read as a GGUF file: {e}") from None


def read_metadata(source: Path | gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata field of a GGUF file as a Python str, bool, number or list of them."""
    reader = open_gguf(source) if isinstance(source, (str, Path)) else source
    return {name: _field_value(field) for name, field in reader.fields.items()}


def require_int(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"GGUF metadata {key} is {value!r}; expected one integer")
    return value


def require_number(meta: dict[str, Any], key: str) -> float:
    value = meta.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"GGUF metadata {key} is {value!r}; expected one number")
    return float(value)


def optional_int(meta: dict[str, Any], key: str, default: int) -> int:
    return default if key not in meta else require_int(meta, key)


def dequantized(tensor: gguf.ReaderTensor, index: int | None = None) -> np.ndarray:
    """The tensor's values (its `index`-th along the outermost dimension, if given: one
    expert of stacked experts) dequantized by `gguf.quants` to float32, in NumPy order."""
    import gguf

    data = tensor.data if index is None else tensor.data[index]
    return np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32)


def open_shards(path: Path) -> GGUFShards:
    """Every file of the model `path` is a file of, each shard's split keys checked."""
    given = open_gguf(path)
    split = _split_keys(path, given)
    if split is None:
        return GGUFShards((path,), (given,))
    paths = _named_set(path, *split)
    readers = tuple(given if idx == split[0] else open_gguf(p) for idx, p in enumerate(paths))
    num_tensors = sum(len(reader.tensors) for reader in readers)
    for idx, (shard, reader) in enumerate(zip(paths, readers, strict=True)):
        keys = [_int_key(reader, key) for key in ("split.no", "split.count", "split.tensors.count")]
        if keys != [idx, len(paths), num_tensors]:
            raise ValueError(
                f"{shard}: split.no {keys[0]}, split.count {keys[1]}, split.tensors.count "
                f"{keys[2]}; shard {idx + 1} of {len(paths)} ({num_tensors} tensors in all) "
                f"needs split.no {idx}, split.count {len(paths)}, split.tensors.count {num_tensors}"
            )
    seen: dict[str, Path] = {}
    for shard, reader in zip(paths, readers, strict=True):
        for tensor in reader.tensors:
            if seen.setdefault(tensor.name, shard) != shard:
                raise ValueError(f"{shard}: tensor {tensor.name!r} is in {seen[tensor.name]} too")
    return GGUFShards(paths, readers)


def shard_paths(path: Path) -> tuple[Path, ...]:
    """The files of the model `path` is a file of, as `open_shards` finds them: its split
    set when it is split, else itself. Reads `path`'s metadata only when it is named as a
    shard (`open_shards` refuses a split file that is not); raises ValueError as it does for
    a name that disagrees with the file's split keys, or a missing shard."""
    if _SHARD_NAME.fullmatch(path.name) is None:
        return (path,)
    split = _split_keys(path, open_gguf(path))
    return (path,) if split is None else _named_set(path, *split)


def named_shards(path: Path) -> tuple[Path, ...]:
    """The set `path`'s name alone puts it in (llama.cpp's names; present or not), or
    itself when it is not named as a shard of more than one. Reads nothing."""
    match = _SHARD_NAME.fullmatch(path.name)
    if match is None:
        return (path,)
    number, count = int(match["number"]), int(match["count"])
    if count < 2 or not 1 <= number <= count:
        return (path,)
    return tuple(path.with_name(_shard_name(match["prefix"], i, count)) for i in range(count))


def _split_keys(path: Path, reader: gguf.GGUFReader) -> tuple[int, int] | None:
    """(split.no, split.count) of a split file, None for one that is not split."""
    count = _int_key(reader, "split.count")
    if count is None or count < 2:  # llama.cpp's loader: a count of 1 is one file
        return None
    idx = _int_key(reader, "split.no")
    if idx is None or not 0 <= idx < count:
        raise ValueError(
            f"{path}: split.count is {count} but split.no is {idx}; a shard of {count} needs "
            f"one from 0 to {count - 1}"
        )
    return idx, count


def _named_set(path: Path, idx: int, count: int) -> tuple[Path, ...]:
    """The shards of the set whose shard `idx` of `count` is `path`, each present."""
    suffix = _shard_name("", idx, count)
    if not path.name.endswith(suffix) or path.name == suffix:  # llama_split_prefix's rule
        raise ValueError(
            f"{path}: split.no {idx} and split.count {count} make it shard {idx + 1} of "
            f"{count}, which llama.cpp names <prefix>{suffix}"
        )
    prefix = path.name[: -len(suffix)]
    paths = tuple(path.with_name(_shard_name(prefix, i, count)) for i in range(count))
    for i, shard in enumerate(paths):
        if not shard.is_file():
            raise ValueError(f"missing shard {i + 1} of {count} of a split GGUF model: {shard}")
    return paths


def _shard_name(prefix: str, idx: int, count: int) -> str:
    return f"{prefix}-{idx + 1:05d}-of-{count:05d}.gguf"


def _int_key(reader: gguf.GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    value = None if field is None else _field_value(field)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _field_value(field: Any) -> Any:
    import gguf

    def scalar(part: Any, kind: gguf.GGUFValueType) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    kinds = field.types
    if kinds and kinds[0] == gguf.GGUFValueType.ARRAY:
        if len(kinds) < 2:
            return []
        return [scalar(field.parts[i], kinds[1]) for i in field.data]
    return scalar(field.parts[field.data[0]], kinds[0])
