"""The second model family, Qwen2 (registry.py): the registry's choices and refusals,
the forward against transformers' own Qwen2ForCausalLM on the same weights, synthetic
Qwen2 folders, reuse invariance, and the bias op (`add_bias`) on both backends: its
NumPy twin against torch's BF16 linear, its kernel in the emulator and, through the
emulated CuPy, the whole Qwen2 forward on the GPU backend."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpu_support import needs_gpu
from test_model_reference import TINY, hf_logits, rel_l2_rows, run_ours

from reprise.cuda.backend import NumpyBackend
from reprise.cuda.bias import add_bias_ref
from reprise.cuda.dtypes import BF16, F32
from reprise.cuda.gemm import gemm_ref
from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model import registry, synth
from reprise.daemon.model.config import ModelConfig, ModelConfigError
from reprise.daemon.model.modelinfo import model_info
from reprise.daemon.model.synth import SHAPES, synth_model, tensor_shapes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QWEN2 = {**TINY, "rope_theta": 1e6, "rms_norm_eps": 1e-6}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reprise.cli.main", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


# --- the registry ---------------------------------------------------------------------


def test_families_by_architecture_or_model_type() -> None:
    raw = {**QWEN2, "num_hidden_layers": 2}
    assert registry.supported_architectures() == (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "MistralForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "GraniteForCausalLM",
        "SmolLM3ForCausalLM",
        "SeedOssForCausalLM",
        "HeliumForCausalLM",
        "InternLM2ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Olmo2ForCausalLM",
        "Olmo3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "GraniteMoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "OlmoeForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "LlamaModel",
        "MistralModel",
        "Qwen2Model",
        "Qwen3Model",
    )
    for fields, arch in [
        ({"architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM"),
        ({"architectures": ["Qwen2Model"]}, "Qwen2ForCausalLM"),  # bare: the family's, tied
        ({"model_type": "qwen2"}, "Qwen2ForCausalLM"),  # no architectures: by model_type
        ({"model_type": "llama"}, "LlamaForCausalLM"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "qwen2"}, "LlamaForCausalLM"),
    ]:
        config = ModelConfig.from_dict({**raw, **fields})
        assert config.architecture == arch
        assert config.qkv_bias == (arch == "Qwen2ForCausalLM")
        assert config.tie_word_embeddings == (
            raw.get("tie_word_embeddings", False) or fields.get("architectures") == ["Qwen2Model"]
        )


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "'GPT2LMHeadModel'"),
        ({"architectures": ["PhiForCausalLM"], "model_type": "phi"}, "'PhiForCausalLM'"),
        ({"model_type": "gemma"}, "'gemma'"),
        ({}, "None"),
    ],
)
def test_an_unknown_architecture_is_refused_in_one_line(fields: dict, name: str) -> None:
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_dict({**QWEN2, **fields})
    assert str(e.value) == (
        f"unsupported architecture {name}; supported: LlamaForCausalLM, Qwen2ForCausalLM, "
        "MistralForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, GraniteForCausalLM, "
        "SmolLM3ForCausalLM, SeedOssForCausalLM, HeliumForCausalLM, InternLM2ForCausalLM, "
        "Gemma2ForCausalLM, Gemma3ForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, "
        "MixtralForCausalLM, Qwen2MoeForCausalLM, GraniteMoeForCausalLM, Qwen3MoeForCausalLM, "
        "OlmoeForCausalLM, "
        "Gemma3ForConditionalGeneration, "
        "Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, "
        "Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration, LlamaModel, "
        "MistralModel, Qwen2Model, Qwen3Model"
    )


def test_the_cli_refuses_an_unknown_architecture_before_loading(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN2, "architectures": ["Phi3X"]}))
    result = cli("model", "info", str(tmp_path))  # no weights: it must stop at the config
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "Error: unsupported architecture 'Phi3X'; supported: LlamaForCausalLM, "
        "Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
        "GraniteForCausalLM, SmolLM3ForCausalLM, SeedOssForCausalLM, HeliumForCausalLM, "
        "InternLM2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Olmo2ForCausalLM, "
        "Olmo3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, GraniteMoeForCausalLM, Qwen3MoeForCausalLM, "
        "OlmoeForCausalLM, Gemma3ForConditionalGeneration, Qwen2VLForConditionalGeneration, "
        "Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration, "
        "Qwen3VLMoeForConditionalGeneration, LlamaModel, MistralModel, "
        "Qwen2Model, Qwen3Model"
    ]


@pytest.mark.parametrize(
    "fields",
    [
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
        {"use_sliding_window": True, "sliding_window": 64},  # from layer 28 on: none
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 3},
        {"use_sliding_window": True, "sliding_window": 64,
         "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
        {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0},
    ],
)  # fmt: skip
def test_each_layers_window_is_where_transformers_applies_one(fields: dict) -> None:
    """The rule is transformers' (Qwen2Config): checked against its own layer_types. A
    window at least the context never binds, so it is none; the context is the model's."""
    raw = {**QWEN2, "architectures": ["Qwen2ForCausalLM"], **fields}
    hf = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "architectures"})
    context = QWEN2["max_position_embeddings"]
    want = tuple(
        hf.sliding_window if kind == "sliding_attention" and hf.sliding_window < context else 0
        for kind in hf.layer_types
    )
    config = ModelConfig.from_dict(raw)
    assert config.qkv_bias and config.max_position_embeddings == context
    assert config.layer_windows == (want if any(want) else None)


