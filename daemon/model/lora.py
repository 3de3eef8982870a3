"""A LoRA adapter (PEFT's layout) merged into its base model's weights: a model folder of
its own (`reprise model merge-lora BASE ADAPTER OUT`), which then runs as any other.

A PEFT adapter folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors`, whose tensors
`base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]) change
the base tensor `<module>.weight` by scale * B @ A, scale = lora_alpha / r (or
lora_alpha / sqrt(r) with rsLoRA). `merge_lora` guarantees:

- each changed tensor is the base tensor plus scale * B @ A, computed in float64 and
  rounded to BF16 (through float32; PEFT's merge adds in the weight's own dtype, so the
  two differ by about that rounding); every other tensor and file is copied as it is;
- one tensor is in memory at a time (the merged file is written as it is made);
- what it cannot merge faithfully is refused in one line naming it, before anything is
  written: DoRA, per-module ranks or alphas, `modules_to_save` (whole tensors trained
  beside the adapter), bias training, `fan_in_fan_out`, embedding adapters, an adapter
  tensor with no base tensor, or shapes that do not fit.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .prepare import MARKER_NAME
from .safetensors_io import TensorSpec, load_safetensors, save_safetensors_streamed
from .weights import open_checkpoint

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, slots=True)
class Adapter:
    scale: float
    # base tensor name -> (A [r, in], B [out, r]), float32 (as the adapter stores them,
    # F32 or BF16)
    deltas: dict[str, tuple[np.ndarray, np.ndarray]]


def read_adapter(folder: Path) -> Adapter:
    """A PEFT adapter folder, checked (ValueError naming what cannot be merged)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: no readable {ADAPTER_CONFIG} ({e})") from None
    _check_config(config)
    tensors = load_safetensors(folder / ADAPTER_WEIGHTS)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        if not name.startswith(_PREFIX) or not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"{ADAPTER_WEIGHTS}: tensor {name!r} is not a LoRA A or B matrix")
        module, part = name[len(_PREFIX) :].rsplit(".lora_", 1)
        pairs.setdefault(module + ".weight", {})[part[0]] = tensor.astype(np.float32)
    deltas = {}
    for base, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{ADAPTER_WEIGHTS}: {base} has lora_{''.join(pair)} alone")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{ADAPTER_WEIGHTS}: {base}'s A {a.shape} and B {b.shape} do not chain"
            )
        deltas[base] = (a, b)
    rank = int(config["r"])
    if any(a.shape[0] != rank for a, _ in deltas.values()):
        raise ValueError(f"{ADAPTER_WEIGHTS}: a matrix's rank is not the config's r = {rank}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return Adapter(scale, deltas)


def _check_config(config: dict[str, Any]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type is {config.get('peft_type')!r}; only LoRA adapters merge")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter r must be a positive integer; got {rank!r}")
    refused = {
        "use_dora": "DoRA's magnitude vectors",
        "modules_to_save": "modules_to_save (whole tensors trained beside the adapter)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (transposed GPT-2 style layers)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"{what} cannot be merged here; this adapter sets {key}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias {config['bias']!r}: trained biases cannot be merged here")


def merge_lora(base: Path, adapter_dir: Path, out: Path) -> list[str]:
    """Write `out`: the base folder's files with its checkpoint replaced by one
    `model.safetensors` of the merged weights. Returns the changed tensors' names."""
    base, out = Path(base), Path(out)
    adapter = read_adapter(adapter_dir)
    tensors = open_checkpoint(base)
    for name, (a, b) in adapter.deltas.items():
        if name not in tensors:
            raise ValueError(f"the adapter changes {name}, which the base checkpoint lacks")
        if tensors[name].shape != (b.shape[0], a.shape[1]):
            raise ValueError(f"{name}: base {tensors[name].shape}, adapter B @ A "
                             f"{(b.shape[0], a.shape[1])}")  # fmt: skip
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; give an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        # the checkpoint is written anew; a prepared folder's marker names the base's source
        skip = item.name.endswith(".safetensors") or item.name in (
            "model.safetensors.index.json",
            MARKER_NAME,
        )
        if item.is_file() and not skip:
            shutil.copy2(item, out / item.name)
    specs = {
        name: TensorSpec(BF16 if name in adapter.deltas else t.dtype, tuple(t.shape))
        for name, t in tensors.items()
    }

    def produce(name: str) -> np.ndarray:
        tensor = tensors[name]
        if name not in adapter.deltas:
            return np.asarray(tensor)
        a, b = adapter.deltas[name]
        delta = b.astype(np.float64) @ a.astype(np.float64)  # r products a value, ~exact
        merged = tensor.astype(np.float64) + adapter.scale * delta
        return merged.astype(np.float32).astype(BF16)

    save_safetensors_streamed(out / "model.safetensors", specs, produce, {"format": "pt"})
    return sorted(adapter.deltas)
