"""Gemma 3 (`Gemma3ForCausalLM`, text) against transformers' own class on the same weights.

Gemma 3's layer differs from Llama's in five ways, each tested to matter:
- its RMSNorms scale by (1 + w) (weights._unit_offset_norms: 1 + w rounded to BF16 once);
- the attention's and the MLP's outputs are each normalized before their residual add
  (sandwich norms);
- its MLP is GELU (tanh) gated, not SiLU (gelu_tanh_mul);
- its embedding is scaled by sqrt(hidden_size) in BF16 (embed's `scale`);
- its sliding layers rotate by their own base (rope_local_base_freq, unscaled), the full
  layers by rope_theta with rope_scaling (linear, factor 8 for the 4B and larger).
Its attention scale is query_pre_attn_scalar ** -0.5, and each query and key head is
normalized (Qwen3's head_rmsnorm). Each within test_model_reference's bound in one chunk
and in four, windows binding; chunked and cached bits kept; the GPU backend (emulated)
runs it, at head_dim 64 and at Gemma's own 256.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_model_reference import (
    TINY,
    hf_logits,
    rel_l2_rows,
    reuse_keeps_bits,
    run_ours,
)
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy, synth_like  # noqa: F401 (a fixture)

from reprise.daemon.model import weights
from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# three layers: sliding, full, sliding, a window of 40 over a 150-token prompt
GEMMA = {
    **TINY,
    **IDS,
    "sliding_window": 40,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 24,
}


def make(out: Path, seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**{**GEMMA, **overrides})
    return save_gemma(transformers.Gemma3ForCausalLM(config), out)


def save_gemma(model: torch.nn.Module, out: Path) -> torch.nn.Module:
    """save_widened, but each norm weight w drawn around 0, as Gemma's (1 + w) are
    trained: save_widened's, around 1, double every query and key and make the attention
    so sharp that transformers' own BF16 forward strays past the bound."""
    from reprise.daemon.model.synth import write_tokenizer

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.copy_(0.1 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    write_tokenizer(out, TINY["vocab_size"])
    return model.float().eval()


PROMPT_SEED, PROMPT_LEN = 7, 150


def matches(
    path: Path, ref: torch.nn.Module, near_ties: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """test_model_reference.matches_transformers, its bound the larger of 2e-2 and 1.5 times
    the error of transformers' own BF16 forward (Gemma's (1 + w), rounded to BF16 here,
    and its scaled embedding leave this tiny model's own BF16 error near 2e-2). Rows in
    `near_ties` (a mixture of experts' rows whose router logits sit on a near tie, where
    BF16 rounding picks the expert in either implementation) are left out of the largest
    error, not of the mean or the argmax."""
    prompt = np.random.default_rng(PROMPT_SEED).integers(0, TINY["vocab_size"], size=PROMPT_LEN)
    kept = np.ones(len(prompt), bool)
    if near_ties is not None:
        kept[near_ties] = False
    want = hf_logits(ref, prompt)
    with torch.no_grad():
        own = ref.to(torch.bfloat16)(torch.tensor(prompt[None])).logits[0].float().numpy()
        ref.float()
    own_err = rel_l2_rows(own, want)
    for chunks in ([150], [1, 40, 64, 45]):
        ours = run_ours(path, prompt, chunks)
        err = rel_l2_rows(ours, want)
        assert err[kept].max() < max(2e-2, 1.5 * own_err.max()), (err.max(), own_err.max())
        assert err.mean() < 1.5 * own_err.mean(), (err.mean(), own_err.mean())
        assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.95
    return ours, prompt, err


def far_off(ours: np.ndarray, ref: torch.nn.Module, prompt: np.ndarray, err: np.ndarray) -> bool:
    return bool(rel_l2_rows(ours, hf_logits(ref, prompt)).mean() > 5 * err.max())


def test_gemma3_matches_transformers(tmp_path: Path) -> None:
    ref = make(tmp_path, seed=61)
    config = ModelConfig.from_dir(tmp_path)
    assert config.architecture == "Gemma3ForCausalLM" and config.activation == "gelu_tanh"
    assert config.layer_windows == (40, 0, 40)
    assert config.local_rope_layers == (True, False, True)
    assert config.attention_scale == pytest.approx(24**-0.5)
    assert config.embed_scale == pytest.approx(96**0.5)
    _, prompt, err = matches(tmp_path, ref)
    # the windows and the attention scale matter: read without them, far off
    for change in ({"layer_types": ["full_attention"] * 3}, {"query_pre_attn_scalar": 16}):
        other = tmp_path / f"other{len(change)}{next(iter(change))}"
        other.mkdir()
        for f in tmp_path.iterdir():
            if f.is_file():
                (other / f.name).write_bytes(f.read_bytes())
        raw = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**raw, **change}))
        assert far_off(run_ours(other, prompt, [len(prompt)]), ref, prompt, err), change
    reuse_keeps_bits(tmp_path, TINY["vocab_size"])


