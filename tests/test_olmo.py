"""OLMo 2, OLMo 3 and OLMoE against transformers' own classes on the same weights.

OLMo 2's layer normalizes no input: the attention and the MLP read the residual stream
in BF16, and each one's output is RMS-normalized before the residual add (`norm_add`);
its q_norm and k_norm are one RMSNorm over all of a token's query heads and one over all
its key heads (`head_rmsnorm` with weights that long). OLMoE is Llama's layer with those
whole q and k norms and a mixture of experts whose weights are not renormalized. OLMo 3
is OLMo 2's layer with sliding windows on some layers, which rotate by their own
unscaled rope (as Gemma 3's do).
Checked: the logits within the bound of transformers' own BF16 forward, in one chunk
and in four; each part mattering (the whole norms read per head, the post-norms left
out, the router renormalized); bits kept under chunking and reuse; the GPU backend's
forward (emulated here) against NumPy's; the config's refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_gemma3 import matches  # the bound of transformers' own BF16 error
from test_model_reference import (
    TINY,
    hf_logits,
    rel_l2_rows,
    reuse_keeps_bits,
    run_ours,
    save_widened,
)
from test_moe import RouteLog, read_with
from test_moe import far_off as far_off_mean  # past 5 times the mean error
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy, synth_like  # noqa: F401 (a fixture)

from reprise.cuda.dtypes import BF16
from reprise.cuda.rmsnorm import head_rmsnorm_ref, norm_add_ref, rmsnorm_ref
from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

FAMILIES = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # ids below: OLMo's defaults are past TINY's
    # OLMo 3: windows on layers 0-2 of 4 (transformers' default types), a linear scaling on
    # the full layer alone (the sliding ones rotate by the unscaled rope)
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        {
            "num_hidden_layers": 4,
            "sliding_window": 24,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {"num_experts": 6, "num_experts_per_tok": 3, "intermediate_size": 48},
    ),
}


def make(out: Path, family: str, seed: int, **overrides) -> torch.nn.Module:
    config_cls, model_cls, own = FAMILIES[family]
    torch.manual_seed(seed)
    ids = {"eos_token_id": 2, "pad_token_id": 1, "bos_token_id": None}
    config = getattr(transformers, config_cls)(**{**TINY, **ids, **own, **overrides})
    model = save_widened(getattr(transformers, model_cls)(config), out, TINY["vocab_size"])
    if family == "olmoe":  # transformers may start its routers at zero (every logit tied);
        with torch.no_grad():  # these spread a token's weight over several experts
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.05)
        model.to(torch.bfloat16).save_pretrained(out)
        model.float()
    return model


def far_off(ours: np.ndarray, ref: torch.nn.Module, prompt: np.ndarray, err: np.ndarray) -> bool:
    return bool(rel_l2_rows(ours, hf_logits(ref, prompt)).mean() > 5 * err.max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_olmo_models_match_transformers(tmp_path: Path, family: str) -> None:
    ref = make(tmp_path, family, seed=41)
    config = ModelConfig.from_dir(tmp_path)
    assert config.architecture == FAMILIES[family][1]
    assert config.family.qk_norm_whole and config.family.post_norms == (family != "olmoe")
    if family == "olmo3":
        assert config.layer_windows == (24, 24, 24, 0)
        assert config.local_rope_layers == (True, True, True, False)
        saved = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
        assert config.rope_scaling is not None and config.rope_theta == 10_000.0
        assert config.local_rope_theta == saved["sliding_attention"]["rope_theta"]
    assert config.qk_norm_sizes == (config.q_size, config.kv_size)
    matches(tmp_path, ref)
    reuse_keeps_bits(tmp_path, TINY["vocab_size"])


def test_each_part_matters(tmp_path: Path) -> None:
    """Read per head (Qwen3's norms on OLMo's weights: one weight row for every head),
    OLMo 2's q and k norms are far off; so are its post-norms left out (outputs added as
    they come), and OLMoE's router renormalized."""
    from reprise.cuda.backend import NumpyBackend

    path = tmp_path / "olmo2"
    ref = make(path, "olmo2", seed=42)
    _, prompt, err = matches(path, ref)

    def per_head(qkv, q_weight, k_weight, num_heads, eps):
        d = qkv.shape[-1]
        return head_rmsnorm_ref(qkv, q_weight[:d], k_weight[:d], num_heads, eps)

    def unnormed(residual, delta, delta_weight, eps):  # each output added as it came
        return norm_add_ref(residual, None, None, eps) if delta is None else _plain_add(
            residual, delta)  # fmt: skip

    for name, op in (("head_rmsnorm", per_head), ("norm_add", unnormed)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(NumpyBackend, name, staticmethod(op))
            assert far_off(run_ours(path, prompt, [len(prompt)]), ref, prompt, err), name

    path = tmp_path / "olmoe"
    ref = make(path, "olmoe", seed=43)
    experts = ModelConfig.from_dir(path).experts
    assert experts is not None and not experts.normalize and experts.intermediate_size == 48
    _, prompt, err = matches(path, ref)
    assert far_off_mean(read_with({"normalize": True}, path, prompt), ref, prompt, err)


def _plain_add(residual: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    summed = residual.astype(np.float32) + delta.astype(np.float32)
    return summed, summed.astype(BF16)


def test_whole_norms_are_one_rmsnorm_over_the_heads() -> None:
    """The twin's whole form: each token's queries one row of num_heads * head_dim, its
    keys one of kv_heads * head_dim, the values untouched; against float64."""
    rng = np.random.default_rng(3)
    heads, kv, d, tokens = 4, 2, 16, 5
    qkv = rng.standard_normal((tokens, heads + 2 * kv, d)).astype(BF16)
    q_w = (1 + 0.3 * rng.standard_normal(heads * d)).astype(BF16)
    k_w = (1 + 0.3 * rng.standard_normal(kv * d)).astype(BF16)
    out = head_rmsnorm_ref(qkv, q_w, k_w, heads, 1e-6).astype(np.float64)
    x = qkv.astype(np.float64)
    for part, weight, got in (
        (x[:, :heads].reshape(tokens, -1), q_w, out[:, :heads].reshape(tokens, -1)),
        (x[:, heads : heads + kv].reshape(tokens, -1), k_w, out[:, heads : heads + kv].reshape(tokens, -1)),
    ):  # fmt: skip
        want = (
            part / np.sqrt((part**2).mean(axis=1, keepdims=True) + 1e-6) * weight.astype(np.float64)
        )
        assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want) + 1e-30)
    assert np.array_equal(out[:, heads + kv :], x[:, heads + kv :])
    # the residual alone (the first layer's input): the stream rounded once
    residual = rng.standard_normal((3, 8)).astype(np.float32)
    summed, rounded = norm_add_ref(residual, None, None, 1e-6)
    assert np.array_equal(summed, residual) and np.array_equal(rounded, residual.astype(BF16))
    delta = rng.standard_normal((3, 8)).astype(BF16)
    w = (1 + 0.3 * rng.standard_normal(8)).astype(BF16)
    summed, rounded = norm_add_ref(residual, delta, w, 1e-6)
    assert np.array_equal(summed, residual + rmsnorm_ref(delta, w, 1e-6).astype(np.float32))
    assert np.array_equal(rounded, summed.astype(BF16))


@pytest.mark.parametrize("like", ["tiny-olmo2", "tiny-olmoe"])
def test_the_gpu_backend_runs_olmo(
    cupy_kind: str,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
    like: str,
) -> None:
    """CupyBackend (emulated, or a device): the whole q and k norms and the post-norms
    through their kernels give logits within 4 BF16 ulps of NumPy's (up to a token routed
    apart at a near tie, OLMoE's), the same tokens, and decode from CUDA graphs
    bit-identical to eager."""
    folder = synth_like(tmp_path_factory, like, seed=9)
    watch = RouteLog() if like == "tiny-olmoe" else None
    gpu_forward_matches_numpy(cupy_kind, folder, watch=watch)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
    ],
)
def test_refusals(tmp_path: Path, change: dict, message: str) -> None:
    make(tmp_path, "olmoe", seed=44)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dir(tmp_path)
