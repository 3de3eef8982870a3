"""Next tokens from a step's logits rows: greedy rows by the backend's argmax, the
others by its seeded sampling (`sample_ref` on NumPy, a kernel on the GPU), each
draw keyed by the request's seed and the token's position, so a token depends on
nothing but its row and those two numbers."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cuda.protocol import Backend, SampleDraws
from .sequence import Sequence


def next_tokens(ops: Backend, logits: Any, greedy: Any, seqs: list[Sequence]) -> Any:
    """[>= len(seqs)] int32 backend array: row i is seqs[i]'s next token. `greedy` is the
    argmax of each row of `logits` (whose row i is seqs[i]'s)."""
    drawn = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if not drawn:
        return greedy
    vocab = logits.shape[1]
    picked = [seqs[i] for i in drawn]
    draws = SampleDraws(
        temperature=np.asarray([s.params.temperature for s in picked], dtype=np.float32),
        top_k=np.asarray([min(s.params.top_k or vocab, vocab) for s in picked], dtype=np.int32),
        top_p=np.asarray([s.params.top_p for s in picked], dtype=np.float32),
        seeds=np.asarray([s.seed for s in picked], dtype=np.uint64),
        positions=np.asarray([s.num_tokens for s in picked], dtype=np.int64),
    )
    return ops.sample(logits, greedy, np.asarray(drawn), draws)
