"""vLLM's bad_words (daemon/engine/sampling/bad_words.py): the token sequences a list of
words bans, the tokens banned at a row given the tokens generated before it, and the
engine's tokens against that definition spelled out here (greedy and seeded, batched,
cached, through the padded decode path, drafted), on a tiny random Llama and on the
default model's real tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from reprise.cuda.sampling import sample_ref
from reprise.daemon import Completion, Engine, SamplingParams
from reprise.daemon.engine.sampling.bad_words import (
    MAX_BAD_WORDS,
    BadWords,
    tokenize_bad_words,
    with_banned,
)
from reprise.daemon.model.synth import synth_model

NUM_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("bad_words") / "tiny")


def engine(path: Path, seqs: tuple[tuple[int, ...], ...] | None = None, **kwargs) -> Engine:
    """A NumPy engine; with `seqs`, every request's bad_words ban exactly those token
    sequences (the tiny model's byte tokenizer spells few words; the real tokenizer's
    sequences are tested on the default model below)."""
    kwargs.setdefault("num_device_blocks", 64)
    eng = Engine.from_pretrained(path, backend="numpy", block_size=16, **kwargs)
    if seqs is not None:
        eng.bad_words_ids = lambda words: seqs if words else ()  # type: ignore[method-assign]
    return eng


def banned_at(seqs: tuple[tuple[int, ...], ...], before: list[int]) -> set[int]:
    """The definition: a sequence's last token is banned where the generated tokens
    before end with the rest of it (a one-token sequence: everywhere)."""
    return {
        s[-1]
        for s in seqs
        if len(s) - 1 <= len(before) and before[len(before) - len(s) + 1 :] == list(s[:-1])
    }


def test_words_are_tokenized_as_written_and_after_a_space() -> None:
    """Each word as written (leading spaces dropped), and with one space before it when
    that is as many tokens and begins with another one; repeats kept once."""
    vocab = {"ab": 1, " ab": 2, "c": 3, " c": 4, " ": 5, "d": 6, "e": 7}

    def encode(text: str) -> list[int]:  # greedy longest match over `vocab`
        ids = []
        while text:
            piece = max((p for p in vocab if text.startswith(p)), key=len)
            ids.append(vocab[piece])
            text = text[len(piece) :]
        return ids

    assert tokenize_bad_words(["ab"], encode) == ((1,), (2,))
    assert tokenize_bad_words(["  abc"], encode) == ((1, 3), (2, 3))
    assert tokenize_bad_words(["d"], encode) == ((6,),)  # " d" is two tokens: not kept
    assert tokenize_bad_words(["ab", " ab", "de"], encode) == ((1,), (2,), (6, 7))


def test_banned_tokens_follow_the_generated_tokens() -> None:
    """BadWords.banned against the definition on random sequences and histories over a
    few symbols (many matches), with the history cut to `keep` as the state keeps it."""
    rng = np.random.default_rng(0)
    num_dynamic = 0
    for _ in range(400):
        seqs = tuple(
            tuple(rng.integers(0, 4, size=int(rng.integers(1, 5))).tolist())
            for _ in range(int(rng.integers(1, 6)))
        )
        bad = BadWords.of(seqs)
        assert bad is not None
        before = rng.integers(0, 4, size=int(rng.integers(0, 8))).tolist()
        recent = tuple(before[-bad.keep :]) if bad.keep else ()
        got = bad.banned(recent)
        assert got.dtype == np.int32 and np.all(np.diff(got) > 0)
        want = banned_at(seqs, before)
        assert set(got.tolist()) == want
        num_dynamic += want != {s[0] for s in seqs if len(s) == 1}
    assert num_dynamic > 50


def test_banned_tokens_join_the_logit_bias_at_minus_infinity() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        ids = np.unique(rng.integers(0, 50, size=int(rng.integers(1, 10)))).astype(np.int32)
        bias = None if rng.random() < 0.2 else (ids, rng.normal(size=ids.size).astype(np.float32))
        banned = np.unique(rng.integers(0, 50, size=int(rng.integers(0, 6)))).astype(np.int32)
        got = with_banned(bias, banned)
        want = {} if bias is None else dict(zip(bias[0].tolist(), bias[1].tolist(), strict=True))
        want.update(dict.fromkeys(banned.tolist(), -np.inf))
        if not want:
            assert got is None
            continue
        assert got is not None and np.all(np.diff(got[0]) > 0) and got[0].dtype == np.int32
        assert dict(zip(got[0].tolist(), got[1].tolist(), strict=True)) == want


@pytest.mark.parametrize(
    ("words", "says"),
    [
        ("swear", "must be a list"),
        ([""], "1 to 256 characters"),
        (["   "], "not only spaces"),
        ([7], "must be strings"),
        (["x" * 257], "1 to 256 characters"),
        (["w"] * (MAX_BAD_WORDS + 1), f"at most {MAX_BAD_WORDS}"),
    ],
)
def test_bad_lists_are_refused_naming_the_field(words: object, says: str) -> None:
    with pytest.raises(ValueError, match="bad_words") as refused:
        SamplingParams(bad_words=words)  # type: ignore[arg-type]
    assert says.split()[-1] in str(refused.value)


def plain_and_seqs(
    eng: Engine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], tuple]:
    """The request's tokens without bad words, and sequences that would change them: one
    of its tokens alone, a pair of its tokens and a triple."""
    plain = eng.generate(prompt, params).token_ids
    return plain, ((plain[6],), (plain[0], plain[1]), tuple(plain[9:12]), (plain[3], 77, 78))


def check_against_definition(out: Completion, seqs: tuple, params: SamplingParams) -> None:
    assert out.logits is not None
    for i, token in enumerate(out.token_ids):
        banned = banned_at(seqs, out.token_ids[:i])
        assert token not in banned
        row = out.logits[i].copy()  # the raw row: logits come back before the bans
        row[list(banned)] = -np.inf
        if params.greedy:
            assert token == int(np.argmax(row))
        else:
            assert token == sample_ref(row, temperature=params.temperature, top_k=None, top_p=1.0,
                                       seed=params.seed, position=len(out.prompt_token_ids) + i)  # fmt: skip


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                        return_logits=True, logprobs=2, bad_words=["x"])  # fmt: skip
SEEDED = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.7, seed=5, ignore_eos=True,
                        return_logits=True, bad_words=["x"])  # fmt: skip


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tokens_are_drawn_from_rows_without_the_banned_tokens(tiny: Path, params) -> None:
    """Every token is the argmax (or the seeded draw) of its raw row with the tokens banned
    there at -inf; the bans move the answer; batched, repeated from the cache and through
    the padded decode path, the same bits; logprobs stay the raw rows'."""
    prompt = np.random.default_rng(2).integers(4, 250, size=37).tolist()
    plain, seqs = plain_and_seqs(engine(tiny), prompt, SamplingParams(
        **{**fields(params), "bad_words": None}))  # fmt: skip
    eng = engine(tiny, seqs)
    out = eng.generate(prompt, params)
    check_against_definition(out, seqs, params)
    assert out.token_ids != plain
    if params.greedy and plain[0] != plain[6]:
        assert out.token_ids[0] == plain[0]  # a pair's first token is free
    # the pair's and the triple's ends were banned where their starts were generated
    hits = [i for i in range(1, NUM_TOKENS) if len(banned_at(seqs, out.token_ids[:i])) > 1]
    assert hits or params.temperature > 0
    if params.logprobs:
        raw = out.logits[0].astype(np.float64)
        assert out.logprobs[0].logprob == pytest.approx(
            raw[out.token_ids[0]] - raw.max() - np.log(np.exp(raw - raw.max()).sum()), abs=1e-5
        )
    other = np.random.default_rng(3).integers(4, 250, size=29).tolist()
    for again in (eng.generate([other, prompt], [SamplingParams(max_tokens=5), params])[1],
                  engine(tiny, seqs, cuda_graphs=True).generate(prompt, params)):  # fmt: skip
        assert again.token_ids == out.token_ids
        assert np.array_equal(again.logits.view(np.uint32), out.logits.view(np.uint32))


