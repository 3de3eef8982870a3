"""`n` choices of one prompt (SamplingParams.n), in the engine: validated, seeded
seed + i, the prompt's full blocks computed once for all of them, and each choice
bit-identical to the same request run alone (tiny random Llama, NumPy backend)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from reprise.daemon import Completion, Engine, SamplingParams
from reprise.daemon.engine.sampling.params import MAX_CHOICES, MAX_SEED
from reprise.daemon.model.synth import synth_model

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("choices") / "tiny")


def engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 64)
    return Engine.from_pretrained(path, backend="numpy", block_size=BLOCK, **kwargs)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 250, size=n).tolist()


@pytest.mark.parametrize("bad", [0, MAX_CHOICES + 1, -1, True, 2.0, "2"])
def test_n_out_of_range_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"^n must be an integer in \[1, {MAX_CHOICES}\]"):
        SamplingParams(n=bad)  # type: ignore[arg-type]


def test_choice_i_is_one_completion_seeded_seed_plus_i() -> None:
    params = SamplingParams(n=3, seed=MAX_SEED - 2, temperature=0.7, max_tokens=5)
    choices = [params.choice(i) for i in range(3)]
    assert [c.seed for c in choices] == [MAX_SEED - 2, MAX_SEED - 1, 0]  # wraps mod 2**64
    assert all(c.n == 1 and c.temperature == 0.7 and c.max_tokens == 5 for c in choices)
    assert [c.seed for c in (SamplingParams(n=2).choice(i) for i in range(2))] == [None, None]
    with pytest.raises(ValueError, match="choice index"):
        params.choice(3)


def test_choices_share_one_prefill_and_each_is_its_request_alone(tiny: Path) -> None:
    ids = prompt(4 * BLOCK + 6, seed=5)
    params = SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=11, ignore_eos=True,
                            return_logits=True, logprobs=2)  # fmt: skip
    eng = engine(tiny)
    outs = eng.generate(ids, params)
    assert isinstance(outs, list) and len(outs) == 3
    # the first choice computed the prompt; the others waited for its four full blocks
    # and computed only the tail
    assert [o.cached_tokens for o in outs] == [0, 4 * BLOCK, 4 * BLOCK]
    assert eng.prefill_tokens_computed == len(ids) + 2 * 6
    assert len({tuple(o.token_ids) for o in outs}) > 1  # seeds 11, 12, 13 differ
    for i, out in enumerate(outs):
        alone = engine(tiny).generate(ids, params.choice(i))
        assert isinstance(alone, Completion)
        assert alone.token_ids == out.token_ids
        assert alone.logits is not None and out.logits is not None
        assert np.array_equal(alone.logits, out.logits)  # bit-identical, reused or not
        assert alone.logprobs == out.logprobs
    assert eng.stats()["used_blocks"] == 0


def test_choices_of_a_batch_come_prompt_major(tiny: Path) -> None:
    prompts = [prompt(20, seed=1), prompt(20, seed=2)]
    params = SamplingParams(n=2, max_tokens=3, temperature=0.8, seed=3, ignore_eos=True)
    outs = engine(tiny).generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == [prompts[0]] * 2 + [prompts[1]] * 2
    single = engine(tiny).generate(prompts[1], params.choice(1))
    assert isinstance(single, Completion) and outs[3].token_ids == single.token_ids


def test_add_request_runs_one_choice_and_a_refused_n_queues_nothing(tiny: Path) -> None:
    eng = engine(tiny, num_device_blocks=8)
    with pytest.raises(ValueError, match="add_choices"):
        eng.add_request([5, 6, 7], SamplingParams(n=2))
    with pytest.raises(ValueError, match="KV blocks"):  # 9 blocks needed, 8 in the pool
        eng.add_choices(prompt(8 * BLOCK, seed=4), SamplingParams(n=3, max_tokens=1))
    assert not eng.has_work() and not eng._live
    assert len(eng.add_choices([5, 6, 7], SamplingParams(n=4, max_tokens=2))) == 4
