"""GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2,
Mistral, TinyLlama), against SentencePiece's own tokenizer and transformers' GGUF reader.

A BPE model is trained here with SentencePiece (Llama 2's settings: byte fallback, digits
split, whitespace-only pieces, no normalization) and written as llama.cpp's converter writes
one: each piece, its score and its type. The tokenizer built from those keys must give
SentencePiece's ids and text on fixed and random texts, with and without the space prefix,
and the converted folder must tokenize, template and generate as the file says.
"""

from __future__ import annotations

import io
import itertools
import re
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_gguf_families import gguf_of, hf_source

from reprise.daemon.model.gguf_convert import convert_gguf
from reprise.daemon.model.gguf_tokenizer import build_tokenizer
from reprise.daemon.model.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

_CORPUS = [
    "The year 2024 was (mostly) fine; don't you think? I'll say it 12345 times: hello!!\n\n",
    "  Café naïve façade — résumé, Ångström, Straße. 日本語のテキスト 中文混合 한국어\n",
    "def f(x):\n    return x ** 2  # square\n\tpass\r\n(a+b)=c; x<=y ^~| $5 'quoted' \"q\"\n",
    "We've THEY'LL O'Neil's 3.14159 -0.5e10 1,000,000 x2y 0x1F <tag>ok</tag>\n",
    "the quick brown fox jumps over the lazy dog, then the dog sleeps and the fox runs away.",
]
_CONTROL = ["[INST]", "[/INST]"]  # Mistral's, as control pieces
_USER_DEFINED = ["<think>"]
TEXTS = [
    "The capital of France is Paris.",
    "(hello) world!!! 12345678 don't I'll WE'VE",
    "Café naïve — résumé, Ångström 日本語 한국어 😀 ẞ ǅ",  # the last three not in the vocab
    "def f(x):\n    return x ** 2\n\n\n\tpass\r\n",
    "  runs   of\u00a0spaces  \n x ",
    " leading space",
    "the the the thethe fox-dog",
    "",
]


def _train(add_prefix: bool) -> Any:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 20),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        add_dummy_prefix=add_prefix,
        character_coverage=0.99,
        user_defined_symbols=_USER_DEFINED,
        control_symbols=_CONTROL,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def spm_kv(sp: Any, add_prefix: bool = True, **changes: Any) -> dict[str, Any]:
    """The tokenizer keys llama.cpp's converter writes for `sp` (convert_hf_to_gguf.py's
    SentencePiece vocabulary: each piece, its score, its type)."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]

    def kind(i: int) -> int:  # llama.cpp's token types, from SentencePiece's
        checks = [(sp.is_unknown, 2), (sp.is_control, 3), (sp.is_unused, 5), (sp.is_byte, 6)]
        kinds = [k for check, k in checks if check(i)]
        return kinds[0] if kinds else 4 if pieces[i] in _USER_DEFINED else 1

    kv = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [kind(i) for i in range(len(pieces))],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": add_prefix,
        "tokenizer.chat_template": "{% for m in messages %}[INST] {{ m['content'] }} [/INST]"
        "{% endfor %}",
    }
    return {**kv, **changes}


@pytest.fixture(scope="module", params=[True, False], ids=["prefix", "no-prefix"])
def trained(request: pytest.FixtureRequest) -> tuple[Any, bool]:
    return _train(request.param), request.param


def random_texts(seed: int, count: int) -> list[str]:
    """Texts of letters, digits, punctuation and runs of spaces, with characters the
    vocabulary lacks (byte fallback) and pieces of the corpus's words."""
    rng = np.random.default_rng(seed)
    words = " ".join(_CORPUS).split()
    alphabet = [*string.ascii_letters, *string.digits, *string.punctuation,
                " ", " ", " ", "\n", "\t", "é", "ß", "日", "😀", "ẞ", "\u00a0", "\u2581"]  # fmt: skip
    texts = []
    for _ in range(count):
        parts = [
            rng.choice(words) if rng.random() < 0.4 else "".join(rng.choice(alphabet, 3))
            for _ in range(rng.integers(1, 12))
        ]
        texts.append("".join(p + rng.choice(["", " ", "  "]) for p in parts))
    return texts


def test_ids_and_text_equal_sentencepiece(trained: tuple[Any, bool]) -> None:
    sp, prefix = trained
    ours = build_tokenizer(spm_kv(sp, prefix))
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh texts each run
    for text in TEXTS + random_texts(seed, 400):
        expected = sp.encode(text)
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == expected, (seed, text)
        assert ours.encode(text).ids == [sp.bos_id(), *expected], (seed, text)
        assert ours.decode(ids) == sp.decode(expected), (seed, text)


