"""logit_bias (OpenAI's): each biased token's logit plus its bias, in fp32, before the
penalties (vLLM's order), on a tiny random Llama and the NumPy backend. Every token is
what the biased and penalized raw row gives; the returned logits and logprobs stay the
raw model's; tokens and logits are bit-identical alone, batched with other traffic,
through the padded (CUDA graph) decode path, reused and as an exact repeat; bad values
are refused in one line, on the engine and on the wire."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_sampling_engine import add_traffic, assert_identical, engine, prompt

from reprise.cuda.dtypes import F32
from reprise.cuda.penalties import LogitBias, Penalties, penalize_ref
from reprise.cuda.sampling import sample_ref
from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.synth import synth_model
from reprise.ipc.client import generate_message
from reprise.ipc.codec import decode_request, encode
from reprise.ipc.messages import Generate, ProtocolError, logit_bias_from_wire

NUM_TOKENS = 10


PROMPTS = [prompt(32, 1), prompt(48, 2)]  # whole blocks: a repeat is an exact one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("bias") / "tiny")


@pytest.fixture(scope="module")
def params(tiny: Path) -> list[SamplingParams]:
    """A greedy request that bans its own unbiased first token and biases 40 others at
    random, and a seeded one with penalties that biases 60 tokens, its own included."""
    plain = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    banned = engine(tiny).generate(PROMPTS[0], plain).token_ids[0]
    rng = np.random.default_rng(7)
    vocab = Engine.from_pretrained(tiny, backend="numpy", num_device_blocks=8).config.vocab_size

    def random_bias(n: int) -> dict[int, float]:
        ids = rng.choice(vocab, size=n, replace=False).tolist()
        return dict(zip(ids, rng.uniform(-8, 8, n).tolist(), strict=True))

    common = {"max_tokens": NUM_TOKENS, "ignore_eos": True, "return_logits": True}
    return [
        SamplingParams(
            temperature=0, logprobs=3, logit_bias={**random_bias(40), banned: -100}, **common
        ),
        SamplingParams(
            temperature=0.9,
            top_k=50,
            seed=11,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logit_bias=random_bias(60),
            **common,
        ),
    ]


def processed(row: np.ndarray, params: SamplingParams, prompt_ids: list[int], outputs: list[int]):
    """The raw row after the request's logit bias and penalties, from the twin on one row."""
    counts = {t: outputs.count(t) for t in outputs}
    penalized = params.repetition_penalty != 1 or params.frequency_penalty != 0
    seen = set(outputs) if penalized else set()
    seen = sorted(seen | (set(prompt_ids) if params.repetition_penalty != 1 else set()))
    bias = params.logit_bias or {}
    out = row[None].copy()
    penalize_ref(
        out,
        Penalties(
            repetition=np.array([params.repetition_penalty], F32),
            frequency=np.array([params.frequency_penalty], F32),
            presence=np.array([params.presence_penalty], F32),
            token_offsets=np.array([0, len(seen)], np.int32),
            token_ids=np.array(seen, np.int32),
            output_counts=np.array([counts.get(t, 0) for t in seen], np.int32),
            bias=LogitBias(
                np.array([0, len(bias)], np.int32),
                np.array(list(bias), np.int32),
                np.array(list(bias.values()), F32),
            ),
        ),
    )
    return out[0]


def test_the_bias_is_added_before_the_penalties() -> None:
    logits = np.array([[2.0, -2.0, 1.0, 0.5]], F32)
    out = logits.copy()
    penalize_ref(
        out,
        Penalties(
            repetition=np.array([1.25], F32),
            frequency=np.array([0.5], F32),
            presence=np.array([0.75], F32),
            token_offsets=np.array([0, 2], np.int32),
            token_ids=np.array([0, 2], np.int32),
            output_counts=np.array([0, 2], np.int32),
            bias=LogitBias(
                np.array([0, 3], np.int32),
                np.array([0, 1, 2], np.int32),
                np.array([1.0, 0.5, -4.0], F32),
            ),
        ),
    )
    # token 0: (2 + 1) / 1.25 (seen in the prompt); 1: biased only; 2: (1 - 4) * 1.25, then
    # generated twice: - 0.5 * 2 - 0.75; 3: untouched
    want = [3.0 / 1.25, -2.0 + 0.5, -3.0 * 1.25 - 0.5 * 2 - 0.75, 0.5]
    np.testing.assert_allclose(out[0], want, rtol=1e-6)


