"""Engine.prepare_prompt, the admission work a server does off its loop: a prepared
prompt gets the checks, block keys, cache hits and bits the prompt itself gets, under
its own salt only, from the engine that prepared it only (prompts.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reprise.blockpool.hashing import Namespace, hash_token_blocks
from reprise.daemon import Engine, SamplingParams
from reprise.daemon.engine.prompts import PreparedPrompt
from reprise.daemon.model.synth import synth_model

BS = 16
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("prepared") / "tiny")


def engine_of(path: Path, **kwargs) -> Engine:
    return Engine.from_pretrained(path, backend="numpy", block_size=BS, **kwargs)


def random_prompt(rng: np.random.Generator, vocab: int, num_blocks: int) -> list[int]:
    return rng.integers(0, vocab, size=num_blocks * BS + int(rng.integers(1, BS))).tolist()


def test_a_prepared_prompts_keys_are_the_blocks_keys(tiny: Path, rng) -> None:
    """Its keys against hash_token_blocks, the per-block reference, for fresh random
    prompts and salts of either type; none with prompt-table ids or reuse off."""
    engine = engine_of(tiny)
    vocab = engine.config.vocab_size
    fingerprint = engine.kv.model_fingerprint
    for salt in (None, f"s{rng.integers(1 << 20)}", bytes(rng.integers(0, 256, 9).tolist())):
        ids = random_prompt(rng, vocab, int(rng.integers(0, 6)))
        prepared = engine.prepare_prompt(ids, cache_salt=salt)
        want = hash_token_blocks(
            ids, BS, namespace=Namespace(cache_salt=salt), model_fingerprint=fingerprint
        )
        assert prepared.keys == tuple(want) and len(want) == len(ids) // BS
        assert prepared.ids == tuple(ids) and prepared.array.tolist() == ids
        assert not prepared.array.flags.writeable
    with_table_ids = [*random_prompt(rng, vocab, 2), vocab + 1]
    assert engine.prepare_prompt(with_table_ids).keys == ()
    assert engine_of(tiny, enable_reuse=False).prepare_prompt(ids).keys == ()


def test_a_prepared_prompt_runs_as_the_prompt_does(tiny: Path, rng) -> None:
    """The same tokens and logits bits, fresh and cached, and the same cache hits, as the
    plain prompt in a twin engine; text prompts too."""
    plain, prepared = engine_of(tiny), engine_of(tiny)
    vocab = plain.config.vocab_size
    prompts: list[str | list[int]] = [random_prompt(rng, vocab, 3), "a prompt given as text"]
    for prompt in prompts:
        for _ in range(2):  # fresh, then every full block cached
            want = plain.generate(prompt, PARAMS)
            got = prepared.generate(prepared.prepare_prompt(prompt), PARAMS)
            assert got.prompt_token_ids == want.prompt_token_ids
            assert got.token_ids == want.token_ids
            assert got.logits.tobytes() == want.logits.tobytes()
            assert got.cached_tokens == want.cached_tokens
        assert got.cached_tokens > 0 or len(got.prompt_token_ids) <= BS
    assert prepared.stats()["reused_blocks"] == plain.stats()["reused_blocks"] > 0
    prepared.pool.check_integrity()


def test_a_prepared_prompts_keys_serve_only_its_own_salt(tiny: Path, rng) -> None:
    """Prepared under one salt and sent under another (or with a prompt table), its keys
    are not taken: the request hits what its own salt cached, and nothing else."""
    engine = engine_of(tiny)
    ids = random_prompt(rng, engine.config.vocab_size, 4)
    engine.generate(ids, PARAMS, cache_salt="a")  # cached under "a" only
    under_a = engine.prepare_prompt(ids, cache_salt="a")
    assert engine.generate(under_a, PARAMS, cache_salt="b").cached_tokens == 0
    assert engine.generate(under_a, PARAMS, cache_salt="a").cached_tokens == 4 * BS
    assert engine.generate(under_a, PARAMS).cached_tokens == 0  # no salt: another namespace
    under_none = engine.prepare_prompt(ids)
    assert engine.generate(under_none, PARAMS, cache_salt="b").cached_tokens == 4 * BS  # "b"'s
    engine.pool.check_integrity()


def test_a_prepared_prompt_is_refused_as_the_prompt_is(tiny: Path) -> None:
    engine, other = engine_of(tiny, max_model_len=64), engine_of(tiny)
    for bad, message in (([], "prompt is empty"), ([1] * 64, "at most 63"),
                         ([1, -2], "must be in"), ([1.5], "list of token ids")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            engine.add_request(bad, PARAMS)
        with pytest.raises(ValueError, match=message):
            engine.prepare_prompt(bad)
    prepared = other.prepare_prompt([1, 2, 3])
    assert isinstance(prepared, PreparedPrompt)
    with pytest.raises(ValueError, match="only by the engine that prepared it"):
        engine.add_request(prepared, PARAMS)
    assert not engine.has_work()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny: Path, rng) -> None:
    """vLLM's truncate_prompt_tokens: a prompt longer than the context runs as its last k
    tokens (raw or prepared with the same k), as those tokens alone run; a prepared
    prompt longer than k is refused, a shorter one runs whole."""
    engine = engine_of(tiny, max_model_len=64)
    prompt = rng.integers(0, 1000, size=150).tolist()
    with pytest.raises(ValueError, match="at most 63"):
        engine.add_request(prompt, PARAMS)
    cut = SamplingParams(**{**{n: getattr(PARAMS, n) for n in PARAMS.__slots__},
                            "truncate_prompt_tokens": 40})  # fmt: skip
    want = engine.generate(prompt[-40:], PARAMS)
    for given in (prompt, engine.prepare_prompt(prompt, truncate_prompt_tokens=40)):
        got = engine.generate(given, cut)
        assert got.prompt_token_ids == prompt[-40:] and got.token_ids == want.token_ids
        assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))
    with pytest.raises(ValueError, match="prepare it with truncate_prompt_tokens"):
        engine.add_request(engine.prepare_prompt(prompt[:50]), cut)
    short = engine.generate(prompt[:10], cut)
    assert short.prompt_token_ids == prompt[:10]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)
