"""GGUF files of the Llama, Qwen2 and Qwen3 families (gguf_convert.py, gguf_config.py,
gguf_tokenizer.py), against transformers reading the same files with its own code.

Each tiny file is written here as llama.cpp's converter writes one (its tensor names, Q and
K permuted for a Llama, the large matrices quantized to Q8_0, a vocabulary trained here
with byte-level BPE). The conversion must give transformers' dequantized weights bit for
bit once rounded to BF16, logits as close to its forward as BF16 allows, and its tokenizer's
ids; a Llama 3 file's rope_freqs must become the rope scaling that makes them.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf_support import llama_cpp_permute, write_gguf
from test_model_reference import hf_logits, rel_l2_rows, run_ours
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from reprise.daemon.model.gguf_config import llama3_rope_scaling
from reprise.daemon.model.gguf_convert import convert_gguf
from reprise.daemon.model.gguf_tokenizer import build_tokenizer
from reprise.daemon.model.prepare import PrepareError, gguf_model_dir, prepare_gguf
from reprise.daemon.model.safetensors_io import load_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The splits the vocabulary is trained with (Llama 3's published regex, as its
# tokenizer.json spells it): merges then cross the places other splitters cut.
_TRAIN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS = [
    "The year 2024 was (mostly) fine; don't you think? I'll say it 12345 times: hello!!\n\n",
    "  Café naïve façade — résumé, Ångström, Straße. 日本語のテキスト 中文混合 한국어\n",
    "def f(x):\n    return x ** 2  # square\n\tpass\r\n(a+b)=c; x<=y ^~| $5 'quoted' \"q\"\n",
    "We've THEY'LL O'Neil's 3.14159 -0.5e10 1,000,000 x2y 0x1F <tag>ok</tag>\n",
]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "The capital of France is Paris.",
    "(hello) world!!! 12345678 don't I'll WE'VE",
    "Café naïve — résumé, Ångström 日本語 한국어 😀",
    "def f(x):\n    return x ** 2\n\n\n\tpass\r\n",
    "<|im_start|>user\nhi 2024<|im_end|>\n<|im_start|>assistant\n",
    "  runs   of\u00a0spaces  \n x",
]


def _vocabulary() -> tuple[list[str], list[str]]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_TRAIN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=_SPECIALS,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


TOKENS, MERGES = _vocabulary()


def _tokenizer_kv(pre: str, **changes: Any) -> dict[str, Any]:
    kv = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3 if t in _SPECIALS else 1 for t in TOKENS],
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": TOKENS.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }
    return {**kv, **changes}


# --- writing a GGUF as llama.cpp's converter does --------------------------------------------

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3's fused projections
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    assert match, hf_name
    return f"blk.{match[1]}.{_LAYER[match[2]]}"


_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)  # fmt: skip
_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
            "granite": "Granite", "smollm3": "SmolLM3"}  # fmt: skip
PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's converter permutes their Q and K
# Granite's config fields -> llama.cpp's metadata keys (convert_hf_to_gguf.py's GraniteModel)
_GRANITE_KEYS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                 "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}  # fmt: skip


def hf_source(arch: str, seed: int, **overrides: Any) -> Any:
    """A random model of `arch`'s transformers class, its values widened past the default
    init (as test_model_reference's are) and made BF16-exact."""
    torch.manual_seed(seed)
    prefix = _CLASSES[arch]
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # Phi3Config's are 32,000
    config = getattr(transformers, f"{prefix}Config")(
        **{**_SHAPE, "vocab_size": len(TOKENS), "rope_theta": 1e6 if arch != "llama" else 1e4,
           **(ids if arch in ("phi3", "smollm3") else {}), **overrides}
    )  # fmt: skip
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():  # as test_qwen2 widens them: biases as large as trained ones
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.mul_(4.0) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.to(torch.bfloat16).to(torch.float32).eval()


def gguf_of(
    path: Path,
    arch: str,
    model: Any,
    pre: str,
    tokenizer: dict[str, Any] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    quantized: bool = True,
    **kv_changes: Any,
) -> Path:
    """`model` written as llama.cpp's converter writes `arch`, with the byte-level vocabulary
    trained here split by `pre`, or the `tokenizer` keys given."""
    config = model.config
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    tensors = {}
    for name, value in state.items():
        if arch in PERMUTED and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, config.num_attention_heads)
        elif arch in PERMUTED and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, config.num_key_value_heads)
        tensors[_gguf_name(name)] = value
    tensors |= extra or {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = {
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        **(_tokenizer_kv(pre) if tokenizer is None else tokenizer),
        **{
            f"{arch}.{key}": float(getattr(config, field))
            for field, key in _GRANITE_KEYS.items()
            if arch == "granite"
        },
        **kv_changes,
    }
    return write_gguf(path, arch, kv, tensors, quantized=quantized)


CASES = [
    ("llama", "llama-bpe", {}),
    ("llama", "llama-bpe", {"tie_word_embeddings": True}),
    ("qwen2", "qwen2", {"tie_word_embeddings": True}),
    ("qwen2", "qwen2", {"tie_word_embeddings": False}),
    ("qwen3", "qwen2", {"tie_word_embeddings": True, "head_dim": 128}),
    ("phi3", "llama-bpe", {"tie_word_embeddings": False}),
]
IDS = ["llama", "llama-tied", "qwen2-tied", "qwen2", "qwen3", "phi3"]


@pytest.fixture(scope="module", params=range(len(CASES)), ids=IDS)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch, pre, overrides = CASES[request.param]
    tmp = tmp_path_factory.mktemp(IDS[request.param])
    source = gguf_of(tmp / "model.gguf", arch, hf_source(arch, request.param, **overrides), pre)
    convert_gguf(source, tmp / "out", progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    return arch, source, tmp / "out", reference


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint16)


def test_weights_equal_transformers_dequantized(converted: Any) -> None:
    arch, _, out, reference = converted
    ours = load_safetensors(out / "model.safetensors")
    theirs = {name: t.detach().numpy() for name, t in reference.state_dict().items()}
    if reference.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert sorted(ours) == sorted(theirs)
    for name, weight in ours.items():
        assert weight.shape == theirs[name].shape, name
        expected = theirs[name].astype(ml_dtypes.bfloat16)
        assert np.array_equal(_bits(weight), _bits(expected)), f"{name} differs"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [f"{_CLASSES[arch]}ForCausalLM"]
    assert config["tie_word_embeddings"] == reference.config.tie_word_embeddings
    heads = reference.config.num_attention_heads
    want = getattr(reference.config, "head_dim", None) or reference.config.hidden_size // heads
    assert config["head_dim"] == want


def test_logits_match_transformers(converted: Any) -> None:
    """Our NumPy forward on the folder against transformers' fp32 forward on the file: as
    close as a BF16 forward gets (test_model_reference's bound), in one chunk and in three."""
    _, _, out, reference = converted
    prompt = np.random.default_rng(5).integers(0, len(TOKENS), 40)
    theirs = hf_logits(reference, prompt)
    for chunks in ([40], [7, 20, 13]):
        ours = run_ours(out, prompt, chunks)
        assert rel_l2_rows(ours, theirs).max() < 2e-2, chunks  # test_qwen2's bound
        assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_equal_transformers(tmp_path: Path, pre: str, text: str) -> None:
    model = hf_source("qwen2", 0, tie_word_embeddings=True, num_hidden_layers=1)
    source = gguf_of(tmp_path / "t.gguf", "qwen2", model, pre)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    ours = build_tokenizer(_tokenizer_kv(pre))
    assert ours.encode(text).ids == theirs(text)["input_ids"]
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    del source


def test_the_pre_tokenizers_split_differently() -> None:
    """The tests above can see a wrong splitter: Llama 3's, Qwen2's and GPT-2's give
    different ids on these texts."""
    ids = {pre: [build_tokenizer(_tokenizer_kv(pre)).encode(t).ids for t in TEXTS]
           for pre in ("llama-bpe", "qwen2", "gpt-2")}  # fmt: skip
    assert ids["llama-bpe"] != ids["qwen2"] and ids["llama-bpe"] != ids["gpt-2"]
    assert ids["qwen2"] != ids["gpt-2"]
    for alias in ("mpt", "olmo"):  # llama.cpp's names for GPT-2's split (OLMoE's files: olmo)
        assert [build_tokenizer(_tokenizer_kv(alias)).encode(t).ids for t in TEXTS] == ids["gpt-2"]


# Tiktoken's pattern as Mistral NeMo's tokenizer.json spells it (tekken), and llama.cpp's
# ASCII stand-in for its Unicode cases, written out independently of gguf_tokenizer.py.
_TIKTOKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA_CPP_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|"
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CASED = ["ΑθήναΠόλη МоскваГород HTTPServer iPhone don't WE'VE x/\n/y", "ǅemal ÀÉÎõü ΣΊΣΥΦΟΣ"]


def test_tekken_splits_as_the_models_tokenizer_does() -> None:
    """Mistral NeMo's and Ministral's pre-tokenizer: each piece is one of tiktoken's pattern's
    matches (the `regex` module's, which knows Unicode cases), byte-level mapped. Decided:
    the model's own pattern, not llama.cpp's stand-in, which splits Greek and Cyrillic
    words differently (checked here, so the texts can tell them apart)."""
    regex = pytest.importorskip("regex")
    tokenizer = build_tokenizer(_tokenizer_kv("tekken"))
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in TEXTS + CASED:
        pieces = [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        want = [to_bytes.pre_tokenize_str(m)[0][0] for m in regex.findall(_TIKTOKEN_PATTERN, text)]
        assert pieces == want, text
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    ours = regex.findall(_TIKTOKEN_PATTERN, CASED[0])
    assert [m.group(0) for m in regex.finditer(_LLAMA_CPP_TEKKEN, CASED[0])] != ours


def _split_in_turn(text: str, patterns: list[str]) -> list[str]:
    """Each pattern's matches cut every piece the patterns before it left, unmatched text
    kept as pieces too (llama.cpp's unicode_regex_split; tokenizers' Split "isolated")."""
    regex = pytest.importorskip("regex")
    pieces = [text]
    for pattern in patterns:
        cut = []
        for piece in pieces:
            at = 0
            for m in regex.finditer(pattern, piece):
                cut += [piece[at : m.start()]] if m.start() > at else []
                cut += [m.group()] if m.end() > m.start() else []
                at = m.end()
            cut += [piece[at:]] if at < len(piece) else []
        pieces = cut
    return pieces


# DeepSeek-Coder's splits as its tokenizer.json and llama.cpp spell them
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
CODE = [
    "def f(x):\n    return x ** 2  # 平方 제곱\r\n\tpass",
    "a1b22c333 = [1, 2];",
    "中文混合English",
]


def test_deepseek_coder_splits_in_turn() -> None:
    tokenizer = build_tokenizer(_tokenizer_kv("deepseek-coder"))
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in TEXTS + CODE + CASED:
        pieces = [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        want = [to_bytes.pre_tokenize_str(p)[0][0] for p in _split_in_turn(text, _DEEPSEEK_CODER)]
        assert pieces == want, text
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    smollm = build_tokenizer(_tokenizer_kv("smollm"))
    for alias in ("starcoder", "refact", "codeshell"):  # llama.cpp's names for the same split
        assert [build_tokenizer(_tokenizer_kv(alias)).encode(t).ids for t in CODE] == [
            smollm.encode(t).ids for t in CODE
        ]


def test_a_mistral_nemo_shape_converts(tmp_path: Path) -> None:
    """A Llama-architecture file whose key length is not hidden / heads (Mistral NeMo's 128
    of 5,120 / 32) with tekken's vocabulary: the weights (written unquantized) come back
    bit for bit and the logits are the source model's. transformers' GGUF reader drops
    the key length, so the source model is the reference here."""
    model = hf_source("llama", 6, head_dim=32, num_hidden_layers=2)
    source = gguf_of(tmp_path / "nemo.gguf", "llama", model, "tekken", quantized=False)
    convert_gguf(source, tmp_path / "out", progress=False)
    ours = load_safetensors(tmp_path / "out" / "model.safetensors")
    for name, value in model.state_dict().items():
        expected = value.detach().numpy().astype(ml_dtypes.bfloat16)
        assert np.array_equal(_bits(ours[name]), _bits(expected)), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["head_dim"] == 32
    prompt = np.random.default_rng(9).integers(0, len(TOKENS), 40)
    theirs = hf_logits(model, prompt)
    assert rel_l2_rows(run_ours(tmp_path / "out", prompt, [40]), theirs).max() < 2e-2


def test_a_granite_file_converts_to_its_scaled_model(tmp_path: Path) -> None:
    """llama.cpp's `granite` architecture: Llama's tensors, Q and K permuted, and the four
    scales in its metadata. Written unquantized, the weights come back bit for bit, the
    config carries the multipliers, and the logits are the source model's (transformers'
    GGUF reader has no Granite)."""
    scales = dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                  attention_multiplier=0.5, logits_scaling=8.0)  # fmt: skip
    model = hf_source("granite", 7, tie_word_embeddings=True, **scales)
    source = gguf_of(tmp_path / "g.gguf", "granite", model, "llama-bpe", quantized=False)
    convert_gguf(source, tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["GraniteForCausalLM"]
    assert {k: config[k] for k in scales} == scales
    ours = load_safetensors(tmp_path / "out" / "model.safetensors")
    for name, value in model.state_dict().items():
        if name != "lm_head.weight":  # tied
            expected = value.detach().numpy().astype(ml_dtypes.bfloat16)
            assert np.array_equal(_bits(ours[name]), _bits(expected)), name
    prompt = np.random.default_rng(10).integers(0, len(TOKENS), 40)
    theirs = hf_logits(model, prompt)
    assert rel_l2_rows(run_ours(tmp_path / "out", prompt, [40]), theirs).max() < 2e-2


def test_a_smollm3_file_converts_without_rope_in_every_4th_layer(tmp_path: Path) -> None:
    """llama.cpp's `smollm3`: Llama's tensors, Q and K permuted, every 4th layer without
    RoPE by llama.cpp's own constant. The folder says so, and its logits are the source
    model's (transformers' GGUF reader has no SmolLM3)."""
    model = hf_source("smollm3", 8, tie_word_embeddings=True, num_hidden_layers=4)
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    source = gguf_of(tmp_path / "s.gguf", "smollm3", model, "llama-bpe", quantized=False)
    convert_gguf(source, tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["SmolLM3ForCausalLM"]
    assert config["no_rope_layer_interval"] == 4
    prompt = np.random.default_rng(11).integers(0, len(TOKENS), 40)
    theirs = hf_logits(model, prompt)
    assert rel_l2_rows(run_ours(tmp_path / "out", prompt, [40]), theirs).max() < 2e-2


# --- Llama 3's rope frequencies ---------------------------------------------------------------


def _llama_cpp_rope_freqs(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it, written out independently."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _inv_freq(config: Any) -> np.ndarray:
    rope = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    return rope(config, "cpu")[0].double().numpy()


@pytest.mark.parametrize(
    ("theta", "head_dim", "scaling"),
    [
        (500000.0, 128, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)),  # Llama 3.1
        (500000.0, 64, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)),  # Llama 3.2 1B
        (10000.0, 64, dict(factor=6.0, low_freq_factor=2.0, high_freq_factor=5.0,
                           original_max_position_embeddings=512)),
        (1e6, 128, dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=3.0,
                        original_max_position_embeddings=3000)),
    ],
)  # fmt: skip
def test_rope_freqs_become_the_llama3_scaling_that_makes_them(
    theta: float, head_dim: int, scaling: dict[str, Any]
) -> None:
    """The recovered scaling's frequencies are the source's to float32 precision, by
    transformers' own llama3 rope (not ours)."""
    factors = _llama_cpp_rope_freqs(theta, head_dim, scaling)
    assert (factors > 1).any() and (factors < factors.max()).any()
    recovered = llama3_rope_scaling(factors, theta, head_dim)
    assert recovered is not None and recovered["rope_type"] == "llama3"

    def config(rope: dict[str, Any]) -> Any:
        return transformers.LlamaConfig(
            hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
            rope_parameters={"rope_type": "llama3", "rope_theta": theta, **rope},
        )  # fmt: skip

    want = _inv_freq(config(scaling))
    got = _inv_freq(config({k: v for k, v in recovered.items() if k != "rope_type"}))
    assert np.allclose(got, want, rtol=1e-6, atol=0)


def test_rope_freqs_no_llama3_scaling_makes_are_refused() -> None:
    factors = _llama_cpp_rope_freqs(500000.0, 128, dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ))  # fmt: skip
    factors[::7] *= 1.5  # not one smooth ramp any more
    with pytest.raises(ValueError, match="matches no Llama 3 rope scaling"):
        llama3_rope_scaling(factors, 500000.0, 128)
    assert llama3_rope_scaling(np.ones(64, np.float32), 500000.0, 128) is None


def test_a_llama3_file_converts_to_its_scaled_model(tmp_path: Path) -> None:
    """A Llama 3 GGUF (rope_freqs.weight beside the weights) gives the logits of the source
    model with its llama3 rope_scaling: the folder, not the file, is the reference here
    (transformers' GGUF loader ignores rope_freqs)."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # fmt: skip
    model = hf_source("llama", 3, rope_parameters={"rope_theta": 10000.0, **scaling})
    source = gguf_of(tmp_path / "l3.gguf", "llama", model, "llama-bpe")
    rope_freqs = _llama_cpp_rope_freqs(10000.0, 16, scaling)
    reader = gguf.GGUFReader(source)
    kv = {k: v for k, v in _metadata(reader).items() if not k.startswith(("GGUF.", "general."))}
    tensors = {t.name: _plain(t) for t in reader.tensors} | {"rope_freqs.weight": rope_freqs}
    write_gguf(tmp_path / "l3r.gguf", "llama", kv, tensors, quantized=False)
    convert_gguf(tmp_path / "l3r.gguf", tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == {**scaling, "low_freq_factor": 1.0}
    assert "rope_freqs.weight" not in load_safetensors(tmp_path / "out" / "model.safetensors")
    prompt = np.random.default_rng(2).integers(0, len(TOKENS), 120)
    theirs = hf_logits(model, prompt)
    ours = run_ours(tmp_path / "out", prompt, [120])
    assert rel_l2_rows(ours, theirs).max() < 0.05
    plain = hf_source("llama", 3)  # the same weights without the scaling: far off past 64
    assert rel_l2_rows(hf_logits(plain, prompt), theirs)[80:].max() > 0.05


def _metadata(reader: Any) -> dict[str, Any]:
    from reprise.daemon.model.gguf_files import read_metadata

    return read_metadata(reader)


def _plain(tensor: Any) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, np.float32).reshape(shape)


# --- refusals, the cache and the command line -------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("qwen2", {"tokenizer.ggml.pre": "jais"}, "tokenizer.ggml.pre is 'jais'"),
        ("qwen2", {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0},
         "qwen2.rope.scaling.type is 'yarn' (factor 4.0); the forward implements linear, yarn "
         "(with rope.scaling.original_context_length)"),
        ("qwen2", {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                   "qwen2.rope.scaling.original_context_length": 64,
                   "qwen2.rope.scaling.attn_factor": 0.75},
         "qwen2.rope.scaling.attn_factor is 0.75; a yarn attention factor other than 1 is not "
         "read"),
        ("qwen2", {"qwen2.attention.key_length": 32, "qwen2.attention.value_length": 32},
         "is not the hidden size 64"),
        ("qwen3", {"qwen3.rope.dimension_count": 8}, "rope dimension 8"),
        ("phi3", {"extra": {"rope_factors_long.weight": np.ones(8, np.float32)}},
         "a phi3 file with rope_factors_long.weight; LongRoPE factors are read from phi3 files "
         "holding both"),
        ("qwen2", {"extra": {"rope_factors_long.weight": np.ones(8, np.float32),
                             "rope_factors_short.weight": np.ones(8, np.float32)}},
         "a qwen2 file with rope_factors_long.weight and rope_factors_short.weight;"),
        ("phi3", {"extra": {"rope_factors_long.weight": np.ones(8, np.float32),
                            "rope_factors_short.weight": np.ones(8, np.float32)}},
         "LongRoPE factors without phi3.rope.scaling.original_context_length"),
    ],
)  # fmt: skip
def test_what_cannot_be_converted_is_refused(
    tmp_path: Path, arch: str, changes: dict[str, Any], message: str
) -> None:
    model = hf_source(arch, 0, tie_word_embeddings=True, num_hidden_layers=1)
    source = gguf_of(tmp_path / "x.gguf", arch, model, "qwen2", **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_gguf(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_phi3_files_sliding_window_reaches_every_layer(tmp_path: Path) -> None:
    """Phi-3-mini-4k's window (2,047 of 4,096) is in its GGUF: the folder says so, and
    every layer's attention takes it, as for the Hugging Face checkpoint (test_phi3)."""
    from reprise.daemon.model.config import ModelConfig

    model = hf_source("phi3", 4, num_hidden_layers=1)
    source = gguf_of(tmp_path / "p.gguf", "phi3", model, "llama-bpe",
                     **{"phi3.attention.sliding_window": 100})  # fmt: skip
    convert_gguf(source, tmp_path / "out", progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 100
    config = ModelConfig.from_dir(tmp_path / "out")
    assert config.layer_windows == (100,) and config.max_position_embeddings > 100


def test_prepare_gguf_converts_once_and_again_when_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    model = hf_source("qwen2", 1, tie_word_embeddings=True, num_hidden_layers=1)
    source = gguf_of(tmp_path / "q.gguf", "qwen2", model, "qwen2")
    first = prepare_gguf(source, progress=False)
    assert first.created and first.path == gguf_model_dir(source)
    assert first.path.is_relative_to(tmp_path / "cache" / "models" / "gguf")
    assert not prepare_gguf(source, progress=False).created
    os.utime(source, ns=(1, 1))  # a changed file (its modification time) is converted again
    assert prepare_gguf(source, progress=False).created
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(PrepareError, match="is not a GGUF file"):
        prepare_gguf(tmp_path / "not.gguf", progress=False)


def test_the_cache_lists_and_removes_conversions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reprise model list` shows each conversion, stale once its file changes or goes;
    `reprise model remove` takes a listed folder (or --stale ones), nothing else."""
    from reprise.daemon.model.prepare import cached_models, remove_cached

    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    model = hf_source("qwen2", 1, tie_word_embeddings=True, num_hidden_layers=1)
    kept, changed, gone = (gguf_of(tmp_path / f"{n}.gguf", "qwen2", model, "qwen2")
                           for n in ("kept", "changed", "gone"))  # fmt: skip
    folders = {f: prepare_gguf(f, progress=False).path for f in (kept, changed, gone)}
    assert [(m.path, m.stale) for m in cached_models()] == sorted(
        (folder, False) for folder in folders.values()
    )
    assert all(m.size_bytes > (tmp_path / "kept.gguf").stat().st_size for m in cached_models())
    os.utime(changed, ns=(1, 1))
    gone.unlink()
    stale = {m.path for m in cached_models() if m.stale}
    assert stale == {folders[changed], folders[gone]}

    env = {**os.environ, "REPRISE_CACHE_DIR": str(tmp_path / "cache")}
    cli = [sys.executable, "-m", "reprise.cli.main", "model"]
    listed = subprocess.run([*cli, "list", "--json"], capture_output=True, text=True, env=env,
                            timeout=60)  # fmt: skip
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted((r["path"], r["stale"]) for r in rows) == sorted(
        (str(f), f in stale) for f in folders.values()
    )
    done = subprocess.run([*cli, "remove", "--stale"], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [m.path for m in cached_models()] == [folders[kept]]
    refused = subprocess.run([*cli, "remove", str(tmp_path)], capture_output=True, text=True,
                             env=env, timeout=60)  # fmt: skip
    assert refused.returncode == 1 and "is not a model folder reprise prepared" in refused.stderr
    assert "Traceback" not in refused.stderr and tmp_path.exists()
    assert remove_cached(folders[kept]) > 0 and cached_models() == []


def test_the_engine_and_the_command_line_take_a_gguf_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprise.daemon import Engine, SamplingParams

    cache = tmp_path / "cache"
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(cache))
    model = hf_source("qwen3", 2, tie_word_embeddings=True, head_dim=32)
    source = gguf_of(tmp_path / "q3.gguf", "qwen3", model, "qwen2")
    engine = Engine.from_pretrained(source, backend="numpy", num_device_blocks=16, block_size=16)
    prompt = "<|im_start|>user\nhello 2024<|im_end|>\n"
    out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    folder = gguf_model_dir(source)
    assert (folder / "config.json").is_file()
    expected = Engine.from_pretrained(folder, backend="numpy", num_device_blocks=16,
                                      block_size=16).generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]  # fmt: skip
    assert out.token_ids == expected.token_ids and len(out.token_ids) == 4

    env = {**os.environ, "REPRISE_CACHE_DIR": str(cache)}
    cli = [sys.executable, "-m", "reprise.cli.main"]
    done = subprocess.run([*cli, "model", "convert", str(source)], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(folder)
    assert "already converted" in done.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    done = subprocess.run([*cli, "model", "convert", str(bad)], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: {bad} cannot be read as a GGUF file: Sorry, file appears to be version 0 "
        "which we cannot handle"
    )
    assert not gguf_model_dir(bad).exists()
