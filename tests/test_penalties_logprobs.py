"""Penalties and logprobs below the engine: the twin's arithmetic against the
OpenAI/vLLM formulas, the per-request token counts, the step's batch, the sampler's
greedy-after-penalty rows, and logprobs against a float64 log_softmax."""

from __future__ import annotations

import numpy as np
import pytest

from reprise.cuda.backend import NumpyBackend
from reprise.cuda.dtypes import F32
from reprise.cuda.penalties import Penalties, penalize_ref
from reprise.cuda.sampling import sample_ref
from reprise.daemon.engine.sampling import SamplingBatch, SamplingParams, SamplingState
from reprise.daemon.engine.sampling.logprobs import log_softmax, token_logprobs
from reprise.daemon.engine.sampling.sampler import sample
from reprise.daemon.engine.sampling.state import PenaltyTokens


def one_row(rep: float, freq: float, pres: float, ids: list[int], counts: list[int]) -> Penalties:
    return Penalties(
        repetition=np.array([rep], F32),
        frequency=np.array([freq], F32),
        presence=np.array([pres], F32),
        token_offsets=np.array([0, len(ids)], np.int32),
        token_ids=np.array(ids, np.int32),
        output_counts=np.array(counts, np.int32),
    )


def test_penalties_follow_the_openai_and_vllm_formulas() -> None:
    logits = np.array([[2.0, -2.0, 1.0, 0.5, 3.0, -1.0]], F32)
    # token 0: prompt and generated once; 1: prompt only; 2: generated 3 times; 5: listed
    # nowhere (untouched), 3 and 4 likewise
    penalized = logits.copy()
    penalize_ref(penalized, one_row(1.25, 0.5, 0.75, [0, 1, 2], [1, 0, 3]))
    want = logits.copy()
    want[0, 0] = 2.0 / 1.25 - 0.5 * 1 - 0.75  # repetition first, then frequency, presence
    want[0, 1] = -2.0 * 1.25  # a negative logit is multiplied
    want[0, 2] = 1.0 / 1.25 - 0.5 * 3 - 0.75
    np.testing.assert_allclose(penalized, want, rtol=1e-6)
    assert np.array_equal(penalized[0, 3:], logits[0, 3:])


def test_penalties_are_elementwise_fp32(rng: np.random.Generator) -> None:
    """Each listed element is its own fp32 computation: the listing order and the other
    rows change no bit, and neutral settings change nothing."""
    vocab, rows = 500, 4
    logits = (rng.standard_normal((rows, vocab)) * 5).astype(F32)
    logits[:, :4] = [0.0, -0.0, np.inf, -np.inf]
    lists = [rng.choice(vocab, size=int(rng.integers(1, 60)), replace=False) for _ in range(rows)]
    lists[1][:4] = [0, 1, 2, 3]
    counts = [rng.integers(0, 5, size=ids.size) for ids in lists]
    params = rng.uniform(0.2, 2.0, size=(rows, 3)).astype(F32)

    def batch(order: list[np.ndarray]) -> Penalties:
        ids = [lists[r][order[r]] for r in range(rows)]
        return Penalties(
            repetition=params[:, 0].copy(),
            frequency=params[:, 1] - 1,
            presence=params[:, 2] - 1,
            token_offsets=np.cumsum([0, *(i.size for i in ids)]).astype(np.int32),
            token_ids=np.concatenate(ids).astype(np.int32),
            output_counts=np.concatenate([counts[r][order[r]] for r in range(rows)]).astype(
                np.int32
            ),
        )

    together = logits.copy()
    penalize_ref(together, batch([np.arange(ids.size) for ids in lists]))
    shuffled = logits.copy()
    penalize_ref(shuffled, batch([rng.permutation(ids.size) for ids in lists]))
    assert np.array_equal(together.view(np.uint32), shuffled.view(np.uint32))
    for r in range(rows):  # each row alone
        alone = logits[r : r + 1].copy()
        penalize_ref(
            alone,
            one_row(*params[r] - [0, 1, 1], lists[r].tolist(), counts[r].tolist()),
        )
        assert np.array_equal(alone[0].view(np.uint32), together[r].view(np.uint32))
    neutral = logits.copy()
    ids = np.tile(np.arange(vocab), rows).astype(np.int32)
    penalize_ref(neutral, Penalties(
        repetition=np.ones(rows, F32), frequency=np.zeros(rows, F32),
        presence=np.zeros(rows, F32), token_offsets=np.arange(rows + 1, dtype=np.int32) * vocab,
        token_ids=ids, output_counts=ids % 3,
    ))  # fmt: skip
    assert np.array_equal(neutral.view(np.uint32), logits.view(np.uint32))


def test_penalty_tokens_count_each_distinct_token_once() -> None:
    tokens = PenaltyTokens.of_prompt([5, 3, 5, 9])
    for t in [3, 7, 7, *range(100, 200)]:  # grows past its first capacity
        tokens.count_output(t)
    ids = tokens.token_ids[: tokens.size].tolist()
    counts = dict(zip(ids, tokens.output_counts[: tokens.size].tolist(), strict=True))
    assert len(ids) == len(set(ids)) == 3 + 1 + 100
    assert counts[5] == counts[9] == 0 and counts[3] == 1 and counts[7] == 2 and counts[150] == 1
    assert all(tokens.slot_of[t] == i for i, t in enumerate(ids))


