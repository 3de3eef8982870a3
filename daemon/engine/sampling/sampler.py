"""Next tokens from a step's logits rows, on the backend the model runs on (device
or host): the one call the runner makes.

A greedy row without penalties takes the forward's argmax. The other rows are
copied out of the logits (which stay raw, for returned logits and logprobs),
penalized, then a greedy one takes the backend's argmax of its penalized row
and a random one its seeded draw (`sample_ref` on NumPy, a kernel on the GPU),
keyed by the request's seed and the token's position. Every step of this acts
on a row alone, so a token depends on nothing but its raw row, its request's
settings and token counts, and its position: not on the batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ....cuda.protocol import Backend
from .batch import SamplingBatch
from .state import SamplingState


def next_tokens(
    ops: Backend,
    logits: Any,
    greedy: Any,
    states: list[SamplingState],
    positions: list[int],
    masks: dict[int, np.ndarray] | None = None,
) -> tuple[Any, tuple[int, ...]]:
    """[>= len(states)] int32 backend array: row i is the token drawn from `logits` row i
    by a request of `states[i]` at `positions[i]` (the index the token will have in its
    sequence); and the rows no token can be drawn from (SamplingBatch.dead_rows), whose
    entries are no tokens. `greedy` is the argmax of each row of `logits`. `masks`:
    grammar masks given by row (SamplingBatch.build)."""
    if all(state.plain_greedy for state in states):
        return greedy, ()
    batch = SamplingBatch.build(states, positions, logits.shape[1], masks)
    assert batch is not None
    return sample(ops, logits, greedy, batch), batch.dead_rows


def sample(ops: Backend, logits: Any, greedy: Any, batch: SamplingBatch) -> Any:
    """`greedy` (left unchanged) with each of `batch.rows` replaced by its token."""
    work = logits[ops.from_host(batch.rows)]  # [S, vocab] fp32, a copy
    if batch.penalties is not None:
        ops.penalize(work, batch.penalties)
    tokens = greedy.copy()
    num_greedy = batch.num_greedy
    if num_greedy:
        tokens[ops.from_host(batch.rows[:num_greedy])] = ops.argmax(work[:num_greedy])
    if batch.draws is not None:
        tokens[ops.from_host(batch.rows[num_greedy:])] = ops.sample(work[num_greedy:], batch.draws)
    return tokens