def _without(step: str, mp: pytest.MonkeyPatch) -> None:
    """Take one of Gemma's own steps out of the NumPy forward."""
    from reprise.cuda.activation import silu_mul_ref
    from reprise.cuda.backend import NumpyBackend
    from reprise.cuda.embedding import embed_ref
    from reprise.cuda.rmsnorm import add_rmsnorm_ref

    if step == "unit offset norms":
        mp.setattr(weights, "_unit_offset_norms", lambda w: None)
    elif step == "sandwich norms":  # the outputs added as they are
        plain = lambda r, d, dw, w, eps: add_rmsnorm_ref(r, d, w, eps)  # noqa: E731
        mp.setattr(NumpyBackend, "norm_add_rmsnorm", staticmethod(plain))
    elif step == "gelu":
        mp.setattr(NumpyBackend, "gelu_tanh_mul", staticmethod(silu_mul_ref))
    elif step == "embedding scale":
        embed = lambda table, ids, rows=None, scale=None: embed_ref(table, ids, rows)  # noqa: E731
        mp.setattr(NumpyBackend, "embed", staticmethod(embed))


@pytest.mark.parametrize("step", ["unit offset norms", "sandwich norms", "gelu", "embedding scale"])
def test_each_of_gemmas_steps_matters(tmp_path: Path, step: str) -> None:
    """Without one of Gemma's own steps, far from transformers (where with it, within
    the bound)."""
    ref = make(tmp_path, seed=62)
    _, prompt, err = matches(tmp_path, ref)
    with pytest.MonkeyPatch.context() as mp:
        _without(step, mp)
        assert far_off(run_ours(tmp_path, prompt, [len(prompt)]), ref, prompt, err)


def test_the_full_layers_scaling_and_the_local_base(tmp_path: Path) -> None:
    """Linear scaling (the 4B's factor 8) applies to the full layers only, and the sliding
    layers rotate by rope_local_base_freq: both against transformers, and a long prompt's
    window past the local base's period."""
    ref = make(tmp_path, seed=63, rope_scaling={"rope_type": "linear", "factor": 8.0},
               rope_local_base_freq=500.0, rope_theta=20000.0)  # fmt: skip
    config = ModelConfig.from_dir(tmp_path)
    assert config.local_rope_theta == 500.0 and config.rope_theta == 20000.0
    assert config.max_position_embeddings == TINY["max_position_embeddings"]  # not stretched
    _, prompt, err = matches(tmp_path, ref)
    with pytest.MonkeyPatch.context() as mp:  # every layer by the full layers' tables
        import dataclasses

        from reprise.daemon.model import llama

        original = llama.LlamaModel.__init__

        def init(self, config, w, backend):
            original(self, dataclasses.replace(config, local_rope_layers=None), w, backend)

        mp.setattr(llama.LlamaModel, "__init__", init)
        assert far_off(run_ours(tmp_path, prompt, [len(prompt)]), ref, prompt, err)


def test_both_rope_layouts_read_alike(tmp_path: Path) -> None:
    """transformers 4's keys (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern) and transformers 5's (rope_parameters by layer type,
    layer_types) give one config."""
    base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **TINY, **IDS,
            "num_hidden_layers": 7, "sliding_window": 32, "query_pre_attn_scalar": 16}  # fmt: skip
    base.pop("rope_theta")
    old = {**base, "rope_theta": 30000.0, "rope_local_base_freq": 700.0,
           "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "sliding_window_pattern": 3}  # fmt: skip
    new = {
        **base,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 30000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 700.0},
        },
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2
        + ["sliding_attention"],
    }
    assert ModelConfig.from_dict(old) == ModelConfig.from_dict(new)
    # and transformers' own reading of the old keys writes the new ones
    saved = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "architectures"})
    assert ModelConfig.from_dict({**saved.to_dict(), "architectures": ["Gemma3ForCausalLM"]}) == (
        ModelConfig.from_dict(old)
    )


def test_what_the_forward_lacks_is_refused() -> None:
    gemma = {"architectures": ["Gemma3ForCausalLM"], **TINY}
    for change, message in [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"layer_types": ["chunked_attention"] * 3}, "chunked_attention"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}}, "sliding layers"),
    ]:
        with pytest.raises(ModelConfigError, match=message):
            ModelConfig.from_dict({**gemma, **change})


