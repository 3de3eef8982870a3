"""Choose each sampling sequence's next token from its logits row."""

from __future__ import annotations

import numpy as np

from reprise.cuda.sampling import argmax_ref, sample_ref
from reprise.daemon.params import SamplingParams


def sample_token(logits: np.ndarray, params: SamplingParams, seed: int, position: int) -> int:
    """logits: [vocab] fp32 of the token at `position - 1`; returns the token for `position`."""
    if params.greedy:
        return argmax_ref(logits)
    return sample_ref(
        logits,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=seed,
        position=position,
    )
