"""`reprise model synth`: random-weight folders in the shape of real models, which load
in reprise and in transformers alike, and say that they are random."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.safetensors_io import read_header
from reprise.daemon.model.synth import SHAPES, synth_model, tensor_shapes


@pytest.mark.parametrize(
    ("like", "parameters"),
    [
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.2-1b", 1_235_814_400),
        ("smollm2-135m", 134_515_008),
        ("phi-3-mini", 3_821_079_552),  # Phi-3-mini-4k-instruct's safetensors
        ("mistral-7b-v0.1", 7_241_732_096),
        ("phi-4-mini", 3_836_021_760),  # Phi-4-mini-instruct's (tied embeddings)
    ],
)
def test_shapes_have_the_real_models_parameter_counts(like: str, parameters: int) -> None:
    assert sum(int(np.prod(dims)) for _, dims in tensor_shapes(SHAPES[like])) == parameters


@pytest.mark.parametrize("like", list(SHAPES))
def test_every_shapes_tensors_are_its_configs_parameters(like: str) -> None:
    """The tensors a synthetic folder holds add up to its config's parameter count (a
    sparse layer's experts alone: the count once caught a stray dense down_proj there)."""
    from reprise.daemon.model.synth import synth_config

    written = sum(int(np.prod(dims)) for _, dims in tensor_shapes(SHAPES[like]))
    assert written == synth_config(like).num_parameters()


def _metadata(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=3)


def test_the_folder_says_it_is_random(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert "random weights" in config["reprise_synthetic"]
    assert "random weights" in (tiny / "README.md").read_text().lower()
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        assert "random weights" in _metadata(tiny / shard)["reprise_synthetic"]
    cfg = ModelConfig.from_dir(tiny)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 2, 32, 1024)
    assert cfg.rope_scaling is not None and not cfg.tie_word_embeddings


def test_reprise_runs_it_and_transformers_agrees(tiny: Path) -> None:
    engine = Engine.from_pretrained(tiny, backend="numpy", num_device_blocks=16, block_size=16)
    prompt = np.random.default_rng(0).integers(0, 1024, size=40).tolist()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_logits=True)
    out = engine.generate(prompt, params)
    assert len(out.token_ids) == 4 and np.isfinite(out.logits).all()
    assert engine.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True)).token_ids
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    assert np.linalg.norm(out.logits[0] - want) / np.linalg.norm(want) < 3e-2


def test_same_seed_same_weights_and_bad_requests(tmp_path: Path, tiny: Path) -> None:
    again = synth_model("tiny", tmp_path / "again", seed=3, num_layers=1)
    shard = "model-00001-of-00001.safetensors"
    assert (again / shard).read_bytes()[-64:] != b""  # written
    assert (
        read_header(again / shard)[0]["model.embed_tokens.weight"]
        == read_header(tiny / shard)[0]["model.embed_tokens.weight"]
    )
    with pytest.raises(ValueError, match="like must be one of"):
        synth_model("gpt-5", tmp_path / "x")
    with pytest.raises(ValueError, match="not empty"):
        synth_model("tiny", tiny)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        synth_model("tiny", tmp_path / "y", num_layers=0)


def test_cli_writes_the_folder_and_prints_it(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "reprise.cli.main", "model", "synth", "--like", "tiny",
         "--out", str(out), "--num-layers", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(out)
    assert ModelConfig.from_dir(out).num_layers == 1
    refused = subprocess.run(
        [sys.executable, "-m", "reprise.cli.main", "model", "synth", "--like", "tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0 and "not empty" in refused.stderr
