"""Penalties and logprobs through the engine, on a tiny random Llama and the NumPy
backend: every token is what the penalized raw row gives, and tokens, logits and
logprobs are bit-identical whether the prompt was reused, batched with other
traffic, or decoded through the padded (CUDA graph) path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from reprise.cuda.dtypes import F32
from reprise.cuda.penalties import Penalties, penalize_ref
from reprise.cuda.sampling import sample_ref
from reprise.daemon import Completion, Engine, SamplingParams
from reprise.daemon.model.synth import synth_model

NUM_TOKENS = 12
PENALIZED_GREEDY = SamplingParams(
    max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, return_logits=True, logprobs=3,
    frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3,
)  # fmt: skip
PENALIZED_SEEDED = SamplingParams(
    max_tokens=NUM_TOKENS, temperature=0.8, top_k=40, top_p=0.9, seed=31, ignore_eos=True,
    return_logits=True, logprobs=5, frequency_penalty=-0.5, repetition_penalty=0.8,
)  # fmt: skip
PARAMS = [PENALIZED_GREEDY, PENALIZED_SEEDED]


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 250, size=n).tolist()


PROMPTS = [prompt(37, 1), prompt(37, 2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("sampling") / "tiny")


def engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 64)
    return Engine.from_pretrained(path, backend="numpy", block_size=16, **kwargs)


def penalized(row: np.ndarray, params: SamplingParams, prompt_ids: list[int], outputs: list[int]):
    """The row after the request's penalties, from the formulas (the twin, on one row)."""
    counts = {t: outputs.count(t) for t in outputs}
    seen = sorted(set(outputs) | (set(prompt_ids) if params.repetition_penalty != 1 else set()))
    out = row[None].copy()
    penalize_ref(out, Penalties(
        repetition=np.array([params.repetition_penalty], F32),
        frequency=np.array([params.frequency_penalty], F32),
        presence=np.array([params.presence_penalty], F32),
        token_offsets=np.array([0, len(seen)], np.int32),
        token_ids=np.array(seen, np.int32),
        output_counts=np.array([counts.get(t, 0) for t in seen], np.int32),
    ))  # fmt: skip
    return out[0]


def test_tokens_are_drawn_from_the_penalized_raw_rows(tiny: Path) -> None:
    outs = engine(tiny).generate(PROMPTS, PARAMS)
    for prompt_ids, params, out in zip(PROMPTS, PARAMS, outs, strict=True):
        assert out.logits is not None and len(out.token_ids) == NUM_TOKENS
        for i, token in enumerate(out.token_ids):
            row = penalized(out.logits[i], params, prompt_ids, out.token_ids[:i])
            if params.greedy:
                assert token == int(np.argmax(row))
            else:
                want = sample_ref(row, temperature=params.temperature, top_k=params.top_k,
                                  top_p=params.top_p, seed=31, position=len(prompt_ids) + i)  # fmt: skip
                assert token == want
    plain = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    assert engine(tiny).generate(PROMPTS[0], plain).token_ids != outs[0].token_ids


