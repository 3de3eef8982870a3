"""A request no token can follow: its mask (a structured output's grammar, or
allowed_token_ids) keeps only tokens that its bad_words ban or min_tokens holds back,
so every logit it could draw is -inf. The engine finds it on the host before sampling
(SamplingBatch.dead_rows) and ends it with finish reason "error" and one line saying
why, never with the id 0 an all -inf row's argmax gives; the other requests of its step
get the bits they get alone, its blocks go back to the pool, and the daemon answers it
with a bad_request error and serves on. allowed_token_ids that bad_words or min_tokens
empty before the first token are refused before anything is queued.

On a tiny random Llama (byte tokens: "yes" is three tokens) and the NumPy backend."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_sampling_engine import engine

from reprise.daemon import Completion, Engine, SamplingParams, StructuredOutput
from reprise.daemon.model.synth import synth_model
from reprise.daemon.serve.server import Server, ServerConfig
from reprise.ipc import Client, Done, RequestError, TokenChunk

YES_NO = StructuredOutput("regex", r"(yes|no)-[0-9]{3}")  # "-" must follow "yes" or "no"
GRAMMAR_ENDS = {  # the dead end's message after each answer the grammar leaves
    "yes": "no token can come next (after 3 generated): the structured output's grammar "
    "admits only tokens banned by bad_words",
    "no": "no token can come next (after 2 generated): the structured output's grammar "
    "admits only tokens banned by bad_words",
}
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "seed": 11}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("dead_end") / "tiny")


def ids(eng: Engine, text: str) -> list[int]:
    return eng.tokenizer.encode(text, add_special_tokens=False)


def assert_clean(eng: Engine) -> None:
    """Nothing left running, and every block back in the pool."""
    assert not eng.has_work()
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    eng.pool.check_integrity()


def dead_grammar(**kw: object) -> SamplingParams:
    """A request whose grammar, after "yes" or "no", admits only the "-" bad_words ban."""
    return SamplingParams(max_tokens=20, structured=YES_NO, bad_words=["-"], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft", [0, 4], ids=["decoded", "drafted"])
def test_a_grammar_left_no_token_ends_with_an_error(tiny: Path, sampling: dict, draft: int) -> None:
    """The tokens before the dead end are kept, the request ends with the error there and
    no token 0; drafted (the grammar forces "es-" after "y": the dead row is inside the
    draft), the same tokens and the same error."""
    eng = engine(tiny, speculative_tokens=draft)
    for prompt in PROMPTS:
        done = eng.generate(prompt, dead_grammar(**sampling))
        assert done.text in GRAMMAR_ENDS, done
        assert done.token_ids == ids(eng, done.text) and 0 not in done.token_ids
        assert done.finish_reason == "error" and done.error == GRAMMAR_ENDS[done.text]
        assert_clean(eng)
        if draft:
            assert (
                done.token_ids == engine(tiny).generate(prompt, dead_grammar(**sampling)).token_ids
            )
    assert bool(eng.stats()["spec_draft_tokens"]) == bool(draft)


def test_allowed_token_ids_left_no_token_end_with_an_error(tiny: Path) -> None:
    """allowed_token_ids ["a"] with the bad word "aa": "a", then no token; with the eos
    allowed too and min_tokens holding it back, the same, the message naming both."""
    eng = engine(tiny)
    (a,) = ids(eng, "a")
    eos = min(eng.stop_token_ids)
    done = eng.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0,
                                                   allowed_token_ids=[a], bad_words=["aa"]))  # fmt: skip
    assert (done.token_ids, done.finish_reason) == ([a], "error")
    assert done.error == (
        "no token can come next (after 1 generated): allowed_token_ids admits only tokens "
        "banned by bad_words"
    )
    held = SamplingParams(max_tokens=8, temperature=0.7, seed=3, min_tokens=3,
                          allowed_token_ids=[a, eos], bad_words=["aa"])  # fmt: skip
    done = eng.generate(PROMPTS[1], held)
    assert (done.token_ids, done.finish_reason) == ([a], "error")
    assert done.error == (
        "no token can come next (after 1 generated): allowed_token_ids admits only tokens "
        "banned by bad_words or held back by min_tokens (3: the stop tokens)"
    )
    assert_clean(eng)


def same_bits(a: Completion, b: Completion) -> None:
    assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
    assert a.logits is not None and b.logits is not None
    assert np.array_equal(a.logits.view(np.uint32), b.logits.view(np.uint32))


def test_the_other_requests_of_its_step_get_what_they_get_alone(tiny: Path) -> None:
    """A dead request batched with a grammar request (a mask row beside it), a seeded one
    and a greedy one: each of them gets the tokens and logits bits it gets alone."""
    others = [
        SamplingParams(max_tokens=12, temperature=0, structured=YES_NO, return_logits=True),
        SamplingParams(
            max_tokens=12,
            temperature=0.8,
            seed=5,
            return_logits=True,
            logprobs=2,
            bad_words=["-"],
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=12, temperature=0, return_logits=True, ignore_eos=True),
    ]
    prompts = [[60 + i, 61, 62, 63, 64, 65] for i in range(len(others))]
    alone = [engine(tiny).generate(p, sp) for p, sp in zip(prompts, others, strict=True)]
    eng = engine(tiny)
    batched = eng.generate([PROMPTS[0], *prompts], [dead_grammar(**GREEDY), *others])
    assert isinstance(batched, list)
    assert batched[0].finish_reason == "error" and 0 not in batched[0].token_ids
    for got, want in zip(batched[1:], alone, strict=True):
        same_bits(got, want)
    assert_clean(eng)


def test_allowed_token_ids_empty_from_the_start_are_refused_before_queueing(tiny: Path) -> None:
    """Every allowed id banned everywhere (a one-token bad word) or held back by min_tokens
    at the first token: refused in one line naming allowed_token_ids, nothing queued."""
    eng = engine(tiny)
    (a,) = ids(eng, "a")
    eos = min(eng.stop_token_ids)
    for params in (
        SamplingParams(allowed_token_ids=[a], bad_words=["a"]),
        SamplingParams(allowed_token_ids=[eos], min_tokens=1),
        SamplingParams(allowed_token_ids=[a, eos], bad_words=["a"], min_tokens=2),
    ):
        with pytest.raises(ValueError, match=r"^allowed_token_ids \[.*\] are all banned by ") as e:
            eng.add_request(PROMPTS[0], params)
        assert "\n" not in str(e.value)
        assert_clean(eng)
    # one allowed token left: runs (the eos once min_tokens is out)
    done = eng.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, min_tokens=1,
                                                   allowed_token_ids=[a, eos], bad_words=["aa"]))  # fmt: skip
    assert done.token_ids[0] == a and done.finish_reason in ("stop", "error", "length")


def test_the_daemon_answers_a_dead_end_with_an_error_and_serves_on(tmp_path: Path) -> None:
    """Over the socket: a dead end's request gets one bad_request error (streamed: after
    the chunks of the tokens before it), and the next request on the same connection its
    answer, with every block back in the pool."""
    engine_ = engine(synth_model("tiny", tmp_path / "tiny"))
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    address = f"ipc://{folder}/d.sock"
    server = Server(engine_, ServerConfig(address=address))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    dead = {"max_tokens": 20, "temperature": 0, "structured": YES_NO, "bad_words": ["-"]}
    try:
        deadline = time.monotonic() + 60
        while not (folder / "d.sock").exists():
            assert time.monotonic() < deadline and serving.is_alive()
            time.sleep(0.05)
        with Client(address, timeout_s=60) as client:
            with pytest.raises(RequestError) as refused:
                client.generate(PROMPTS[0], **dead)
            assert refused.value.code == "bad_request"
            assert refused.value.message in GRAMMAR_ENDS.values()
            chunks: list[TokenChunk] = []
            with pytest.raises(RequestError) as streamed:
                for reply in client.stream(PROMPTS[0], **dead):
                    assert isinstance(reply, TokenChunk), reply
                    chunks.append(reply)
            assert streamed.value.message == refused.value.message
            assert "".join(c.text for c in chunks) in GRAMMAR_ENDS
            later = client.generate(PROMPTS[1], max_tokens=3, temperature=0, ignore_eos=True)
            assert isinstance(later, Done) and len(later.token_ids) == 3
            stats = client.stats(check=True)
        assert stats["used_blocks"] == 0 and stats["integrity"] == "ok"
    finally:
        server.stop.set()
        serving.join(60)
    assert not serving.is_alive()
