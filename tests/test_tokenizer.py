"""Tokenizer, chat template and incremental detokenizer.

Small synthetic folders (a byte-level BPE trained here in milliseconds) cover the file formats
and error paths without the model; the default model's folder is compared with transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as BackendTokenizer

from reprise.daemon.model.tokenizer import (
    REPLACEMENT_CHAR,
    ChatTemplateError,
    IncrementalDetokenizer,
    InvalidMessagesError,
    Tokenizer,
)

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "héllo wörld naïve café 日本語のテキスト 中文字符 한국어",
    "emoji 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 and numbers 12345 3.14",
] * 20
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
AWKWARD_TEXTS = [
    "",
    "Hello, world!",
    "héllo wörld — naïve café, e\u0301 ﬁ",
    "日本語のテキストと中文字符、한국어",
    "👨‍👩‍👧‍👦 family, 👍🏽 thumbs, 🏳️‍🌈 flag, 🇯🇵",
    "a    b\t\tc\n\n\nd\r\ne \r\n",
    "   leading and trailing   ",
    "12345 3.14 1,000,000 0x1F -7e-3",
    'def f(x):\n    return {"a": [x ** 2]}  # done\n',
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more<|im_end|>",
    "<|im_start|><|im_start|>",
    "\u00a0nbsp\u200bzero-width\ufeffbom",
]


def _write_folder(
    path: Path,
    *,
    config: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
    jinja: str | None = None,
    bos_processor: bool = False,
) -> Path:
    """A byte-level BPE model folder like the ones transformers saves."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    if bos_processor:  # Llama 3 style: tokenizer.json itself adds BOS
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 0)]
        )
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


