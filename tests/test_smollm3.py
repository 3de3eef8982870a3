"""The SmolLM3 family (registry.py): Llama's forward with some layers that do not rotate
their queries and keys (`no_rope_layers`: every 4th by default), run with tables of ones
and zeros (llama.py). Against transformers' own SmolLM3ForCausalLM on the same weights;
chunked and cached bits kept; the GPU backend through the emulated CuPy."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_model_reference import (
    hf_logits,
    matches_transformers,
    rel_l2_rows,
    reuse_keeps_bits,
    save_widened,
)
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy  # noqa: F401 (a fixture)

from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMOLLM3 = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)  # fmt: skip


def make_hf_smollm3(out: Path, seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.SmolLM3Config(**{**SMOLLM3, **overrides})
    return save_widened(transformers.SmolLM3ForCausalLM(config), out, SMOLLM3["vocab_size"])


@pytest.mark.parametrize("no_rope", [None, [0, 1, 1, 0]], ids=["every-4th", "first-and-last"])
def test_logits_match_transformers_smollm3(tmp_path: Path, no_rope: list[int] | None) -> None:
    given = {} if no_rope is None else {"no_rope_layers": no_rope}
    ref = make_hf_smollm3(tmp_path, seed=3, **given)
    config = ModelConfig.from_dir(tmp_path)
    assert config.rope_layers == tuple(bool(v) for v in ref.config.no_rope_layers)
    assert not all(config.rope_layers)
    from reprise.daemon.model.modelinfo import model_info

    without = [i for i, v in enumerate(ref.config.no_rope_layers) if not v]
    assert model_info(tmp_path)["layers_without_rope"] == without
    ours, prompt, err = matches_transformers(tmp_path, ref, SMOLLM3["vocab_size"])
    # the layers without RoPE matter: rotating in every layer, transformers is far from us
    every = make_hf_smollm3(tmp_path / "every", seed=3, no_rope_layers=[1] * 4)
    assert rel_l2_rows(ours, hf_logits(every, prompt)).mean() > 5 * err.mean()


def test_the_engine_keeps_smollm3s_bits_cached_and_chunked(tmp_path: Path) -> None:
    make_hf_smollm3(tmp_path, seed=5)
    reuse_keeps_bits(tmp_path, SMOLLM3["vocab_size"])


def test_bad_no_rope_layers_are_refused() -> None:
    raw = {"architectures": ["SmolLM3ForCausalLM"], **SMOLLM3}
    for bad in ([1, 0, 1], [1, 0, 2, 1], "1,0,1,0"):
        with pytest.raises(ModelConfigError, match="no_rope_layers must be a list of 4"):
            ModelConfig.from_dict({**raw, "no_rope_layers": bad})
    assert ModelConfig.from_dict({**raw, "no_rope_layers": [1] * 4}).rope_layers is None


@pytest.fixture(scope="module")
def tiny_smollm3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reprise.daemon.model.synth import synth_model

    return synth_model("tiny-smollm3", tmp_path_factory.mktemp("smollm3") / "tiny", seed=2)


def test_the_gpu_backend_runs_smollm3(cupy_kind: str, tiny_smollm3: Path) -> None:  # noqa: F811
    """CupyBackend (emulated here, or a real device) with identity tables for the layers
    without RoPE: the same tokens as NumPy, logits within a few BF16 ulps; graphs keep
    eager decode's bits."""
    gpu_forward_matches_numpy(cupy_kind, tiny_smollm3)
