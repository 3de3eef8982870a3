"""vLLM's `bad_words`: words a request's answer may not contain, as token sequences.

Each word is tokenized twice, as vLLM does: as written (its leading spaces dropped),
and with one space before it, kept when that spelling is as many tokens and begins
with another token (the word in the middle of a text). A one-token sequence bans its
token at every row; a longer one bans its last token at a row whose request's last
generated tokens are the rest of it. Only generated tokens count, never the prompt's
(vLLM's). A banned token's logit is -inf before the penalties, so it is never drawn,
greedy or not; logprobs stay the raw model's.

Guarantee: a row's bans depend on the request's words and its generated tokens before
that row alone (a draft's row sees the draft tokens before it as generated), so
tokens stay bit-identical however the request is batched, reused or drafted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

MAX_BAD_WORDS = 128  # words one request may ban
MAX_BAD_WORD_CHARS = 256  # characters of one word

TokenSeq = tuple[int, ...]


def check_bad_words(words: object) -> list[str] | None:
    """`words` as a list of words (None when empty), or ValueError saying what is allowed."""
    if words is None:
        return None
    if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
        raise ValueError(
            f"bad_words must be a list of at most {MAX_BAD_WORDS} strings; got {words!r:.60}"
        )
    for word in words:
        if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise ValueError(
                f"bad_words[] must be strings of 1 to {MAX_BAD_WORD_CHARS} characters, not "
                f"only spaces; got {word!r:.60}"
            )
    return words or None


def tokenize_bad_words(
    words: Sequence[str], encode: Callable[[str], list[int]]
) -> tuple[TokenSeq, ...]:
    """The token sequences `words` ban (module docstring), in order, without repeats.
    `encode`: text -> ids, with no special tokens."""
    seqs: list[TokenSeq] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        seqs.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            seqs.append(spaced)
    return tuple(dict.fromkeys(s for s in seqs if s))


@dataclass(frozen=True, slots=True)
class BadWords:
    """One request's banned sequences: tokens banned everywhere, and the longer ones."""

    always: np.ndarray  # [A] int32, ascending: the one-token sequences
    after: tuple[TokenSeq, ...]  # the longer sequences
    keep: int  # generated tokens the longer ones look back at (the longest's length - 1)
    # the longer sequences by their next-to-last token: a row looks only at those whose
    # next-to-last is the token before it, so a step costs a lookup, not every sequence
    by_last: dict[int, tuple[TokenSeq, ...]]

    @classmethod
    def of(cls, seqs: Sequence[TokenSeq]) -> BadWords | None:
        if not seqs:
            return None
        always = sorted({s[0] for s in seqs if len(s) == 1})
        after = tuple(s for s in seqs if len(s) > 1)
        by_last: dict[int, list[TokenSeq]] = {}
        for s in after:
            by_last.setdefault(s[-2], []).append(s)
        return cls(
            always=np.asarray(always, dtype=np.int32),
            after=after,
            keep=max((len(s) - 1 for s in after), default=0),
            by_last={k: tuple(v) for k, v in by_last.items()},
        )

    def banned(self, recent: TokenSeq) -> np.ndarray:
        """The tokens banned at a row whose request's last generated tokens are `recent`
        (at most `keep` of them): ascending int32."""
        near = self.by_last.get(recent[-1], ()) if recent else ()
        hits = [s[-1] for s in near if len(s) - 1 <= len(recent) and recent[1 - len(s) :] == s[:-1]]
        if not hits:
            return self.always
        return np.union1d(self.always, np.asarray(hits, dtype=np.int32)).astype(np.int32)


def with_banned(
    bias: tuple[np.ndarray, np.ndarray] | None, banned: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """A logit bias (ascending ids, values) with the `banned` tokens at -inf."""
    if banned.size == 0:
        return bias
    if bias is None:
        return banned, np.full(banned.size, -np.inf, dtype=np.float32)
    ids = np.union1d(bias[0], banned).astype(np.int32)
    values = np.zeros(ids.size, dtype=np.float32)
    values[np.searchsorted(ids, bias[0])] = bias[1]
    values[np.searchsorted(ids, banned)] = -np.inf
    return ids, values
