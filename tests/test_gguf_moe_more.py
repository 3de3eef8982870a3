"""GGUF files of Granite MoE (`granitemoe`) and of Qwen3-VL's and Qwen3-VL-MoE's text
models (`qwen3vl`, `qwen3vlmoe`), converted by gguf_convert.py, gguf_config.py and
gguf_experts.py.

Each tiny file is written here as llama.cpp's converter writes one from a random
transformers model: Granite MoE's Q and K permuted (its GraniteMoeModel is a LlamaModel),
its `input_linear` split into `ffn_gate_exps` and `ffn_up_exps`, `output_linear` as
`ffn_down_exps`, the router as `ffn_gate_inp`, its four multipliers as the granite scales;
Qwen3-VL's language model without its vision tower, with the keys llama.cpp adds
(`rope.dimension_sections`, `n_deepstack_layers`). transformers reads none of these
architectures from GGUF, so the files are unquantized and the reference is the source
model itself (Qwen3-VL's whole ...ForConditionalGeneration, on token ids): converted, the
weights must be its own rounded to BF16, expert by expert, and our logits its fp32
forward's within test_moe.matches' bound (MoE) or test_model_reference's 2e-2 (dense), in
one chunk and in four. Then the refusals.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gguf_support import llama_cpp_permute, text_model_kv, write_gguf
from test_gguf_families import _GLOBAL, _LAYER, TOKENS, _tokenizer_kv
from test_gguf_moe import llama_cpp_tensors, same_bits_by_expert
from test_model_reference import hf_logits, rel_l2_rows, run_ours
from test_moe import matches

from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.gguf_convert import convert_gguf
from reprise.daemon.model.safetensors_io import load_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              vocab_size=len(TOKENS))  # fmt: skip
# Granite's multipliers, none of them 1 (transformers' GraniteMoeConfig's names)
_GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.125,
                logits_scaling=2.0, num_local_experts=4, num_experts_per_tok=2,
                intermediate_size=48, rope_theta=1e4)  # fmt: skip
# Qwen3-VL's text config: M-RoPE interleaved over a 16-dim head's 8 frequencies
_QWEN3_VL = dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                 "mrope_section": [2, 3, 3], "mrope_interleaved": True})  # fmt: skip
_QWEN3_VL_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
_VISION = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32,
               deepstack_visual_indexes=[0])  # fmt: skip
ARCHS = ("granitemoe", "qwen3vl", "qwen3vlmoe")
# llama.cpp's architecture -> config.json's architecture, as converted
CONVERTED = {"granitemoe": "GraniteMoeForCausalLM", "qwen3vl": "Qwen3ForCausalLM",
             "qwen3vlmoe": "Qwen3MoeForCausalLM"}  # fmt: skip
# Granite MoE's names within a layer -> llama.cpp's (its attention's are _LAYER's)
_GRANITE_NAMES = {
    "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.output_linear.weight": "ffn_down_exps.weight",
}


def source(arch: str, seed: int, **overrides: Any) -> Any:
    """A random transformers model for `arch`, widened as test_gguf_moe's moe_source (its
    routers random: Qwen3-VL-MoE's start at zero), BF16-exact, fp32."""
    torch.manual_seed(seed)
    if arch == "granitemoe":
        config = transformers.GraniteMoeConfig(**{**_SHAPE, **_GRANITE, **overrides})
        model = transformers.GraniteMoeForCausalLM(config)
    else:
        moe = arch == "qwen3vlmoe"
        text = {**_SHAPE, **_QWEN3_VL, **(_QWEN3_VL_MOE if moe else {}), **overrides}
        prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
        config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=_VISION)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.layer.weight")):
                p.copy_(0.3 * torch.randn_like(p))
            elif p.dim() > 1:
                p.mul_(4.0)
            else:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.to(torch.bfloat16).to(torch.float32).eval()


# transformers 5's names in memory for Granite MoE's experts -> its checkpoints' (what
# save_pretrained writes, llama.cpp's converter reads and weights.py reads): renames only
_GRANITE_CHECKPOINT = {
    "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
    "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
}


def text_state(model: Any) -> dict[str, np.ndarray]:
    """The language model's tensors under a causal LM's checkpoint names (Qwen3-VL's vision
    tower left out, as llama.cpp's converter leaves it to the mmproj file)."""
    out = {}
    for name, value in model.state_dict().items():
        if ".visual." in name or name.startswith("visual."):
            continue
        name = name.replace("model.language_model.", "model.")
        for memory, checkpoint in _GRANITE_CHECKPOINT.items():
            name = name.removesuffix(memory) + checkpoint if name.endswith(memory) else name
        out[name] = value.detach().numpy()
    if model.config.tie_word_embeddings:  # the outer config's, for Qwen3-VL
        out.pop("lm_head.weight", None)
    return out


