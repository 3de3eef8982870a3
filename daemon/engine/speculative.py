"""Speculative decoding without a draft model: drafts of a request's next tokens, found
in its own tokens (prompt lookup, an n-gram match, as vLLM's "ngram" method) or forced
by its grammar, checked by the model in one step.

A decode step of a request with a draft d_1..d_m computes its pending token and the
draft as one chunk, and samples at each of the m + 1 positions exactly as decoding
would there: the same logits row bits (DESIGN §4: a position's logits do not depend
on the chunk it is computed in), and the same draw (keyed by the request's seed and
the token's position). Sample i + 1 is the request's token wherever d_1..d_i were its
tokens, so the request keeps the samples while they equal the draft, and the first
that differs: its output is bit for bit the one decoding one token a step gives, with
any sampling settings. (vLLM's rejection sampling keeps the distribution, not the
tokens.) The K/V written at rejected positions is never read: attention reads a
sequence's positions below its length, and a position is written again before any
query reaches it; blocks are registered only up to the accepted positions.

A request whose sampler carries state from token to token samples each row with
the state it would have there: penalties counting the draft tokens before the row,
the min_tokens hold by the row's own count (`SamplingState.ahead`), and a grammar's
mask after the draft tokens before it (`Grammar.masks_with_draft`). A grammar's draft
is the tokens it forces next, when there are any (llguidance's fast-forward tokens:
drafted like this, they cost the model one step for all of them), else the n-gram
draft cut where the grammar would refuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sequence import RequestId, Sequence


@dataclass(slots=True)
class TokenHistory:
    """A sequence's tokens as one int32 array, appended to as it grows (doubling)."""

    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    size: int = 0

    def sync(self, seq: Sequence) -> np.ndarray:
        """The sequence's tokens so far, [num_tokens] (a view)."""
        num = seq.num_tokens
        if self.size < num:
            if num > self.tokens.size:
                grown = np.empty(max(2 * self.tokens.size, num + 64), dtype=np.int32)
                grown[: self.size] = self.tokens[: self.size]
                self.tokens = grown
            self.tokens[self.size : num] = seq.token_ids(self.size, num)
            self.size = num
        return self.tokens[:num]


def find_draft(tokens: np.ndarray, num_draft: int, ngram_min: int, ngram_max: int) -> np.ndarray:
    """The tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` (`ngram_max` down to `ngram_min` tokens long) seen before: at
    most `num_draft` of them, none when no such suffix occurs."""
    n = tokens.size
    if n < ngram_min + 1:
        return tokens[:0]
    # ends of earlier occurrences of the last token (the suffix itself ends at n - 1)
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    length = 1
    while ends.size and length < min(ngram_max, n - 1):
        longer = ends[ends >= length]
        longer = longer[tokens[longer - length] == tokens[n - 1 - length]]
        if not longer.size:
            break
        ends, length = longer, length + 1
    if not ends.size or length < ngram_min:
        return tokens[:0]
    end = int(ends[-1])  # the most recent of the longest matches
    return tokens[end + 1 : end + 1 + num_draft]


@dataclass(slots=True)
class Speculator:
    """Drafts for decode steps, and how many of their tokens were kept."""

    num_tokens: int  # the most draft tokens a step proposes for a request
    ngram_min: int
    ngram_max: int
    vocab_size: int  # drafts stop before a prompt-table id (no vocabulary entry)
    max_model_len: int
    num_draft_tokens: int = 0  # proposed so far
    num_accepted_tokens: int = 0  # of them, equal to the token sampled there
    histories: dict[RequestId, TokenHistory] = field(default_factory=dict)

    def draft(self, seq: Sequence, room: int) -> list[int]:
        """At most `room` draft tokens for `seq`'s next decode step: none unless it is
        decoding (one pending token, after its first) and its grammar forces tokens or
        its tokens have an n-gram to follow; never past its max_tokens or the context
        (the sampled tokens past an end are never kept)."""
        if room < 1 or seq.num_pending_tokens != 1 or not seq.output_token_ids:
            return []
        limit = min(
            self.num_tokens,
            room,
            seq.params.max_tokens - len(seq.output_token_ids) - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if limit < 1:
            return []
        grammar = seq.sampling.grammar
        if grammar is None:
            return self.propose(seq, limit)
        return grammar.forced(limit) or grammar.taken(self.propose(seq, limit))

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most `limit` tokens that may follow `seq`'s (`find_draft`), cut before the
        first prompt-table id."""
        history = self.histories.get(seq.request_id)
        if history is None:
            history = self.histories[seq.request_id] = TokenHistory()
        found = find_draft(history.sync(seq), limit, self.ngram_min, self.ngram_max)
        fake = np.flatnonzero(found >= self.vocab_size)
        return found[: fake[0] if fake.size else found.size].tolist()

    def forget(self, seq: Sequence) -> None:
        """Drop a finished request's history."""
        self.histories.pop(seq.request_id, None)
