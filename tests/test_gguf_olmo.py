"""GGUF files of OLMo 2 and OLMo 3 (`olmo2`) and OLMoE (`olmoe`), converted by
gguf_convert.py, gguf_config.py and gguf_experts.py.

Each tiny file is written here as llama.cpp's converter (convert_hf_to_gguf.py's
Olmo2Model and OlmoeModel) writes one from a random transformers model: TextModel's keys
(no key length: no config has a head_dim; the full layers' rope, the sliding layers' base
as `rope.freq_base_swa`), Q and K as the checkpoint holds them (no Llama permutation:
llama.cpp rotates both architectures NeoX-style), OLMo 2's and 3's output norms as
`post_attention_norm` and `post_ffw_norm`, OLMo 3's window and one bool a layer for its
sliding pattern, OLMoE's experts stacked with the router `ffn_gate_inp` in F32, its norm
epsilon the 1e-5 OlmoeModel writes whatever the config says. transformers' GGUF reader
has none of the architectures, so the references are the source model (a file in F32:
every weight its own once rounded to BF16, expert by expert) and, for a Q8_0 file, the
source's class holding the file's tensors as gguf-py dequantizes them (what
transformers' reader would hold); our logits within test_moe.matches' bound of either, in
one chunk and in four. OLMo 3's sliding pattern and base are the checkpoint's where the
file gives them (its list, `rope.freq_base_swa`), llama.cpp's olmo2 loader's where not.
Then the refusals, one line each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf_support import text_model_kv, write_gguf
from test_gguf_families import _GLOBAL, _LAYER, TOKENS, _tokenizer_kv
from test_gguf_moe import same_bits_by_expert
from test_model_reference import run_ours
from test_moe import far_off, matches

from reprise.daemon.model.config import ModelConfig, YarnScaling
from reprise.daemon.model.gguf_convert import convert_gguf
from reprise.daemon.model.safetensors_io import load_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, rms_norm_eps=1e-5, vocab_size=len(TOKENS),
              rope_theta=5e5, eos_token_id=2, pad_token_id=1, bos_token_id=None)  # fmt: skip
# the family -> transformers' class prefix and the source's own settings: OLMo 2 with
# grouped keys (its k_norm as long as the keys); OLMo 3 the same over 4 layers, windows of
# 24 on the first 3 (Olmo3Config's default types), its full layer's rope YaRN-scaled (as the
# released models') and the sliding ones' the same base unscaled; OLMoE with as many key
# heads as query heads (llama.cpp's olmoe loader sizes k_norm by the hidden size), 6 experts
# of 32, 3 a token
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "olmo2": ("Olmo2", {"num_key_value_heads": 2}),
    "olmo3": ("Olmo3", {"num_key_value_heads": 2, "num_hidden_layers": 4, "sliding_window": 24,
                        "rope_scaling": _YARN}),
    "olmoe": ("Olmoe", {"num_key_value_heads": 4, "intermediate_size": 32, "num_experts": 6,
                        "num_experts_per_tok": 3}),
}  # fmt: skip
ARCH = {"olmo2": "olmo2", "olmo3": "olmo2", "olmoe": "olmoe"}  # llama.cpp's, each family's
# transformers' names within a layer -> llama.cpp's (llama-arch.cpp's LLM_ARCH_OLMO2 and
# LLM_ARCH_OLMOE), past a Llama's (_LAYER); an OLMo 2's post_attention_layernorm is its
# attention's output's, an OLMoE's its MLP's input's (a Llama's ffn_norm)
_NAMES = {
    "olmo2": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
    "olmoe": {
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.experts.down_proj": "ffn_down_exps.weight",
    },
}
# a stack of each expert's gate rows, then its up rows ([E, 2I, H]), as two llama.cpp stacks
_JOINED = ("mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"))


def source(family: str, seed: int, **overrides: Any) -> Any:
    """A random model of `family`'s transformers class, widened as test_gguf_moe's
    moe_source (its router random: transformers may start it at zero, every logit tied),
    BF16-exact, fp32."""
    prefix, own = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(**{**_SHAPE, **own, **overrides})
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif p.dim() > 1:
                p.mul_(4.0)
            else:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.to(torch.bfloat16).to(torch.float32).eval()


def gguf_names(arch: str, hf_name: str) -> tuple[str, ...]:
    """The llama.cpp tensors that hold a transformers tensor (two for the joined experts)."""
    if hf_name in _GLOBAL:
        return (_GLOBAL[hf_name],)
    layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name).groups()
    names = _JOINED[1] if rest == _JOINED[0] else ({**_LAYER, **_NAMES[arch]}[rest],)
    return tuple(f"blk.{layer}.{name}" for name in names)


def llama_cpp_tensors(arch: str, model: Any) -> dict[str, np.ndarray]:
    """`model`'s tensors as llama.cpp's converter writes `arch`: renamed, nothing permuted,
    the experts' gate and up stacks split."""
    tensors = {}
    for hf_name, value in model.state_dict().items():
        value = value.detach().numpy()
        names = gguf_names(arch, hf_name)
        parts = np.split(value, len(names), axis=1) if len(names) > 1 else [value]
        tensors |= {
            name: np.ascontiguousarray(part) for name, part in zip(names, parts, strict=True)
        }
    return tensors


