"""Sampling, in one place, in the order a request meets it:

- `params`: SamplingParams, what a request asks for, validated on construction;
- `state`: SamplingState, built once per request: its settings and the token
  counts its penalties need;
- `batch`: SamplingBatch, one step's work in named arrays (Draws, Penalties);
- `sampler`: `next_tokens`, the runner's one call, on the device or the host;
- `structured`: structured outputs (a JSON schema, a regex, a grammar...), each
  step's mask of the tokens a request's grammar allows next;
- `logprobs`: the raw model's log-probabilities of a chosen token and its
  alternatives, for requests that ask.

Guarantee (DESIGN §4): a token, and its logprobs, depend on its logits row, its
request's settings and tokens, and its position alone, so they stay
bit-identical under prefix reuse and batching. The defaults (no penalties, no
logprobs) leave every token what the argmax or the seeded draw gives.
"""

from .batch import SamplingBatch
from .logprobs import TokenLogprobs
from .params import MAX_LOGPROBS, SamplingParams
from .sampler import next_tokens
from .state import SamplingState
from .structured import Grammar, Grammars, StructuredOutput

__all__ = [
    "MAX_LOGPROBS",
    "Grammar",
    "Grammars",
    "SamplingBatch",
    "SamplingParams",
    "SamplingState",
    "StructuredOutput",
    "TokenLogprobs",
    "next_tokens",
]
