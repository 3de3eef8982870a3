"""Sampling: the counter-based generator, greedy ties, top-k/top-p support, and
the distribution a seeded sampler draws from."""

from __future__ import annotations

import numpy as np
import pytest

from reprise.cuda.sampling import argmax_ref, philox4x32, sample_ref, uniform
from reprise.daemon.engine.params import SamplingParams


@pytest.mark.parametrize(
    ("counter", "key", "want"),
    [  # known-answer vectors of Philox4x32-10 from the Random123 distribution
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(counter, key, want) -> None:
    assert philox4x32(counter, key) == want


def test_uniform_depends_only_on_seed_and_position() -> None:
    draws = [uniform(1234, p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert draws == [uniform(1234, p) for p in range(2000)]
    assert draws != [uniform(1235, p) for p in range(2000)]
    # roughly uniform: each tenth of [0, 1) gets 200 +- 60 of 2000 draws
    counts = np.histogram(draws, bins=10, range=(0, 1))[0]
    assert counts.min() > 140 and counts.max() < 260, counts


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = np.zeros(50, dtype=np.float32)
    logits[[7, 3, 41]] = 2.5
    assert argmax_ref(logits) == 3


def test_sampling_follows_the_softmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(8).astype(np.float32) * 2
    n = 6000
    draws = [
        sample_ref(logits, temperature=0.7, top_k=None, top_p=1.0, seed=99, position=p)
        for p in range(n)
    ]
    probs = np.exp(logits / 0.7 - (logits / 0.7).max())
    probs /= probs.sum()
    counts = np.bincount(draws, minlength=8)
    # every count within 5 standard deviations of its expectation
    assert np.all(np.abs(counts - n * probs) <= 5 * np.sqrt(n * probs * (1 - probs)) + 1), (
        counts,
        n * probs,
    )


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = np.array([0.0, 3.0, 1.0, 2.9, -1.0, 2.0], dtype=np.float32)
    top2 = {
        sample_ref(logits, temperature=1.0, top_k=2, top_p=1.0, seed=5, position=p)
        for p in range(400)
    }
    assert top2 == {1, 3}
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()  # sorted: 1 (0.39), 3 (0.36), 5 (0.14), 2 (0.05) ...
    nucleus = {
        sample_ref(logits, temperature=1.0, top_k=None, top_p=0.8, seed=5, position=p)
        for p in range(400)
    }
    assert nucleus == {1, 3, 5}
    tiny = {
        sample_ref(logits, temperature=1.0, top_k=None, top_p=0.01, seed=5, position=p)
        for p in range(100)
    }
    assert tiny == {1}  # at least one token is always kept


def test_min_p_keeps_the_tokens_as_likely_as_min_p_times_the_top() -> None:
    """vLLM's min_p: after temperature, a token stays if its probability is at least
    min_p times the most likely one's; with top-k and top-p the three cuts are
    prefixes of one ranking, top-p's mass taken over what the other two kept."""
    logits = np.array([0.0, 3.0, 1.0, 2.9, -1.0, 2.0, 2.5], dtype=np.float32)
    # relative to the top (id 1): 3 0.90, 6 0.61, 5 0.37, 2 0.14, 0 0.05, 4 0.02

    def support(**kw) -> set[int]:
        kw = {"temperature": 1.0, "top_k": None, "top_p": 1.0, **kw}
        return {sample_ref(logits, seed=5, position=p, **kw) for p in range(600)}

    assert support(min_p=0.0) == set(range(7))
    assert support(min_p=0.3) == {1, 3, 6, 5}
    assert support(min_p=0.5) == {1, 3, 6}
    assert support(min_p=0.95) == {1}
    assert support(min_p=1.0) == {1}  # the top token always stays
    assert support(min_p=0.5, temperature=3.0) == {1, 3, 6, 5, 2}  # flatter: more stay
    assert support(min_p=0.3, top_k=2) == {1, 3}
    # kept: 1, 3, 6, 5 (p 1, 0.90, 0.61, 0.37 of 2.88): 0.6 of that mass is 1, 3
    assert support(min_p=0.3, top_p=0.6) == {1, 3}
    # the draws among what min_p keeps follow its renormalized softmax
    n, kept = 8000, [1, 3, 6, 5]
    draws = [sample_ref(logits, temperature=1.0, top_k=None, top_p=1.0, min_p=0.3, seed=9,
                        position=p) for p in range(n)]  # fmt: skip
    probs = np.exp(logits[kept] - logits.max())
    probs /= probs.sum()
    counts = np.bincount(draws, minlength=7)[kept]
    assert np.all(np.abs(counts - n * probs) <= 5 * np.sqrt(n * probs * (1 - probs)) + 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1] * 32769),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", "3"),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", float("nan")),
        ("min_p", "0.1"),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("max_tokens", 0),
        ("seed", -1),
        ("seed", 2**64),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
        ("max_tokens", 2.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field.rstrip("s") if field == "stop" else field):
        SamplingParams(**{field: value})


def test_penalty_and_logprobs_ranges_are_inclusive() -> None:
    for value in (-2, -2.0, 0, 2.0):
        SamplingParams(presence_penalty=value, frequency_penalty=value)
    SamplingParams(repetition_penalty=1e-3, logprobs=0)
    SamplingParams(repetition_penalty=7, logprobs=20)
    with pytest.raises(ValueError, match=r"presence_penalty must be a number in \[-2, 2\]"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\] or None"):
        SamplingParams(logprobs=50)


@pytest.mark.parametrize("top_k", [1, 2, 7, 50, 300, 999, 1000, 5000])
@pytest.mark.parametrize("n", [1000, 5003])
def test_top_k_ranking_matches_a_full_stable_sort(
    rng: np.random.Generator, top_k: int, n: int
) -> None:
    """The candidate shortcut keeps the same ids in the same order as sorting every
    score: coarse grids (many ties), signed zeros, -inf, a few huge values."""
    from reprise.cuda.sampling import ranked

    for trial in range(20):
        if trial % 2:
            scores = (rng.integers(-6, 7, size=n) * 0.5).astype(np.float32)
        else:
            scores = rng.standard_normal(n).astype(np.float32)
        scores[rng.integers(0, n, size=20)] = -0.0
        scores[rng.integers(0, n, size=5)] = -np.inf
        scores[rng.integers(0, n, size=3)] = 1e30
        want = np.argsort(-scores, kind="stable")[:top_k]
        assert np.array_equal(ranked(scores, top_k), want)
    assert np.array_equal(ranked(scores, None), np.argsort(-scores, kind="stable"))


def test_allowed_token_ids_exclude_structured_outputs() -> None:
    from reprise.daemon import StructuredOutput

    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined with structured"):
        SamplingParams(allowed_token_ids=[3], structured=StructuredOutput("regex", "a+"))


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_mask_of_keeps_exactly_the_ids(rng: np.random.Generator, vocab: int) -> None:
    from reprise.cuda.penalties import TokenMask, apply_token_mask_ref, mask_of, mask_words

    ids = np.unique(rng.integers(0, vocab, size=max(1, vocab // 3)))
    row = mask_of(ids, vocab)
    assert row.dtype == np.uint32 and row.shape == (mask_words(vocab),)
    logits = rng.standard_normal((1, vocab)).astype(np.float32)
    apply_token_mask_ref(logits, TokenMask(row[None]))
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == ids.tolist()