def test_layer_types_of_the_wrong_length_are_refused() -> None:
    raw = {**QWEN2, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
           "sliding_window": 64, "layer_types": ["sliding_attention"]}  # fmt: skip
    with pytest.raises(ModelConfigError, match="layer_types has 1 entries for 3 layers"):
        ModelConfig.from_dict(raw)


def test_llama_with_attention_bias_is_still_refused() -> None:
    with pytest.raises(ModelConfigError, match="attention_bias=true is not supported"):
        ModelConfig.from_dict({**TINY, "model_type": "llama", "attention_bias": True})


# --- the forward against transformers --------------------------------------------------


def make_hf_qwen2(out: Path, seed: int, **overrides) -> torch.nn.Module:
    """A random Qwen2ForCausalLM saved as BF16 safetensors; returned in fp32 (same values).
    Weights widened as test_model_reference does; biases N(0, 1), as large as trained ones."""
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**QWEN2, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.mul_(4.0) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    return model.float().eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers_qwen2(tmp_path: Path, tied: bool) -> None:
    ref = make_hf_qwen2(tmp_path, seed=5 + tied, tie_word_embeddings=tied)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["tie_word_embeddings"] == tied
    prompt = np.random.default_rng(7).integers(0, QWEN2["vocab_size"], size=150)
    ours = run_ours(tmp_path, prompt, [150])
    want = hf_logits(ref, prompt)
    err = rel_l2_rows(ours, want)
    assert err.max() < 2e-2, err.max()  # test_model_reference's tolerance for Llama
    assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.95
    # the biases matter: without them transformers is far from us (the test can fail)
    with torch.no_grad():
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    assert rel_l2_rows(ours, hf_logits(ref, prompt)).mean() > 10 * err.max()


def test_chunked_prefill_keeps_the_bits(tmp_path: Path) -> None:
    make_hf_qwen2(tmp_path, seed=9)
    prompt = np.random.default_rng(8).integers(0, QWEN2["vocab_size"], size=70)
    whole = run_ours(tmp_path, prompt, [70])
    assert np.array_equal(
        whole.view(np.uint32), run_ours(tmp_path, prompt, [1, 16, 33, 20]).view(np.uint32)
    )


