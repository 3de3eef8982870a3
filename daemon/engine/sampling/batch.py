"""One step's sampling work, gathered from the requests' states into named arrays
for the backend.

Guarantee: every field is taken from one request's state and the position of
its token alone, so a row's entry is the same whatever else is in the step.
A step whose requests are all greedy without penalties has no batch at all: its
tokens are the forward's argmax. A row no token can be drawn from (its mask keeps only
tokens its bias puts at -inf) is named in `dead_rows`, found on the host from the mask
words and the biases alone, so no logits are read back for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....cuda.penalties import LogitBias, Penalties, TokenMask, mask_words
from ....cuda.sampling import Draws
from .state import SamplingState
from .structured import fill_masks


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """The logits rows a step must do more than argmax on, greedy ones first.

    `rows[:num_greedy]` take the argmax of their penalized row; `rows[num_greedy:]`
    are drawn at random, as `draws` says (one entry each, in order). `penalties` has
    one entry per row of `rows` (None: no row is penalized)."""

    rows: np.ndarray  # [S] int64, indices into the step's logits rows
    num_greedy: int
    draws: Draws | None  # None: no row is drawn at random
    penalties: Penalties | None
    # rows of the step's logits whose mask (a grammar's or allowed_token_ids') keeps only
    # tokens at -inf (bad_words' bans, min_tokens' held stop tokens): their token is none
    dead_rows: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        states: list[SamplingState],
        positions: list[int],
        vocab: int,
        masks: dict[int, np.ndarray] | None = None,
    ) -> SamplingBatch | None:
        """The batch of logits rows whose request i has `states[i]` and draws its token
        at `positions[i]`; None when every row's token is its argmax. `masks`: the
        grammar masks of rows whose grammar is ahead of its place (a draft's rows), by
        row; the other grammar rows' are computed here."""
        greedy = [i for i, s in enumerate(states) if s.temperature == 0 and not s.plain_greedy]
        drawn = [i for i, s in enumerate(states) if s.temperature != 0]
        if not greedy and not drawn:
            return None
        order = greedy + drawn
        picked = [states[i] for i in order]
        given = None if masks is None else {k: masks[i] for k, i in enumerate(order) if i in masks}
        penalties = _penalties(picked, vocab, given)
        return cls(
            rows=np.asarray(order, dtype=np.int64),
            num_greedy=len(greedy),
            draws=_draws([states[i] for i in drawn], [positions[i] for i in drawn], vocab),
            penalties=penalties,
            dead_rows=tuple(order[k] for k in _dead_rows(picked, penalties, vocab)),
        )


def _draws(states: list[SamplingState], positions: list[int], vocab: int) -> Draws | None:
    if not states:
        return None
    return Draws(
        temperature=np.asarray([s.temperature for s in states], dtype=np.float32),
        top_k=np.asarray([min(s.top_k or vocab, vocab) for s in states], dtype=np.int32),
        top_p=np.asarray([s.top_p for s in states], dtype=np.float32),
        min_p=np.asarray([s.min_p for s in states], dtype=np.float32),
        seeds=np.asarray([s.seed for s in states], dtype=np.uint64),
        positions=np.asarray(positions, dtype=np.int64),
    )


def _penalties(
    states: list[SamplingState], vocab: int, given: dict[int, np.ndarray] | None = None
) -> Penalties | None:
    lists = [s.penalty_tokens for s in states]
    biases = [s.bias for s in states]  # once: a request's bad words make it a computation
    if all(t is None for t in lists) and all(
        b is None and s.grammar is None and s.allowed_ids is None
        for s, b in zip(states, biases, strict=True)
    ):
        return None
    sizes = [0 if tokens is None else tokens.size for tokens in lists]
    present = [tokens for tokens in lists if tokens is not None]
    empty = np.empty(0, np.int32)
    return Penalties(
        repetition=np.asarray([s.repetition_penalty for s in states], dtype=np.float32),
        frequency=np.asarray([s.frequency_penalty for s in states], dtype=np.float32),
        presence=np.asarray([s.presence_penalty for s in states], dtype=np.float32),
        token_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32),
        token_ids=np.concatenate([empty] + [t.token_ids[: t.size] for t in present]),
        output_counts=np.concatenate([empty] + [t.output_counts[: t.size] for t in present]),
        bias=_bias(biases),
        mask=_mask(states, vocab, given),
    )


def _bias(biases: list[tuple[np.ndarray, np.ndarray] | None]) -> LogitBias | None:
    """The rows' biases (each row's SamplingState.bias) as one LogitBias."""
    biased = [b for b in biases if b is not None]
    if not biased:
        return None
    sizes = [0 if b is None else b[0].size for b in biases]
    return LogitBias(
        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32),
        ids=np.concatenate([ids for ids, _ in biased]),
        values=np.concatenate([values for _, values in biased]),
    )


def _mask(
    states: list[SamplingState], vocab: int, given: dict[int, np.ndarray] | None = None
) -> TokenMask | None:
    """The rows' masks: a grammar's (`given` rows' as given), or allowed_token_ids' (a
    request has one or the other), every bit set in a row with neither; None when no
    row has one."""
    if all(s.grammar is None and s.allowed_ids is None for s in states):
        return None
    words = np.full((len(states), mask_words(vocab)), 0xFFFFFFFF, dtype=np.uint32)
    for r, row in (given or {}).items():
        words[r] = row
    rows = [r for r, s in enumerate(states) if s.grammar is not None and r not in (given or {})]
    if rows:
        masks = np.empty((len(rows), words.shape[1]), np.uint32)  # the grammars' rows, packed
        fill_masks([states[r].grammar for r in rows], masks)  # type: ignore[misc]
        words[rows] = masks
    for r, state in enumerate(states):
        if state.allowed_ids is not None:
            words[r] = state.allowed_mask(vocab)
    return TokenMask(words)


def _dead_rows(states: list[SamplingState], penalties: Penalties | None, vocab: int) -> list[int]:
    """The rows (of `states`) whose mask keeps no token their bias leaves above -inf. Only
    a row with a mask (a grammar or allowed_token_ids) and a -inf bias can be one, and
    only those rows' words are looked at."""
    if penalties is None or penalties.mask is None or penalties.bias is None:
        return []
    bias = penalties.bias
    banned = np.isneginf(bias.values)
    if not banned.any():
        return []
    row_of = np.repeat(np.arange(len(states)), np.diff(bias.offsets))[banned]  # [N] per -inf
    masked = np.fromiter((s.grammar is not None or s.allowed_ids is not None for s in states),
                         dtype=bool, count=len(states))  # fmt: skip
    ids, row_of = bias.ids[banned][masked[row_of]], row_of[masked[row_of]]
    rows = np.unique(row_of)
    words = penalties.mask.words[rows]  # [len(rows), ceil(vocab / 32)] uint32, a copy
    bits = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
    np.bitwise_and.at(words, (np.searchsorted(rows, row_of), ids >> 5), ~bits)
    if vocab % 32:  # bits past the vocabulary are no tokens
        words[:, -1] &= np.uint32((1 << (vocab % 32)) - 1)
    return rows[~words.any(axis=1)].tolist()
