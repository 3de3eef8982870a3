"""Sliding windows in the families that have them, against transformers' own classes on
the same weights: Mistral's and Phi-3's on every layer, Qwen2's from max_window_layers on,
SmolLM3's on its layers without RoPE. Each window binds (transformers with full attention
is far from us), chunked and cached bits are kept, and the GPU backend (emulated CuPy, or
a device) runs it on both attention kernels.

The attention itself (the twin's window, and each kernel's against it) is in
test_sliding_window.py, test_sliding_window_emulated.py and
test_sliding_window_tc_emulated.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_model_reference import (
    TINY,
    hf_logits,
    matches_transformers,
    rel_l2_rows,
    reuse_keeps_bits,
    run_ours,
    save_widened,
)
from test_qwen2 import (  # noqa: F401 (a fixture)
    cupy_kind,
    gpu_forward_matches_numpy,
    run_on,
    synth_like,
)

from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.modelinfo import model_info

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

WINDOW = 24  # binds on the 150-token prompts of matches_transformers


def make(kind: str, out: Path, seed: int, **overrides) -> torch.nn.Module:
    """A random transformers model of family `kind`, saved widened (save_widened)."""
    config_class, model_class = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # within the vocabulary
    model = model_class(config_class(**{**TINY, **ids, **overrides}))
    return save_widened(model, out, TINY["vocab_size"])


# (family, the config that slides, each of TINY's 3 layers' window)
CASES = {
    "mistral": ({"sliding_window": WINDOW}, (WINDOW,) * 3),
    "qwen2": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
              (0, WINDOW, WINDOW)),
    "smollm3": ({"use_sliding_window": True, "sliding_window": WINDOW,
                 "no_rope_layer_interval": 2}, (0, WINDOW, 0)),
}  # fmt: skip
FULL = {
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "smollm3": {"use_sliding_window": False},
}


@pytest.mark.parametrize("kind", list(CASES))
def test_windowed_logits_match_transformers(tmp_path: Path, kind: str) -> None:
    sliding, windows = CASES[kind]
    ref = make(kind, tmp_path, seed=21, **sliding)
    assert ModelConfig.from_dir(tmp_path).layer_windows == windows
    layer_types = getattr(ref.config, "layer_types", None)
    if layer_types is not None:  # transformers' own rule agrees on which layers slide
        assert [w != 0 for w in windows] == [t == "sliding_attention" for t in layer_types]
    ours, prompt, err = matches_transformers(tmp_path, ref, TINY["vocab_size"])
    # the window binds: with full attention transformers is far from us past the window
    full = make(kind, tmp_path / "full", seed=21, **FULL[kind])
    assert rel_l2_rows(ours[100:], hf_logits(full, prompt)[100:]).min() > 5 * err.max()
    # chunks of any size, the same bits
    assert np.array_equal(run_ours(tmp_path, prompt, [7, 30, 113]).view(np.uint32),
                          ours.view(np.uint32))  # fmt: skip


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_the_engine_keeps_windowed_bits_cached_and_chunked(tmp_path: Path, kind: str) -> None:
    make(kind, tmp_path, seed=22, **CASES[kind][0])
    reuse_keeps_bits(tmp_path, TINY["vocab_size"])


def test_model_info_names_each_layers_window(tmp_path: Path) -> None:
    make("qwen2", tmp_path, seed=23, **CASES["qwen2"][0])
    assert model_info(tmp_path)["sliding_windows"] == f"{WINDOW} on layers 1-2"


@pytest.fixture(scope="module", params=["every-layer", "by-layer"])
def windowed_d64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny models of head_dim 64 (the attention kernels take 64 and 128) with a window
    of 8: Phi-3's on every layer (the layers in one attention_layers call), Qwen2's on
    its second (one layer at a time)."""
    like, window = {
        "every-layer": ("tiny-phi3", {"sliding_window": 8}),
        "by-layer": ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 8,
                                    "max_window_layers": 1}),
    }[request.param]  # fmt: skip
    folder = synth_like(tmp_path_factory, like, seed=6, **window)
    assert any(ModelConfig.from_dir(folder).layer_windows or ())
    return folder


