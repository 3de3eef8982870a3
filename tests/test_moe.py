"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers' own
classes on the same weights, and the routing's twin against torch's.

A sparse layer's MLP is the router, the k experts each token picks and their weighted
sum (cuda/moe.py); Qwen2-MoE adds a sigmoid-gated shared expert, and Qwen's configs may
keep layers dense. Checked: the logits within the bound of transformers' own BF16
forward (a token whose router sees a near tie may take another expert in BF16 than in
fp32, in either forward), in one chunk and in four; each part mattering (the routing's
normalization, the shared expert, the weights of the chosen experts); bits kept under
chunking and reuse; the config's reading and refusals.
"""

from __future__ import annotations

import dataclasses
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
from test_qwen2 import cupy_kind, gpu_forward_matches_numpy, synth_like  # noqa: F401 (a fixture)

from reprise.cuda.dtypes import BF16
from reprise.cuda.moe import moe_combine_ref, moe_route_ref
from reprise.daemon.model.config import ModelConfig, ModelConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

MOE = {**TINY, "num_experts_per_tok": 2}
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 6,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 80,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    ),
    # Granite's four scalars as Granite 3.1's MoE models set them
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        {
            "num_local_experts": 5,
            "num_experts_per_tok": 2,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0625,
            "logits_scaling": 6.0,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "moe_intermediate_size": 40,
            "norm_topk_prob": True,
            "num_experts_per_tok": 3,
        },
    ),
}


def make(out: Path, family: str, seed: int, **overrides) -> torch.nn.Module:
    config_cls, model_cls, own = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**MOE, **own, **overrides})
    return save_widened(getattr(transformers, model_cls)(config), out, TINY["vocab_size"])


def far_off(ours: np.ndarray, ref: torch.nn.Module, prompt: np.ndarray, err: np.ndarray) -> bool:
    return bool(rel_l2_rows(ours, hf_logits(ref, prompt)).mean() > 5 * err.mean())


def read_with(config_change: dict, path: Path, prompt: np.ndarray) -> np.ndarray:
    """Our logits with the experts' config changed as given (a part left out)."""
    from reprise.daemon.model import llama

    original = llama.LlamaModel.__init__

    def init(self, config, w, backend):
        experts = dataclasses.replace(config.experts, **config_change)
        original(self, dataclasses.replace(config, experts=experts), w, backend)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama.LlamaModel, "__init__", init)
        return run_ours(path, prompt, [len(prompt)])


def tie_gaps(logits: np.ndarray, k: int) -> np.ndarray:
    """Each row's k-th largest router logit less its (k+1)-th, in BF16 ulps of the row's
    largest magnitude: a gap of a few is a near tie, where rounding picks the expert."""
    rows = np.asarray(logits, np.float64)
    top = -np.sort(-rows, axis=1)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(rows).max(axis=1))) - 7)
    return (top[:, k - 1] - top[:, k]) / ulp


def near_tie_rows(path: Path, ulps: int = 1) -> np.ndarray:
    """The prompt rows (test_gemma3.matches' prompt) whose router logits, at some layer of
    a NumPy forward, put the k-th and (k+1)-th largest within `ulps` BF16 ulps of the
    largest: there BF16 rounding picks the expert, in transformers' BF16 forward and ours."""
    from test_gemma3 import PROMPT_LEN, PROMPT_SEED

    from reprise.cuda.backend import NumpyBackend

    prompt = np.random.default_rng(PROMPT_SEED).integers(0, TINY["vocab_size"], size=PROMPT_LEN)
    rows: set[int] = set()
    route = NumpyBackend.moe_route

    def recorded(logits, k: int, normalize: bool):  # type: ignore[no-untyped-def]
        gaps = tie_gaps(np.asarray(logits).view(BF16), k)
        rows.update(np.flatnonzero(gaps <= ulps).tolist())
        return route(logits, k, normalize)  # moe_route_ref, a static method

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NumpyBackend, "moe_route", staticmethod(recorded))
        run_ours(path, prompt, [len(prompt)])
    return np.array(sorted(rows), np.int64)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_models_match_transformers(tmp_path: Path, family: str) -> None:
    ref = make(tmp_path, family, seed=31)
    config = ModelConfig.from_dir(tmp_path)
    assert config.experts is not None and config.architecture == FAMILIES[family][1]
    ties = near_tie_rows(tmp_path)
    assert len(ties) < 0.2 * 150, ties  # a few rows, not the prompt (1 ulp: adjacent values)
    _, prompt, err = matches(tmp_path, ref, ties)
    reuse_keeps_bits(tmp_path, TINY["vocab_size"])
    # the weights of the chosen experts matter: all equal is far off
    assert far_off(read_with({"top_k": 1}, tmp_path, prompt), ref, prompt, err)


