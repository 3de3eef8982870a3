"""Heads padded with zeros (ModelConfig.padded): how the GPU backend runs a model whose
head_dim its attention kernels are not built for (Phi-3-mini's and Phi-3.5-mini's 96 run
as 128). q's, k's and v's rows of the padding are zeros and so are o_proj's columns for
it; the padding rotates as a partial rotary embedding's passed-through dimensions, and
the scores keep the checkpoint's scale. Every sum then gains exact zeros, so the logits
are the unpadded model's: bit for bit but where the twins' grids (set by a vector's
length) round an element far below its vector's largest otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_model_reference import TINY, run_ours, save_widened
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy, synth_like  # noqa: F401 (a fixture)

from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "phi3-partial": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                     {"partial_rotary_factor": 0.75}),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                {"attention_multiplier": 0.1, "embedding_multiplier": 2.0}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_padded_heads_give_the_unpadded_logits(tmp_path: Path, case: str) -> None:
    config_class, model_class, overrides = CASES[case]
    torch.manual_seed(61)
    model = model_class(config_class(**{**TINY, **IDS, **overrides}))
    save_widened(model, tmp_path, TINY["vocab_size"])
    padded = ModelConfig.from_dir(tmp_path).padded(64)
    assert padded.head_dim == 64 and padded.checkpoint_head_dim == 16
    prompt = np.random.default_rng(14).integers(0, TINY["vocab_size"], size=120)
    want = run_ours(tmp_path, prompt, [120])
    got = run_ours(tmp_path, prompt, [120], pad_to=64)
    same = np.mean(got.view(np.uint32) == want.view(np.uint32))
    assert same > 0.999, same
    assert np.max(np.abs(got - want)) <= 2.0**-12 * np.max(np.abs(want))
    # chunked, the padded model keeps its own bits
    chunked = run_ours(tmp_path, prompt, [7, 50, 63], pad_to=64)
    assert np.array_equal(chunked.view(np.uint32), got.view(np.uint32))


def test_what_cannot_be_padded_is_refused(tmp_path: Path) -> None:
    raw = {**TINY, "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ModelConfigError, match="q and k norms or interleaved rotary pairs"):
        ModelConfig.from_dict(raw).padded(64)


@pytest.fixture(scope="module")
def phi3_d48(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phi-3 of head_dim 48 (Phi-3-mini's 96, halved): the GPU runs it at 64."""
    return synth_like(tmp_path_factory, "tiny-phi3", seed=9, hidden_size=192, head_dim=48)


def test_the_gpu_engine_pads_a_head_dim_its_kernels_lack(
    cupy_kind: str,  # noqa: F811
    phi3_d48: Path,
) -> None:
    """Engine.from_pretrained on the GPU backend pads a head of 48 to 64 (the fingerprint
    says so) and generates the NumPy engine's tokens; a head past 256 is refused in one
    line before any weight loads."""
    from reprise.daemon import Engine, SamplingParams
    from reprise.daemon.model.fingerprint import model_fingerprint

    gpu = Engine.from_pretrained(phi3_d48, backend="cupy", num_device_blocks=16, block_size=16)
    assert gpu.config.head_dim == 64 and gpu.config.checkpoint_head_dim == 48
    assert model_fingerprint(phi3_d48, gpu.config) != model_fingerprint(phi3_d48)
    cpu = Engine.from_pretrained(phi3_d48, backend="numpy", num_device_blocks=16, block_size=16)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompt = list(range(5, 40))
    assert gpu.generate(prompt, params).token_ids == cpu.generate(prompt, params).token_ids
    from reprise.cuda.cupy_backend import kernel_head_dim

    assert [kernel_head_dim(d) for d in (48, 64, 96, 128, 160, 256)] == [64, 64, 128, 128, 256, 256]
    with pytest.raises(ValueError, match="head_dim up to 256; this model's is 288"):
        kernel_head_dim(288)