def rope_kv(params: dict[str, Any]) -> dict[str, Any]:
    """TextModel's rope keys for a transformers 5 `rope_parameters`: the full layers' base
    and scaling (linear, or YaRN with whatever of its settings the config gives), the
    sliding layers' base where the layers have types."""
    full = params.get("full_attention", params)
    kv: dict[str, Any] = {"rope.freq_base": float(full["rope_theta"])}
    if "sliding_attention" in params:
        kv["rope.freq_base_swa"] = float(params["sliding_attention"]["rope_theta"])
    if full["rope_type"] in ("linear", "yarn"):
        kv |= {"rope.scaling.type": full["rope_type"], "rope.scaling.factor": float(full["factor"])}
    if full["rope_type"] == "yarn":
        kv["rope.scaling.original_context_length"] = full["original_max_position_embeddings"]
        kv |= {f"rope.scaling.yarn_{k}": float(full[k])
               for k in ("beta_fast", "beta_slow") if k in full}  # fmt: skip
    return kv


def llama_cpp_file(
    path: Path, family: str, model: Any, quantized: bool = False, **changes: Any
) -> Path:
    """`model` as llama.cpp's converter writes `family`, but the keys and tensors in
    `changes` (a value of None drops one)."""
    arch, config = ARCH[family], model.config
    kv = text_model_kv(config) | {
        **rope_kv(config.rope_parameters),
    }
    if family == "olmo3":  # Olmo2Model's: the window, one bool a layer (True: sliding)
        kv |= {"attention.sliding_window": config.sliding_window,
               "attention.sliding_window_pattern": [t == "sliding_attention"
                                                    for t in config.layer_types]}  # fmt: skip
    if arch == "olmoe":  # TextModel's expert keys; OlmoeModel's epsilon over the config's
        kv |= {"expert_count": config.num_experts, "expert_used_count": config.num_experts_per_tok,
               "attention.layer_norm_rms_epsilon": 1e-5}  # fmt: skip
    # OLMo 2's released files say dbrx (its cl100k vocabulary); OLMoE's GPT-NeoX vocabulary
    # is llama.cpp's `olmo`, which splits as gpt-2
    kv = {f"{arch}.{k}": v for k, v in kv.items()} | _tokenizer_kv(
        "dbrx" if arch == "olmo2" else "gpt-2"
    )
    tensors = llama_cpp_tensors(arch, model)
    for name, value in changes.items():
        table = tensors if name.endswith(".weight") else kv
        table.pop(name, None) if value is None else table.__setitem__(name, value)
    return write_gguf(path, arch, kv, tensors, quantized=quantized)