def granite_tensors(model: Any) -> dict[str, np.ndarray]:
    """A Granite MoE model's tensors as llama.cpp's GraniteMoeModel writes them."""
    config, tensors = model.config, {}
    for name, value in text_state(model).items():
        if name in _GLOBAL:
            tensors[_GLOBAL[name]] = value
            continue
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if rest == "block_sparse_moe.input_linear.weight":  # [E, 2I, H]: gate rows, then up
            size = value.shape[1] // 2
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(value[:, :size])
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(value[:, size:])
            continue
        if rest == "self_attn.q_proj.weight":
            value = llama_cpp_permute(value, config.num_attention_heads)
        elif rest == "self_attn.k_proj.weight":
            value = llama_cpp_permute(value, config.num_key_value_heads)
        tensors[f"blk.{layer}.{({**_LAYER, **_GRANITE_NAMES})[rest]}"] = value
    return tensors


class _TextOnly:
    """A Qwen3-VL model seen as its language model, for test_gguf_moe.llama_cpp_tensors."""

    def __init__(self, model: Any) -> None:
        self.config = SimpleNamespace(tie_word_embeddings=False)  # lm_head: text_state's
        self._state = text_state(model)

    def state_dict(self) -> dict[str, Any]:
        return {k: torch.from_numpy(v) for k, v in self._state.items()}


def llama_cpp_file(path: Path, arch: str, model: Any, **changes: Any) -> Path:
    """`model` as llama.cpp's converter writes `arch` (unquantized), but the keys and
    tensors in `changes` (a value of None drops one)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = text_model_kv(config) | {
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
    }
    if arch == "granitemoe":  # LlamaModel's keys, GraniteModel's scales (no head_dim)
        tensors = granite_tensors(model)
        kv |= {"vocab_size": config.vocab_size, "rope.dimension_count": head_dim,
               "expert_count": config.num_local_experts,
               "expert_used_count": config.num_experts_per_tok,
               "attention.scale": config.attention_multiplier,
               "embedding_scale": config.embedding_multiplier,
               "residual_scale": config.residual_multiplier,
               "logit_scale": config.logits_scaling}  # fmt: skip
    else:  # Qwen3Model's (Qwen3MoeModel's) keys and Qwen3VLTextModel's own
        tensors = llama_cpp_tensors("qwen3moe", _TextOnly(model))
        sections = [*config.rope_parameters["mrope_section"], 0]  # padded to 4, as llama.cpp
        kv |= {"attention.key_length": head_dim, "attention.value_length": head_dim,
               "rope.dimension_sections": sections,
               "n_deepstack_layers": len(model.config.vision_config.deepstack_visual_indexes)}  # fmt: skip
    if arch == "qwen3vlmoe":
        kv |= {"expert_count": config.num_experts, "expert_used_count": config.num_experts_per_tok,
               "expert_feed_forward_length": config.moe_intermediate_size}  # fmt: skip
    kv = {f"{arch}.{k}": v for k, v in kv.items()} | _tokenizer_kv("qwen2")
    for name, value in changes.items():
        table = tensors if name.endswith(".weight") else kv
        table.pop(name, None) if value is None else table.__setitem__(name, value)
    return write_gguf(path, arch, kv, tensors, quantized=False)


@pytest.fixture(scope="module", params=ARCHS)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(arch, the folder, the source model)."""
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    model = source(arch, seed=43)
    convert_gguf(llama_cpp_file(tmp / "model.gguf", arch, model), tmp / "out", progress=False)
    return arch, tmp / "out", model


def test_weights_equal_the_source_models(converted: Any) -> None:
    """Every tensor, each expert's apart, is the source's rounded to BF16, under the names
    weights.py reads (Granite MoE's block_sparse_moe names, Qwen3-VL's text model's as a
    causal LM's)."""
    arch, out, model = converted
    ours = load_safetensors(out / "model.safetensors")
    theirs = text_state(model)
    assert same_bits_by_expert(ours, theirs) == (0 if arch == "qwen3vl" else 2 * 2)