def test_add_bias_twin_rounds_like_torchs_bf16_linear(rng: np.random.Generator) -> None:
    """bf16(x @ w.T + b) with one rounding: against F.linear in BF16 on the CPU, whose sum
    order differs from ours, so a few results straddling a rounding boundary may differ
    by one ulp; a twin that rounded twice (GEMM to BF16, then + bias) differs far more."""
    x = rng.standard_normal((64, 96)).astype(BF16)
    w = (rng.standard_normal((160, 96)) * 0.2).astype(BF16)
    b = rng.standard_normal(160).astype(BF16)
    ours = add_bias_ref(gemm_ref(x, w, out_f32=True), b)
    tx, tw, tb = (torch.from_numpy(a.astype(F32)).to(torch.bfloat16) for a in (x, w, b))
    want = torch.nn.functional.linear(tx, tw, tb).float().numpy().astype(BF16)
    exact = (x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)).astype(BF16)
    twice = (gemm_ref(x, w).astype(F32) + b.astype(F32)).astype(BF16)
    assert np.array_equal(ours, exact) or (ours != exact).mean() < 1e-3
    assert (ours != want).mean() < 0.01, (ours != want).mean()
    assert (twice != exact).mean() > 10 * max((ours != exact).mean(), 1e-4)


# --- synthetic Qwen2 folders, the engine, model info -----------------------------------


def test_qwen2_05b_has_the_real_models_parameter_count() -> None:
    assert sum(int(np.prod(d)) for _, d in tensor_shapes(SHAPES["qwen2-0.5b"])) == 494_032_768
    assert synth.synth_config("qwen2-0.5b").num_parameters() == 494_032_768


def test_the_clis_synth_choices_are_the_shapes() -> None:
    from reprise.cli.model_cmds import model_synth

    like = next(p for p in model_synth.params if p.name == "like")
    assert list(like.type.choices) == list(SHAPES)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "tiny-qwen2"
    result = cli("model", "synth", "--like", "tiny-qwen2", "--out", str(out), "--seed", "3")
    assert result.returncode == 0, result.stderr
    return out


def test_synth_writes_a_qwen2_folder_transformers_agrees_with(tiny_qwen2: Path) -> None:
    raw = json.loads((tiny_qwen2 / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2"
    assert raw["tie_word_embeddings"] and raw["rope_theta"] == 1e6
    index = json.loads((tiny_qwen2 / "model.safetensors.index.json").read_text())
    assert "model.layers.1.self_attn.k_proj.bias" in index["weight_map"]
    assert (tiny_qwen2 / "tokenizer.json").is_file()
    engine = Engine.from_pretrained(
        tiny_qwen2, backend="numpy", num_device_blocks=16, block_size=16
    )
    prompt = np.random.default_rng(0).integers(0, 1024, size=40).tolist()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_logits=True)
    out = engine.generate(prompt, params)
    assert engine.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True)).token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        want = hf(torch.tensor([prompt + out.token_ids[:3]])).logits[0, -4:].numpy()
    err = rel_l2_rows(out.logits, want)
    assert err.max() < 2e-2, err
    assert out.token_ids == want.argmax(-1).tolist()


def test_reuse_invariance_on_qwen2(tiny_qwen2: Path) -> None:
    """The same prompt twice with reuse on (the second mostly from the pool), and once in
    chunks of 7 with reuse off: the same tokens and logits bits."""
    prompt = np.random.default_rng(1).integers(0, 1024, size=50).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
    engine = Engine.from_pretrained(
        tiny_qwen2, backend="numpy", num_device_blocks=32, block_size=16
    )
    first, second = engine.generate(prompt, params), engine.generate(prompt, params)
    chunked = Engine.from_pretrained(
        tiny_qwen2, backend="numpy", num_device_blocks=32, block_size=16, enable_reuse=False,
        max_num_batched_tokens=7,
    ).generate(prompt, params)  # fmt: skip
    assert first.cached_tokens == 0 and second.cached_tokens == 48
    for other in (second, chunked):
        assert other.token_ids == first.token_ids
        assert np.array_equal(other.logits.view(np.uint32), first.logits.view(np.uint32))