def test_the_gpu_backend_runs_windowed_models(cupy_kind: str, windowed_d64: Path) -> None:  # noqa: F811
    """Both attention kernels: the same tokens as NumPy, logits within a few BF16 ulps,
    and (tensor cores) graphs' decode bit-identical to eager."""
    from reprise.cuda.backend import NumpyBackend
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.daemon.model.llama import LlamaModel
    from reprise.daemon.model.weights import load_weights

    gpu_forward_matches_numpy(cupy_kind, windowed_d64)
    config = ModelConfig.from_dir(windowed_d64)
    weights = load_weights(windowed_d64, config)
    prompt = np.random.default_rng(3).integers(0, 256, size=20)
    want = run_on(LlamaModel(config, weights, NumpyBackend()), prompt)
    got = run_on(LlamaModel(config, weights, CupyBackend("cuda-cores")), prompt)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    worst = float(np.max(np.abs(got - want) / np.max(np.abs(want), axis=1, keepdims=True)))
    assert worst < 4 * 2.0**-8, worst


def test_a_window_across_kv_chunks_keeps_its_bits_cached_chunked_and_decoded(
    tmp_path: Path,
) -> None:
    """A window of 300 over a 700-token prompt (rows start their window in the middle of
    a KV chunk and skip whole ones): prefilled at once, in 128-token chunks, with 640 of
    its tokens cached, each the same tokens and logits, bit for bit."""
    from reprise.daemon import Engine, SamplingParams

    make("mistral", tmp_path, seed=24, sliding_window=300, max_position_embeddings=1024)
    prompt = np.random.default_rng(9).integers(3, TINY["vocab_size"], size=700).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    outs = []
    for batched in (1024, 128):
        engine = Engine.from_pretrained(tmp_path, backend="numpy", num_device_blocks=128,
                                        block_size=16, max_num_batched_tokens=batched)  # fmt: skip
        outs.append(engine.generate(prompt, params))
    outs.append(engine.generate(prompt, params))
    assert outs[2].cached_tokens >= 640
    for out in outs[1:]:
        assert out.token_ids == outs[0].token_ids
        assert np.array_equal(out.logits.view(np.uint32), outs[0].logits.view(np.uint32))


def test_windowed_requests_give_back_the_blocks_before_their_windows(tmp_path: Path) -> None:
    """Three requests of 320 tokens each on a pool of 20 16-token blocks (one request's
    worth): with full attention they cannot all hold their blocks, and the scheduler
    preempts; with a window of 40 each holds about a window's worth (the blocks before it
    given back, still cached until the pool recycles them, which it soon must) and none
    is preempted. Either way each request's tokens and logits are the ones it gets alone
    on a pool it never fills, bit for bit: no block a query still sees was given back."""
    from reprise.daemon import Engine, SamplingParams

    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, return_logits=True)
    rng = np.random.default_rng(10)
    prompts = [rng.integers(3, TINY["vocab_size"], size=20).tolist() for _ in range(3)]
    preemptions, alone_tokens = {}, {}
    for window in (40, None):
        folder = tmp_path / str(window)
        make("mistral", folder, seed=25, sliding_window=window)
        alone = Engine.from_pretrained(folder, backend="numpy", num_device_blocks=64,
                                       block_size=16)  # fmt: skip
        want = [alone.generate(p, params) for p in prompts]
        alone_tokens[window] = want[0].token_ids
        engine = Engine.from_pretrained(folder, backend="numpy", num_device_blocks=20,
                                        block_size=16)  # fmt: skip
        got = engine.generate(prompts, [params] * 3)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))
        preemptions[window] = engine.scheduler.num_preemptions
    assert preemptions[40] == 0 < preemptions[None]
    # alone on a large pool: it holds at most the window's blocks and two more at any
    # step, and the blocks it gave back stay cached, so a repeat finds its prompt
    engine = Engine.from_pretrained(tmp_path / "40", backend="numpy", num_device_blocks=200,
                                    block_size=16)  # fmt: skip
    request_id = engine.add_request(prompts[0], params)
    seq, most = engine._live[request_id], 0
    while engine.has_work():
        engine.step()
        most = max(most, engine.stats()["used_blocks"])
        if seq.status.name == "RUNNING":  # given back: exactly the blocks before the window
            first_seen = seq.num_computed_tokens - 40 + 1
            assert seq.num_released_blocks == max(
                0, min(first_seen // 16, len(seq.block_hashes) - 1)
            )
    assert engine.take_completion(request_id).token_ids == alone_tokens[40]
    assert most <= 40 // 16 + 3, most
    again = engine.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0.0))
    assert again.cached_tokens >= 16