def test_tokens_are_drawn_from_the_biased_raw_rows(tiny: Path, params) -> None:
    outs = engine(tiny).generate(PROMPTS, params)
    plain = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_logits=True)
    unbiased = engine(tiny).generate(PROMPTS[0], plain)
    for prompt_ids, p, out in zip(PROMPTS, params, outs, strict=True):
        assert out.logits is not None and len(out.token_ids) == NUM_TOKENS
        for i, token in enumerate(out.token_ids):
            row = processed(out.logits[i], p, prompt_ids, out.token_ids[:i])
            if p.greedy:
                assert token == int(np.argmax(row))
            else:
                want = sample_ref(
                    row,
                    temperature=p.temperature,
                    top_k=p.top_k,
                    top_p=p.top_p,
                    seed=11,
                    position=len(prompt_ids) + i,
                )
                assert token == want
    # the logits and logprobs returned are the raw model's, the bias changed the token
    assert np.array_equal(outs[0].logits[0].view(np.uint32), unbiased.logits[0].view(np.uint32))
    assert outs[0].token_ids[0] != unbiased.token_ids[0]
    assert outs[0].logprobs is not None and outs[0].logprobs[0].token_id == outs[0].token_ids[0]
    exact = outs[0].logits[0].astype(np.float64)
    exact -= exact.max() + np.log(np.exp(exact - exact.max()).sum())
    assert abs(outs[0].logprobs[0].logprob - exact[outs[0].token_ids[0]]) <= 1e-5


def test_a_large_bias_forces_a_token_and_a_small_one_moves_nothing(tiny: Path) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng = engine(tiny)
    forced = eng.generate(
        PROMPTS[1],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={77: 100}),
    )
    assert forced.token_ids == [77] * 6
    unbiased = eng.generate(PROMPTS[1], greedy).token_ids
    tiny_bias = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={t: 1e-30 for t in range(100)}
    )
    assert eng.generate(PROMPTS[1], tiny_bias).token_ids == unbiased


def test_biased_requests_are_bit_identical_reused_repeated_and_batched(tiny: Path, params) -> None:
    reference = [
        engine(tiny, enable_reuse=False).generate(p, s)
        for p, s in zip(PROMPTS, params, strict=True)
    ]
    eng = engine(tiny)
    first = eng.generate(PROMPTS, params)
    again = eng.generate(PROMPTS, params)  # every prompt token cached: exact repeats
    assert eng.stats()["exact_repeats"] == 2
    assert_identical(first, reference)  # type: ignore[arg-type]
    assert_identical(again, reference)  # type: ignore[arg-type]

    eng = engine(tiny, cuda_graphs=True)  # the padded bucket steps, run eagerly on NumPy
    others = add_traffic(
        eng, lambda i, rng: {"logit_bias": {int(t): -5.0 for t in rng.integers(0, 256, i)} or None}
    )
    ids = [eng.add_request(p, s) for p, s in zip(PROMPTS, params, strict=True)]
    while eng.has_work():
        eng.step()
    assert eng.runner.decode is not None and eng.runner.decode.steps > 0
    assert_identical([eng.take_completion(i) for i in ids], reference)  # type: ignore[arg-type]
    for r in others:
        eng.take_completion(r)


@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ([(1, 2.0)], "logit_bias must be a dict of token id -> bias"),
        ({-1: 2.0}, "logit_bias token id must be an integer >= 0"),
        ({"5": 2.0}, "logit_bias token id must be an integer >= 0"),
        ({5: 100.5}, "logit_bias values must be numbers in [-100, 100]"),
        ({5: float("nan")}, "logit_bias values must be numbers in [-100, 100]"),
        ({5: True}, "logit_bias values must be numbers in [-100, 100]"),
        ({i: 1.0 for i in range(1025)}, "logit_bias may bias at most 1024 tokens"),
    ],
)
def test_bad_logit_bias_is_refused_naming_it(bias: object, says: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    assert says in str(info.value)


def test_the_engine_refuses_ids_past_its_vocabulary(tiny: Path) -> None:
    eng = engine(tiny)
    vocab = eng.config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {vocab}\)"):
        eng.add_request(PROMPTS[0], SamplingParams(logit_bias={vocab: 1.0}))
    assert not eng.has_work()
    assert SamplingParams(logit_bias={}).logit_bias is None  # empty: no bias, plain greedy path


def test_the_wire_carries_the_bias_as_pairs() -> None:
    message = generate_message("hi", stream=False, logit_bias={9: -100, 3: 2.5})
    assert message.sampling["logit_bias"] == [[3, 2.5], [9, -100]]
    back = decode_request(encode(message))
    assert isinstance(back, Generate)
    assert logit_bias_from_wire(back.sampling["logit_bias"]) == {3: 2.5, 9: -100}
    assert "logit_bias" not in generate_message("hi", stream=False, logit_bias={}).sampling
    with pytest.raises(ProtocolError, match="names a token id twice"):
        logit_bias_from_wire([[3, 1.0], [3, 2.0]])
    for pairs, says in [
        ([[3]], "pairs"),
        ([[3, "x"]], "bias must be int or float"),
        ([["3", 1.0]], "token id must be int"),
        ([[1 << 64, 1.0]], "64 bits"),
    ]:
        with pytest.raises(ProtocolError, match=says):
            Generate(id="a", prompt="x", sampling={"logit_bias": pairs})