def test_model_info_on_a_qwen2_folder(tiny_qwen2: Path) -> None:
    info = model_info(tiny_qwen2)
    assert info["architecture"] == "Qwen2ForCausalLM" and info["qkv_bias"] is True
    assert info["parameters"] == sum(
        int(np.prod(d)) for _, d in tensor_shapes(SHAPES["tiny-qwen2"])
    )
    assert info["tied_embeddings"] and info["rope_theta"] == 1e6
    result = cli("model", "info", str(tiny_qwen2), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["parameters"] == info["parameters"]


# --- the bias kernel: emulated, and the GPU backend's Qwen2 forward through it -----------


def test_add_bias_kernel_matches_its_twin(emu_lib: ctypes.CDLL, rng: np.random.Generator) -> None:
    y = (rng.standard_normal((7, 1000)) * 3).astype(F32)
    bias = rng.standard_normal(1000).astype(BF16)
    out = np.full((7, 1000), 0xFFFF, np.uint16)  # poisoned: NaN in BF16
    ptr = ctypes.c_void_p
    args = (ptr(y.ctypes.data), ptr(bias.ctypes.data), ptr(out.ctypes.data))
    emu_lib.run_add_bias(*args, ctypes.c_longlong(7), 1000, 5)  # 5 blocks: grid-stride
    assert np.array_equal(out, add_bias_ref(y, bias).view(np.uint16))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("width", [1152, 4608])  # qwen2-0.5b's and Qwen2-7B's q+k+v
def test_add_bias_launcher_matches_its_twin_on_the_device(rng, width: int) -> None:
    from gpu_support import dev, host, poisoned

    from reprise.cuda.launchers import add_bias

    y = (rng.standard_normal((37, width)) * 3).astype(F32)
    bias = rng.standard_normal(width).astype(BF16)
    out = add_bias(dev(y), dev(bias), out=poisoned((37, width), np.uint16))
    assert np.array_equal(host(out).view(np.uint16), add_bias_ref(y, bias).view(np.uint16))


@pytest.fixture(
    scope="module", params=["emulated", pytest.param("gpu", marks=[pytest.mark.gpu, needs_gpu])]
)
def cupy_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The GPU backend's CuPy: the emulated one (kernels compiled for the host), or the
    real one on a device."""
    if request.param == "gpu":
        yield "gpu"
        return
    from kernel_emu import emucupy
    from test_cupy_emulated import KERNEL_CACHES

    lib = request.getfixturevalue("emu_lib")
    with pytest.MonkeyPatch.context() as mp:
        for cache in KERNEL_CACHES:
            cache.cache_clear()
        emucupy.install(lib, mp.setitem)
        yield "emulated"
        for cache in KERNEL_CACHES:
            cache.cache_clear()


def synth_like(factory: pytest.TempPathFactory, like: str, seed: int, **changes: object) -> Path:
    """A synthetic folder of synth.SHAPES[like] with `changes`, by default at head_dim 64
    (the attention kernels take 64 and 128): 4 heads of a 256-wide hidden state."""
    shape = {**SHAPES[like], "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64,
             "intermediate_size": 256, **changes}  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SHAPES, "changed", shape)
        return synth_model("changed", factory.mktemp(like) / "m", seed=seed)


@pytest.fixture(scope="module")
def qwen2_d64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 of head_dim 64."""
    return synth_like(tmp_path_factory, "tiny-qwen2", seed=4)


def test_the_gpu_backend_runs_qwen2(cupy_kind: str, qwen2_d64: Path) -> None:
    """CupyBackend: the same tokens as NumPy, logits within a few BF16 ulps of the row's
    largest (a Qwen2 forward without its bias would be far off, as the reference test
    shows); and through the engine, decode replayed from CUDA graphs keeps the bits of
    eager decode."""
    gpu_forward_matches_numpy(cupy_kind, qwen2_d64)


def gpu_forward_matches_numpy(cupy_kind: str, folder: Path, watch: Any = None) -> None:
    """The model in `folder` on CupyBackend (emulated, or a device): logits within 4 BF16
    ulps of each row's largest, and so the same tokens as on NumPy wherever its top two
    are further apart than twice that (nearer, the bound allows a swap: a random model's
    near ties); decode from CUDA graphs bit-identical to eager decode (replayed: counted
    on the emulated CuPy). `watch` (a mixture of experts' test_moe.RouteLog) sees both
    backends' ops and names the rows to compare: those before a token routed apart."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.daemon.engine.engine import model_fingerprint
    from reprise.daemon.model.llama import LlamaModel
    from reprise.daemon.model.tokenizer import Tokenizer
    from reprise.daemon.model.weights import load_weights

    config = ModelConfig.from_dir(folder)
    weights = load_weights(folder, config)
    gpu, cpu = CupyBackend(), NumpyBackend()
    if watch is not None:
        watch.install(gpu, cpu)
    model = LlamaModel(config, weights, gpu)
    prompt = np.random.default_rng(2).integers(0, 256, size=20)
    got = run_on(model, prompt)
    want = run_on(LlamaModel(config, weights, cpu), prompt)
    rows = len(prompt)
    if watch is not None:
        watch.uninstall(gpu, cpu)
        rows = watch.alike_rows(len(prompt))
    got, want = got[: max(rows, 1)], want[: max(rows, 1)]  # row 0 unchecked where rows is 0
    scale = np.max(np.abs(want), axis=1, keepdims=True)
    worst = float(np.max(np.abs(got - want) / scale)) if rows else 0.0
    assert worst < 4 * 2.0**-8, f"{worst / 2.0**-8:.2f} BF16 ulps of the row's largest logit"
    top_two = np.sort(want, axis=1)[:, -2:]
    clear = (top_two[:, 1] - top_two[:, 0]) > 8 * 2.0**-8 * scale[:, 0]
    clear &= np.arange(len(clear)) < rows
    assert clear.any() or not rows
    assert np.array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, return_logits=True)
    outs = []
    for graphs in (False, True):
        engine = Engine(config, Tokenizer.from_dir(folder), model, block_size=16,
                        num_device_blocks=16, cuda_graphs=graphs,
                        model_fingerprint=model_fingerprint(folder))  # fmt: skip
        replays = replay_count(cupy_kind)
        outs.append(engine.generate(prompt.tolist(), params))
        assert (replay_count(cupy_kind) - replays >= 4) == (graphs and cupy_kind == "emulated")
    if rows == len(prompt) and clear[-1]:
        assert outs[0].token_ids[0] == int(want[-1].argmax())
    assert outs[0].token_ids == outs[1].token_ids
    assert np.array_equal(outs[0].logits.view(np.uint32), outs[1].logits.view(np.uint32))


def replay_count(cupy_kind: str) -> int:
    """Graph replays so far on the emulated CuPy (0 on a real one, which does not count)."""
    if cupy_kind != "emulated":
        return 0
    from kernel_emu import emucupy

    return emucupy.replays()


def run_on(model, prompt: np.ndarray, block_size: int = 16) -> np.ndarray:
    """All positions' logits of one prompt in one step, on the model's backend."""
    from reprise.cuda.kvcache import kv_cache_shape
    from reprise.daemon.model.llama import ForwardBatch

    cfg, n = model.config, len(prompt)
    num_blocks = -(-n // block_size)
    shape = kv_cache_shape(num_blocks, cfg.num_layers, cfg.num_kv_heads, block_size, cfg.head_dim)
    pos = np.arange(n)
    batch = ForwardBatch(
        token_ids=prompt.astype(np.int32),
        positions=pos.astype(np.int32),
        slot_mapping=pos.astype(np.int64),
        block_tables=np.arange(num_blocks, dtype=np.int32)[None],
        seq_lens=np.array([n], np.int32),
        query_start_loc=np.array([0, n], np.int32),
        logit_rows=None,
    )
    return model.ops.to_host(model.forward(batch, model.ops.kv_cache(shape)))
