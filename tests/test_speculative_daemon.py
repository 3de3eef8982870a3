"""Prompt lookup speculation through a real `reprise serve --speculative-tokens`: answers
on the socket (streamed, with chunks of several tokens where drafts were kept) and over
HTTP equal the in-process engine's without drafts, and /metrics counts the drafts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from http_support import HttpDaemon, scrape  # noqa: E402

from reprise.daemon import Engine, SamplingParams  # noqa: E402
from reprise.ipc import Client  # noqa: E402
from reprise.ipc.messages import Done, TokenChunk  # noqa: E402

# a prompt the tiny model's greedy answer falls into a loop after: drafts get kept
_BASE = np.random.default_rng(3).integers(4, 250, size=19).tolist()
PROMPT = _BASE * 3
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reprise.daemon.model.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[HttpDaemon]:
    d = HttpDaemon(
        tmp_path_factory.mktemp("spec"), tiny, "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}',
    )  # fmt: skip
    yield d
    d.stop()
    assert d.proc.returncode == 0, d.read_log()[-2000:]


@pytest.fixture(scope="module")
def want(tiny: Path):
    """The in-process engine's answer, one token a step."""
    eng = Engine.from_pretrained(
        tiny, backend="numpy", block_size=16, num_device_blocks=96, max_model_len=256
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    return eng.generate(PROMPT, params)


def test_the_socket_stream_carries_kept_drafts_as_one_chunk(daemon: HttpDaemon, want) -> None:
    with Client(daemon.address) as client:
        before = client.stats()
        replies = list(client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     ignore_eos=True, logprobs=2))  # fmt: skip
        after = client.stats()
        whole = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    chunks = [r for r in replies if isinstance(r, TokenChunk)]
    done = replies[-1]
    assert isinstance(done, Done) and isinstance(whole, Done)
    assert [t for c in chunks for t in c.token_ids] == done.token_ids == want.token_ids
    assert whole.token_ids == want.token_ids
    got_logprobs = [lp["logprob"] for c in chunks for lp in c.logprobs]
    assert got_logprobs == [lp.logprob for lp in want.logprobs]
    kept = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert kept > 0 and after["spec_draft_tokens"] > before["spec_draft_tokens"]
    # the first chunk is the prompt's step's token; each later one a step's tokens
    assert len(chunks) == MAX_TOKENS - kept and max(len(c.token_ids) for c in chunks) > 1


def test_http_answers_equal_and_metrics_count_the_drafts(daemon: HttpDaemon, want) -> None:
    client = daemon.openai()
    kwargs = dict(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                  temperature=0, logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs)
    streamed = list(client.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == whole.choices[0].text
    got = [lp for c in streamed if c.choices and c.choices[0].logprobs
           for lp in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert got == whole.choices[0].logprobs.token_logprobs
    assert got == [lp.logprob for lp in want.logprobs]
    samples = scrape(daemon.url)
    drafted = samples[("reprise_spec_decode_num_draft_tokens_total", ())]
    kept = samples[("reprise_spec_decode_num_accepted_tokens_total", ())]
    assert drafted >= kept > 0


def test_a_stop_string_inside_a_kept_draft_cuts_the_reply_there(daemon: HttpDaemon, tiny) -> None:
    """The daemon's detokenizing thread finds a stop string in a chunk of several kept
    tokens: the reply ends where the in-process engine, one token a step, ends it."""
    options = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                   logit_bias={t: 30.0 for t in range(32, 127)})  # fmt: skip
    eng = Engine.from_pretrained(
        tiny, backend="numpy", block_size=16, num_device_blocks=96, max_model_len=256
    )
    full = eng.generate(PROMPT, SamplingParams(**options))
    # from the first "LA" through the second: first seen in the answer's second round of
    # a loop, whose tokens the drafts (the first round's) give
    first = full.text.index("LA")
    piece = full.text[first + 1 : full.text.index("LA", first + 2) + 2]
    want = eng.generate(PROMPT, SamplingParams(stop=[piece], **options))
    assert want.finish_reason == "stop" and len(want.token_ids) < MAX_TOKENS
    with Client(daemon.address) as client:
        before = client.stats()["spec_accepted_tokens"]
        replies = list(client.stream(PROMPT, stop=[piece], **options))
        kept = client.stats()["spec_accepted_tokens"] - before
    done = replies[-1]
    assert isinstance(done, Done)
    assert kept > 0
    assert done.finish_reason == "stop" and done.text == want.text
    assert done.token_ids == want.token_ids
    chunks = [r for r in replies if isinstance(r, TokenChunk)]
    assert "".join(c.text for c in chunks) == want.text
    assert len(chunks[-1].token_ids) > 1  # the stop came in a step's kept draft