def test_defaults_keep_no_counts_and_make_no_batch() -> None:
    state = SamplingState.build(SamplingParams(temperature=0), 1, [1, 2, 3])
    assert state.penalty_tokens is None and state.plain_greedy and not state.reads_row
    assert state.record(4, None) is None
    assert SamplingBatch.build([state, state], [3, 3], vocab=10) is None
    # frequency and presence alone count the output, not the prompt
    freq = SamplingState.build(SamplingParams(frequency_penalty=0.5), 1, [1, 2, 3])
    assert freq.penalty_tokens is not None and freq.penalty_tokens.size == 0
    rep = SamplingState.build(SamplingParams(repetition_penalty=1.1), 1, [1, 2, 2])
    assert rep.penalty_tokens is not None and rep.penalty_tokens.size == 2


def test_batch_puts_penalized_greedy_rows_first_with_named_fields() -> None:
    plain = SamplingState.build(SamplingParams(temperature=0), 1, [1])
    pen_greedy = SamplingState.build(SamplingParams(temperature=0, presence_penalty=1.0), 2, [1])
    pen_greedy.record(4, None)
    drawn = SamplingState.build(SamplingParams(temperature=0.5, top_k=3, seed=9), 9, [1])
    batch = SamplingBatch.build([drawn, plain, pen_greedy], [10, 11, 12], vocab=50)
    assert batch is not None
    assert batch.rows.tolist() == [2, 0] and batch.num_greedy == 1
    assert batch.draws is not None and batch.draws.positions.tolist() == [10]
    assert batch.draws.top_k.tolist() == [3] and batch.draws.seeds.tolist() == [9]
    assert batch.penalties is not None
    assert batch.penalties.token_offsets.tolist() == [0, 1, 1]  # the drawn row lists none
    assert batch.penalties.token_ids.tolist() == [4]
    assert batch.penalties.presence.tolist() == [1.0, 0.0]


def test_greedy_with_penalties_takes_the_argmax_of_the_penalized_row(
    rng: np.random.Generator,
) -> None:
    vocab = 300
    logits = rng.standard_normal((3, vocab)).astype(F32)
    logits[:, 17] = 10.0  # every row's argmax
    greedy = np.argmax(logits, axis=1).astype(np.int32)
    states = [
        SamplingState.build(SamplingParams(temperature=0, frequency_penalty=2.0), 0, [1]),
        SamplingState.build(SamplingParams(temperature=0), 0, [1]),
        SamplingState.build(
            SamplingParams(temperature=0.8, seed=5, repetition_penalty=50.0), 5, [17]
        ),
    ]
    for _ in range(4):
        states[0].record(17, None)  # its logit goes 10 -> 10 - 2 * 4 = 2
    batch = SamplingBatch.build(states, [5, 5, 5], vocab)
    assert batch is not None
    tokens = sample(NumpyBackend(), logits, greedy, batch)
    assert np.array_equal(greedy, np.argmax(logits, axis=1))  # left unchanged
    want0 = logits[0].copy()
    want0[17] = F32.type(10.0) - F32.type(2.0) * F32.type(4)
    assert tokens[0] == np.argmax(want0) != 17  # the penalty moved it off the raw argmax
    assert tokens[1] == 17
    want2 = logits[2].copy()
    want2[17] = F32.type(10.0) / F32.type(50.0)
    assert tokens[2] == sample_ref(
        want2, temperature=0.8, top_k=None, top_p=1.0, seed=5, position=5
    )


def float64_log_softmax(row: np.ndarray) -> np.ndarray:
    wide = row.astype(np.float64)
    return wide - wide.max() - np.log(np.sum(np.exp(wide - wide.max())))


def test_logprobs_are_the_raw_log_softmax(rng: np.random.Generator) -> None:
    row = (rng.standard_normal(5000) * 4).astype(F32)
    row[[10, 20, 30]] = row.max() + 1  # a three-way tie at the top: by lower id
    got = token_logprobs(row, 123, 5)
    exact = float64_log_softmax(row)
    assert got.token_id == 123
    assert abs(got.logprob - exact[123]) <= 1e-6 * max(1.0, abs(exact[123]))
    assert [t for t, _ in got.top[:3]] == [10, 20, 30]
    assert [t for t, _ in got.top] == np.argsort(-exact, kind="stable")[:5].tolist()
    values = [lp for _, lp in got.top]
    assert values == sorted(values, reverse=True)
    np.testing.assert_allclose(values, exact[[t for t, _ in got.top]], rtol=1e-6)
    assert token_logprobs(row, 5, 0).top == ()


def test_logprobs_depend_on_the_row_bits_alone(rng: np.random.Generator) -> None:
    row = (rng.standard_normal(49152) * 6).astype(F32)
    want = log_softmax(row).view(np.uint32)
    block = np.zeros((3, 49153), F32)
    block[1, 1:] = row  # the same bits at another offset and alignment
    assert np.array_equal(log_softmax(block[1, 1:]).view(np.uint32), want)
    with pytest.raises(AssertionError):
        SamplingState.build(SamplingParams(logprobs=2), 1, [1]).record(3, None)
