"""GGUF files of OLMo 2 (`olmo2`) and OLMoE (`olmoe`), converted by gguf_convert.py and
gguf_experts.py.

Each tiny file is written here as llama.cpp's converter (convert_hf_to_gguf.py's
Olmo2Model and OlmoeModel) writes one from a random transformers model: TextModel's keys
(no key length: neither config has a head_dim), Q and K as the checkpoint holds them (no
Llama permutation: llama.cpp rotates both architectures NeoX-style), OLMo 2's output norms
as `post_attention_norm` and `post_ffw_norm`, OLMoE's experts stacked with the router
`ffn_gate_inp` in F32, its norm epsilon the 1e-5 OlmoeModel writes whatever the config says.
transformers' GGUF reader has neither architecture, so the references are the source model
(a file in F32: every weight its own once rounded to BF16, expert by expert) and, for a Q8_0
file, the source's class holding the file's tensors as gguf-py dequantizes them (what
transformers' reader would hold); our logits within test_moe.matches' bound of either, in
one chunk and in four. Then the refusals, one line each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf_support import write_gguf
from test_gguf_families import _GLOBAL, _LAYER, TOKENS, _tokenizer_kv
from test_gguf_moe import same_bits_by_expert
from test_moe import matches

from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.gguf_convert import convert_gguf
from reprise.daemon.model.safetensors_io import load_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, rms_norm_eps=1e-5, vocab_size=len(TOKENS),
              rope_theta=5e5, eos_token_id=2, pad_token_id=1, bos_token_id=None)  # fmt: skip
# llama.cpp's architecture -> transformers' class prefix and the source's own settings:
# OLMo 2 with grouped keys (its k_norm as long as the keys), OLMoE with as many key heads
# as query heads (llama.cpp's olmoe loader sizes k_norm by the hidden size), 6 experts of
# 32, 3 a token
FAMILIES = {
    "olmo2": ("Olmo2", {"num_key_value_heads": 2}),
    "olmoe": ("Olmoe", {"num_key_value_heads": 4, "intermediate_size": 32, "num_experts": 6,
                        "num_experts_per_tok": 3}),
}  # fmt: skip
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


def source(arch: str, seed: int, **overrides: Any) -> Any:
    """A random model of `arch`'s transformers class, widened as test_gguf_moe's moe_source
    (its router random: transformers may start it at zero, every logit tied), BF16-exact,
    fp32."""
    prefix, own = FAMILIES[arch]
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


def llama_cpp_file(
    path: Path, arch: str, model: Any, quantized: bool = False, **changes: Any
) -> Path:
    """`model` as llama.cpp's converter writes `arch`, but the keys and tensors in `changes`
    (a value of None drops one)."""
    config = model.config
    kv = {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
    }
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


@pytest.fixture(scope="module", params=[(a, q) for a in FAMILIES for q in (False, True)],
                ids=["olmo2-f32", "olmo2-q8_0", "olmoe-f32", "olmoe-q8_0"])  # fmt: skip
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
    """config.json names the family and runs it as llama.cpp does: OLMo 2's post-norms,
    both families' whole q and k norms, OLMoE's 6 experts of 32, 3 a token, not
    renormalized (olmoe.cpp's norm_w false; OlmoeConfig's default), no clamp."""
    arch, out, reference = converted
    raw = json.loads((out / "config.json").read_text())
    prefix = FAMILIES[arch][0]
    assert raw["architectures"] == [f"{prefix}ForCausalLM"] and raw["model_type"] == arch
    assert raw["rms_norm_eps"] == 1e-05 and raw["rope_theta"] == 5e5 and raw["rope_scaling"] is None
    config = ModelConfig.from_dir(out)
    assert config.family.qk_norm_whole and config.family.post_norms == (arch == "olmo2")
    assert config.qk_norm_sizes == (config.q_size, config.kv_size)
    assert (config.head_dim, config.num_kv_heads) == (16, reference.config.num_key_value_heads)
    if arch == "olmo2":
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
    ("arch", "changes", "message"),
    [
        ("olmo2", {"olmo2.attention.sliding_window": 16,
                   "olmo2.attention.sliding_window_pattern": [True, False]},
         "olmo2.attention.sliding_window is 16: an OLMo 3 file (sliding windows), which "
         "this converter does not read yet"),
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
    ids=["olmo3-windows", "olmoe-clamp", "olmo2-clamp", "olmo2-input-norm", "no-router",
         "dense-layer"],
)  # fmt: skip
def test_what_cannot_be_converted_is_refused(
    tmp_path: Path, arch: str, changes: dict[str, Any], message: str
) -> None:
    path = llama_cpp_file(tmp_path / "x.gguf", arch, source(arch, seed=7), **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_file_without_a_window_is_olmo2(tmp_path: Path) -> None:
    """A window of 0 is none (llama.cpp's olmo2 loader windows the layers only above 0)."""
    path = llama_cpp_file(tmp_path / "x.gguf", "olmo2", source("olmo2", seed=8),
                          **{"olmo2.attention.sliding_window": 0})  # fmt: skip
    convert_gguf(path, tmp_path / "out", progress=False)
    assert ModelConfig.from_dir(tmp_path / "out").layer_windows is None
