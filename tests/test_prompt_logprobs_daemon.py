"""Prompt logprobs through a real `reprise serve --http` on the tiny synthetic model:
the socket protocol (Done.prompt_logprobs), `reprise generate --prompt-logprobs`, and
OpenAI's legacy `echo` + `logprobs` on /v1/completions, each equal to the in-process
engine's entries and served from the cache on a repeat; bad values get one error."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from http_support import HttpDaemon, served  # noqa: E402

from reprise.daemon import Engine, SamplingParams  # noqa: E402
from reprise.ipc import Client, RequestError  # noqa: E402

PROMPT = np.random.default_rng(5).integers(4, 250, size=40).tolist()  # 2 blocks of 16 + 8
TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reprise.daemon.model.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=4)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[HttpDaemon]:
    with served(tmp_path_factory.mktemp("plp"), tiny, "--max-prompt-logprobs", "5") as d:
        yield d


@pytest.fixture(scope="module")
def want(tiny: Path) -> list:
    """The in-process engine's entries for PROMPT, the daemon's model and block size."""
    eng = Engine.from_pretrained(tiny, backend="numpy", block_size=16, num_device_blocks=16)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP)
    entries = eng.generate(PROMPT, params).prompt_logprobs
    assert entries is not None
    return entries


def wire_of(entries: list) -> list[tuple]:
    return [(e.token_id, e.logprob, [(t, v) for t, v in e.top]) for e in entries[1:]]


def from_wire(wire: list[dict]) -> list[tuple]:
    return [(lp["id"], lp["logprob"], [(t, v) for t, _, v in lp["top"]]) for lp in wire[1:]]


def test_the_socket_answer_carries_them_cached_or_not(daemon: HttpDaemon, want: list) -> None:
    with Client(daemon.address) as client:
        first = client.generate(PROMPT, max_tokens=2, temperature=0, prompt_logprobs=TOP,
                                cache_salt="socket")  # fmt: skip
        again = client.generate(PROMPT, max_tokens=2, temperature=0, prompt_logprobs=TOP,
                                cache_salt="socket")  # fmt: skip
        plain = client.generate(PROMPT, max_tokens=2, temperature=0, cache_salt="socket")
    # 2 full blocks, as without them: the tail's entries (8 tokens) are kept too
    assert first.cached_tokens == 0 and again.cached_tokens == 32
    for done in (first, again):
        assert done.prompt_logprobs is not None and len(done.prompt_logprobs) == len(PROMPT)
        head = done.prompt_logprobs[0]
        assert head["id"] == PROMPT[0] and head["logprob"] is None and head["top"] == []
        assert from_wire(done.prompt_logprobs) == wire_of(want)
    assert plain.prompt_logprobs is None and plain.token_ids == first.token_ids


def test_bad_values_get_one_error_line(daemon: HttpDaemon) -> None:
    with Client(daemon.address) as client:
        for bad, words in ((6, "[0, 5]"), (-1, ">= 0")):
            with pytest.raises(RequestError) as info:
                client.generate(PROMPT, max_tokens=1, prompt_logprobs=bad)
            assert info.value.code == "bad_request", info.value
            message = str(info.value)
            assert "prompt_logprobs" in message and words in message and "\n" not in message
        assert client.health().status == "ok"


def test_the_cli_prints_them(daemon: HttpDaemon, want: list) -> None:
    base = [sys.executable, "-m", "reprise.cli.main", "generate", "--socket", daemon.address,
            "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "2",
            "--temperature", "0", "--prompt-logprobs", str(TOP)]  # fmt: skip
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert from_wire(json.loads(out.stdout)["prompt_logprobs"]) == wire_of(want)
    text = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    lines = text.stderr.splitlines()
    start = lines.index("prompt:")
    assert len(lines[start + 1 : start + 1 + len(PROMPT)]) == len(PROMPT)
    assert f"{want[1].logprob:.3f}" in lines[start + 2]
    refused = subprocess.run([*base[:-1], "9"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "prompt_logprobs" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_echo_with_logprobs_on_completions(daemon: HttpDaemon, want: list) -> None:
    api = daemon.openai()
    answers = [
        api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                               echo=True, logprobs=TOP, extra_body={"cache_salt": "http"})
        for _ in range(2)
    ]  # fmt: skip
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 32
    with Client(daemon.address) as client:
        done = client.generate(PROMPT, max_tokens=2, temperature=0, logprobs=TOP,
                               prompt_logprobs=TOP)  # fmt: skip
    for answer in answers:
        lp = answer.choices[0].logprobs
        num = len(PROMPT)
        assert len(lp.tokens) == num + 2 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:num] == [e.logprob for e in want[1:]]
        # as OpenAI's dict by token text (two ids of one text, such as U+FFFD, are one key),
        # the prompt token itself listed too where it is outside the top (OpenAI's rule)
        assert lp.top_logprobs[1:num] == [
            {x["token"]: x["logprob"], **{t: v for _, t, v in x["top"]}}
            for x in done.prompt_logprobs[1:]
        ]
        assert lp.token_logprobs[num:] == [x["logprob"] for x in done.logprobs]
        assert lp.tokens[:num] == [x["token"] for x in done.prompt_logprobs]
        assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
        assert answer.choices[0].text == "".join(lp.tokens)
    text = api.completions.create(model="tiny", prompt="hello there", max_tokens=2,
                                  temperature=0, echo=True)  # fmt: skip
    assert text.choices[0].text.startswith("hello there") and text.choices[0].logprobs is None


def test_echo_is_refused_where_it_cannot_be_served(daemon: HttpDaemon) -> None:
    api = daemon.openai()
    cases = [
        (api.completions.create, {"prompt": "x", "echo": True, "logprobs": 9}, "prompt_logprobs"),
        (api.completions.create, {"prompt": "x", "echo": "yes"}, "echo"),
        (api.completions.create, {"prompt": "x", "echo": True, "stream": True, "logprobs": 1},
         "echo"),  # a streamed echo takes no logprobs
        (api.completions.create, {"prompt": [5, 6], "echo": True, "stream": True}, "echo"),
        (api.chat.completions.create,
         {"messages": [{"role": "user", "content": "x"}], "extra_body": {"echo": "yes"}}, "echo"),
    ]  # fmt: skip
    for create, kwargs, word in cases:
        with pytest.raises(openai.BadRequestError) as info:
            create(model="tiny", max_tokens=1, **kwargs)
        assert word in str(info.value)


def test_vllms_prompt_logprobs_parameter(daemon: HttpDaemon, want: list) -> None:
    """vLLM's `prompt_logprobs` (extra_body): per prompt token, null first, then the
    token's {logprob, rank, decoded_token} and its alternatives' (ranked 1, 2, ...), on
    each completion choice and at the top of a chat answer; the engine's entries, cached
    or not; with echo + logprobs, each keeps its own number of alternatives."""
    api = daemon.openai()
    answers = [
        api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                               extra_body={"prompt_logprobs": TOP, "cache_salt": "vllm"})
        for _ in range(2)
    ]  # fmt: skip
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 32
    for answer in answers:
        for choice in answer.choices:
            got = choice.model_extra["prompt_logprobs"]
            assert len(got) == len(PROMPT) and got[0] is None
            for entry, e in zip(got[1:], want[1:], strict=True):
                own = entry[str(e.token_id)]
                assert own["logprob"] == e.logprob and own["rank"] == e.rank >= 1
                alternatives = [(t, i, v) for i, (t, v) in enumerate(e.top, 1) if t != e.token_id]
                others = [
                    (int(t), x["rank"], x["logprob"]) for t, x in entry.items() if x is not own
                ]
                assert others == alternatives
    assert any(e.rank > TOP for e in want[1:])  # a prompt token past the top: its own rank
    # echo + logprobs 1 beside prompt_logprobs TOP: the echo keeps one alternative, and
    # the prompt token where it is another
    both = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                  echo=True, logprobs=1, extra_body={"prompt_logprobs": TOP})  # fmt: skip
    echoed = both.choices[0].logprobs
    for token, top in zip(echoed.tokens[1:], echoed.top_logprobs[1:], strict=True):
        # (an alternative of the same text, a byte token's U+FFFD, keeps its own value)
        assert token in top and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in echoed.top_logprobs[1:])
    assert both.choices[0].model_extra["prompt_logprobs"] == got
    chat = api.chat.completions.create(model="tiny", max_tokens=1, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"prompt_logprobs": 1})  # fmt: skip
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(1 <= len(e) <= 2 for e in entries[1:])
    for bad, word in (({"prompt_logprobs": -1}, "prompt_logprobs"),
                      ({"prompt_logprobs": 9}, "prompt_logprobs"),
                      ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            api.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body=bad)
        assert word in str(info.value)