def test_the_config_is_the_text_models(converted: Any) -> None:
    """config.json names the causal LM (Qwen3-VL's as Qwen3's, its M-RoPE the plain
    rotation), Granite's multipliers as the source's, the experts' routing normalized."""
    arch, out, model = converted
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [CONVERTED[arch]]
    assert "rope_parameters" not in raw and raw["rope_scaling"] is None
    config = ModelConfig.from_dir(out)
    assert config.architecture == CONVERTED[arch] and config.rope_scaling is None
    text = model.config.get_text_config()
    assert config.head_dim == getattr(text, "head_dim", 16)
    if arch == "granitemoe":
        for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                      "logits_scaling"):  # fmt: skip
            assert raw[field] == getattr(text, field) != 1.0, field
    if arch == "qwen3vl":
        assert config.experts is None
        return
    experts = config.experts
    assert experts is not None and experts.normalize and experts.sparse_layers == (True, True)
    if arch == "granitemoe":
        assert (experts.num_experts, experts.top_k, experts.intermediate_size) == (4, 2, 48)
    else:
        assert raw["norm_topk_prob"] is True
        assert (experts.num_experts, experts.top_k, experts.intermediate_size) == (6, 2, 32)


def test_logits_match_the_source_model(converted: Any) -> None:
    """Our NumPy forward on the folder against the source's fp32 forward (Qwen3-VL's whole
    model on ids): test_moe.matches for the experts, within 2e-2 for dense Qwen3-VL, in one
    chunk and in four."""
    arch, out, model = converted
    if arch != "qwen3vl":
        copy = type(model)(model.config)  # `matches` casts it
        copy.load_state_dict(model.state_dict())
        matches(out, copy.eval())
        return
    prompt = np.random.default_rng(7).integers(0, 300, size=120)
    want = hf_logits(model, prompt)
    for chunks in ([120], [1, 40, 64, 15]):
        ours = run_ours(out, prompt, chunks)
        err = rel_l2_rows(ours, want)
        assert err.max() < 2e-2, err.max()
        assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.95


def _shared_expert(model: Any) -> dict[str, np.ndarray]:
    """GraniteMoeShared's shared expert of layer 0, as llama.cpp's converter writes it."""
    h = model.config.hidden_size
    return {"blk.0.ffn_gate_shexp.weight": np.ones((16, h), np.float32),
            "blk.0.ffn_up_shexp.weight": np.ones((16, h), np.float32),
            "blk.0.ffn_down_shexp.weight": np.ones((h, 16), np.float32)}  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "edit", "message"),
    [
        ("granitemoe", {"granitemoe.expert_shared_feed_forward_length": 16},
         "a granitemoe file with granitemoe.expert_shared_feed_forward_length: a shared "
         "expert, as llama.cpp writes GraniteMoeShared's; GraniteMoeSharedForCausalLM is not "
         "supported"),
        ("granitemoe", "shared tensors",
         "a granitemoe file with tensor 'blk.0.ffn_down_shexp.weight': a shared expert"),
        ("granitemoe", {"granitemoe.rope.scaling.finetuned": False},
         "granitemoe.rope.scaling.finetuned is false: llama.cpp runs this file's attention "
         "without RoPE"),
        ("granitemoe", {"granitemoe.expert_count": None},
         "GGUF metadata granitemoe.expert_count is None; expected one integer"),
        ("granitemoe", {"blk.1.ffn_gate_inp.weight": None},
         "a granitemoe file with experts lacks tensor 'blk.1.ffn_gate_inp.weight'"),
        ("qwen3vl", {"cls_out.weight": np.ones((2, 64), np.float32)},
         "GGUF tensor 'cls_out.weight' has no Hugging Face Qwen3ForCausalLM counterpart"),
        ("qwen3vlmoe", {"blk.0.ffn_up_exps.weight": None},
         "a qwen3vlmoe file with experts lacks tensor 'blk.0.ffn_up_exps.weight'"),
        ("qwen3vlmoe", {"blk.1.ffn_gate.weight": np.ones((96, 64), np.float32)},
         "GGUF tensor 'blk.1.ffn_gate.weight': a dense MLP in a qwen3vlmoe file with experts"),
    ],
    ids=["shared-key", "shared-tensors", "no-rope", "no-expert-count", "no-router",
         "reranker-head", "no-up", "dense-layer"],
)  # fmt: skip
def test_what_cannot_be_converted_is_refused(
    tmp_path: Path, arch: str, edit: Any, message: str
) -> None:
    model = source(arch, seed=7, num_hidden_layers=2)
    changes = _shared_expert(model) if edit == "shared tensors" else edit
    path = llama_cpp_file(tmp_path / "x.gguf", arch, model, **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