def llama_cpp_spm(kv: dict[str, Any], text: str) -> list[int]:
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm) written out plainly: "▁" for spaces
    (one put first), then over adjacent symbols merge the pair that makes the piece of
    highest score, the leftmost on ties, until no pair makes one; a symbol that is not
    a piece becomes its bytes' <0xXX> tokens. No text, no tokens."""
    if not text:
        return []
    tokens, scores = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.scores"]
    kinds = kv["tokenizer.ggml.token_type"]
    ids = {t: i for i, t in reversed(list(enumerate(tokens))) if kinds[i] in (1, 4)}
    prefix = " " if kv["tokenizer.ggml.add_space_prefix"] else ""
    symbols = list((prefix + text).replace(" ", "\u2581"))
    while True:
        pairs = [(scores[ids[a + b]], -i) for i, (a, b) in enumerate(itertools.pairwise(symbols))
                 if a + b in ids]  # fmt: skip
        if not pairs:
            break
        i = -max(pairs)[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for symbol in symbols:
        if symbol in ids:
            out.append(ids[symbol])
        else:
            out += [tokens.index(f"<0x{b:02X}>") for b in symbol.encode()]
    return out


def test_merges_follow_the_scores_not_the_ids(trained: tuple[Any, bool]) -> None:
    """A trained vocabulary lists its pieces in score order, so ranking merges by id would
    pass the test above. Here the normal pieces' ids are shuffled, scores kept: the ids
    must be llama.cpp's algorithm's on the shuffled vocabulary."""
    sp, prefix = trained
    kv = spm_kv(sp, prefix)
    assert llama_cpp_spm(kv, TEXTS[2]) == sp.encode(TEXTS[2])  # the twin is SentencePiece
    rng = np.random.default_rng()
    normal = [i for i, k in enumerate(kv["tokenizer.ggml.token_type"]) if k == 1]
    moved = rng.permutation(normal)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores"):
        values = list(kv[key])
        for to, source in zip(normal, moved, strict=True):
            values[to] = kv[key][source]
        kv[key] = values
    ours = build_tokenizer(kv)
    for text in TEXTS + random_texts(int(rng.integers(2**32)), 100):
        assert ours.encode(text, add_special_tokens=False).ids == llama_cpp_spm(kv, text), text


def test_the_texts_reach_byte_fallback_and_long_merges(trained: tuple[Any, bool]) -> None:
    """What the test above checks is not trivial: the texts go through <0xXX> tokens and
    pieces of several merges, and the pieces' scores decide between overlapping merges
    ("the" of "thethe")."""
    sp, _ = trained
    pieces = [p for text in TEXTS for p in sp.encode(text, out_type=str)]
    assert any(re.fullmatch(r"<0x[0-9A-F]{2}>", p) for p in pieces)
    assert max(len(p) for p in pieces) >= 4
    scores = spm_kv(sp)["tokenizer.ggml.scores"]
    assert len(set(scores[sp.get_piece_size() - 200 :])) > 100  # ranked by score, not tied


def test_ids_equal_transformers_reading_the_file(tmp_path: Path) -> None:
    """transformers' GGUF reader on the same file, on the texts where its rule and
    llama.cpp's agree: it puts no "▁" before text that starts with a space, nor after a
    special token (llama.cpp and SentencePiece do; so do we)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sp = _train(True)
    model = hf_source("llama", 0, vocab_size=sp.get_piece_size(), num_hidden_layers=1)
    gguf_of(tmp_path / "m.gguf", "llama", model, "", tokenizer=spm_kv(sp))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    ours = build_tokenizer(spm_kv(sp))
    texts = [t for t in TEXTS + random_texts(7, 200) if t and not t.startswith(" ")]
    assert len(texts) > 100
    for text in texts:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
        assert ours.encode(text).ids == [sp.bos_id(), *sp.encode(text)], text


def test_control_and_user_defined_pieces_are_matched_whole() -> None:
    """As llama.cpp matches them (llama-vocab.cpp's SPM branch, as transformers' legacy
    Llama tokenizer did): each piece's id, and each text between them tokenized alone,
    with its own space prefix."""
    sp = _train(True)
    ours = build_tokenizer(spm_kv(sp))
    inst, end, think = (sp.piece_to_id(p) for p in ("[INST]", "[/INST]", "<think>"))
    ids = ours.encode("x[INST] hi there [/INST]<think>yes", add_special_tokens=False).ids
    assert ids == [*sp.encode("x"), inst, *sp.encode(" hi there "), end, think,
                   *sp.encode("yes")]  # fmt: skip
    assert sp.encode(" hi there ")[0] == sp.piece_to_id("\u2581\u2581")  # prefix + its space


def test_a_sentencepiece_llama_converts_and_generates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprise.daemon import Engine, SamplingParams

    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    pytest.importorskip("torch")
    sp = _train(True)
    model = hf_source("llama", 3, vocab_size=sp.get_piece_size(), tie_word_embeddings=True)
    source = gguf_of(tmp_path / "l2.gguf", "llama", model, "", tokenizer=spm_kv(sp))
    convert_gguf(source, tmp_path / "out", progress=False)
    tokenizer = Tokenizer.from_dir(tmp_path / "out")
    text = "The fox, 2024 — 😀"
    assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "[INST] hi [/INST]"
    engine = Engine.from_pretrained(source, backend="numpy", num_device_blocks=16, block_size=16)
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert len(out.token_ids) == 6 or out.token_ids[-1] == sp.eos_id()
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores must give every token's score"),
        ({"tokenizer.ggml.model": "bert"}, "supported: 'gpt2' (byte-level BPE) and 'llama'"),
    ],
)
def test_what_cannot_be_built_is_refused(changes: dict[str, Any], message: str) -> None:
    sp = _train(True)
    kv = {k: v for k, v in spm_kv(sp, **changes).items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        build_tokenizer(kv)


# --- a folder with a SentencePiece tokenizer.model and no tokenizer.json (spm_model.py) -----


def _train_proto(add_prefix: bool, **options: Any) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 20), model_writer=model, vocab_size=400,
        model_type="bpe", byte_fallback=True, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", add_dummy_prefix=add_prefix,
        character_coverage=0.99, user_defined_symbols=_USER_DEFINED,
        control_symbols=_CONTROL, minloglevel=2, **options,
    )  # fmt: skip
    return model.getvalue()


def test_the_model_file_is_read_as_sentencepiece_reads_it(tmp_path: Path) -> None:
    from reprise.daemon.model.spm_model import read_spm_model

    proto = _train_proto(True)
    (tmp_path / "tokenizer.model").write_bytes(proto)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    model = read_spm_model(tmp_path / "tokenizer.model")
    assert model.pieces == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert model.scores == [sp.get_score(i) for i in range(sp.get_piece_size())]
    kv = spm_kv(sp)  # the types from SentencePiece's own checks (user-defined by name)
    assert model.types == kv["tokenizer.ggml.token_type"]
    assert (model.model_type, model.add_dummy_prefix, model.remove_extra_whitespaces) == (
        2, True, False)  # fmt: skip


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_a_folder_with_tokenizer_model_alone_tokenizes_as_sentencepiece(
    tmp_path: Path, prefix: bool
) -> None:
    proto = _train_proto(prefix)
    (tmp_path / "tokenizer.model").write_bytes(proto)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    sp = spm.SentencePieceProcessor(model_proto=proto)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.bos_token_id == sp.bos_id() and sp.eos_id() in tokenizer.eos_token_ids
    for text in TEXTS + random_texts(int(np.random.SeedSequence().entropy % 2**32), 100):
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        assert tokenizer.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text


def test_what_the_model_file_reader_cannot_follow_is_refused(tmp_path: Path) -> None:
    from reprise.daemon.model.spm_model import spm_tokenizer

    for options, message in [
        ({"model_type": "unigram"}, "a SentencePiece unigram model; only BPE models load"),
        ({"remove_extra_whitespaces": True}, "removes extra whitespace"),
        ({"normalization_rule_name": "nmt_nfkc"}, "normalizer 'nmt_nfkc' is not supported"),
    ]:
        model = io.BytesIO()
        settings = dict(sentence_iterator=iter(_CORPUS * 20), model_writer=model, vocab_size=400,
                        model_type="bpe", byte_fallback=True, remove_extra_whitespaces=False,
                        normalization_rule_name="identity", minloglevel=2,
                        character_coverage=0.99, hard_vocab_limit=False)  # fmt: skip
        spm.SentencePieceTrainer.train(**{**settings, **options})
        (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
        with pytest.raises(ValueError, match=re.escape(message)):
            spm_tokenizer(tmp_path / "tokenizer.model", "<s>", "</s>", add_bos=True)
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05ab")  # a field past the end
    with pytest.raises(ValueError, match="runs past the end"):
        spm_tokenizer(tmp_path / "tokenizer.model", "<s>", "</s>", add_bos=True)
