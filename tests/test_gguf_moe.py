"""GGUF files of mixture-of-experts models (gguf_convert.py, gguf_config.py, gguf_experts.py):
Mixtral as llama.cpp's `llama` architecture with experts, `qwen2moe` and `qwen3moe`.

Each tiny file is written here as llama.cpp's converter writes one: each layer's experts
stacked (`ffn_gate_exps`, `ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I]), the router
`ffn_gate_inp` kept in F32, Qwen2-MoE's shared-expert gate squeezed to [H], a Mixtral's Q
and K permuted, the other matrices Q8_0. transformers reads qwen2moe and qwen3moe files with
its own tensor code (its config reader leaves out the experts' sizes: they are given it from
the file's metadata); converted, the weights must be its reading bit for bit once rounded
to BF16, expert by expert, and our logits its forward's within the bound of its own BF16
forward (test_moe.matches: a near tie in the router may pick another expert in BF16), in
one chunk and in four. Its reader drops a `llama` file's experts, so a Mixtral file is
written unquantized and checked against the source model. Then llama.cpp's defaults for
the experts' sizes, a split file, one expert in memory at a time, and the refusals.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf_support import llama_cpp_permute, split_gguf, text_model_kv, write_gguf
from test_gguf_families import _GLOBAL, _LAYER, TOKENS, _tokenizer_kv
from test_moe import matches

from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.gguf_config import hf_config
from reprise.daemon.model.gguf_convert import convert_gguf
from reprise.daemon.model.gguf_files import read_metadata
from reprise.daemon.model.safetensors_io import load_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              num_experts_per_tok=2, vocab_size=len(TOKENS), rope_theta=1e6)  # fmt: skip
# llama.cpp's architecture -> transformers' class prefix and the source's own settings
FAMILIES = {
    "llama": ("Mixtral", {"num_local_experts": 4, "intermediate_size": 96}),
    "qwen2moe": ("Qwen2Moe", {"num_experts": 6, "moe_intermediate_size": 64,
                              "shared_expert_intermediate_size": 96}),
    "qwen3moe": ("Qwen3Moe", {"num_experts": 8, "moe_intermediate_size": 32,
                              "num_experts_per_tok": 3, "norm_topk_prob": True, "head_dim": 32,
                              "tie_word_embeddings": True}),
}  # fmt: skip
# the experts each source's file runs as llama.cpp runs them: (experts, per token, an
# expert's size, its chosen weights renormalized, the shared expert's size)
EXPERTS = {"llama": (4, 2, 96, True, 0), "qwen2moe": (6, 2, 64, False, 96),
           "qwen3moe": (8, 3, 32, True, 0)}  # fmt: skip
# transformers' names within a layer -> llama.cpp's, past a Llama's (_LAYER)
_EXPERT_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def moe_source(arch: str, seed: int, **overrides: Any) -> Any:
    """A random model of `arch`'s transformers class, widened as test_gguf_families'
    hf_source's (biases as large as trained ones), BF16-exact."""
    prefix, own = FAMILIES[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(**{**_SHAPE, **own, **overrides})
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.mul_(4.0) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.to(torch.bfloat16).to(torch.float32).eval()


def llama_cpp_tensors(arch: str, model: Any) -> dict[str, np.ndarray]:
    """`model`'s tensors as llama.cpp's converter writes them for `arch`."""
    config = model.config
    tensors = {}
    for name, value in model.state_dict().items():
        value = value.detach().numpy()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name in _GLOBAL:
            tensors[_GLOBAL[name]] = value
            continue
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: each expert's gate rows, then up
            size = value.shape[1] // 2
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(value[:, :size])
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(value[:, size:])
            continue
        if rest == "mlp.shared_expert_gate.weight":
            value = value.reshape(-1)  # [1, H] squeezed, as llama.cpp's converter writes it
        elif arch == "llama" and rest == "self_attn.q_proj.weight":
            value = llama_cpp_permute(value, config.num_attention_heads)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            value = llama_cpp_permute(value, config.num_key_value_heads)
        tensors[f"blk.{layer}.{({**_LAYER, **_EXPERT_NAMES})[rest]}"] = value
    return tensors


def llama_cpp_metadata(arch: str, model: Any) -> dict[str, Any]:
    """The metadata llama.cpp's converter writes for `model` (TextModel's keys, LlamaModel's
    and Qwen2MoeModel's own)."""
    config, (_, own) = model.config, FAMILIES[arch]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = text_model_kv(config) | {
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "expert_count": own.get("num_local_experts", own.get("num_experts")),
        "expert_used_count": config.num_experts_per_tok,
    }
    if "head_dim" in own:
        kv |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    if arch == "llama":
        kv |= {"vocab_size": config.vocab_size, "rope.dimension_count": head_dim}
    else:
        kv["expert_feed_forward_length"] = config.moe_intermediate_size
    if arch == "qwen2moe":
        kv["expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    return {f"{arch}.{k}": v for k, v in kv.items()} | _tokenizer_kv("qwen2")


def moe_gguf(
    path: Path,
    arch: str,
    model: Any,
    quantized: bool = True,
    drop: tuple[str, ...] = (),
    changes: dict[str, np.ndarray] | None = None,
) -> Path:
    """`model` written as llama.cpp writes `arch`, but the tensors and keys in `drop` and
    the tensors in `changes`."""
    tensors = llama_cpp_tensors(arch, model) | (changes or {})
    kv = llama_cpp_metadata(arch, model)
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    kv = {k: v for k, v in kv.items() if k not in drop}
    return write_gguf(path, arch, kv, tensors, quantized=quantized)


def transformers_reading(folder: Path, file_name: str) -> Any:
    """transformers' model of a qwen2moe or qwen3moe file: its config reader's config, with
    the experts' sizes its reader leaves out (GGUF_CONFIG_MAPPING has no
    expert_feed_forward_length or expert_shared_feed_forward_length) from the metadata."""
    meta = read_metadata(folder / file_name)
    arch = meta["general.architecture"]
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=file_name)
    config.moe_intermediate_size = meta[f"{arch}.expert_feed_forward_length"]
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = meta[f"{arch}.expert_shared_feed_forward_length"]
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file_name, config=config, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module", params=list(FAMILIES), ids=["mixtral", "qwen2moe", "qwen3moe"])
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(arch, the folder, the reference model): transformers' reading of the file, or for
    Mixtral (written unquantized) the source model itself."""
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    source = moe_source(arch, seed=41)
    path = moe_gguf(tmp / "model.gguf", arch, source, quantized=arch != "llama")
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    quantized = {name: kind == gguf.GGMLQuantizationType.Q8_0 for name, kind in kinds.items()
                 if re.search(r"ffn_(gate|up|down)_(exps|shexp)\.", name)}  # fmt: skip
    assert set(quantized.values()) == {arch != "llama"}, quantized
    convert_gguf(path, tmp / "out", progress=False)
    reference = source if arch == "llama" else transformers_reading(tmp, "model.gguf")
    return arch, tmp / "out", reference


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint16)


def test_weights_equal_transformers_reading(converted: Any) -> None:
    """Every tensor, each expert's apart, is the reference's rounded to BF16, under the
    names weights.py reads (Mixtral's experts under block_sparse_moe)."""
    arch, out, reference = converted
    ours = load_safetensors(out / "model.safetensors")
    theirs = {name: t.detach().numpy() for name, t in reference.state_dict().items()}
    if reference.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    if arch == "llama":
        theirs = {name.replace(".mlp.", ".block_sparse_moe."): t for name, t in theirs.items()}
    assert same_bits_by_expert(ours, theirs) == 2 * 2  # each layer's gate_up and down


def test_the_config_runs_the_experts_as_llama_cpp_does(converted: Any) -> None:
    """config.json reads as the experts llama.cpp runs: every layer sparse, Mixtral's and
    Qwen3-MoE's chosen weights renormalized and Qwen2-MoE's not (llama.cpp's code; and
    transformers' reading of the file agrees), the sizes the metadata gives."""
    arch, out, reference = converted
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [f"{FAMILIES[arch][0]}ForCausalLM"]
    experts = ModelConfig.from_dir(out).experts
    assert experts is not None and experts.sparse_layers == (True, True)
    assert (experts.num_experts, experts.top_k, experts.intermediate_size, experts.normalize,
            experts.shared_intermediate_size) == EXPERTS[arch]  # fmt: skip
    if arch != "llama":
        assert reference.config.norm_topk_prob is experts.normalize
    heads = reference.config.num_attention_heads
    want = getattr(reference.config, "head_dim", None) or reference.config.hidden_size // heads
    assert ModelConfig.from_dir(out).head_dim == want


def test_logits_match_transformers(converted: Any) -> None:
    """Our NumPy forward on the folder against the reference's fp32 forward, within the
    bound of its own BF16 forward, in one chunk and in four (test_moe.matches)."""
    _, out, reference = converted
    # a model of the reference's class and weights, which `matches` may cast (transformers
    # refuses to cast a model it loaded from a GGUF file)
    model = type(reference)(reference.config)
    model.load_state_dict(reference.state_dict())
    matches(out, model.eval())


def test_llama_cpp_defaults_size_the_experts(tmp_path: Path) -> None:
    """Without expert_feed_forward_length an expert is feed_forward_length /
    expert_used_count, without expert_shared_feed_forward_length the shared one
    feed_forward_length (llama.cpp's qwen2moe and qwen3moe loaders); a Qwen MoE file
    without feed_forward_length gets its experts' size there, and one without either is
    refused."""
    model = moe_source("qwen2moe", seed=3, num_hidden_layers=1)
    meta = read_metadata(moe_gguf(tmp_path / "q2.gguf", "qwen2moe", model))
    names = {"output.weight"}
    for arch in ("qwen2moe", "qwen3moe"):
        meta = {k.replace("qwen2moe.", f"{arch}."): v for k, v in meta.items()}
        meta["general.architecture"] = arch
        given = hf_config(meta, names)
        assert given["moe_intermediate_size"] == 64 and given["intermediate_size"] == 128
        plain = {k: v for k, v in meta.items() if "expert_" not in k or "count" in k}
        config = hf_config(plain, names)
        assert config["moe_intermediate_size"] == 128 // 2
        assert config.get("shared_expert_intermediate_size", 128) == 128
        assert ("shared_expert_intermediate_size" in config) is (arch == "qwen2moe")
        sized = {k: v for k, v in meta.items() if k != f"{arch}.feed_forward_length"}
        assert hf_config(sized, names)["intermediate_size"] == 64
        neither = {k: v for k, v in plain.items() if k != f"{arch}.feed_forward_length"}
        with pytest.raises(ValueError, match=f"needs {arch}.feed_forward_length to size"):
            hf_config(neither, names)


def test_a_split_file_converts_as_one_one_expert_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen2-MoE file cut into shards of two tensors (a layer's gate and up stacks in
    different ones) converts to the same bytes as the file; no tensor is dequantized with
    more than one expert's values at once (every dequantization is of at most 2 dims)."""
    model = moe_source("qwen2moe", seed=5)
    whole = moe_gguf(tmp_path / "m.gguf", "qwen2moe", model)
    shards = split_gguf(whole, tmp_path / "split.gguf", max_tensors=2)
    where = {t.name: p for p in shards for t in gguf.GGUFReader(p).tensors}
    assert any(where[f"blk.{i}.ffn_gate_exps.weight"] != where[f"blk.{i}.ffn_up_exps.weight"]
               for i in range(2))  # fmt: skip
    convert_gguf(whole, tmp_path / "one", progress=False)
    dims = []
    dequantize = gguf.quants.dequantize

    def recorded(data: np.ndarray, kind: Any) -> np.ndarray:
        out = dequantize(data, kind)
        dims.append(out.ndim)
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", recorded)
    convert_gguf(shards[1], tmp_path / "split", progress=False)
    assert max(dims) == 2 and len(dims) > len(where)  # the experts one by one
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "split" / name).read_bytes()


def _per_expert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stacked experts as llama.cpp's older Mixtral files held them: one tensor each."""
    out = {}
    for name, value in tensors.items():
        match = re.fullmatch(r"(blk\.\d+\.ffn_(?:gate|up|down))_exps\.weight", name)
        for e in range(value.shape[0] if match else 0):
            out[f"{match[1]}.{e}.weight"] = value[e]
    return out


@pytest.mark.parametrize(
    ("arch", "overrides", "edit", "message"),
    [
        ("qwen3moe", {"mlp_only_layers": [1]}, None,
         "GGUF tensor 'blk.1.ffn_gate.weight': a dense MLP in a qwen3moe file with experts "
         "(a layer without them: transformers' mlp_only_layers)"),
        ("llama", {}, "per-expert",
         "GGUF tensor 'blk.0.ffn_down.0.weight': experts one tensor each, as llama.cpp's older "
         "Mixtral files store them"),
        ("qwen2moe", {}, ("blk.1.ffn_up_shexp.weight",),
         "a qwen2moe file with experts lacks tensor 'blk.1.ffn_up_shexp.weight'"),
        ("qwen3moe", {}, ("blk.0.ffn_gate_inp.weight",),
         "a qwen3moe file with experts lacks tensor 'blk.0.ffn_gate_inp.weight'"),
        ("qwen3moe", {}, "wider up",
         "blk.0.ffn_gate_exps.weight and blk.0.ffn_up_exps.weight have shapes [(8, 32, 64), "
         "(8, 64, 64)]; joined into model.layers.0.mlp.experts.gate_up_proj, they must be alike"),
        ("llama", {}, ("llama.expert_count",),
         "GGUF tensor 'blk.0.ffn_gate_inp.weight' has no Hugging Face LlamaForCausalLM "
         "counterpart"),
    ],
    ids=["dense-layer", "per-expert", "no-shared-up", "no-router", "gate-up-unlike",
         "no-expert-count"],
)  # fmt: skip
def test_what_llama_cpp_would_not_run_is_refused(
    tmp_path: Path, arch: str, overrides: dict[str, Any], edit: Any, message: str
) -> None:
    model = moe_source(arch, seed=7, **overrides)
    drop, changes = (), None
    if edit == "per-expert":
        stacked = llama_cpp_tensors(arch, model)
        drop = tuple(name for name in stacked if name.endswith("_exps.weight"))
        changes = _per_expert(stacked)
    elif edit == "wider up":
        changes = {"blk.0.ffn_up_exps.weight": np.ones((8, 64, 64), np.float32)}
    elif edit is not None:
        drop = edit
    source = moe_gguf(tmp_path / "x.gguf", arch, model, drop=drop, changes=changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_gguf(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def same_bits_by_expert(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> int:
    """Every tensor of `ours` is `theirs` rounded to BF16, bit for bit, a stack of experts
    expert by expert (so a failure names the expert); the same names. Returns the stacks."""
    assert sorted(ours) == sorted(theirs)
    stacks = 0
    for name, weight in ours.items():
        expected = theirs[name].astype(ml_dtypes.bfloat16)
        assert weight.shape == expected.shape, name
        if weight.ndim == 3:
            stacks += 1
            for e in range(weight.shape[0]):
                assert np.array_equal(_bits(weight[e]), _bits(expected[e])), f"{name} expert {e}"
        else:
            assert np.array_equal(_bits(weight), _bits(expected)), name
    return stacks