def test_bans_that_leave_no_allowed_token_never_give_one(tiny: Path) -> None:
    """Bans that leave no token (here: the one allowed token) never give the id 0 an all
    -inf row's argmax would: banned everywhere, the request is refused before it is
    queued; banned after itself, it ends with an error after it, greedy or drawn
    (test_sampling_dead_end.py)."""
    for params in (GREEDY, SEEDED):
        allowed = SamplingParams(**{**fields(params), "allowed_token_ids": [7]})
        eng = engine(tiny, ((7,),))
        with pytest.raises(ValueError, match="allowed_token_ids"):
            eng.generate([5, 6, 7, 8], allowed)
        eng = engine(tiny, ((7, 7),))
        out = eng.generate([5, 6, 7, 8], allowed)
        assert (out.token_ids, out.finish_reason) == ([7], "error")
        assert out.logits is not None and out.logits.shape[0] == 1
        assert eng.pool.num_free_blocks == eng.pool.num_blocks


def fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


@pytest.mark.model
def test_the_default_models_answer_leaves_out_the_words(default_model_dir: Path) -> None:
    """The real tokenizer: a word the greedy answer had is gone from it, mid-text and at
    its start, and what the words ban is what they spell."""
    eng = Engine.from_pretrained(default_model_dir, backend="numpy")
    prompt = "The capital of France is"
    plain = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0)).text
    assert "Paris" in plain and "answer" in plain
    seqs = eng.bad_words_ids(["Paris", " answer"])
    assert {eng.tokenizer.decode(list(s)) for s in seqs} == {"Paris", " Paris", "answer", " answer"}
    cut = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0,
                                              bad_words=["Paris", " answer"]))  # fmt: skip
    assert "Paris" not in cut.text and cut.text != plain
    with pytest.raises(ValueError, match="bad_words"):
        eng.add_request(prompt, SamplingParams(bad_words=[""]))