def file_reading(path: Path, model: Any) -> Any:
    """`model`'s class holding the file's tensors, dequantized by gguf-py to float32 (each
    HF tensor from its llama.cpp tensors), as transformers' GGUF reader would hold them."""
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    stored = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        stored[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(shape)
    state = {}
    for name in model.state_dict():
        parts = [np.array(stored[g]) for g in gguf_names(arch, name)]
        state[name] = torch.from_numpy(
            np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        )
    reading = type(model)(model.config)
    reading.load_state_dict(state)
    return reading.eval()


_CASES = {"olmo2-f32": ("olmo2", False), "olmo2-q8_0": ("olmo2", True),
          "olmo3-f32": ("olmo3", False), "olmoe-f32": ("olmoe", False),
          "olmoe-q8_0": ("olmoe", True)}  # fmt: skip


@pytest.fixture(scope="module", params=list(_CASES.values()), ids=list(_CASES))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(arch, the folder, the reference): the source model for an F32 file, the file's
    dequantized reading for a Q8_0 one (its matrices and experts quantized, as checked)."""
    arch, quantized = request.param
    tmp = tmp_path_factory.mktemp(arch)
    model = source(arch, seed=47)
    path = llama_cpp_file(tmp / "model.gguf", arch, model, quantized=quantized)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds["blk.1.attn_q.weight"] == ("Q8_0" if quantized else "F32")
    if arch == "olmoe":
        assert kinds["blk.1.ffn_up_exps.weight"] == kinds["blk.1.attn_q.weight"]
        assert kinds["blk.1.ffn_gate_inp.weight"] == "F32"
    convert_gguf(path, tmp / "out", progress=False)
    return arch, tmp / "out", file_reading(path, model) if quantized else model


def test_weights_are_the_references(converted: Any) -> None:
    """Every tensor, each expert's apart, is the reference's rounded to BF16, bit for bit,
    under the names weights.py reads: Q and K rows as stored, OLMo 2 without input norms."""
    arch, out, reference = converted
    ours = load_safetensors(out / "model.safetensors")
    theirs = {name: t.detach().numpy() for name, t in reference.state_dict().items()}
    assert same_bits_by_expert(ours, theirs) == (2 * 2 if arch == "olmoe" else 0)
    assert ("model.layers.0.input_layernorm.weight" in ours) is (arch == "olmoe")


def test_the_config_is_the_families(converted: Any) -> None:
    """config.json names the family and runs it as llama.cpp does: OLMo 2's and 3's
    post-norms, every family's whole q and k norms, OLMo 3's windows on its sliding layers
    and their unscaled rope (transformers reads the source's settings back), OLMoE's 6
    experts of 32, 3 a token, not renormalized (olmoe.cpp's norm_w false; OlmoeConfig's
    default), no clamp."""
    family, out, reference = converted
    raw = json.loads((out / "config.json").read_text())
    prefix = FAMILIES[family][0]
    assert raw["architectures"] == [f"{prefix}ForCausalLM"] and raw["model_type"] == family
    assert raw["rms_norm_eps"] == 1e-05 and raw["rope_theta"] == 5e5
    assert raw["rope_scaling"] == (_YARN if family == "olmo3" else None)
    config = ModelConfig.from_dir(out)
    assert config.family.qk_norm_whole and config.family.post_norms == (family != "olmoe")
    assert config.qk_norm_sizes == (config.q_size, config.kv_size)
    assert (config.head_dim, config.num_kv_heads) == (16, reference.config.num_key_value_heads)
    if family == "olmo3":
        theirs, source_config = transformers.AutoConfig.from_pretrained(out), reference.config
        for field in ("layer_types", "sliding_window", "rope_parameters"):
            assert getattr(theirs, field) == getattr(source_config, field), field
        assert config.layer_windows == (24, 24, 24, 0)
        assert config.local_rope_layers == (True, True, True, False)
        assert config.local_rope_theta == 5e5 and isinstance(config.rope_scaling, YarnScaling)
    if family != "olmoe":
        assert config.experts is None
        return
    experts = config.experts
    assert experts is not None and experts.sparse_layers == (True, True)
    assert (experts.num_experts, experts.top_k, experts.intermediate_size) == (6, 3, 32)
    assert experts.normalize is False is reference.config.norm_topk_prob
    assert raw["clip_qkv"] is None


def test_logits_match_the_reference(converted: Any) -> None:
    """Our NumPy forward on the folder against the reference's fp32 forward, within the
    bound of its own BF16 forward, in one chunk and in four (test_moe.matches)."""
    _, out, reference = converted
    copy = type(reference)(reference.config)  # `matches` casts it
    copy.load_state_dict(reference.state_dict())
    matches(out, copy.eval())


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("olmo3", {"olmo2.attention.sliding_window_pattern": [True, False]},
         "olmo2.attention.sliding_window_pattern is [True, False]; expected a bool for each "
         "of the 4 layers"),
        ("olmoe", {"olmoe.attention.clamp_kqv": 8.0},
         "olmoe.attention.clamp_kqv is 8.0: a clamp of q, k and v (clip_qkv), which the "
         "forward lacks"),
        ("olmo2", {"olmo2.attention.clamp_kqv": 8.0}, "olmo2.attention.clamp_kqv is 8.0"),
        ("olmo2", {"blk.0.attn_norm.weight": np.ones(64, np.float32)},
         "GGUF tensor 'blk.0.attn_norm.weight' has no Hugging Face Olmo2ForCausalLM counterpart"),
        ("olmoe", {"blk.1.ffn_gate_inp.weight": None},
         "a olmoe file with experts lacks tensor 'blk.1.ffn_gate_inp.weight'"),
        ("olmoe", {"blk.0.ffn_down.weight": np.ones((64, 32), np.float32)},
         "GGUF tensor 'blk.0.ffn_down.weight': a dense MLP in a olmoe file with experts"),
    ],
    ids=["olmo3-pattern", "olmoe-clamp", "olmo2-clamp", "olmo2-input-norm", "no-router",
         "dense-layer"],
)  # fmt: skip
def test_what_cannot_be_converted_is_refused(
    tmp_path: Path, family: str, changes: dict[str, Any], message: str
) -> None:
    path = llama_cpp_file(tmp_path / "x.gguf", family, source(family, seed=7), **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_file_without_a_window_is_olmo2(tmp_path: Path) -> None:
    """A window of 0 is none (llama.cpp's olmo2 loader windows the layers only above 0)."""
    path = llama_cpp_file(tmp_path / "x.gguf", "olmo2", source("olmo2", seed=8),
                          **{"olmo2.attention.sliding_window": 0})  # fmt: skip
    convert_gguf(path, tmp_path / "out", progress=False)
    assert ModelConfig.from_dir(tmp_path / "out").layer_windows is None


def test_olmo3_keeps_the_checkpoints_pattern_and_sliding_base(tmp_path: Path) -> None:
    """A file whose pattern list (layers 0 and 3 sliding) and `rope.freq_base_swa` (1e6,
    the full layers' 1e4 linearly scaled) are not what llama.cpp's olmo2 runs (every 4th
    layer full, all rotated by `rope.freq_base`) converts to the checkpoint's own: its
    logits are the source's, and far off with the sliding layers at the full base."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    model = source("olmo3", seed=9, layer_types=types, rope_parameters=rope, rope_scaling=None)
    path = llama_cpp_file(tmp_path / "x.gguf", "olmo3", model)
    assert gguf.GGUFReader(path).fields["olmo2.rope.freq_base_swa"].contents() == 1e6
    out = tmp_path / "out"
    convert_gguf(path, out, progress=False)
    raw = json.loads((out / "config.json").read_text())
    assert raw["layer_types"] == types and raw["rope_parameters"] == rope
    config = ModelConfig.from_dir(out)
    assert config.layer_windows == (24, 0, 0, 24) and config.local_rope_theta == 1e6
    _, prompt, err = matches(out, model)
    raw["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e4
    (out / "config.json").write_text(json.dumps(raw))
    assert far_off(run_ours(out, prompt, [150]), model, prompt, err)


@pytest.mark.parametrize(
    ("pattern", "kinds"),
    [(None, "SSSF"), (2, "SFSF"), (0, "SSSS"), (1, "FFFF")],
    ids=["none-every-4th-full", "period-2", "period-0-all-sliding", "period-1-all-full"],
)
def test_an_olmo3_pattern_as_one_number_is_llama_cpps(
    tmp_path: Path, pattern: int | None, kinds: str
) -> None:
    """A pattern given as one number n, or none, is read as llama.cpp's olmo2 loader reads
    it (set_swa_pattern(n), n 4 where absent): layer i slides where n is 0 or
    i % n < n - 1."""
    change = {"olmo2.attention.sliding_window_pattern": pattern}
    path = llama_cpp_file(tmp_path / "x.gguf", "olmo3", source("olmo3", seed=10), **change)
    convert_gguf(path, tmp_path / "out", progress=False)
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    names = {"S": "sliding_attention", "F": "full_attention"}
    assert raw["layer_types"] == [names[k] for k in kinds]
