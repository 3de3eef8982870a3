"""The tokenizer a GGUF file's metadata describes, as a Hugging Face `tokenizers.Tokenizer`.

A GGUF has no tokenizer.json: it stores the vocabulary, each token's type, and either the
merges and a pre-tokenizer's name (`tokenizer.ggml.pre`) whose splitting rules are compiled
into llama.cpp, or each token's score. `build_tokenizer` guarantees:

- every GGUF token id is kept;
- `tokenizer.ggml.model` "gpt2" (byte-level BPE: Llama 3, Qwen, SmolLM): text is split the
  way llama.cpp splits it for the named pre-tokenizer (its regexes, the ones llama.cpp runs:
  `llama-vocab.cpp`), or the name is refused in one line;
- `tokenizer.ggml.model` "llama" (SentencePiece BPE: Llama 2, Mistral, TinyLlama): spaces
  become "▁", one is put before the text and after each special token where
  `tokenizer.ggml.add_space_prefix` asks (llama.cpp's default), and adjacent pieces merge
  highest score first, as llama.cpp's and SentencePiece's own tokenizers merge them; a
  character outside the vocabulary becomes its UTF-8 bytes' `<0xXX>` tokens. The merges are
  every split of a piece into two pieces, ranked by the whole piece's score, so a merge
  happens exactly where the concatenation is in the vocabulary;
- control tokens are special and user-defined ones (`<think>`) are matched whole, as
  llama.cpp matches both;
- BOS / EOS are added where `tokenizer.ggml.add_{bos,eos}_token` ask for them.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4  # llama.cpp's token types
_SPACE = "\u2581"  # SentencePiece's space, "▁"

# llama.cpp's BPE pre-tokenizer regexes (llama-vocab.cpp), applied one after another.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
# Llama 3's (GPT-4's) and Qwen2's: a letter run may take one non-letter before it; digits go
# in runs of at most three (Llama 3) or one at a time (Qwen2). The contractions are spelled
# with classes where the models' own tokenizer.json have (?i:...), as llama.cpp spells them.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT4_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _GPT4_TAIL
_QWEN2_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _GPT4_TAIL
# Tekken's (Mistral NeMo, Ministral; tiktoken's pattern, as the models' tokenizer.json has it):
# a run of letters splits where lower case follows upper, by Unicode case; no contractions.
# llama.cpp spells the cases as "not a-z" / "not A-Z" (its engine lacks \p{Lu}), which
# splits other scripts' cased letters differently; the models were trained on this one.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek-Coder's (the DeepSeek LLM family's code models): line breaks alone, letter runs
# and punctuation runs with one space before them, CJK runs, digits one at a time.
_DEEPSEEK_CODER_SPLITS = (
    r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}",
)  # fmt: skip
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (the GPT-2 byte mapping
# follows them); the names are those llama.cpp's converter writes.
_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"),
                    (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    "deepseek-coder": _DEEPSEEK_CODER_SPLITS,
}  # fmt: skip


# llama.cpp's names for the SmolLM split (digits alone, then GPT-2's regex): code models'
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
# llama.cpp's names for GPT-2's regex alone (llama-vocab.cpp: GPT2, MPT and OLMO, OLMoE's)
_GPT2 = ("gpt-2", "mpt", "olmo")


def supported_pre_tokenizers() -> tuple[str, ...]:
    return (*_DIGITS_THEN_GPT2, *_GPT2, *_SPLITS)


def supported_tokenizer_models() -> tuple[str, ...]:
    return ("gpt2", "llama")


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `Tokenizer` equivalent to llama.cpp's for this GGUF's vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model not in supported_tokenizer_models():
        raise ValueError(
            f"tokenizer.ggml.model is {model!r}; supported: 'gpt2' (byte-level BPE) and "
            "'llama' (SentencePiece BPE)"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"{len(token_types)} token types for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # on duplicates the first id wins, as in llama.cpp
    if model == "gpt2":
        tokenizer = _byte_level(meta, vocab)
    else:
        tokenizer = _sentencepiece(meta, vocab, token_types)
    typed = list(zip(tokens, token_types, strict=True))
    tokenizer.add_special_tokens([_added(t, True) for t, kind in typed if kind == _TOKEN_CONTROL])
    tokenizer.add_tokens([_added(t, False) for t, kind in typed if kind == _TOKEN_USER_DEFINED])
    tokenizer.post_processor = _post_processor(meta, byte_level=model == "gpt2")
    return tokenizer


def _byte_level(meta: dict[str, Any], vocab: dict[str, int]) -> Tokenizer:
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise ValueError(
            "tokenizer.ggml.merges holds an entry that is not two space-separated tokens"
        )
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(
    meta: dict[str, Any], vocab: dict[str, int], token_types: list[int]
) -> Tokenizer:
    """llama.cpp's SPM tokenizer as a BPE model with byte fallback: the merges rank each
    pair of pieces by the score of the piece they make (highest first, ties by that
    piece's id, then its halves'). Only normal and user-defined pieces merge or are made
    (SentencePiece's own rule; llama.cpp's vocabularies never make another kind)."""
    scores = meta.get("tokenizer.ggml.scores")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if scores is None or len(scores) != len(tokens):
        raise ValueError(
            "tokenizer.ggml.scores must give every token's score for a SentencePiece "
            f"('llama') vocabulary; got {'none' if scores is None else len(scores)} "
            f"for {len(tokens)} tokens"
        )
    pieces = {
        token: token_id
        for token, token_id in vocab.items()
        if token_types[token_id] in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED)
    }
    ranked = []
    for piece, piece_id in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[piece_id], piece_id, pieces[left], pieces[right]))
    ranked.sort()
    merges = [(tokens[left], tokens[right]) for _, _, left, right in ranked]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = None if unk_id is None else tokens[unk_id]
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", _SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), spaces]) if prefix else spaces
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tokenizer


def tokenizer_config(meta: dict[str, Any], max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by name and the chat template (added tokens
    live in tokenizer.json)."""

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else meta["tokenizer.ggml.tokens"][token_id]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def end_token_ids(meta: dict[str, Any]) -> int | list[int] | None:
    """generation_config.json's eos_token_id: the EOS, and llama.cpp's other end-of-generation
    tokens (end of turn, end of message) where the file names them: one id, or a list."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [meta[f"tokenizer.ggml.{k}"] for k in keys if meta.get(f"tokenizer.ggml.{k}") is not None]
    unique = list(dict.fromkeys(ids))
    if not unique:
        return None
    return unique[0] if len(unique) == 1 else unique


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_THEN_GPT2:  # llama.cpp: \p{N} alone, then the GPT-2 regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLITS:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS[pre]]
        return pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    raise ValueError(
        f"tokenizer.ggml.pre is {pre!r}; supported pre-tokenizers: "
        + ", ".join(repr(name) for name in supported_pre_tokenizers())
    )


def _post_processor(meta: dict[str, Any], byte_level: bool) -> processors.PostProcessor:
    """BOS / EOS where `tokenizer.ggml.add_{bos,eos}_token` ask for them, after ByteLevel's
    offsets for a byte-level vocabulary."""
    added: dict[str, tuple[str, int]] = {}
    for what in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{what}_token_id")
        if meta.get(f"tokenizer.ggml.add_{what}_token") and token_id is not None:
            added[what] = (meta["tokenizer.ggml.tokens"][token_id], token_id)
    steps: list[processors.PostProcessor] = (
        [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    )
    if added:
        bos = [added["bos"][0]] if "bos" in added else []
        eos = [added["eos"][0]] if "eos" in added else []
        steps.append(
            processors.TemplateProcessing(
                single=[*bos, "$A", *eos],
                pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
                special_tokens=list(added.values()),
            )
        )
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)
