"""min_tokens (vLLM's): no stop token ends a request before its min_tokens-th token (the
sampler holds them back at -inf), and stop strings are looked for from that token on;
in process on a tiny random Llama, through the padded decode path, as an exact repeat,
and through a daemon (its detokenizing thread applies the stop strings)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_sampling_engine import PROMPTS, engine

from reprise.daemon import SamplingParams
from reprise.daemon.model.synth import synth_model

pytestmark = pytest.mark.model  # the daemon test serves the default model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("min_tokens") / "tiny")


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, return_logits=True, **kw)  # type: ignore[arg-type]


def test_stop_tokens_are_held_back_until_min_tokens(tiny: Path) -> None:
    eng = engine(tiny)
    free = eng.generate(PROMPTS[0], greedy(max_tokens=12))
    stop = free.token_ids[2]  # a stop token id the free run meets at its third token
    first_stop = free.token_ids.index(stop)
    plain = eng.generate(PROMPTS[0], greedy(max_tokens=12, stop_token_ids=[stop]))
    assert plain.finish_reason == "stop" and len(plain.token_ids) == first_stop + 1
    held = eng.generate(PROMPTS[0], greedy(max_tokens=12, stop_token_ids=[stop], min_tokens=6))
    assert stop not in held.token_ids[:6]
    assert held.logits is not None
    for i, token in enumerate(held.token_ids):
        row = held.logits[i].copy()
        if i < 6:
            row[stop] = -np.inf  # what the sampler saw
        assert token == int(np.argmax(row))
    if held.finish_reason == "stop":  # it ends at the first stop token after the 6th
        assert held.token_ids.index(stop, 6) == len(held.token_ids) - 1
    else:
        assert held.finish_reason == "length" and len(held.token_ids) == 12


def test_held_back_bits_are_the_same_batched_padded_and_repeated(tiny: Path) -> None:
    free = engine(tiny).generate(PROMPTS[1], greedy(max_tokens=8))
    params = [
        greedy(max_tokens=8, stop_token_ids=[free.token_ids[0]], min_tokens=4, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True, min_tokens=8,
                       stop_token_ids=list(free.token_ids[:3]), return_logits=True),
    ]  # fmt: skip
    prompts = [PROMPTS[1][:32], PROMPTS[0][:32]]  # whole blocks: a repeat is an exact one
    alone = [
        engine(tiny, enable_reuse=False).generate(p, s)
        for p, s in zip(prompts, params, strict=True)
    ]
    assert free.token_ids[0] not in alone[0].token_ids[:4]  # held back: the first token moved
    eng = engine(tiny, cuda_graphs=True)
    for outs in (eng.generate(prompts, params), eng.generate(prompts, params)):
        for got, want in zip(outs, alone, strict=True):  # type: ignore[arg-type]
            assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
            assert np.array_equal(np.stack(got.logits).view(np.uint32),
                                  np.stack(want.logits).view(np.uint32))  # fmt: skip
    assert eng.stats()["exact_repeats"] == 2


def test_with_nothing_to_hold_back_the_logit_bias_still_applies(tiny: Path) -> None:
    """ignore_eos and no stop_token_ids: min_tokens holds nothing back, and the request's
    own logit bias applies from its first token."""
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, min_tokens=2,
                            logit_bias={77: 100.0})  # fmt: skip
    assert engine(tiny).generate(PROMPTS[0], params).token_ids == [77, 77, 77]


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be an integer in \[0, 4\]"),
        ({"min_tokens": -1}, r"min_tokens must be an integer in \[0, 16\]"),
        ({"min_tokens": 1.5}, "min_tokens must be an integer"),
    ],
)
def test_bad_min_tokens_is_refused(kw: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kw)


def test_stop_strings_count_from_min_tokens_in_process_and_through_a_daemon(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """The default model answers " Paris.\\n\\nThe answer is" greedily: "." (its 2nd token)
    ends it at once, but not with min_tokens 3; "answer" (6th) still ends it then."""
    from test_daemon import Daemon

    from reprise.daemon import Engine

    prompt = "The capital of France is"
    eng = Engine.from_pretrained(default_model_dir, backend="numpy", num_device_blocks=32)
    free = eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
    assert free.text.startswith(" Paris.\n\nThe answer"), free.text
    cases = [
        ({"stop": ["."]}, " Paris", "stop"),
        ({"stop": ["."], "min_tokens": 3}, free.text, "length"),
        ({"stop": ["answer"], "min_tokens": 3}, " Paris.\n\nThe ", "stop"),
    ]
    d = Daemon(tmp_path, default_model_dir)
    try:
        with d.client() as client:
            for kw, text, reason in cases:
                local = eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0, **kw))
                served = client.generate(prompt, max_tokens=8, temperature=0, **kw)
                assert (local.text, local.finish_reason) == (text, reason), kw
                assert (served.text, served.finish_reason) == (text, reason), kw
                assert served.token_ids == local.token_ids
    finally:
        d.stop()
    assert d.proc.returncode == 0