@pytest.mark.parametrize("min_p", [0.3, 0.8])
def test_min_p_cuts_each_row_as_the_twin(tiny: Path, min_p: float) -> None:
    """min_p through the engine: every token is sample_ref's with min_p from its row
    (after temperature), at least min_p as likely as the row's top, and a deep cut changes
    what a seeded request draws; batched with a request without it, and repeated from the
    cache, the same tokens."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.5, min_p=min_p, seed=8,
                            ignore_eos=True, return_logits=True)  # fmt: skip
    eng = engine(tiny)
    out = eng.generate(PROMPTS[0], params)
    for i, token in enumerate(out.token_ids):
        row = out.logits[i]
        want = sample_ref(row, temperature=1.5, top_k=None, top_p=1.0, min_p=min_p, seed=8,
                          position=len(PROMPTS[0]) + i)  # fmt: skip
        assert token == want
        scaled = row.astype(np.float64) / 1.5
        assert np.exp(scaled[token] - scaled.max()) >= min_p * (1 - 1e-6)
    uncut = eng.generate(PROMPTS[0], SamplingParams(**{**_fields(params), "min_p": 0.0}))
    if min_p == 0.8:  # cuts mass enough to move the draws (0.3 only the far tail's)
        assert uncut.token_ids != out.token_ids
    batched = eng.generate(PROMPTS, [params, PENALIZED_SEEDED])
    assert batched[0].token_ids == out.token_ids and batched[0].cached_tokens > 0
    assert np.array_equal(batched[0].logits.view(np.uint32), out.logits.view(np.uint32))


def test_allowed_token_ids_restrict_every_draw(tiny: Path) -> None:
    """vLLM's allowed_token_ids: a greedy request takes the most likely allowed token of
    each raw row, a seeded one draws only allowed ones (sample_ref on the row with the
    others at -inf); batched with others, repeated from the cache and through the padded
    decode path, the same bits; an id past the vocabulary is refused."""
    rng = np.random.default_rng(4)
    allowed = sorted(set(rng.integers(0, 1024, size=40).tolist()))
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, allowed_token_ids=allowed,
                            ignore_eos=True, return_logits=True, logprobs=2)  # fmt: skip
    seeded = SamplingParams(**{**_fields(greedy), "temperature": 0.9, "seed": 3})
    eng = engine(tiny)
    outs = eng.generate(PROMPTS, [greedy, seeded])
    for prompt_ids, params, out in zip(PROMPTS, [greedy, seeded], outs, strict=True):
        assert set(out.token_ids) <= set(allowed)
        for i, token in enumerate(out.token_ids):
            row = np.full_like(out.logits[i], -np.inf)
            row[allowed] = out.logits[i][allowed]
            if params.greedy:
                assert token == int(np.argmax(row))
            else:
                assert token == sample_ref(row, temperature=0.9, top_k=None, top_p=1.0, seed=3,
                                           position=len(prompt_ids) + i)  # fmt: skip
        # logprobs are the raw rows': their top alternatives reach past the allowed ones
        assert any(t not in allowed for lp in out.logprobs for t, _ in lp.top)
    free = eng.generate(
        PROMPTS[0], SamplingParams(**{**_fields(greedy), "allowed_token_ids": None})
    )
    assert not set(free.token_ids) <= set(allowed)
    again = engine(tiny, cuda_graphs=True).generate(PROMPTS * 2, [greedy, seeded] * 2)
    for got, want in zip(again, outs * 2, strict=True):
        assert got.token_ids == want.token_ids
        assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))
    assert again[2].cached_tokens > 0
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, 1024\)"):
        eng.add_request(PROMPTS[0], SamplingParams(allowed_token_ids=[5, 1024]))


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def test_logprobs_are_the_log_softmax_of_the_returned_logits(tiny: Path) -> None:
    outs = engine(tiny).generate(PROMPTS, PARAMS)
    for params, out in zip(PARAMS, outs, strict=True):
        assert out.logprobs is not None and out.logits is not None
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        for lp, row in zip(out.logprobs, out.logits, strict=True):
            exact = row.astype(np.float64) - row.max()
            exact -= np.log(np.exp(exact).sum())
            assert abs(lp.logprob - exact[lp.token_id]) <= 1e-5
            assert len(lp.top) == params.logprobs
            ids = [t for t, _ in lp.top]
            assert ids == np.argsort(-exact, kind="stable")[: params.logprobs].tolist()
            np.testing.assert_allclose([v for _, v in lp.top], exact[ids], atol=1e-5)
            # vLLM's rank: the tokens at least as likely in the raw row, itself included
            # (penalized and seeded draws are not always its top)
            assert lp.rank == int(np.count_nonzero(exact >= exact[lp.token_id]))
        assert max(lp.rank for lp in out.logprobs) > 1
    none = engine(tiny).generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))
    assert none.logprobs is None and none.logits is None


def assert_identical(got: list[Completion], want: list[Completion]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logits is not None and w.logits is not None
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))
        assert g.logprobs == w.logprobs  # exact floats, exact top lists


@pytest.fixture(scope="module")
def reference(tiny: Path) -> list[Completion]:
    """Each request alone, reuse off."""
    outs = [
        engine(tiny, enable_reuse=False).generate(p, s)
        for p, s in zip(PROMPTS, PARAMS, strict=True)
    ]
    assert all(isinstance(o, Completion) for o in outs)
    return outs  # type: ignore[return-value]


def test_repeated_prompts_reuse_the_cache_bit_for_bit(tiny: Path, reference) -> None:
    eng = engine(tiny)
    first = eng.generate(PROMPTS, PARAMS)
    again = eng.generate(PROMPTS, PARAMS)
    assert isinstance(again, list) and all(o.cached_tokens > 0 for o in again)
    assert_identical(first, reference)
    assert_identical(again, reference)


def add_traffic(eng: Engine, extra: Callable[[int, np.random.Generator], dict]) -> list[int]:
    """Six other requests of mixed lengths and settings for a batch to carry beside the
    ones under test; `extra(i, rng)`: more SamplingParams fields of the i-th."""
    rng = np.random.default_rng(5)
    return [
        eng.add_request(
            prompt(int(rng.integers(3, 50)), 100 + i),
            SamplingParams(
                max_tokens=int(rng.integers(1, 20)),
                temperature=0.7 * (i % 2),
                seed=i,
                ignore_eos=True,
                presence_penalty=0.3 * (i % 3),
                **extra(i, rng),
            ),
        )
        for i in range(6)
    ]


def test_batched_with_traffic_and_through_padded_decode_steps(tiny: Path, reference) -> None:
    eng = engine(tiny, cuda_graphs=True)  # the padded bucket steps, run eagerly on NumPy
    others = add_traffic(eng, lambda i, rng: {"logprobs": i % 4 or None})
    ids = [eng.add_request(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    streamed: dict[int, list] = {i: [] for i in ids}
    while eng.has_work():
        for out in eng.step():
            if out.request_id in streamed:
                assert out.logprobs is not None and len(out.logprobs) == 1
                streamed[out.request_id] += out.logprobs
    assert eng.runner.decode is not None and eng.runner.decode.steps > 0
    got = [eng.take_completion(i) for i in ids]
    assert_identical(got, reference)
    assert [streamed[i] for i in ids] == [c.logprobs for c in got]
    for r in others:
        eng.take_completion(r)


def test_the_engine_seed_repeats_unseeded_answers(tiny: Path) -> None:
    """EngineConfig.seed (--seed): unseeded requests draw their seeds from it in the order
    they are added, so a second engine with the same seed gives the same tokens; without
    it, or with another seed, they differ; a request's own seed is its own either way."""
    hot = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.5, ignore_eos=True)

    def answers(**settings: object) -> list[list[int]]:
        eng = engine(tiny, **settings)
        return [c.token_ids for c in eng.generate(PROMPTS * 2, hot)]

    seeded = answers(seed=11)
    assert seeded == answers(seed=11)
    assert seeded[0] != seeded[2]  # the same prompt, a seed of its own
    assert answers(seed=12) != seeded and answers() != answers()
    own = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.5, ignore_eos=True, seed=5)
    assert (engine(tiny, seed=11).generate(PROMPTS[0], own).token_ids
            == engine(tiny).generate(PROMPTS[0], own).token_ids)  # fmt: skip


@pytest.mark.parametrize("seed", [-1, 1 << 64, 1.5, True])
def test_a_bad_engine_seed_is_refused(seed: object) -> None:
    from reprise.daemon.engine.config import EngineConfig, SettingError

    with pytest.raises(SettingError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        EngineConfig(seed=seed)  # type: ignore[arg-type]
