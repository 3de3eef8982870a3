"""A LoRA adapter merged into its base model (lora.py, `reprise model merge-lora`): the
adapter is written here as PEFT writes one, and the merged folder's logits are held to
transformers running the base model with the low-rank update applied in fp32."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_model_reference import TINY, hf_logits, make_hf_model, rel_l2_rows, run_ours

from reprise.daemon.model.lora import merge_lora
from reprise.daemon.model.prepare import MARKER_NAME
from reprise.daemon.model.safetensors_io import load_safetensors, save_safetensors

torch = pytest.importorskip("torch")

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
PROJ = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "down_proj": "mlp"}


def write_adapter(folder: Path, model, rank: int, alpha: float, seed: int, **config) -> dict:
    """A random adapter on `model` in PEFT's files; returns {base tensor: (A, B)} in fp32
    (A as PEFT initializes it, B nonzero as training leaves it)."""
    rng = np.random.default_rng(seed)
    state = model.state_dict()
    tensors, deltas = {}, {}
    for i in range(model.config.num_hidden_layers):
        for proj in TARGETS:
            name = f"model.layers.{i}.{PROJ[proj]}.{proj}"
            out_f, in_f = state[name + ".weight"].shape
            a = (rng.standard_normal((rank, in_f)) / math.sqrt(in_f)).astype(np.float32)
            b = (rng.standard_normal((out_f, rank)) * 0.2).astype(np.float32)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            deltas[name + ".weight"] = (a, b)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / "adapter_model.safetensors", tensors)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": TARGETS,
        "bias": "none", "fan_in_fan_out": False, "use_dora": False, **config}))  # fmt: skip
    return deltas


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_the_merged_model_is_the_base_with_its_update(tmp_path: Path, rslora: bool) -> None:
    base = make_hf_model(tmp_path / "base", seed=2, tie_word_embeddings=False)
    (tmp_path / "base" / MARKER_NAME).write_text("{}")  # a prepared folder's, not the merge's
    deltas = write_adapter(tmp_path / "adapter", base, rank=4, alpha=8.0, seed=3,
                           use_rslora=rslora)  # fmt: skip
    scale = 8.0 / (math.sqrt(4) if rslora else 4)
    changed = merge_lora(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    assert changed == sorted(deltas)
    # the weights: the base plus scale * B @ A, within one BF16 rounding of float64's
    ours = load_safetensors(tmp_path / "merged" / "model.safetensors")
    source = load_safetensors(tmp_path / "base" / "model.safetensors")
    for name, tensor in source.items():
        if name not in deltas:
            assert np.array_equal(ours[name].view(np.uint16), tensor.view(np.uint16)), name
            continue
        a, b = deltas[name]
        want = tensor.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
        got = ours[name].astype(np.float64)
        assert np.all(np.abs(got - want) <= np.abs(want) * 2.0**-8 + 1e-30), name
    # the logits: transformers with the update applied in fp32, against the merged folder
    with torch.no_grad():
        for name, (a, b) in deltas.items():
            param = dict(base.named_parameters())[name]
            param += torch.from_numpy(scale * (b @ a))
    prompt = np.random.default_rng(5).integers(0, TINY["vocab_size"], size=60)
    want = hf_logits(base, prompt)
    got = run_ours(tmp_path / "merged", prompt, [60])
    err = rel_l2_rows(got, want)
    assert err.max() < 2e-2
    assert rel_l2_rows(run_ours(tmp_path / "base", prompt, [60]), want).mean() > 10 * err.max()
    assert not (tmp_path / "merged" / MARKER_NAME).exists()
    assert (tmp_path / "merged" / "config.json").read_text() == (
        tmp_path / "base" / "config.json"
    ).read_text()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA's magnitude vectors cannot be merged"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"alpha_pattern": {"q_proj": 4}}, "per-module alphas"),
        ({"bias": "all"}, "trained biases cannot be merged"),
        ({"r": 0}, "adapter r must be a positive integer"),
        ({"peft_type": "IA3"}, "only LoRA adapters merge"),
        ({"r": 8}, "rank is not the config's r = 8"),
    ],
)
def test_what_cannot_be_merged_is_refused(tmp_path: Path, change: dict, message: str) -> None:
    base = make_hf_model(tmp_path / "base", seed=2)
    write_adapter(tmp_path / "adapter", base, rank=4, alpha=8.0, seed=3, **change)
    with pytest.raises(ValueError, match=re.escape(message)):
        merge_lora(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_the_command_line_merges_and_refuses_in_one_line(tmp_path: Path) -> None:
    base = make_hf_model(tmp_path / "base", seed=2)
    write_adapter(tmp_path / "adapter", base, rank=2, alpha=2.0, seed=4)
    cli = [sys.executable, "-m", "reprise.cli.main", "model", "merge-lora",
           str(tmp_path / "base"), str(tmp_path / "adapter")]  # fmt: skip
    done = subprocess.run([*cli, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "out") and "merged 12 tensors" in done.stderr
    again = subprocess.run([*cli, str(tmp_path / "out")], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert again.returncode == 1 and "is not empty" in again.stderr
    assert "Traceback" not in again.stderr
    merged = load_safetensors(tmp_path / "out" / "model.safetensors")
    assert all(t.dtype == ml_dtypes.bfloat16 for t in merged.values())
