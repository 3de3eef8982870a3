"""Per-token log-probabilities, for requests that ask (SamplingParams.logprobs).

They are the raw model's, as vLLM's default: log_softmax of the logits row the
token was drawn from, before penalties and temperature. Both backends compute
them here, on the host, from that row: the runner reads a row back only for a
request that asked, after the step (a captured decode graph is not touched),
and one row's log_softmax costs about as much as its copy.

Guarantee: a token's logprobs are a function of its logits row's bits alone.
The row is widened to float64 (exact), shifted by its maximum (exact), and
exp-summed over one contiguous float64 array, whose pairwise summation order
NumPy fixes by the length alone; each logprob is then rounded once to fp32. So
with the row bit-identical under reuse and batching (DESIGN §4), its logprobs
are too, and they are within an fp32 rounding of the exact log_softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....cuda.dtypes import F32
from ....cuda.sampling import ranked


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's logprob and the `num_top` most likely tokens', highest first
    (equal logprobs by lower id), and the chosen token's rank (vLLM's: the number of
    tokens at least as likely as it, itself included, so 1 for the only most likely)."""

    token_id: int
    logprob: float  # an fp32 value
    top: tuple[tuple[int, float], ...]  # (token id, logprob)
    rank: int


def log_softmax(row: np.ndarray) -> np.ndarray:
    """[vocab] fp32 logits -> [vocab] fp32 logprobs, a function of the row's bits alone."""
    wide = np.array(row, dtype=np.float64)  # a fresh contiguous array: the sum's order is fixed
    shifted = wide - wide.max()
    total = np.sum(np.exp(shifted))
    return (shifted - np.log(total)).astype(F32)


def token_logprobs(row: np.ndarray, token_id: int, num_top: int) -> TokenLogprobs:
    """The logprobs of `token_id` and of the `num_top` most likely tokens of `row`."""
    logprobs = log_softmax(row)
    top = ranked(logprobs, num_top).tolist() if num_top else []
    own = logprobs[token_id]
    return TokenLogprobs(
        token_id=token_id,
        logprob=float(own),
        top=tuple((t, float(logprobs[t])) for t in top),
        rank=int(np.count_nonzero(logprobs >= own)),
    )
