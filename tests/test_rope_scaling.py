"""Rope scalings beyond Llama 3's (`linear`, `yarn`, `longrope`) and the partial rotary
embedding (Phi-4-mini's `partial_rotary_factor`), against transformers.

- The frequencies and attention factor equal transformers' own ROPE_INIT_FUNCTIONS on
  random settings; the table's passed-through pairs are exactly the identity.
- The permutation of a head's dimensions (weights.py) keeps every q . k of a partial
  rotary embedding: rotated our way, the scores are transformers' rotated its way.
- Models against transformers' classes on the same weights: Llama with linear scaling,
  Qwen2 with YaRN, Phi-3 with LongRoPE and a partial rotary embedding, its short factors
  for a context up to the original one and its long factors past it (then transformers
  uses the long ones for the whole sequence: so does the engine, for every position).
- A `dynamic` (NTK) scaling is plain RoPE within max_position_embeddings, the context,
  as transformers computes it there; an unknown type is refused.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from test_model_reference import TINY, hf_logits, rel_l2_rows, run_ours, save_widened
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy, synth_like  # noqa: F401 (a fixture)

from reprise.cuda.rope import LongRopeScaling, rope_inv_freq, rope_table, rotary_permutation
from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

pytestmark = pytest.mark.reference


def hf_rope(config: transformers.PreTrainedConfig, kind: str, seq_len: int | None = None):
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    return inv_freq.double().numpy(), float(factor)


def ours(raw: dict, max_model_len: int | None = None) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["Phi3ForCausalLM"], **raw}, max_model_len)


@pytest.mark.parametrize("seed", range(4))
def test_frequencies_and_attention_factor_are_transformers(seed: int) -> None:
    rng = np.random.default_rng(seed)
    heads, head_dim = 4, int(rng.choice([32, 64, 128]))
    partial = float(rng.choice([1.0, 0.75, 0.5]))
    rotated = int(head_dim * partial)
    original = int(rng.choice([256, 4096]))
    base = dict(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
                rope_theta=float(rng.choice([1e4, 1e6])), partial_rotary_factor=partial,
                max_position_embeddings=original * int(rng.choice([2, 8, 32])),
                original_max_position_embeddings=original)  # fmt: skip
    cases = {
        "linear": {"factor": float(rng.uniform(1.5, 8))},
        "yarn": {"factor": float(rng.uniform(1.5, 8)), "beta_fast": float(rng.choice([16, 32])),
                 "truncate": bool(rng.integers(2)),
                 **({"mscale": 0.707, "mscale_all_dim": 1.0} if rng.integers(2) else {})},
        "longrope": {"short_factor": list(rng.uniform(1, 3, rotated // 2)),
                     "long_factor": list(rng.uniform(2, 40, rotated // 2))},
    }  # fmt: skip
    for kind, params in cases.items():
        if kind == "yarn":
            params["original_max_position_embeddings"] = original
        rope = {"rope_type": kind, **params}
        if kind == "longrope":  # Phi-3's config takes only longrope
            hf = transformers.Phi3Config(**base, rope_scaling=rope)
        else:  # Llama's reads the partial factor from its rope parameters
            rope["partial_rotary_factor"] = partial
            hf = transformers.LlamaConfig(**base, rope_scaling=rope)
        for max_model_len, seq_len in [
            (None, None),
            (base["max_position_embeddings"], original + 1),
        ]:
            config = ours({**base, "vocab_size": 10, "intermediate_size": 8, "num_hidden_layers": 1,
                           "rope_scaling": rope}, max_model_len)  # fmt: skip
            want, want_factor = hf_rope(hf, kind, seq_len)
            got = rope_inv_freq(rotated, hf.rope_parameters["rope_theta"], config.rope_scaling)
            assert np.allclose(got, want, rtol=2e-6, atol=0), (kind, max_model_len)
            cos, sin = rope_table(
                head_dim, 8, hf.rope_parameters["rope_theta"], config.rope_scaling, rotated
            )
            assert cos[0, 0] == np.float32(want_factor), kind  # cos 0 times the factor
            assert (cos[:, rotated // 2 :] == 1).all() and (sin[:, rotated // 2 :] == 0).all()
            if kind == "longrope":
                assert config.rope_scaling.long == (max_model_len is not None)
                context = base["max_position_embeddings"] if max_model_len else original
                assert config.max_position_embeddings == context


def test_the_permuted_partial_rotation_keeps_every_score(rng: np.random.Generator) -> None:
    """transformers' partial rotation (pairs i, i + r/2 of the first r dimensions, the
    rest passed through) against ours on the permuted dimensions: the same q . k."""
    head_dim, rotated, positions = 16, 12, np.arange(40)
    inv_freq = rope_inv_freq(rotated, 1e4, None)
    angles = positions[:, None] * inv_freq[None]  # [T, r/2]

    def theirs(x: np.ndarray) -> np.ndarray:
        r, half = x[:, :rotated], rotated // 2
        x1, x2 = r[:, :half], r[:, half:]
        c, s = np.cos(angles), np.sin(angles)
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[:, rotated:]], axis=1)

    cos, sin = rope_table(head_dim, len(positions), 1e4, None, rotated)

    def ours_rotated(x: np.ndarray) -> np.ndarray:
        half = head_dim // 2
        x1, x2 = x[:, :half], x[:, half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)

    order = rotary_permutation(head_dim, rotated)
    assert sorted(order) == list(range(head_dim))
    q, k = rng.standard_normal((2, len(positions), head_dim))
    want = theirs(q) @ theirs(k).T
    got = ours_rotated(q[:, order]) @ ours_rotated(k[:, order]).T
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
    # the checkpoint's order as it is would be another rotation
    assert not np.allclose(ours_rotated(q) @ ours_rotated(k).T, want, rtol=1e-2, atol=1e-2)


PHI3 = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip
ORIGINAL = 64  # the LongRoPE model's original context: its long factors past it
# twice the original: an attention factor of 1.08 (1.22 at 512, which scales the scores by
# 1.5 and transformers' own BF16 forward's rounding with them)
LONG = 128


def make_phi4_mini_like(out: Path, seed: int, **overrides) -> torch.nn.Module:
    """A tiny Phi-3 with Phi-4-mini's features: 3/4 of each head rotated, LongRoPE."""
    rng = np.random.default_rng(seed)
    rotated = int(16 * 0.75)
    rope = {"rope_type": "longrope", "short_factor": list(rng.uniform(1, 2, rotated // 2)),
            "long_factor": list(rng.uniform(2, 30, rotated // 2))}  # fmt: skip
    torch.manual_seed(seed)
    config = transformers.Phi3Config(**{**PHI3, "partial_rotary_factor": 0.75,
                                        "max_position_embeddings": LONG,
                                        "original_max_position_embeddings": ORIGINAL,
                                        "rope_scaling": rope, **overrides})  # fmt: skip
    return save_widened(transformers.Phi3ForCausalLM(config), out, PHI3["vocab_size"])


def check_close(ours_logits: np.ndarray, ref: torch.nn.Module, prompt: np.ndarray) -> float:
    """Our logits against `ref`'s fp32 ones: within test_model_reference's bound, or
    within 1.5 times the error of transformers' own BF16 forward of the same weights
    (LongRoPE's factors and attention factor sharpen this random model's attention, and
    every rounding error with it; ours round in other places than transformers' BF16
    forward: the rotated queries and keys here, cos and sin there). A wrong rotation is
    far past either (the tests check). Returns the error."""
    want = hf_logits(ref, prompt)
    with torch.no_grad():
        own = copy.deepcopy(ref).to(torch.bfloat16)
        own_bf16 = own(torch.tensor(prompt[None], dtype=torch.long)).logits[0].float().numpy()
    err = rel_l2_rows(ours_logits, want)
    assert err.max() < max(2e-2, 1.5 * rel_l2_rows(own_bf16, want).max()), err.max()
    assert (ours_logits.argmax(-1) == want.argmax(-1)).mean() > 0.95
    return float(err.max())


def test_partial_rotary_longrope_matches_transformers_short_and_long(tmp_path: Path) -> None:
    ref = make_phi4_mini_like(tmp_path, seed=31)
    rng = np.random.default_rng(5)
    # up to the original context: the short factors, the context stopping there
    short = rng.integers(0, PHI3["vocab_size"], size=ORIGINAL)
    config = ModelConfig.from_dir(tmp_path)
    assert config.rotary_dim == 12 and config.max_position_embeddings == ORIGINAL
    err = check_close(run_ours(tmp_path, short, [ORIGINAL]), ref, short)
    # past it (an engine of a longer max_model_len): the long factors at every position,
    # as transformers uses them for a sequence that long
    long = rng.integers(0, PHI3["vocab_size"], size=LONG)
    got = run_ours(tmp_path, long, [LONG], max_model_len=LONG)
    check_close(got, ref, long)
    assert np.array_equal(run_ours(tmp_path, long, [20, 64, 44], max_model_len=LONG).view(np.uint32),
                          got.view(np.uint32))  # fmt: skip
    # each part matters: no permutation (rotating the checkpoint's pairs) is far off
    from reprise.daemon.model import weights

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights, "_rotary_ordered", lambda w, c: None)
        unordered = run_ours(tmp_path, short, [ORIGINAL])
    assert rel_l2_rows(unordered, hf_logits(ref, short)).mean() > 5 * err


def test_the_long_factors_are_another_model_to_the_cache(tmp_path: Path) -> None:
    """The engine picks the list from its max_model_len; the fingerprint (the disk
    tier's key) tells the two apart, and a longer max_model_len than the model's is
    refused."""
    from reprise.daemon import Engine
    from reprise.daemon.model.fingerprint import model_fingerprint

    make_phi4_mini_like(tmp_path, seed=32)
    short = Engine.from_pretrained(tmp_path, backend="numpy", num_device_blocks=16)
    long = Engine.from_pretrained(tmp_path, backend="numpy", num_device_blocks=16,
                                  max_model_len=100)  # fmt: skip
    assert short.max_model_len == ORIGINAL and long.max_model_len == 100
    assert isinstance(long.config.rope_scaling, LongRopeScaling) and long.config.rope_scaling.long
    fingerprints = {model_fingerprint(tmp_path, e.config) for e in (short, long)}
    assert len(fingerprints) == 2 and model_fingerprint(tmp_path) in fingerprints
    from reprise.daemon.engine.config import SettingError

    with pytest.raises(SettingError, match=rf"max_model_len must be in \[2, {LONG}\]"):
        Engine.from_pretrained(tmp_path, backend="numpy", max_model_len=LONG + 1)


@pytest.mark.parametrize(
    ("family", "rope"),
    [
        ("llama", {"rope_type": "linear", "factor": 4.0}),
        ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
        ("qwen2", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                   "beta_fast": 16.0, "truncate": False}),
    ],
    ids=["llama-linear", "qwen2-yarn", "qwen2-yarn-untruncated"],
)  # fmt: skip
def test_static_scalings_match_transformers(tmp_path: Path, family: str, rope: dict) -> None:
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(33)
    hf = config_class(**{**TINY, "rope_scaling": rope})
    ref = save_widened(model_class(hf), tmp_path, TINY["vocab_size"])
    prompt = np.random.default_rng(6).integers(0, TINY["vocab_size"], size=150)
    err = check_close(run_ours(tmp_path, prompt, [150]), ref, prompt)
    # the scaling matters: without it transformers is far from us
    plain = config_class(**{**TINY})
    unscaled = model_class(plain)
    unscaled.load_state_dict(ref.state_dict())
    far = rel_l2_rows(run_ours(tmp_path, prompt, [150]), hf_logits(unscaled.eval(), prompt))
    assert far.mean() > 5 * err


def test_dynamic_scaling_is_plain_rope_within_the_context(tmp_path: Path) -> None:
    """transformers scales a `dynamic` model's frequencies only past max_position_embeddings,
    which is where the engine's context stops: within it the model is plain RoPE's (no
    scaling in its config), and transformers' dynamic model agrees."""
    torch.manual_seed(39)
    rope = {"rope_type": "dynamic", "factor": 2.0}
    ref = save_widened(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, rope_scaling=rope)),
                       tmp_path, TINY["vocab_size"])  # fmt: skip
    config = ModelConfig.from_dir(tmp_path)
    assert (
        config.rope_scaling is None
        and config.max_position_embeddings == TINY["max_position_embeddings"]
    )
    prompt = np.random.default_rng(11).integers(0, TINY["vocab_size"], size=150)
    check_close(run_ours(tmp_path, prompt, [150]), ref, prompt)


def test_unknown_scalings_and_bad_factors_are_refused() -> None:
    base = {**PHI3, "vocab_size": 10}
    with pytest.raises(ModelConfigError, match="'proportional' is not supported"):
        ours({**base, "rope_scaling": {"rope_type": "proportional", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="factor must be a finite number > 0"):
        ours({**base, "rope_scaling": {"rope_type": "dynamic", "factor": -2.0}})
    bad = {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8,
           "original_max_position_embeddings": 64}  # fmt: skip
    with pytest.raises(ModelConfigError, match="short_factor must hold 8 finite numbers"):
        ours({**base, "rope_scaling": bad})
    with pytest.raises(ModelConfigError, match="lacks 'original_max_position_embeddings'"):
        ours({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="must be even"):
        ours({**base, "partial_rotary_factor": 0.2})  # int(16 x 0.2): 3 dimensions


@pytest.fixture(scope="module")
def phi4_mini_d64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phi-3 of head_dim 64 (the attention kernels take 64 and 128) with 48 of each
    head's dimensions rotated and LongRoPE factors."""
    rng = np.random.default_rng(34)
    rope = {
        "rope_type": "longrope",
        "short_factor": list(rng.uniform(1, 2, 24)),
        "long_factor": list(rng.uniform(2, 30, 24)),
        "original_max_position_embeddings": 2048,
    }
    folder = synth_like(tmp_path_factory, "tiny-phi3", seed=7, partial_rotary_factor=0.75,
                        rope_scaling=rope)  # fmt: skip
    config = ModelConfig.from_dir(folder)
    assert config.rotary_dim == 48 and isinstance(config.rope_scaling, LongRopeScaling)
    return folder


def test_the_gpu_backend_runs_a_partial_rotary_longrope_model(
    cupy_kind: str,  # noqa: F811
    phi4_mini_d64: Path,
) -> None:
    gpu_forward_matches_numpy(cupy_kind, phi4_mini_d64)


def test_a_phi3_gguf_with_longrope_and_partial_rotary_converts(tmp_path: Path) -> None:
    """Phi-4-mini's GGUF (llama.cpp's layout: rope dimension 3/4 of the key length, the
    factor lists as rope_factors_{long,short}.weight, the original context as
    rope.scaling.original_context_length): the converted folder's config is the source
    model's, and its logits are the source model's (within the BF16 bound)."""
    from test_gguf_families import gguf_of, hf_source

    from reprise.daemon.model.gguf_convert import convert_gguf

    rng = np.random.default_rng(35)
    short, long = rng.uniform(1, 2, 6), rng.uniform(2, 30, 6)  # 12 of 16 dimensions rotated
    rope = {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long)}
    source = hf_source("phi3", 36, tie_word_embeddings=False, partial_rotary_factor=0.75,
                       original_max_position_embeddings=ORIGINAL, rope_scaling=rope)  # fmt: skip
    path = gguf_of(tmp_path / "p.gguf", "phi3", source, "llama-bpe", quantized=False,
                   extra={"rope_factors_long.weight": long.astype(np.float32),
                          "rope_factors_short.weight": short.astype(np.float32)},
                   **{"phi3.rope.dimension_count": 12,
                      "phi3.rope.scaling.original_context_length": ORIGINAL})  # fmt: skip
    convert_gguf(path, tmp_path / "out", progress=False)
    config = ModelConfig.from_dir(tmp_path / "out")
    assert config.rotary_dim == 12 and config.max_position_embeddings == ORIGINAL
    assert np.allclose(config.rope_scaling.factors, short.astype(np.float32), rtol=0)
    prompt = np.random.default_rng(7).integers(0, source.config.vocab_size, size=ORIGINAL)
    check_close(run_ours(tmp_path / "out", prompt, [ORIGINAL]), source, prompt)


def test_a_yarn_gguf_converts(tmp_path: Path) -> None:
    """A qwen2 file with llama.cpp's yarn keys: the folder's config has transformers' yarn
    scaling, and its logits are the source model's."""
    from test_gguf_families import gguf_of, hf_source

    from reprise.daemon.model.gguf_convert import convert_gguf

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    source = hf_source("qwen2", 37, tie_word_embeddings=True, rope_scaling=dict(rope))
    path = gguf_of(tmp_path / "q.gguf", "qwen2", source, "qwen2", quantized=False,
                   **{"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                      "qwen2.rope.scaling.original_context_length": 64})  # fmt: skip
    convert_gguf(path, tmp_path / "out", progress=False)
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["rope_scaling"] == rope
    prompt = np.random.default_rng(8).integers(0, source.config.vocab_size, size=150)
    check_close(run_ours(tmp_path / "out", prompt, [150]), source, prompt)


def test_hf_overrides_turn_yarn_on_as_the_config_would(tmp_path: Path) -> None:
    """--hf-overrides (vLLM's) replaces config.json fields before the model loads: YaRN
    given that way runs as YaRN in config.json does (the same tokens and logits, bit for
    bit), the context is the original one stretched by the factor (vLLM's rule), and the
    fingerprint (the disk tier's key) tells the two configs of the one folder apart."""
    from reprise.daemon import Engine, SamplingParams
    from reprise.daemon.model.fingerprint import model_fingerprint

    torch.manual_seed(38)
    plain = save_widened(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)),
                         tmp_path / "plain", TINY["vocab_size"])  # fmt: skip
    del plain
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    written = tmp_path / "written"
    written.mkdir()
    from reprise.daemon.model.synth import write_tokenizer

    write_tokenizer(tmp_path / "plain", TINY["vocab_size"])
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (tmp_path / "plain" / name).is_file():
            (written / name).write_bytes((tmp_path / "plain" / name).read_bytes())
    raw = json.loads((tmp_path / "plain" / "config.json").read_text())
    (written / "config.json").write_text(json.dumps({**raw, "rope_scaling": rope}))
    prompt = np.random.default_rng(9).integers(3, TINY["vocab_size"], size=150).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    overridden = Engine.from_pretrained(tmp_path / "plain", backend="numpy",
                                        hf_overrides=json.dumps({"rope_scaling": rope}))  # fmt: skip
    in_file = Engine.from_pretrained(written, backend="numpy")
    assert overridden.max_model_len == in_file.max_model_len == 512
    a, b = overridden.generate(prompt, params), in_file.generate(prompt, params)
    assert a.token_ids == b.token_ids and np.array_equal(
        a.logits.view(np.uint32), b.logits.view(np.uint32)
    )
    plain_engine = Engine.from_pretrained(tmp_path / "plain", backend="numpy")
    assert not np.array_equal(plain_engine.generate(prompt, params).logits, a.logits)
    folder = tmp_path / "plain"
    assert model_fingerprint(folder, None, {"rope_scaling": rope}) != model_fingerprint(folder)