def _write_sentencepiece_folder(path: Path) -> Path:
    """A Llama 2 style folder: "▁" pieces with byte fallback, a decoder that strips one space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    merges = [("▁", "H"), ("▁H", "i"), ("▁", "w"), ("▁w", "o")]
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzHW,.!?0123456789é", *(a + b for a, b in merges)]:
        vocab.setdefault(piece, len(vocab))
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    config = {
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "pad_token": "<pad>",
        "chat_template": CHATML,
    }
    return Tokenizer.from_dir(_write_folder(tmp_path_factory.mktemp("tok"), config=config))


# --- folder formats ---------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_unreadable_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a tokenizers file"):
        Tokenizer.from_dir(tmp_path)


def test_special_tokens_from_strings_and_dicts(synthetic: Tokenizer) -> None:
    assert synthetic.bos_token_id == 0
    assert synthetic.eos_token_ids == (1,)
    assert synthetic.pad_token_id == 2
    assert synthetic.special_tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }


def test_eos_ids_are_the_union_with_generation_config(tmp_path: Path) -> None:
    folder = _write_folder(
        tmp_path, config={"eos_token": "</s>"}, generation={"eos_token_id": [4, 1, 4]}
    )
    assert Tokenizer.from_dir(folder).eos_token_ids == (1, 4)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert Tokenizer.from_dir(folder).eos_token_ids == (1, 3)
    (folder / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(folder).eos_token_ids == (3,)


def test_bad_generation_eos_is_rejected_naming_the_file(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path, generation={"eos_token_id": [1, 10**6]})
    with pytest.raises(ValueError, match=r"generation_config\.json.*1000000"):
        Tokenizer.from_dir(folder)


def test_special_token_missing_from_vocab_is_added(tmp_path: Path) -> None:
    plain = Tokenizer.from_dir(_write_folder(tmp_path / "a"))
    tok = Tokenizer.from_dir(_write_folder(tmp_path / "b", config={"pad_token": "<extra_pad>"}))
    assert tok.vocab_size == plain.vocab_size + 1
    assert tok.pad_token_id == plain.vocab_size
    assert tok.encode("x<extra_pad>")[-1] == tok.pad_token_id


def test_add_bos_and_eos_flags_and_no_double_bos(tmp_path: Path) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}
    tok = Tokenizer.from_dir(_write_folder(tmp_path, config=config))
    body = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [0, *body, 1]
    assert tok.encode("<s>hello") == [0, *body, 1]
    assert tok.encode("<s><s>hello") == [0, 0, *body, 1]  # the text's own BOS tokens are kept
    assert tok.encode("", add_special_tokens=True) == [0, 1]
    assert tok.encode("<s>hello", add_special_tokens=False) == [0, *body]


def test_add_bos_false_overrides_a_bos_post_processor(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path, config={"bos_token": "<s>"}, bos_processor=True)
    assert Tokenizer.from_dir(folder).encode("hi")[0] == 0
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert Tokenizer.from_dir(folder).encode("hi")[0] != 0


@pytest.mark.reference
def test_bos_post_processor_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    folder = _write_folder(tmp_path, config={"bos_token": "<s>"}, bos_processor=True)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_dir(folder)
    for text in AWKWARD_TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == ref.encode(
                text, add_special_tokens=special
            ), text
    # The one deliberate difference: transformers gives two BOS here, we give one.
    assert ref.encode("<s>hi")[:2] == [0, 0]
    assert tok.encode("<s>hi") == ref.encode("<s>hi")[1:]


def test_chat_template_list_form_and_tool_use(tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}"},
        {"name": "default", "template": "DEFAULT {{ messages[0]['content'] }}"},
    ]
    tok = Tokenizer.from_dir(_write_folder(tmp_path, config={"chat_template": templates}))
    messages = [{"role": "user", "content": "hi"}]
    assert tok.chat_template == "DEFAULT {{ messages[0]['content'] }}"
    assert tok.apply_chat_template(messages) == "DEFAULT hi"
    assert tok.apply_chat_template(messages, tools=[{"name": "é"}]) == 'TOOLS [{"name": "é"}]'


def test_chat_template_jinja_file_wins_over_config(tmp_path: Path) -> None:
    folder = _write_folder(
        tmp_path, config={"chat_template": "FROM CONFIG"}, jinja="FROM FILE {{ bos_token }}"
    )
    tok = Tokenizer.from_dir(folder)
    assert tok.chat_template == "FROM FILE {{ bos_token }}"
    # No bos_token in the config: it is undefined in the template, never "None".
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "FROM FILE "


def test_bad_chat_template_field_is_rejected(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path, config={"chat_template": [{"name": "default"}]})
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer.from_dir(folder)


# --- chat template rendering ------------------------------------------------------------------


def test_template_sees_variables_filters_and_globals(tmp_path: Path) -> None:
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ add_generation_prompt }}|{{ who }}|"
        "{{ messages[0] | tojson }}|{{ {'k': [1]} | tojson(indent=1) }}|{{ strftime_now('%Y') }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}"
        "{% endfor %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    tok = Tokenizer.from_dir(_write_folder(tmp_path, config={**config, "chat_template": source}))
    messages = [{"role": "user", "content": "日本 <b>"}, {"role": "assistant", "content": "x"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False, who="me")
    year = str(datetime.now().year)
    expected = (
        '<s>|</s>|<pad>|False|me|{"role": "user", "content": "日本 <b>"}|{\n "k": [\n  1\n ]\n}|'
        f"{year}|user"
    )
    assert rendered == expected


def test_raise_exception_surfaces_the_template_message(tmp_path: Path) -> None:
    source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}"
    tok = Tokenizer.from_dir(_write_folder(tmp_path, config={"chat_template": source}))
    with pytest.raises(ChatTemplateError, match=r"^need a system turn$"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(ChatTemplateError("x"), ValueError)


@pytest.mark.parametrize(
    ("source", "match"),
    [("{% for %}", "does not compile"), ("{{ messages[0]['content'] + 1 }}", "TypeError")],
)
def test_broken_templates_raise_chat_template_error(
    tmp_path: Path, source: str, match: str
) -> None:
    tok = Tokenizer.from_dir(_write_folder(tmp_path, config={"chat_template": source}))
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_no_template_is_a_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write_folder(tmp_path))
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no default chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ({"role": "user", "content": "hi"}, "must be a list"),
        ([], "empty"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role is missing"),
        ([{"role": 3, "content": "b"}], r"messages\[0\]\.role must be a string, got 3"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string.*int"),
        ([{"role": "user", "content": [{"type": "image"}]}], r"messages\[0\]\.content\[0\]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            r"messages\[0\]\.content\[0\]\.text must be a string, got 3",
        ),
    ],
)
def test_bad_messages_are_rejected(synthetic: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(InvalidMessagesError, match=match):
        synthetic.apply_chat_template(messages)


def test_text_parts_none_values_and_tool_calls_are_accepted(tmp_path: Path) -> None:
    source = "{% for m in messages %}{{ m.role }}:{{ m | tojson }};{% endfor %}"
    tok = Tokenizer.from_dir(_write_folder(tmp_path, config={"chat_template": source}))
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": None},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
    ]
    assert tok.apply_chat_template(messages) == (
        'user:{"role": "user", "content": [{"type": "text", "text": "hi"}]};'
        'assistant:{"role": "assistant", "tool_calls": [{"name": "f"}]};'
    )


TEMPLATES = [
    "{% for m in messages %}\n  {% if m.role %}{{ m.role }}{% endif %}: {{ m.content | trim }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}  >{% endif %}",
    "{{ bos_token }}{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}"
    "{{ m | tojson(indent=2) }}{% endfor %}{{ eos_token }}{{ unk_token }}",
    "{%- for m in messages -%}\n    [{{ m['role'] | upper }}] {{ m['content'] }}\n{%- endfor -%}",
    "{{ messages | tojson }}{% if tools %}{{ tools | tojson }}{% endif %}{{ documents is none }}",
]


@pytest.mark.reference
@pytest.mark.parametrize("source", TEMPLATES)
def test_synthetic_templates_equal_transformers(tmp_path: Path, source: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": source}
    folder = _write_folder(tmp_path, config=config)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_dir(folder)
    messages = [
        {"role": "system", "content": "  Sois brève. <b>&</b>  "},
        {"role": "user", "content": '日本語 👨‍👩‍👧 "quoted"\n'},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    for add_generation_prompt in (True, False):
        for tool_list in (None, tools):
            ours = tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tool_list
            )
            theirs = ref.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                tools=tool_list,
            )
            assert ours == theirs


# --- incremental detokenization ---------------------------------------------------------------


def _stream(tok: Tokenizer, token_ids: Sequence[int], **kwargs: Any) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.push(token_id) for token_id in token_ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def _check_stream(
    tok: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool, *, whole: bool = True
) -> None:
    """No delta holds U+FFFD unless the decode so far does; with `whole` (no malformed run
    of 16+ tokens), the deltas and the flush rebuild the full decode exactly."""
    deltas, tail = _stream(tok, token_ids, skip_special_tokens=skip_special_tokens)
    for idx, delta in enumerate(deltas):
        if REPLACEMENT_CHAR in delta:
            prefix = tok.decode(token_ids[: idx + 1], skip_special_tokens=skip_special_tokens)
            assert REPLACEMENT_CHAR in prefix, (token_ids, idx)
    if whole:
        full = tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + tail == full


def test_split_character_is_emitted_once_complete(synthetic: Tokenizer) -> None:
    byte_ids = [synthetic.backend.token_to_id(ch) for ch in "ðŁĺĢ"]  # byte-level "😀"
    assert synthetic.decode(byte_ids) == "😀"
    deltas, tail = _stream(synthetic, [synthetic.encode("a")[0], *byte_ids])
    assert deltas == ["a", "", "", "", "😀"] and tail == ""
    deltas, tail = _stream(synthetic, byte_ids[:2])  # generation stopped mid-character
    assert deltas == ["", ""] and tail == REPLACEMENT_CHAR


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_deltas_rebuild_decode_of_awkward_texts(
    synthetic: Tokenizer, skip_special_tokens: bool
) -> None:
    for text in AWKWARD_TEXTS:
        token_ids = synthetic.encode(text)
        deltas, tail = _stream(synthetic, token_ids, skip_special_tokens=skip_special_tokens)
        assert tail == ""
        emitted = ""
        for delta in deltas:  # every delta extends a prefix of the final text
            emitted += delta
            assert REPLACEMENT_CHAR not in emitted
            assert text.startswith(emitted) or skip_special_tokens
        assert emitted == synthetic.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_prompt_context_keeps_the_first_token_joined(synthetic: Tokenizer) -> None:
    prompt_ids = synthetic.encode("<|im_start|>assistant\n日本")
    generated = synthetic.encode(" world 😀!", add_special_tokens=False)
    detok = IncrementalDetokenizer(synthetic, prompt_ids)
    text = "".join(detok.push(t) for t in generated) + detok.flush()
    full = synthetic.decode(prompt_ids + generated)
    assert text == full[len(synthetic.decode(prompt_ids)) :] == " world 😀!"


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(_write_sentencepiece_folder(tmp_path_factory.mktemp("sp")))


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_sentencepiece_byte_fallback_stream(
    sentencepiece: Tokenizer, skip_special_tokens: bool
) -> None:
    for text in AWKWARD_TEXTS:
        token_ids = sentencepiece.encode(text)
        assert token_ids[0] == sentencepiece.bos_token_id
        _check_stream(sentencepiece, token_ids, skip_special_tokens)
    emoji = sentencepiece.encode("😀", add_special_tokens=False)[1:]  # four <0x..> tokens
    deltas, tail = _stream(sentencepiece, emoji)
    assert deltas == ["", "", "", "😀"] and tail == ""


def test_sentencepiece_spaces_survive_context_and_skipped_tokens(sentencepiece: Tokenizer) -> None:
    token_ids = sentencepiece.encode("Hi wo")  # <s> ▁Hi ▁wo
    assert len(token_ids) == 3
    detok = IncrementalDetokenizer(sentencepiece, token_ids[:2])
    assert detok.push(token_ids[2]) == " wo"  # decoded alone, "▁wo" would lose its space
    eos = sentencepiece.eos_token_ids[0]
    deltas, _ = _stream(sentencepiece, [token_ids[1], eos, token_ids[2]], skip_special_tokens=True)
    assert "".join(deltas) == "Hi wo"


class _CountingBackend:
    """Wraps a backend and records how many ids each decode call is given."""

    def __init__(self, backend: BackendTokenizer) -> None:
        self.backend = backend
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(token_ids))
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("garbage", [False, True])
def test_decode_window_stays_small(synthetic: Tokenizer, garbage: bool) -> None:
    rng = np.random.default_rng(7)
    if garbage:  # only tokens that end inside a character: the text never becomes whole
        partial = _partial_ids(synthetic)
        token_ids = rng.choice(partial, size=3000).tolist()
    else:
        token_ids = synthetic.encode(" ".join(CORPUS) * 5)
    counting = _CountingBackend(synthetic.backend)
    wrapped = Tokenizer(
        backend=counting,  # type: ignore[arg-type]
        special_tokens={},
        bos_token_id=None,
        eos_token_ids=(),
        pad_token_id=None,
        chat_templates={},
    )
    _stream(wrapped, token_ids)
    assert len(counting.lengths) >= len(token_ids) >= 3000
    assert max(counting.lengths) <= (32 if garbage else 12)
    _check_stream(synthetic, token_ids, skip_special_tokens=False, whole=not garbage)


def _partial_ids(tok: Tokenizer) -> list[int]:
    return [i for i in range(tok.vocab_size) if REPLACEMENT_CHAR in tok.decode([i])]


# --- the default model, against transformers --------------------------------------------------


@pytest.fixture(scope="module")
def model_tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def ref_tok(default_model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.model
@pytest.mark.reference
def test_properties_equal_transformers(model_tok: Tokenizer, ref_tok: Any) -> None:
    assert model_tok.vocab_size == len(ref_tok)
    assert model_tok.bos_token_id == ref_tok.bos_token_id
    assert model_tok.eos_token_ids == (ref_tok.eos_token_id,)
    assert model_tok.pad_token_id == ref_tok.pad_token_id
    assert model_tok.chat_template == ref_tok.chat_template


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("text", AWKWARD_TEXTS)
def test_encode_decode_equal_transformers(model_tok: Tokenizer, ref_tok: Any, text: str) -> None:
    for special in (True, False):
        token_ids = model_tok.encode(text, add_special_tokens=special)
        assert token_ids == ref_tok.encode(text, add_special_tokens=special)
        for skip in (False, True):
            expected = ref_tok.decode(token_ids, skip_special_tokens=skip)
            assert model_tok.decode(token_ids, skip_special_tokens=skip) == expected
    assert model_tok.decode(model_tok.encode(text)) == text


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"}],
    [
        {"role": "user", "content": "Bonjour, ça va ? 日本語 👨‍👩‍👧"},
        {"role": "assistant", "content": "Très bien.\n\n  Et toi ?"},
        {"role": "user", "content": "<|im_end|> tricky\r\n"},
    ],
]


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    model_tok: Tokenizer, ref_tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours = model_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = ref_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert model_tok.encode(ours, add_special_tokens=False) == ref_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )


@pytest.mark.model
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_detokenizer_on_model_vocab(model_tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = np.random.default_rng(2024)
    partial = _partial_ids(model_tok)
    assert len(partial) > 100  # the vocabulary has byte-fragment tokens to split characters
    for text in AWKWARD_TEXTS:  # whole characters split across tokens
        _check_stream(model_tok, model_tok.encode(text), skip_special_tokens)
    for _ in range(200):  # random ids, a third of them fragments of characters
        size = int(rng.integers(1, 48))
        token_ids = rng.integers(0, model_tok.vocab_size, size=size)
        fragments = rng.choice(partial, size=size)
        token_ids = np.where(rng.random(size) < 0.33, fragments, token_ids).tolist()
        _check_stream(model_tok, token_ids, skip_special_tokens)


FINAL_CONTENTS = [
    "The answer is",
    "Trailing spaces  ",
    "  leading",
    "two\nlines\n",
    "日本語 👨‍👩‍👧",
]


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("final", FINAL_CONTENTS)
def test_continue_final_message_equals_transformers(
    model_tok: Tokenizer, ref_tok: Any, final: str
) -> None:
    """transformers' (and vLLM's) continue_final_message: the chat ends where the last
    message's content does, open for the answer to continue it."""
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": final}]
    ours = model_tok.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    theirs = ref_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs and ours.rstrip().endswith(final.strip())
    closed = model_tok.apply_chat_template(messages, add_generation_prompt=False)
    assert closed.startswith(ours) and len(closed) > len(ours)  # the end of turn is cut