def test_the_parts_of_each_layout(tmp_path: Path) -> None:
    """Qwen2-MoE's layers 0 and 2 sparse, 1 dense (mlp_only_layers); its shared expert
    and unnormalized weights; Qwen3-MoE's normalized ones; Mixtral's always normalized.
    Reading Qwen3-MoE's weights unnormalized is far off, and so is Qwen2-MoE's
    normalized (they differ: the chosen 2 of 6 experts' probabilities sum below 1)."""
    for family, normalize in (("mixtral", True), ("qwen2_moe", False), ("qwen3_moe", True)):
        path = tmp_path / family
        ref = make(path, family, seed=32)
        experts = ModelConfig.from_dir(path).experts
        assert experts is not None and experts.normalize is normalize
        if family == "qwen2_moe":
            assert experts.sparse_layers == (True, False, True)
            assert experts.shared_intermediate_size == 80
            _, prompt, err = matches(path, ref)
            assert far_off(read_with({"normalize": True}, path, prompt), ref, prompt, err)
        if family == "qwen3_moe":
            _, prompt, err = matches(path, ref)
            assert far_off(read_with({"normalize": False}, path, prompt), ref, prompt, err)


def test_the_routing_twin_picks_torchs_experts_and_weights(rng: np.random.Generator) -> None:
    """moe_route_ref against transformers' router steps in float64 (softmax, topk, the
    division): the same experts wherever the k-th and (k+1)-th logits differ, weights
    within an fp32 ulp; ties to the lower id; the grouped rows sorted by expert, then
    token."""
    logits = (rng.standard_normal((50, 16)) * 2).astype(BF16)
    top = -np.sort(-logits.astype(np.float64), axis=1)[:, :5]
    distinct = (np.diff(top, axis=1) != 0).all(axis=1)  # rows without a tie in their top 5
    assert distinct.sum() > 30
    for normalize in (False, True):
        route = moe_route_ref(logits, 4, normalize)
        probs = torch.softmax(torch.tensor(logits.astype(np.float64)), dim=-1)
        values, ids = torch.topk(probs, 4, dim=-1)
        if normalize:
            values = values / values.sum(-1, keepdim=True)
        assert np.array_equal(route.expert_ids[distinct], ids.numpy()[distinct])
        assert np.allclose(route.weights[distinct], values.numpy()[distinct], rtol=2**-23, atol=0)
    ties = np.array([[1.0, 3.0, 3.0, 2.0, 3.0]], dtype=BF16)
    assert moe_route_ref(ties, 3, True).expert_ids.tolist() == [[1, 2, 4]]
    route = moe_route_ref(logits[:5], 2, True)
    flat = route.expert_ids.reshape(-1)
    assert route.offsets.tolist() == [0, *np.cumsum(np.bincount(flat, minlength=16))]
    order = sorted(range(10), key=lambda p: (flat[p], p))
    assert route.token_of_row.tolist() == [p // 2 for p in order]
    assert [order[r] for r in route.row_of_slot] == list(range(10))


def test_the_combine_twin_sums_in_slot_order(rng: np.random.Generator) -> None:
    """moe_combine_ref: fp32 w * y summed in slot order, then the shared expert's gated
    term, rounded once to BF16 (checked element by element against plain Python floats
    rounded to fp32 at each step)."""
    logits = rng.standard_normal((3, 5)).astype(BF16)
    route = moe_route_ref(logits, 2, False)
    ys = rng.standard_normal((6, 4)).astype(BF16)
    shared = rng.standard_normal((3, 4)).astype(BF16)
    gate = rng.standard_normal((3, 1)).astype(BF16)
    out = moe_combine_ref(ys, route, shared, gate)
    f32 = np.float32
    for t in range(3):
        for h in range(4):
            acc = f32(0)
            for j in range(2):
                y = f32(ys[route.row_of_slot[2 * t + j], h])
                acc = f32(acc + f32(route.weights[t, j] * y))
            g = f32(1.0 / (1.0 + np.exp(-float(gate[t, 0]))))
            acc = f32(acc + f32(g * f32(shared[t, h])))
            assert out[t, h] == BF16.type(acc), (t, h)
    assert out.dtype == BF16 and moe_combine_ref(ys, route).dtype == BF16


def test_config_reading_and_refusals() -> None:
    raw = {"architectures": ["Qwen3MoeForCausalLM"], **TINY}
    experts = ModelConfig.from_dict(raw).experts
    assert experts is not None
    assert (experts.num_experts, experts.top_k, experts.intermediate_size) == (128, 8, 768)
    assert experts.normalize is False and experts.sparse_layers == (True,) * 3
    step = ModelConfig.from_dict({**raw, "decoder_sparse_step": 2, "mlp_only_layers": [0]})
    assert step.experts.sparse_layers == (False, True, False)
    with pytest.raises(ModelConfigError, match="no layer of this config has experts"):
        ModelConfig.from_dict({**raw, "mlp_only_layers": [0, 1, 2]})
    with pytest.raises(ModelConfigError, match="num_experts_per_tok must be from 1 to 4"):
        ModelConfig.from_dict({**raw, "num_experts": 4, "num_experts_per_tok": 5})
    with pytest.raises(ModelConfigError, match="number of experts must be from 1 to 256"):
        ModelConfig.from_dict({**raw, "num_experts": 1000})
    mixtral = ModelConfig.from_dict({"architectures": ["MixtralForCausalLM"], **TINY})
    assert mixtral.experts.normalize and mixtral.experts.intermediate_size == 160
    assert mixtral.layer_windows is None
    windowed = ModelConfig.from_dict(
        {"architectures": ["MixtralForCausalLM"], **TINY, "sliding_window": 64}
    )
    assert windowed.layer_windows == (64,) * 3
    qwen2 = ModelConfig.from_dict({"architectures": ["Qwen2MoeForCausalLM"], **TINY,
                                   "use_sliding_window": True, "sliding_window": 32,
                                   "max_window_layers": 2})  # fmt: skip
    assert qwen2.layer_windows == (32, 0, 0) and qwen2.experts.shared_intermediate_size == 5632


def test_parameter_counts_of_the_released_shapes() -> None:
    """Mixtral-8x7B's 46.7B (12.9B active) and Qwen3-30B-A3B's 30.5B (3.3B active), from
    their released configs' shapes."""
    mixtral = ModelConfig.from_dict({
        "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "max_position_embeddings": 32768, "num_local_experts": 8,
        "num_experts_per_tok": 2})  # fmt: skip
    assert mixtral.num_parameters() == 46_702_792_704
    assert mixtral.num_parameters(active=True) == 12_879_925_248
    qwen3 = ModelConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True})  # fmt: skip
    assert qwen3.num_parameters() == 30_532_122_624
    assert 3.3e9 < qwen3.num_parameters(active=True) < 3.4e9


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-qwen2-moe"])
def moe_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic MoE folder (synth.py's shape): Qwen3-MoE's, or Qwen2-MoE's with its
    shared expert and a dense layer."""
    from reprise.daemon.model.synth import synth_model

    return synth_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=3)


def test_a_token_routes_alike_in_any_batch(moe_folder: Path) -> None:
    """The engine (NumPy): a prompt's tokens and logits alone and batched with others
    (whose tokens share its experts' grouped GEMMs) are the same bits; with reuse too."""
    from reprise.daemon import Engine, SamplingParams

    engine = Engine.from_pretrained(moe_folder, backend="numpy", num_device_blocks=64,
                                    block_size=16, enable_reuse=False)  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_logits=True)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (37, 5, 60)]
    alone = engine.generate(prompts[0], params)
    batched = engine.generate(prompts, [params] * 3)
    assert batched[0].token_ids == alone.token_ids
    assert np.array_equal(batched[0].logits.view(np.uint32), alone.logits.view(np.uint32))
    reuse_keeps_bits(moe_folder, 512)


