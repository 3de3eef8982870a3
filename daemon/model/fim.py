"""Fill in the middle: a code model's prompt for the text between a prefix and a suffix,
for OpenAI's `suffix` (/v1/completions) and llama.cpp's /infill.

Code models learn the task with special tokens around the two sides, in an order of
their own. `find_fim` reads which of the known sets a vocabulary holds (all of a set's
tokens, as added or special tokens), and `infill_prompt` lays a request out in it:

- Qwen2.5-Coder, Qwen3-Coder, CodeGemma: `<|fim_prefix|>` PREFIX `<|fim_suffix|>` SUFFIX
  `<|fim_middle|>`, with `<|file_sep|>` before each other file of the repository;
- StarCoder 2, Granite Code: `<fim_prefix>` ... `<fim_suffix>` ... `<fim_middle>`, with
  `<file_sep>`;
- DeepSeek-Coder: `<｜fim▁begin｜>` PREFIX `<｜fim▁hole｜>` SUFFIX `<｜fim▁end｜>`;
- Codestral (Mistral's control tokens, suffix first): `[SUFFIX]` SUFFIX `[PREFIX]` PREFIX.

The prompt is text with the tokens spelled out, so the daemon's tokenizer reads them as
the special tokens they are (and adds the BOS where the model wants one), as it reads any
prompt. Guarantee: the prompt ends where the model is to write: after the middle token
(after the prefix in Codestral's order) and then `start`, the middle's first characters
if the request gives them (llama.cpp's `prompt`). Other files of the repository (llama.cpp's
`input_extra`) go first, each as the file separator, its name, a newline and its text;
a model without a separator refuses them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FimTokens:
    """One model family's fill-in-the-middle tokens."""

    prefix: str
    suffix: str
    middle: str | None  # None: the suffix comes first, the prefix last (Codestral's)
    file_sep: str | None = None  # before each other file's name and text (repository)

    def as_wire(self) -> list[str | None]:
        return [self.prefix, self.suffix, self.middle, self.file_sep]

    @classmethod
    def from_wire(cls, value: Sequence[str | None]) -> FimTokens:
        prefix, suffix, middle, file_sep = value
        assert prefix is not None and suffix is not None
        return cls(prefix, suffix, middle, file_sep)


KNOWN = (
    FimTokens("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"),
    FimTokens("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"),
    FimTokens("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimTokens("[PREFIX]", "[SUFFIX]", None),
)


def find_fim(vocabulary: Collection[str]) -> FimTokens | None:
    """The first known set whose tokens the vocabulary (with its added tokens) holds all
    of; its file separator only if the vocabulary has that too. None: no fill-in-the-middle."""
    for fim in KNOWN:
        needed = [fim.prefix, fim.suffix] + ([fim.middle] if fim.middle else [])
        if all(token in vocabulary for token in needed):
            sep = fim.file_sep if fim.file_sep in vocabulary else None
            return FimTokens(fim.prefix, fim.suffix, fim.middle, sep)
    return None


def infill_prompt(
    fim: FimTokens,
    prefix: str,
    suffix: str,
    *,
    start: str = "",
    files: Sequence[tuple[str, str]] = (),
) -> str:
    """The prompt asking for the text between `prefix` and `suffix`, the model writing on
    from `start`; `files` ((name, text) of other files, as context) go first, each after
    the file separator (ValueError when the model has none)."""
    if files and fim.file_sep is None:
        raise ValueError("this model has no file separator token for other files' text")
    context = "".join(f"{fim.file_sep}{name}\n{text}" for name, text in files)
    if fim.middle is None:  # Codestral: suffix first, the prefix runs into the answer
        return f"{context}{fim.suffix}{suffix}{fim.prefix}{prefix}{start}"
    return f"{context}{fim.prefix}{prefix}{fim.suffix}{suffix}{fim.middle}{start}"