def test_continue_final_message_refusals(tmp_path: Path) -> None:
    source = "{% for m in messages %}[{{ m['content'] | upper }}]{% endfor %}"
    tok = Tokenizer.from_dir(_write_folder(tmp_path, config={"chat_template": source}))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        tok.apply_chat_template(chat, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not write the last message"):
        tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    calls = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    with pytest.raises(ChatTemplateError, match="a last message with text"):
        tok.apply_chat_template(calls, add_generation_prompt=False, continue_final_message=True)
    plain = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    tok = Tokenizer.from_dir(_write_folder(tmp_path / "b", config={"chat_template": plain}))
    opened = tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    assert opened == "<hi><yes"


def test_a_requests_chat_options_reach_the_template(tmp_path: Path) -> None:
    """The daemon's tokenizing step renders a request's messages with its chat_options
    (vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs), for
    a generate and a tokenize alike."""
    from reprise.daemon.serve.intake import RequestChecks, RequestLimits
    from reprise.ipc.messages import Generate, Tokenize

    source = (
        "{% if think %}<think>{% endif %}{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
        "{% if add_generation_prompt %}NEXT{% endif %}"
    )
    tok = Tokenizer.from_dir(_write_folder(tmp_path, config={"chat_template": source}))
    checks = RequestChecks(RequestLimits(16, 4, 16, 1 << 20), tok, vocab_size=tok.vocab_size,
                           max_model_len=4096)  # fmt: skip
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    cases = [
        (None, "<hi><yes>NEXT"),
        ({"add_generation_prompt": False}, "<hi><yes>"),
        ({"add_generation_prompt": False, "continue_final_message": True}, "<hi><yes"),
        ({"kwargs": {"think": True}}, "<think><hi><yes>NEXT"),
    ]
    for options, text in cases:
        want = tok.encode(text, add_special_tokens=False)
        for kind in (Generate, Tokenize):
            assert checks.text_ids(kind(id="a", messages=chat, chat_options=options)) == want


def test_a_processors_chat_template_json_when_nothing_else_has_one(tmp_path: Path) -> None:
    """A multimodal checkpoint (Gemma 3's 4B and up) may keep its template in the
    processor's chat_template.json: read when neither tokenizer_config.json nor
    chat_template.jinja has one, never over them."""
    folder = _write_folder(tmp_path / "a", config={})
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "PROC {{ 1 + 1 }}"}))
    assert Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "x"}]) == (
        "PROC 2"
    )
    folder = _write_folder(tmp_path / "b", config={"chat_template": "FROM CONFIG"})
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "PROC"}))
    assert Tokenizer.from_dir(folder).chat_template == "FROM CONFIG"
