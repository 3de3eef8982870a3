"""The Granite family (registry.py): Llama's forward with four scalars, the embedding
multiplier, the residual multiplier on each attention and MLP output, the attention
multiplier as the scores' scale and the logits' divisor, folded into the weights and the
scale (weights.py). Against transformers' own GraniteForCausalLM on the same weights;
chunked and cached bits kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_model_reference import (
    hf_logits,
    matches_transformers,
    rel_l2_rows,
    reuse_keeps_bits,
    save_widened,
)
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy  # noqa: F401 (a fixture)

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GRANITE = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, embedding_multiplier=12.0, residual_multiplier=0.22,
               attention_multiplier=0.75, logits_scaling=8.0)  # fmt: skip


def make_hf_granite(out: Path, seed: int, **overrides) -> torch.nn.Module:
    """A random GraniteForCausalLM saved as BF16 safetensors; returned in fp32 (same
    values), its weights widened as test_model_reference's are."""
    torch.manual_seed(seed)
    config = transformers.GraniteConfig(**{**GRANITE, **overrides})
    return save_widened(transformers.GraniteForCausalLM(config), out, GRANITE["vocab_size"])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers_granite(tmp_path: Path, tied: bool) -> None:
    ref = make_hf_granite(tmp_path, seed=3 + tied, tie_word_embeddings=tied)
    config = ModelConfig.from_dir(tmp_path)
    assert (config.embedding_multiplier, config.residual_multiplier) == (12.0, 0.22)
    assert (config.attention_scale, config.logits_scaling) == (0.75, 8.0)
    from reprise.daemon.model.modelinfo import model_info

    assert model_info(tmp_path)["multipliers"] == {
        "embedding": 12.0, "residual": 0.22, "attention": 0.75, "logits_divisor": 8.0}  # fmt: skip
    ours, prompt, err = matches_transformers(tmp_path, ref, GRANITE["vocab_size"])
    # each scalar matters: with one of them left at its Llama value, transformers is far
    for name, llama_value in [("residual_multiplier", 1.0), ("embedding_multiplier", 1.0),
                              ("attention_multiplier", (96 / 6) ** -0.5), ("logits_scaling", 1.0)]:  # fmt: skip
        changed = make_hf_granite(tmp_path / name, seed=3 + tied, tie_word_embeddings=tied,
                                  **{name: llama_value})  # fmt: skip
        assert rel_l2_rows(ours, hf_logits(changed, prompt)).mean() > 10 * err.max(), name


def test_the_engine_keeps_granites_bits_cached_and_chunked(tmp_path: Path) -> None:
    make_hf_granite(tmp_path, seed=5)
    reuse_keeps_bits(tmp_path, GRANITE["vocab_size"])


def test_prompt_table_rows_are_scaled_as_the_embedding(tmp_path: Path) -> None:
    """A prompt table's rows enter as transformers' inputs_embeds do: times the embedding
    multiplier, so a table of the checkpoint's own embedding rows for some tokens gives
    exactly those tokens' logits (test_prompt_table's check, on a scaled family)."""
    from reprise.daemon.model.safetensors_io import load_safetensors

    make_hf_granite(tmp_path, seed=6)
    raw = load_safetensors(tmp_path / "model.safetensors")["model.embed_tokens.weight"]
    engine = Engine.from_pretrained(tmp_path, backend="numpy", num_device_blocks=64,
                                    block_size=16, enable_reuse=False)  # fmt: skip
    v = GRANITE["vocab_size"]
    params = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)
    text = engine.generate([7, 8, 9, 10, 11, 12], params)
    fake = [7, v, 9, v + 1, 11, 12]
    rows = np.ascontiguousarray(raw[[8, 10]])
    out = engine.generate(fake, params, prompt_table=rows)
    assert np.array_equal(out.logits.view(np.uint32), text.logits.view(np.uint32))


def test_bad_multipliers_are_refused() -> None:
    raw = {"architectures": ["GraniteForCausalLM"], **GRANITE}
    with pytest.raises(ModelConfigError, match="residual_multiplier must be a finite number > 0"):
        ModelConfig.from_dict({**raw, "residual_multiplier": 0})
    with pytest.raises(ModelConfigError, match="mlp_bias=true is not supported"):
        ModelConfig.from_dict({**raw, "mlp_bias": True})


@pytest.fixture(scope="module")
def tiny_granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reprise.daemon.model.synth import synth_model

    return synth_model("tiny-granite", tmp_path_factory.mktemp("granite") / "tiny", seed=2)


def test_the_gpu_backend_runs_granite(cupy_kind: str, tiny_granite: Path) -> None:  # noqa: F811
    """CupyBackend (emulated here, or a real device) with Granite's scale and folded
    weights: the same tokens as NumPy, logits within a few BF16 ulps; graphs keep eager
    decode's bits."""
    gpu_forward_matches_numpy(cupy_kind, tiny_granite)