def test_a_multimodal_gemma3s_language_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration (the 4B, 12B and 27B): its text_config (the fields
    it omits at transformers' defaults) and its language model's weights, read from the
    checkpoint transformers writes; the same text logits as its own forward on ids."""
    text = {k: v for k, v in GEMMA.items() if k not in IDS}
    text.pop("layer_types")
    text["sliding_window_pattern"] = 2  # sliding, full, sliding
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    torch.manual_seed(64)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, **IDS)  # fmt: skip
    ref = save_gemma(transformers.Gemma3ForConditionalGeneration(config), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForConditionalGeneration"]
    # the released configs give only what differs from the defaults
    defaults = transformers.Gemma3TextConfig().to_dict()
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if v != defaults.get(k)}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = ModelConfig.from_dir(tmp_path)
    assert ours.architecture == "Gemma3ForCausalLM" and ours.layer_windows == (40, 0, 40)
    assert ours.num_heads == 6 and ours.head_dim == 16
    matches(tmp_path, ref)


def test_the_synthetic_gemma_3_1b_has_its_parameters() -> None:
    from reprise.daemon.model.synth import synth_config

    config = synth_config("gemma-3-1b")
    assert config.num_parameters() == 999_885_952  # gemma-3-1b-it's count
    assert config.layer_windows.count(512) == 22 and config.local_rope_layers.count(False) == 4


@pytest.fixture(scope="module", params=[64, 256])
def gemma_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 of head_dim 64 or 256 (Gemma's own)."""
    head_dim = request.param
    return synth_like(tmp_path_factory, "tiny-gemma3", seed=9, head_dim=head_dim,
                      num_attention_heads=256 // head_dim * 2, num_key_value_heads=1)  # fmt: skip


def test_the_gpu_backend_runs_gemma3(cupy_kind: str, gemma_folder: Path) -> None:  # noqa: F811
    gpu_forward_matches_numpy(cupy_kind, gemma_folder)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_a_gemma_gguf_converts_as_transformers_reads_it(tmp_path: Path, arch: str) -> None:
    """A gemma3 (or gemma2) GGUF, written as llama.cpp's converter writes one (its tensor
    names, every norm weight stored as 1 + w, Q8_0 matrices; the sliding pattern, the local
    rope base and the score scale left to llama.cpp's code; gemma2's caps in the metadata):
    converted, the weights are transformers' own reading of the file bit for bit once
    rounded to BF16, and the logits its forward's within the bound above; seven layers, so
    gemma3's sixth is full."""
    import ml_dtypes
    from gguf_support import write_gguf
    from test_gguf_families import TOKENS, _tokenizer_kv

    from reprise.daemon.model.gguf_convert import convert_gguf
    from reprise.daemon.model.safetensors_io import load_safetensors

    torch.manual_seed(65)
    config_class, model_class = {
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=7,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=16,
        max_position_embeddings=256, **IDS,
    )  # fmt: skip
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.copy_(0.1 * torch.randn_like(p))
    model = model.to(torch.bfloat16).float()
    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    tensors = {}
    for name, value in model.state_dict().items():
        value = value.numpy()
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("norm.weight"):
            value = value + np.float32(1.0)  # llama.cpp's norm_shift
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = value
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = value
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            tensors[f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"] = value
    kv = {
        "block_count": 7, "context_length": 256, "embedding_length": 64,
        "feed_forward_length": 128, "attention.head_count": 2, "attention.head_count_kv": 1,
        "attention.key_length": 256, "attention.value_length": 256,
        "rope.freq_base": float(config.rope_parameters.get("rope_theta", 1e6))
        if arch == "gemma2" else 1e6,
        "attention.layer_norm_rms_epsilon": 1e-6, "attention.sliding_window": 16,
    }  # fmt: skip
    if arch == "gemma2":
        kv |= {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    kv = {f"{arch}.{k}": v for k, v in kv.items()} | _tokenizer_kv("llama-bpe")
    source = write_gguf(tmp_path / "model.gguf", arch, kv, tensors)
    out = tmp_path / "out"
    convert_gguf(source, out, progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    ours = load_safetensors(out / "model.safetensors")
    theirs = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    theirs.pop("lm_head.weight")
    assert sorted(ours) == sorted(theirs)
    for name, weight in ours.items():
        expected = theirs[name].astype(ml_dtypes.bfloat16)
        assert np.array_equal(weight.view(np.uint16), expected.view(np.uint16)), name
    read = ModelConfig.from_dir(out)
    windows = (16, 0, 16, 0, 16, 0, 16) if arch == "gemma2" else (16,) * 5 + (0, 16)
    assert read.layer_windows == windows and read.attention_scale == 256**-0.5
    assert (read.attn_softcap, read.final_softcap) == (
        (50.0, 30.0) if arch == "gemma2" else (None, None)
    )
    prompt = np.random.default_rng(5).integers(0, len(TOKENS), 40)
    want = hf_logits(reference, prompt)
    with torch.no_grad():
        own = reference.to(torch.bfloat16)(torch.tensor(prompt[None])).logits[0].float().numpy()
    bound = max(2e-2, 1.5 * rel_l2_rows(own, want).max())
    for chunks in ([40], [7, 20, 13]):
        assert rel_l2_rows(run_ours(out, prompt, chunks), want).max() < bound, chunks
