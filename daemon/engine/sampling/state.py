"""Per-request sampling state, built once when a request arrives: its settings in
the form the batch wants them, and the token counts its penalties need.

Guarantee: a request without penalties keeps no token index and `record` costs
it a count and one attribute test; one with penalties keeps each distinct token of its
prompt (for the repetition penalty) and its output once, with the times it was
generated, updated in O(1) per token.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field, replace

import numpy as np

from ....cuda.penalties import mask_of
from .bad_words import BadWords, TokenSeq, with_banned
from .logprobs import TokenLogprobs, token_logprobs
from .params import SamplingParams
from .structured import Grammar


@dataclass(slots=True)
class PenaltyTokens:
    """The distinct tokens a request's penalties apply to, with their output counts.

    NOTE: `token_ids[:size]` are distinct and `slot_of[token_ids[i]] == i`; the arrays
    grow by doubling, so a step hands the backend views, not copies of a dict."""

    slot_of: dict[int, int] = field(default_factory=dict)
    token_ids: np.ndarray = field(default_factory=lambda: np.empty(64, dtype=np.int32))
    output_counts: np.ndarray = field(default_factory=lambda: np.empty(64, dtype=np.int32))
    size: int = 0

    @classmethod
    def of_prompt(cls, prompt_token_ids: list[int]) -> PenaltyTokens:
        unique = np.unique(np.asarray(prompt_token_ids, dtype=np.int32))
        capacity = max(64, 2 * unique.size)
        tokens = cls(
            slot_of=dict(zip(unique.tolist(), range(unique.size), strict=True)),
            token_ids=np.empty(capacity, dtype=np.int32),
            output_counts=np.empty(capacity, dtype=np.int32),
            size=unique.size,
        )
        tokens.token_ids[: unique.size] = unique
        tokens.output_counts[: unique.size] = 0
        return tokens

    def plus(self, token_ids: list[int]) -> PenaltyTokens:
        """A copy with `token_ids` counted as output too (what recording them would make)."""
        tokens = PenaltyTokens(
            slot_of=dict(self.slot_of),
            token_ids=self.token_ids.copy(),
            output_counts=self.output_counts.copy(),
            size=self.size,
        )
        for token_id in token_ids:
            tokens.count_output(token_id)
        return tokens

    def count_output(self, token_id: int) -> None:
        slot = self.slot_of.get(token_id)
        if slot is None:
            if self.size == self.token_ids.size:
                self.token_ids = np.resize(self.token_ids, 2 * self.size)
                self.output_counts = np.resize(self.output_counts, 2 * self.size)
            slot = self.slot_of[token_id] = self.size
            self.token_ids[slot] = token_id
            self.output_counts[slot] = 0
            self.size += 1
        self.output_counts[slot] += 1


@dataclass(slots=True)
class SamplingState:
    """How one request's next tokens are chosen, and what choosing them depends on."""

    seed: int  # the request's seed, or one drawn for it
    temperature: float  # 0: greedy
    top_k: int | None
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    num_logprobs: int | None  # None: no logprobs
    reads_row: bool  # whether its logits row comes back to the host each step
    penalty_tokens: PenaltyTokens | None  # None: no penalties
    # logit_bias as [B] int32 ids (ascending) and [B] fp32 values; None: no bias
    logit_bias: tuple[np.ndarray, np.ndarray] | None
    min_tokens: int
    # the bias while fewer than min_tokens tokens are out: logit_bias with every stop
    # token at -inf (logit_bias itself when there is no stop token to hold back)
    held_bias: tuple[np.ndarray, np.ndarray] | None
    grammar: Grammar | None = None  # a structured output's place in its grammar
    # allowed_token_ids, ascending and distinct; None: every token
    allowed_ids: np.ndarray | None = None
    bad_words: BadWords | None = None  # bad_words' sequences; None: none
    recent: TokenSeq = ()  # the last generated tokens bad_words' longer sequences look at
    num_outputs: int = 0
    _allowed_mask: np.ndarray | None = None  # allowed_ids as a mask row, once made

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        seed: int,
        prompt_token_ids: list[int],
        stop_ids: Collection[int] = (),
        grammar: Grammar | None = None,
        bad_words: Collection[TokenSeq] = (),
    ) -> SamplingState:
        """`stop_ids`: the vocabulary tokens that would end the request (eos unless
        ignore_eos, and its stop_token_ids), held back until `params.min_tokens` are out;
        `grammar`: its structured output's, started (the engine compiles it);
        `bad_words`: the token sequences its bad_words ban (bad_words.py)."""
        tokens = None
        if params.repetition_penalty != 1:
            tokens = PenaltyTokens.of_prompt(prompt_token_ids)
        elif params.penalized:  # frequency and presence count the output alone
            tokens = PenaltyTokens()
        bias = held = _bias_arrays(params.logit_bias)
        if params.min_tokens and stop_ids:
            held = _bias_arrays({**(params.logit_bias or {}), **dict.fromkeys(stop_ids, -math.inf)})
        return cls(
            seed=seed,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            num_logprobs=params.logprobs,
            reads_row=params.return_logits or params.logprobs is not None,
            penalty_tokens=tokens,
            logit_bias=bias,
            min_tokens=params.min_tokens,
            held_bias=held,
            grammar=grammar,
            allowed_ids=(
                None
                if params.allowed_token_ids is None
                else np.unique(np.asarray(params.allowed_token_ids, dtype=np.int32))
            ),
            bad_words=BadWords.of(list(bad_words)),
        )

    @property
    def bias(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The bias of the next token's row: logit_bias, with the stop tokens at -inf
        while fewer than min_tokens tokens are out, and the tokens bad_words bans there
        at -inf."""
        bias = self.held_bias if self.num_outputs < self.min_tokens else self.logit_bias
        if self.bad_words is None:
            return bias
        return with_banned(bias, self.bad_words.banned(self.recent))

    @property
    def plain_greedy(self) -> bool:
        """The row's argmax is the token: greedy with no penalty, bias, bad words, grammar
        or allowed tokens."""
        return (
            self.temperature == 0
            and self.penalty_tokens is None
            and self.bad_words is None  # (its bans are computed only where the row is built)
            and self.bias is None
            and self.grammar is None
            and self.allowed_ids is None
        )

    def dead_end(self) -> str:
        """Why no token can follow (SamplingBatch.dead_rows found its row's mask keeping
        only tokens at -inf), as one line naming what allows and what forbids them."""
        allows = "the structured output's grammar" if self.grammar is not None else "allowed_token_ids"
        forbids = ["banned by bad_words"] if self.bad_words is not None else []
        if self.num_outputs < self.min_tokens and self.held_bias is not self.logit_bias:
            forbids.append(f"held back by min_tokens ({self.min_tokens}: the stop tokens)")
        return (
            f"no token can come next (after {self.num_outputs} generated): {allows} admits "
            f"only tokens {' or '.join(forbids)}"
        )

    def allowed_mask(self, vocab: int) -> np.ndarray:
        """allowed_ids as a mask row (penalties.TokenMask's layout), made once."""
        assert self.allowed_ids is not None
        if self._allowed_mask is None:
            self._allowed_mask = mask_of(self.allowed_ids, vocab)
        return self._allowed_mask

    @property
    def stateless(self) -> bool:
        """Each next row's token depends on that row and its position alone: no penalty
        counts, grammar or bad words' longer sequences that the token before changes, and
        no min_tokens hold left to lift."""
        return (
            self.penalty_tokens is None
            and self.grammar is None
            and self.num_outputs >= self.min_tokens
            and (self.bad_words is None or not self.bad_words.after)
        )

    def ahead(self, token_ids: list[int]) -> SamplingState:
        """The state after recording `token_ids` (speculative.py: a draft's row is sampled
        as if the draft tokens before it were the request's), but for its grammar, whose
        masks ahead the caller computes (`Grammar.masks_with_draft`); itself when
        stateless."""
        if not token_ids or self.stateless:
            return self
        tokens = None if self.penalty_tokens is None else self.penalty_tokens.plus(token_ids)
        return replace(self, penalty_tokens=tokens, num_outputs=self.num_outputs + len(token_ids),
                       recent=self._recent_with(token_ids))  # fmt: skip

    def record(self, token_id: int, row: np.ndarray | None) -> TokenLogprobs | None:
        """Count a token drawn from `row` (the raw logits, when `reads_row`); returns
        its logprobs if the request asked for them."""
        self.num_outputs += 1
        if self.bad_words is not None and self.bad_words.keep:
            self.recent = self._recent_with((token_id,))
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.penalty_tokens is not None:
            self.penalty_tokens.count_output(token_id)
        if self.num_logprobs is None:
            return None
        assert row is not None, "the runner reads back the row of a request with logprobs"
        return token_logprobs(row, token_id, self.num_logprobs)

    def _recent_with(self, token_ids: Collection[int]) -> TokenSeq:
        """`recent` after `token_ids` are generated: the last bad_words' `keep` tokens."""
        keep = 0 if self.bad_words is None else self.bad_words.keep
        return (self.recent + tuple(token_ids))[-keep:] if keep else ()


def _bias_arrays(bias: dict[int, float] | None) -> tuple[np.ndarray, np.ndarray] | None:
    if not bias:
        return None
    ids = np.fromiter(sorted(bias), dtype=np.int32, count=len(bias))
    return ids, np.asarray([bias[i] for i in ids.tolist()], dtype=np.float32)