def test_the_synthetic_shapes() -> None:
    from reprise.daemon.model.synth import SHAPES, synth_config, tensor_shapes

    assert synth_config("qwen3-30b-a3b").num_parameters() == 30_532_122_624
    assert synth_config("mixtral-8x7b").num_parameters() == 46_702_792_704
    names = dict(tensor_shapes({**SHAPES["tiny-qwen2-moe"]}))
    assert names["model.layers.0.mlp.experts.5.down_proj.weight"] == (128, 64)
    assert names["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 128)
    assert names["model.layers.1.mlp.down_proj.weight"] == (128, 192)  # the dense layer
    assert "model.layers.1.mlp.gate.weight" not in names
    mixtral = dict(tensor_shapes({**SHAPES["mixtral-8x7b"], "num_hidden_layers": 1}))
    assert mixtral["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)


def test_model_info_shows_the_experts(moe_folder: Path) -> None:
    from reprise.daemon.model.modelinfo import model_info

    info = model_info(moe_folder)["experts"]
    config = ModelConfig.from_dir(moe_folder)
    assert info["experts"] == config.experts.num_experts and info["per_token"] in (2, 3)
    assert info["dense_layers"] == ([1] if config.experts.shared_intermediate_size else [])
    assert info["active_parameters"] < config.num_parameters()


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-qwen2-moe"])
def moe_d64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic MoE of head_dim 64 (the attention kernels take 64 and 128)."""
    return synth_like(tmp_path_factory, request.param, seed=6, moe_intermediate_size=128)


class RouteLog:
    """Each moe_route call's BF16 router logits and chosen experts on the GPU and NumPy
    backends, read back (gpu_forward_matches_numpy's `watch`: eager forwards only)."""

    TIE_ULPS = 4  # a near tie: the kth and (k+1)th logits this close, in ulps of the largest

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"gpu": [], "numpy": []}

    def install(self, gpu, cpu) -> None:
        for name, backend in (("gpu", gpu), ("numpy", cpu)):
            backend.moe_route = self._recording(name, type(backend).moe_route)

    def uninstall(self, gpu, cpu) -> None:
        del gpu.moe_route, cpu.moe_route

    def _recording(self, name: str, route):
        def recorded(logits, top_k: int, normalize: bool):
            got = route(logits, top_k, normalize)
            host = [
                np.asarray(x.get() if hasattr(x, "get") else x) for x in (logits, got.expert_ids)
            ]
            self.calls[name].append((host[0].view(BF16), host[1]))
            return got

        return recorded

    def alike_rows(self, num_tokens: int) -> int:
        """The prompt rows before the first token the backends routed apart (all of them
        where none was). Each GPU routing is the twin's on its own logits; the first token
        routed apart, at the first layer it was, sat on a near tie of NumPy's logits: its
        hidden state there is within a few ulps of NumPy's, and so are its router logits,
        so a kth and (k+1)th expert nearer than that may swap (a 2026-11-30 H200 run:
        0.5 ulps apart at tiny-qwen3-moe's layer 1, token 10)."""
        gpu, cpu = self.calls["gpu"], self.calls["numpy"]
        assert len(gpu) == len(cpu) > 0
        first, tie = num_tokens, None
        for (g_logits, g_ids), (c_logits, c_ids) in zip(gpu, cpu, strict=True):
            k = g_ids.shape[1]
            assert np.array_equal(g_ids, moe_route_ref(g_logits, k, False).expert_ids)
            apart = np.flatnonzero((np.sort(g_ids, axis=1) != np.sort(c_ids, axis=1)).any(axis=1))
            if apart.size and apart[0] < first:
                first, tie = int(apart[0]), (c_logits[apart[0]].astype(np.float64), k)
        if tie is not None:
            row, k = tie
            gap = tie_gaps(row[None], k)[0]
            assert gap <= self.TIE_ULPS, (first, gap)
        return first


def test_the_gpu_backend_runs_moe(cupy_kind: str, moe_d64: Path) -> None:  # noqa: F811
    """CupyBackend (emulated, or a device): the routing, the grouped GEMMs and the sum
    through their kernels give logits within 4 BF16 ulps of NumPy's up to the first token
    routed apart at a near tie (RouteLog), the same tokens, and decode from CUDA graphs
    bit-identical to eager (the routing read on the device only: captured)."""
    gpu_forward_matches_numpy(cupy_kind, moe_d64, watch=RouteLog())


def test_granite_moe_folds_its_residual_multiplier_into_every_expert(tmp_path: Path) -> None:
    """Granite MoE's residual_multiplier scales each expert's down projection (the
    output_linear stack), rounded to BF16 once, as it scales a dense Granite's down_proj."""
    from reprise.daemon.model.safetensors_io import load_safetensors
    from reprise.daemon.model.weights import load_weights

    make(tmp_path, "granitemoe", seed=33)
    config = ModelConfig.from_dir(tmp_path)
    assert config.experts.normalize and config.residual_multiplier == 0.22
    folded = load_weights(tmp_path, config).layers[1].experts.down
    raw = load_safetensors(tmp_path / "model.safetensors")
    stack = raw["model.layers.1.block_sparse_moe.output_linear.weight"].astype(np.float32)
    assert np.array_equal(folded, (stack * np.float32(0.22)).astype(BF16))


def test_route_log_compares_rows_up_to_a_swap_at_a_near_tie() -> None:
    """RouteLog (the GPU test's comparison, whose swap branch runs only where a device's
    GEMMs round a router logit apart from NumPy's): with routes alike, every row; with
    token 3 swapped at a tie half an ulp wide, rows 0-2; a swap at a wide gap, or a GPU
    routing that is not the twin's on its own logits, fails."""
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((6, 8)).astype(BF16)
    logits[3, :3] = np.array([4.0, 3.0, 3.015625], dtype=BF16)  # 3.0 and the next BF16 up
    ids = moe_route_ref(logits, 2, False).expert_ids
    swapped = ids.copy()
    swapped[3] = [0, 1]  # the near-tied third expert in place of the second

    def log(gpu_ids: np.ndarray, gpu_logits: np.ndarray = logits) -> RouteLog:
        routes = RouteLog()
        routes.calls = {"gpu": [(gpu_logits, gpu_ids)], "numpy": [(logits, ids)]}
        return routes

    assert log(ids).alike_rows(6) == 6
    nudged = logits.copy()
    nudged[3, 1] = np.array(3.03125, dtype=BF16)  # the GPU's logit a step further up
    assert log(swapped, nudged).alike_rows(6) == 3
    with pytest.raises(AssertionError):
        log(swapped).alike_rows(6)  # not the twin's choice on the GPU's own logits
    far = logits.copy()
    far[3, :3] = np.array([4.0, 3.0, 1.0], dtype=BF16)
    far_gpu = far.copy()
    far_gpu[3, 2] = np.array(5.0, dtype=BF16)  # expert 2 a long way up on the GPU alone
    wide = RouteLog()
    wide.calls = {
        "gpu": [(far_gpu, moe_route_ref(far_gpu, 2, False).expert_ids)],
        "numpy": [(far, moe_route_ref(far, 2, False).expert_ids)],
    }
    with pytest.raises(AssertionError):
        wide.alike_rows(6)  # a swap where NumPy's kth and (k+1)th are many ulps apart
