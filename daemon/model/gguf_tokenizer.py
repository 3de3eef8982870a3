"""The tokenizer a GGUF file's metadata describes, as a Hugging Face `tokenizers.Tokenizer`.

A GGUF has no tokenizer.json: it stores the vocabulary, the merges, each token's type and a
pre-tokenizer's name (`tokenizer.ggml.pre`) whose splitting rules are compiled into
llama.cpp. `build_tokenizer` guarantees:

- byte-level BPE (`tokenizer.ggml.model` "gpt2") only; every GGUF token id is kept;
- text is split the way llama.cpp splits it for the named pre-tokenizer (its regexes, the
  ones llama.cpp runs: `llama-vocab.cpp`), or the name is refused in one line;
- control tokens are special and user-defined ones (`<think>`) are matched whole, as
  llama.cpp matches both;
- BOS / EOS are added where `tokenizer.ggml.add_{bos,eos}_token` ask for them.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token types

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

# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (the GPT-2 byte mapping
# follows them); the names are those llama.cpp's converter writes.
_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"),
                    (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
}  # fmt: skip


def supported_pre_tokenizers() -> tuple[str, ...]:
    return ("smollm", "gpt-2", *_SPLITS)


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE `Tokenizer` equivalent to llama.cpp's for this GGUF's vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"{len(token_types)} token types for {len(tokens)} tokens")
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise ValueError(
            "tokenizer.ggml.merges holds an entry that is not two space-separated tokens"
        )
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # on duplicates the first id wins, as in llama.cpp
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=True))
    tokenizer.add_special_tokens([_added(t, True) for t, kind in typed if kind == _TOKEN_CONTROL])
    tokenizer.add_tokens([_added(t, False) for t, kind in typed if kind == _TOKEN_USER_DEFINED])
    tokenizer.post_processor = _post_processor(meta)
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
    if pre == "smollm":  # llama.cpp: \p{N} alone, then the GPT-2 regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre == "gpt-2":
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


def _post_processor(meta: dict[str, Any]) -> processors.PostProcessor:
    """ByteLevel offsets, plus BOS / EOS where `tokenizer.ggml.add_{bos,eos}_token` ask for them."""
    added: dict[str, tuple[str, int]] = {}
    for what in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{what}_token_id")
        if meta.get(f"tokenizer.ggml.add_{what}_token") and token_id is not None:
            added[what] = (meta["tokenizer.ggml.tokens"][token_id], token_id)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not added:
        return byte_level
    bos = [added["bos"][0]] if "bos" in added else []
    eos = [added["eos"][0]] if "eos" in added else []
    template = processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=list(added.values()),
    )
    return processors.Sequence([byte_level, template])


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)
