"""The OpenAI-compatible HTTP front end: a real `reprise serve --http 127.0.0.1:0`
(NumPy backend) driven by the official `openai` package, plus raw HTTP where the SDK
hides what we check (status codes, SSE framing, /metrics, disconnects)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
from http_support import HttpDaemon, scrape, served  # noqa: E402

from reprise.daemon import StructuredOutput  # noqa: E402
from reprise.ipc import Client  # noqa: E402

pytestmark = pytest.mark.model

MODEL_NAME = "smol"
# ~40 tokens: two full blocks of 16 that a repeat finds again.
LONG_PROMPT = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the old wooden "
    "fence near the river, and the farmer counts his sheep one by one before the rain."
)


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[HttpDaemon]:
    with served(tmp_path_factory.mktemp("http"), default_model_dir,
                "--served-model-name", MODEL_NAME, "--max-queue", "4") as d:  # fmt: skip
        yield d


@pytest.fixture(scope="module")
def api(daemon: HttpDaemon) -> openai.OpenAI:
    return daemon.openai()


def complete(api: openai.OpenAI, prompt: str = "The capital of France is", **kw: object):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    return api.completions.create(model=MODEL_NAME, prompt=prompt, **kw)


def chat(api: openai.OpenAI, content: str = "Say hi", **kw: object):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    messages = [{"role": "user", "content": content}]
    return api.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)


def test_version_is_the_packages(daemon: HttpDaemon) -> None:
    import importlib.metadata

    reply = httpx.get(f"{daemon.url}/version", timeout=10)
    assert reply.status_code == 200
    assert reply.json() == {"version": importlib.metadata.version("reprise")}


def test_models_lists_the_served_model(api: openai.OpenAI) -> None:
    assert [m.id for m in api.models.list().data] == [MODEL_NAME]
    card = api.models.retrieve(MODEL_NAME)
    assert card.model_extra["max_model_len"] == 256 and card.model_extra["root"] == MODEL_NAME
    assert api.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        api.models.retrieve("gpt-nothing")
    assert info.value.body["param"] == "model"


def test_completion_and_chat(api: openai.OpenAI) -> None:
    done = complete(api)
    assert done.choices[0].finish_reason == "length" and done.choices[0].text
    assert done.usage.completion_tokens == 4 and done.usage.prompt_tokens > 0
    assert done.usage.prompt_tokens_details.cached_tokens >= 0
    answer = chat(api)
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content
    assert answer.usage.completion_tokens == 4


def test_a_chat_without_max_tokens_runs_to_its_end(api: openai.OpenAI) -> None:
    """vLLM's default for chat (and OpenAI's): no max_tokens runs the answer to its end, or
    to the daemon's --max-tokens-cap (64 here) or the context; a completion keeps 16."""
    messages = [{"role": "user", "content": "Say hi"}]
    done = api.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0)
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens > 16
    messages = [{"role": "user", "content": "Tell me a long story about dragons."}]
    long = api.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0)
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 64
    responses = api.responses.create(model=MODEL_NAME, input=messages, temperature=0)
    assert responses.usage.output_tokens == 64 and responses.status == "incomplete"
    plain = api.completions.create(model=MODEL_NAME, prompt="Once upon", temperature=0)
    assert plain.usage.completion_tokens == 16


def test_streaming_equals_non_streaming_at_temperature_0(api: openai.OpenAI) -> None:
    whole = complete(api).choices[0].text
    events = list(complete(api, stream=True, stream_options={"include_usage": True}))
    assert "".join(e.choices[0].text for e in events if e.choices) == whole
    assert events[-2].choices[0].finish_reason == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 4
    message = chat(api).choices[0].message.content
    deltas = list(chat(api, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == message


def test_continuous_usage_stats_count_each_choice_as_it_streams(api: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage
    so far (the prompt it answers, the tokens streamed, their sum); the last event keeps
    the request's total. Two prompts of different lengths, two choices each."""
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there"]
    sizes = [complete(api, prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    assert sizes[0] != sizes[1]
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = list(complete(api, prompt=prompts, n=2, max_tokens=5, temperature=1, seed=3,
                           stream=True, stream_options=options))  # fmt: skip
    seen = [0] * 4
    for event in events[:-1]:
        (choice,) = event.choices
        usage, i = event.usage, choice.index
        assert usage.prompt_tokens == sizes[i // 2]
        assert usage.completion_tokens >= seen[i] and usage.total_tokens == (
            usage.prompt_tokens + usage.completion_tokens
        )
        seen[i] = usage.completion_tokens
    assert seen == [5] * 4
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 20
    assert events[-1].usage.prompt_tokens == sum(sizes)
    deltas = list(chat(api, max_tokens=3, stream=True, stream_options=options))
    assert [d.usage.completion_tokens for d in deltas[:-1]][-1] == 3
    # without include_usage it asks for nothing (vLLM's); a value of the wrong type is refused
    plain = list(complete(api, stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(e.usage is None for e in plain)
    with pytest.raises(openai.BadRequestError, match="continuous_usage_stats"):
        complete(api, stream=True, stream_options={"continuous_usage_stats": "yes"})


def test_bad_words_leave_the_answer(api: openai.OpenAI) -> None:
    """vLLM's bad_words (extra_body): a word of the greedy answer is not in the answer
    given with it, whole or streamed (the ban is the daemon's: same tokens either way)."""
    plain = complete(api, max_tokens=12).choices[0].text
    word = plain.split()[0].strip(".,")
    cut = complete(api, max_tokens=12, extra_body={"bad_words": [word]}).choices[0].text
    assert word not in cut and cut != plain
    events = list(complete(api, max_tokens=12, stream=True, extra_body={"bad_words": [word]}))
    assert "".join(c.text for e in events for c in e.choices) == cut


def test_a_streamed_echo_sends_the_prompt_first(api: openai.OpenAI) -> None:
    """vLLM's echo with stream: each choice's first chunk starts with its prompt's text;
    joined, each choice is the whole echo's text (two prompts, two choices each)."""
    prompts = ["The capital of France is", "One, two,"]
    whole = complete(api, prompt=prompts, n=2, max_tokens=4, echo=True)
    events = list(complete(api, prompt=prompts, n=2, max_tokens=4, echo=True, stream=True))
    texts = ["", "", "", ""]
    for event in events:
        for choice in event.choices:
            if not texts[choice.index]:
                assert choice.text.startswith(prompts[choice.index // 2])
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]


def test_sse_framing_ends_with_done(daemon: HttpDaemon) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{daemon.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_stop_string_ends_the_text(api: openai.OpenAI) -> None:
    full = complete(api, max_tokens=8).choices[0].text
    stop = full.split()[1]  # a word after the first
    cut = complete(api, max_tokens=8, stop=[stop, "never-seen"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    # vLLM's stop_reason and include_stop_str_in_output, whole and streamed
    assert cut.model_extra["stop_reason"] == stop
    kept = complete(api, max_tokens=8, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]
    assert kept.choices[0].model_extra["stop_reason"] == stop
    events = list(complete(api, max_tokens=8, stop=[stop], stream=True,
                           extra_body={"include_stop_str_in_output": True}))  # fmt: skip
    assert "".join(c.text for e in events for c in e.choices) == kept.choices[0].text
    last = events[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    assert complete(api, max_tokens=2).choices[0].model_extra["stop_reason"] is None  # length
    chat = api.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "Say hello"}])  # fmt: skip
    word = chat.choices[0].message.content.split()[0]
    stopped = api.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, temperature=0, stop=[word],
        messages=[{"role": "user", "content": "Say hello"}],
    )  # fmt: skip
    assert stopped.choices[0].model_extra["stop_reason"] == word


def test_seeded_sampling_repeats_and_n_choices_differ(api: openai.OpenAI) -> None:
    kw = {"temperature": 1.0, "seed": 7, "max_tokens": 4, "n": 2}
    first, again = complete(api, **kw), complete(api, **kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in again.choices] == texts
    assert texts[0] != texts[1]  # seeds 7 and 8
    single = complete(api, temperature=1.0, seed=7, max_tokens=4)
    assert single.choices[0].text == texts[0]
    assert first.usage.completion_tokens == 8


def test_logprobs_identical_on_a_repeat(api: openai.OpenAI) -> None:
    salt = {"cache_salt": "logprobs"}
    first = complete(api, LONG_PROMPT, logprobs=3, extra_body=salt)
    again = complete(api, LONG_PROMPT, logprobs=3, extra_body=salt)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    a, b = first.choices[0].logprobs, again.choices[0].logprobs
    assert a.tokens == b.tokens and len(a.tokens) == 4
    assert a.token_logprobs == b.token_logprobs and a.top_logprobs == b.top_logprobs
    assert all(len(top) == 3 for top in a.top_logprobs)  # greedy: its token is the first
    drawn = complete(api, LONG_PROMPT, logprobs=1, temperature=2.0, seed=3, max_tokens=16)
    lp = drawn.choices[0].logprobs
    # OpenAI's rule: the sampled token is listed too, so up to logprobs + 1 entries
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        # (an alternative of the same text, a byte token's U+FFFD, keeps its own value)
        assert token in top and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp.top_logprobs), "no token drawn outside the top 1"
    assert a.text_offset[0] == 0
    content = chat(api, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_cached_tokens_only_within_a_salt(api: openai.OpenAI) -> None:
    def cached(salt: str) -> int:
        done = complete(api, LONG_PROMPT, max_tokens=1, extra_body={"cache_salt": salt})
        return done.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_penalties_and_priority_are_accepted(api: openai.OpenAI) -> None:
    done = complete(api, presence_penalty=0.5, frequency_penalty=0.5,
                    extra_body={"repetition_penalty": 1.2, "priority": 3, "top_k": 5},
                    user="tester")  # fmt: skip
    assert done.choices[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_end(api: openai.OpenAI) -> None:
    """vLLM's truncate_prompt_tokens (extra_body): a prompt past the context (256 here)
    runs as its last k tokens, as those alone do; without it, it is refused."""
    ids = list(range(1000, 1400))
    with pytest.raises(openai.BadRequestError, match="256") as refused:
        complete(api, prompt=ids, max_tokens=2)
    assert refused.value.code == "context_length_exceeded"
    cut = complete(api, prompt=ids, max_tokens=4, extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100
    assert cut.choices[0].text == complete(api, prompt=ids[-100:], max_tokens=4).choices[0].text
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        complete(api, extra_body={"truncate_prompt_tokens": 0})


def test_allowed_token_ids_reach_the_sampler(daemon: HttpDaemon, api: openai.OpenAI) -> None:
    """vLLM's allowed_token_ids (extra_body): one allowed token is the whole answer."""
    tokens = httpx.post(f"{daemon.url}/tokenize", json={"prompt": " Paris"}, timeout=10)
    token = tokens.json()["tokens"][-1]
    done = complete(api, max_tokens=3, temperature=0.7, seed=1,
                    extra_body={"allowed_token_ids": [token], "ignore_eos": True})  # fmt: skip
    assert done.choices[0].text == " Paris" * 3
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        complete(api, extra_body={"allowed_token_ids": []})


def test_a_request_no_token_can_follow_is_a_400_and_the_daemon_serves_on(
    daemon: HttpDaemon, api: openai.OpenAI
) -> None:
    """allowed_token_ids [" Paris"] with the bad word "Paris Paris": after one " Paris" no
    token can come next (test_sampling_dead_end.py). Whole, a 400 saying so; streamed, the
    first chunk and then one error event; the next request gets its answer."""
    tokens = httpx.post(f"{daemon.url}/tokenize", json={"prompt": " Paris"}, timeout=10)
    token = tokens.json()["tokens"][-1]
    extra = {"allowed_token_ids": [token], "bad_words": ["Paris Paris"], "ignore_eos": True}
    with pytest.raises(openai.BadRequestError, match="no token can come next") as refused:
        complete(api, max_tokens=3, extra_body=extra)
    assert "allowed_token_ids admits only tokens banned by bad_words" in refused.value.message
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "stream": True, **extra}  # fmt: skip
    with httpx.stream("POST", f"{daemon.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == [" Paris"]
    assert "no token can come next" in json.loads(events[-2])["error"]["message"]
    assert complete(api).choices[0].text


def test_min_p_reaches_the_sampler(api: openai.OpenAI) -> None:
    """vLLM's min_p (extra_body): at 1.0 only the most likely token stays, so a hot
    seeded answer is the greedy one; without it the same seeds wander off."""
    greedy = complete(api, max_tokens=8).choices[0].text
    hot = [complete(api, max_tokens=8, temperature=1.8, seed=s, extra_body={"min_p": 1.0})
           for s in range(3)]  # fmt: skip
    assert all(c.choices[0].text == greedy for c in hot)
    free = [complete(api, max_tokens=8, temperature=1.8, seed=s).choices[0].text for s in range(3)]
    assert any(text != greedy for text in free)
    with pytest.raises(openai.BadRequestError, match="min_p"):
        complete(api, extra_body={"min_p": 1.5})


def test_a_batch_of_prompts_answers_each_as_alone(daemon: HttpDaemon, api) -> None:
    """/v1/completions with a list of prompts (as OpenAI's and vLLM's): prompt i's n
    choices are indices i * n .. i * n + n - 1, each what the prompt alone gives, streamed
    or whole, echoed too; usage counts each prompt once; the choices count against the
    queue; a prompt the daemon refuses fails the request and leaves no block held."""
    prompts = ["The capital of France is", [504, 3575, 282], "Hello"]
    alone = [complete(api, prompt=p, max_tokens=3).choices[0].text for p in prompts[:2]]
    whole = complete(api, prompt=prompts[:2], max_tokens=3, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [alone[0], alone[0], alone[1], alone[1]]
    singles = [complete(api, prompt=p, max_tokens=3) for p in prompts[:2]]
    assert whole.usage.prompt_tokens == sum(c.usage.prompt_tokens for c in singles)
    assert whole.usage.completion_tokens == 12
    texts = {0: "", 1: ""}
    for event in complete(api, prompt=prompts[:2], max_tokens=3, stream=True):
        for choice in event.choices:
            texts[choice.index] += choice.text
    assert texts == {0: alone[0], 1: alone[1]}
    echoed = complete(api, prompt=prompts[:2], max_tokens=1, echo=True, logprobs=0)
    for choice, prompt in zip(echoed.choices, prompts[:2], strict=True):
        one = complete(api, prompt=prompt, max_tokens=1, echo=True, logprobs=0).choices[0]
        assert (choice.text, choice.logprobs.tokens) == (one.text, one.logprobs.tokens)
    assert echoed.choices[0].text.startswith(prompts[0])
    with pytest.raises(openai.RateLimitError):  # 3 prompts x 2 choices > --max-queue 4
        complete(api, prompt=prompts, max_tokens=1, n=2)
    with pytest.raises(openai.BadRequestError) as info:
        complete(api, prompt=["a"] * 65, max_tokens=1)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        complete(api, prompt=["a long prompt " * 20, [1, 10**8]], max_tokens=50)
    assert info.value.body["param"] == "prompt"
    with Client(daemon.address) as client:
        deadline = time.monotonic() + 30
        while (stats := client.stats(check=True))["num_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert stats["num_requests"] == 0 and stats["used_blocks"] == 0 and stats["integrity"] == "ok"


def test_tokenize_and_detokenize_as_vllm_answers_them(daemon: HttpDaemon, api) -> None:
    """/tokenize gives the ids a completion (or chat completion) of the prompt is given,
    their count and the context; /detokenize their text; bad bodies are 400s naming
    the field, and the key is asked for like on every other route."""
    url = daemon.url
    text = "The capital of France is"
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL_NAME, "prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    done = complete(api, prompt=text, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == done.usage.prompt_tokens
    assert body["max_model_len"] > body["count"] and body["token_strs"] is None
    with Client(daemon.address) as client:
        assert body["tokens"] == client.tokenize(text)
    r = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}, timeout=60)
    assert r.status_code == 200 and r.json() == {"prompt": text, "content": text}  # llama.cpp's too
    messages = [{"role": "user", "content": "Say hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": True},
                   timeout=60)  # fmt: skip
    assert r.json()["count"] == chat(api, max_tokens=1).usage.prompt_tokens
    for route, payload, param in [
        ("tokenize", {"prompt": text, "add_special_tokens": "no"}, "add_special_tokens"),
        ("tokenize", {"prompt": ["a"]}, "prompt"),
        ("tokenize", {"prompt": text, "return_token_strs": True}, "return_token_strs"),
        ("tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("detokenize", {"tokens": [1, -1]}, "tokens"),
        ("detokenize", {"tokens": [49152]}, "tokens"),
        ("detokenize", {"tokens": "1 2"}, "tokens"),
        ("detokenize", {"tokens": [1], "model": "gpt-nothing"}, "model"),
    ]:
        r = httpx.post(f"{url}/{route}", json=payload, timeout=60)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


STORY = [{"role": "user", "content": "Tell me a short story."},
         {"role": "assistant", "content": "Once upon a time"}]  # fmt: skip
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def test_chat_continues_the_final_message(
    daemon: HttpDaemon, api: openai.OpenAI, default_model_dir: Path
) -> None:
    """vLLM's continue_final_message (and add_generation_prompt: false): the prompt is the
    chat cut where the assistant's last message ends, as transformers renders it; the
    answer continues it as a completion of those ids does; echo puts the message before
    the answer, whole or streamed; chat_template_kwargs reach the template (this one has
    no variable of its own: the same ids)."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    want = ref.apply_chat_template(STORY, tokenize=True, return_dict=False, **CONTINUE)
    for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        r = httpx.post(f"{daemon.url}/tokenize", json={"messages": STORY, **CONTINUE, **extra},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    answer = chat(api, STORY[0]["content"], max_tokens=8)  # a fresh turn, for comparison
    kw = {"model": MODEL_NAME, "messages": STORY, "max_tokens": 8, "temperature": 0}
    went_on = api.chat.completions.create(**kw, extra_body=CONTINUE)
    assert went_on.usage.prompt_tokens == len(want)
    text = went_on.choices[0].message.content
    assert text == complete(api, prompt=want, max_tokens=8).choices[0].text
    assert text != answer.choices[0].message.content
    echoed = api.chat.completions.create(**kw, extra_body={**CONTINUE, "echo": True})
    assert echoed.choices[0].message.content == "Once upon a time" + text
    streamed = api.chat.completions.create(**kw, stream=True, extra_body={**CONTINUE, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Once upon a time" + text
    # echo after a user message echoes nothing (vLLM's: only the answer's own role)
    plain = api.chat.completions.create(**{**kw, "messages": STORY[:1]}, extra_body={"echo": True})
    assert plain.choices[0].message.content == answer.choices[0].message.content
    for body, param in [
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
        ({**CONTINUE, "messages": STORY[:1]}, "continue_final_message"),  # a user's last
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        ({"echo": "yes"}, "echo"),
    ]:
        for route in ("v1/chat/completions", "tokenize"):
            r = httpx.post(f"{daemon.url}/{route}", json={"messages": STORY, **body}, timeout=60)
            if route == "tokenize" and param == "echo":
                assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
                continue
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)


def test_token_ids_come_back_as_vllm_returns_them(daemon: HttpDaemon, api: openai.OpenAI) -> None:
    """vLLM's return_token_ids: the prompt's ids (as /tokenize gives them) and each choice's
    ids, whole or streamed (the prompt's on a choice's first event, chat's at the event's
    top level); return_tokens_as_token_ids names logprobs' tokens "token_id:{id}"."""
    text = "The capital of France is"
    asked = {"return_token_ids": True}
    want = httpx.post(f"{daemon.url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
    whole = complete(api, prompt=text, max_tokens=5, n=2, extra_body=asked)
    for choice in whole.choices:
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == want and len(extra["token_ids"]) == 5
        with Client(daemon.address) as client:
            assert client.detokenize(extra["token_ids"]) == choice.text
    events = list(complete(api, prompt=text, max_tokens=5, n=2, stream=True, extra_body=asked))
    for i in range(2):
        mine = [e.choices[0].model_extra for e in events if e.choices[0].index == i]
        assert mine[0]["prompt_token_ids"] == want
        assert all("prompt_token_ids" not in m for m in mine[1:])
        streamed = [t for m in mine for t in m["token_ids"]]
        assert streamed == whole.choices[i].model_extra["token_ids"]
    messages = [{"role": "user", "content": "Say hi"}]
    chat_ids = httpx.post(f"{daemon.url}/tokenize", json={"messages": messages},
                          timeout=60).json()["tokens"]  # fmt: skip
    answer = chat(api, "Say hi", extra_body=asked)
    assert answer.model_extra["prompt_token_ids"] == chat_ids
    assert len(answer.choices[0].model_extra["token_ids"]) == answer.usage.completion_tokens
    deltas = list(chat(api, "Say hi", stream=True, extra_body=asked))
    assert deltas[0].model_extra["prompt_token_ids"] == chat_ids
    streamed = [t for d in deltas for t in d.choices[0].model_extra["token_ids"]]
    assert streamed == answer.choices[0].model_extra["token_ids"]
    named = complete(api, prompt=text, max_tokens=3, logprobs=2,
                     extra_body={**asked, "return_tokens_as_token_ids": True})  # fmt: skip
    ids, lp = named.choices[0].model_extra["token_ids"], named.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    chat_named = chat(api, "Say hi", logprobs=True, top_logprobs=2,
                      extra_body={**asked, "return_tokens_as_token_ids": True})  # fmt: skip
    entries = chat_named.choices[0].logprobs.content
    assert [e.token for e in entries] == [
        f"token_id:{t}" for t in chat_named.choices[0].model_extra["token_ids"]
    ]
    assert entries[0].bytes == list(entries[0].token.encode())
    for name in ("return_token_ids", "return_tokens_as_token_ids"):
        with pytest.raises(openai.BadRequestError, match=name):
            complete(api, extra_body={name: "yes"})


def test_logit_bias_bans_and_forces_tokens(daemon: HttpDaemon, api: openai.OpenAI) -> None:
    """OpenAI's logit_bias ({"token id": bias}) reaches the sampler: -100 on the greedy
    token takes the next best, +100 on a token makes it every token, in both routes."""
    with Client(daemon.address) as client:  # the greedy answer's token ids
        done = client.generate("The capital of France is", max_tokens=3, temperature=0)
    greedy = complete(api, max_tokens=3).choices[0].text
    banned = complete(api, max_tokens=3, logit_bias={str(done.token_ids[0]): -100})
    assert banned.choices[0].text != greedy
    with Client(daemon.address) as client:
        again = client.generate("The capital of France is", max_tokens=3, temperature=0,
                                logit_bias={done.token_ids[0]: -100})  # fmt: skip
    assert again.token_ids[0] != done.token_ids[0] and again.text == banned.choices[0].text
    forced = complete(api, max_tokens=3, logit_bias={str(done.token_ids[1]): 100})
    with Client(daemon.address) as client:
        forced_done = client.generate("The capital of France is", max_tokens=3, temperature=0,
                                      logit_bias={done.token_ids[1]: 100.0})  # fmt: skip
    assert forced_done.token_ids == [done.token_ids[1]] * 3
    assert forced.choices[0].text == forced_done.text
    chat_forced = chat(api, max_tokens=2, logit_bias={str(done.token_ids[1]): 100})
    assert chat_forced.choices[0].message.content * 3 == forced_done.text * 2  # 6 of that token


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_hold_the_answer(daemon: HttpDaemon, api: openai.OpenAI) -> None:
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and
    guided_* fields: each answer is in its grammar and ends with it ("stop"), streamed as
    it is whole, and is what the socket client gets for the same spec."""
    ask = "Describe a person named Alice who is 30 years old, as JSON."
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = chat(api, ask, max_tokens=40, response_format=fmt)
    answer = json.loads(whole.choices[0].message.content)
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int), answer
    assert whole.choices[0].finish_reason == "stop"
    pieces = chat(api, ask, max_tokens=40, response_format=fmt, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert streamed == whole.choices[0].message.content
    with Client(daemon.address) as client:
        spec = StructuredOutput("json", json.dumps(PERSON))
        messages = [{"role": "user", "content": ask}]
        served = client.generate(messages, max_tokens=40, temperature=0, structured=spec)
    assert served.text == whole.choices[0].message.content
    anything = chat(api, ask, max_tokens=60, response_format={"type": "json_object"})
    text = anything.choices[0].message.content
    assert text.startswith("{") and (anything.choices[0].finish_reason == "length"
                                     or isinstance(json.loads(text), dict))  # fmt: skip
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}}, r"[0-9]{4}-[0-9]{2}"),
        ({"guided_regex": "(Paris|Lyon)!"}, r"(Paris|Lyon)!"),
        ({"structured_outputs": {"choice": ["north", "south"]}}, r"north|south"),
        ({"guided_choice": ["yes", "no"]}, r"yes|no"),
        ({"guided_grammar": 'root ::= "x" [a-c] [a-c]'}, r"x[a-c][a-c]"),
        ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
         r'\{"name":"[^"]*","age":-?[0-9]+\}'),
    ]  # fmt: skip
    for extra, pattern in cases:
        done = complete(api, max_tokens=24, extra_body=extra)
        assert re.fullmatch(pattern, done.choices[0].text), (extra, done.choices[0].text)
        assert done.choices[0].finish_reason == "stop", extra


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False},
    },
}  # fmt: skip
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip


def test_tool_choice_named_and_required_answer_with_tool_calls(
    daemon: HttpDaemon, api: openai.OpenAI
) -> None:
    """vLLM's tool use without a parser: a named function or "required" holds the answer
    to the calls' grammar and comes back as tool_calls (content "", finish "stop"),
    streamed alike; "none" answers as if no tools were given; the conversation can go on
    with the call and its result."""
    ask = "What is the weather in Paris?"
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(api, ask, max_tokens=40, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named)
    message, choice = whole.choices[0].message, whole.choices[0]
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert message.content == "" and choice.finish_reason == "stop"
    counted = httpx.post(f"{daemon.url}/tokenize", timeout=60, json={
        "messages": [{"role": "user", "content": ask}], "tools": [WEATHER_TOOL, TIME_TOOL]})  # fmt: skip
    assert counted.json()["count"] == whole.usage.prompt_tokens  # the same prompt, tools too
    events = list(chat(api, ask, max_tokens=40, tools=[WEATHER_TOOL, TIME_TOOL],
                       tool_choice=named, stream=True))  # fmt: skip
    deltas = [d for e in events if e.choices for d in (e.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 1  # the arguments stream as they come, as vLLM's
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert deltas[0].function.name == "get_weather" and deltas[0].id and deltas[0].type
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "stop"
    required = chat(api, ask, max_tokens=64, tools=[WEATHER_TOOL, TIME_TOOL],
                    tool_choice="required")  # fmt: skip
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        assert isinstance(json.loads(c.function.arguments), dict)
    plain = chat(api, ask, max_tokens=8)
    nothing = chat(api, ask, max_tokens=8, tools=[WEATHER_TOOL], tool_choice="none")
    assert nothing.choices[0].message.content == plain.choices[0].message.content
    assert not nothing.choices[0].message.tool_calls
    turns = [{"role": "user", "content": ask},
             {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
             {"role": "tool", "content": "18 C and sunny", "tool_call_id": call.id}]  # fmt: skip
    after = api.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=8,
                                        temperature=0, tools=[WEATHER_TOOL], tool_choice="none")  # fmt: skip
    assert (
        after.choices[0].message.content and after.usage.prompt_tokens > whole.usage.prompt_tokens
    )
    # a call's content null (OpenAI's own shape, as an agent appends the answer's message):
    # the template gets "" (vLLM's), so the same prompt and answer
    turns[1]["content"] = None
    again = api.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=8,
                                        temperature=0, tools=[WEATHER_TOOL], tool_choice="none")  # fmt: skip
    assert again.choices[0].message.content == after.choices[0].message.content
    assert again.usage.prompt_tokens == after.usage.prompt_tokens


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tools": [WEATHER_TOOL]}, "tool_choice"),  # "auto", the default with tools
        ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": "x"}},
         "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": ["required"]}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                   "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
         "tools"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]},
         "messages[0].tool_calls"),
    ],
)  # fmt: skip
def test_chat_tool_errors_name_the_field(api: openai.OpenAI, kw: dict, param: str) -> None:
    kw = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
          **kw}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(**kw)
    assert info.value.body.get("param") == param, info.value.body


@pytest.mark.parametrize(
    ("kw", "error", "param"),
    [
        ({"top_p": 0}, "BadRequestError", "top_p"),
        ({"extra_body": {"mirostat": 1}}, "BadRequestError", "mirostat"),
        ({"logprobs": 99}, "BadRequestError", "logprobs"),
        ({"model": "gpt-nothing"}, "NotFoundError", "model"),
        ({"prompt": [1] * 300}, "BadRequestError", "prompt"),  # prompt past the context
        ({"n": 5}, "RateLimitError", None),  # more choices than --max-queue 4
        # values the request message itself refuses, before the daemon sees them: of the
        # wrong type, or integers msgpack cannot carry
        ({"temperature": "hot"}, "BadRequestError", "temperature"),
        ({"seed": 2**80}, "BadRequestError", "seed"),
        ({"prompt": [1, 2**64]}, "BadRequestError", "prompt"),
        ({"max_tokens": -(2**70)}, "BadRequestError", "max_tokens"),
        ({"stop": ["a", 7]}, "BadRequestError", "stop"),
        ({"extra_body": {"stop_token_ids": [2**65]}}, "BadRequestError", "stop_token_ids"),
        ({"extra_body": {"ignore_eos": "yes"}}, "BadRequestError", "ignore_eos"),
        ({"extra_body": {"priority": 2**64}}, "BadRequestError", "priority"),
        ({"extra_body": {"cache_salt": 5}}, "BadRequestError", "cache_salt"),
        ({"stop": ["s"] * 17}, "BadRequestError", "stop"),  # the daemon's max_stop_strings
        ({"extra_body": {"min_tokens": 5}}, "BadRequestError", "min_tokens"),  # > max_tokens
        ({"extra_body": {"bad_words": "x"}}, "BadRequestError", "bad_words"),
        ({"extra_body": {"bad_words": ["x" * 300]}}, "BadRequestError", "bad_words"),
        ({"logit_bias": {"abc": 1}}, "BadRequestError", "logit_bias"),
        ({"logit_bias": {"5": 101}}, "BadRequestError", "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "BadRequestError", "logit_bias"),  # past the vocabulary
        ({"logit_bias": {"5": "1"}}, "BadRequestError", "logit_bias"),
        ({"logit_bias": {str(2**64): 1}}, "BadRequestError", "logit_bias"),
        # structured outputs: a spec llguidance does not compile, two at once, an unknown
        # field, a malformed response_format
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "BadRequestError",
         "structured_outputs"),
        ({"extra_body": {"guided_json": {"type": "strong"}}}, "BadRequestError", "guided_json"),
        ({"extra_body": {"guided_choice": []}}, "BadRequestError", "guided_choice"),
        ({"extra_body": {"guided_grammar": "start: nothing_defined"}}, "BadRequestError",
         "guided_grammar"),
        ({"extra_body": {"response_format": {"type": "json_object"}, "guided_regex": "a"}},
         "BadRequestError", "guided_regex"),
        ({"extra_body": {"structured_outputs": {"json": {}, "backend": "xgrammar"}}},
         "BadRequestError", "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
         "BadRequestError", "structured_outputs"),
        ({"extra_body": {"response_format": {"type": "yaml"}}}, "BadRequestError",
         "response_format"),
        ({"extra_body": {"response_format": {"type": "json_schema"}}}, "BadRequestError",
         "response_format"),
    ],
)  # fmt: skip
def test_errors_have_status_and_shape(api: openai.OpenAI, kw: dict, error: str, param) -> None:
    kw = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, **kw}
    with pytest.raises(openai.APIStatusError) as info:
        api.completions.create(**kw)
    e = info.value
    assert type(e).__name__ == error
    assert e.body["type"] and e.body["message"] and e.body.get("param") == param
    if "prompt" in kw and isinstance(kw["prompt"], list) and len(kw["prompt"]) > 2:
        assert e.code == "context_length_exceeded"  # OpenAI's code, as vLLM's


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", b'{"prompt": "hi \\ud800 there", "max_tokens": 1}', "prompt"),
        ("chat", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
         "messages"),
        ("chat", b'{"messages": [{"role": "\\ud800", "content": "x"}], "max_tokens": 1}',
         "messages"),
        ("completions", b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
        ("completions", b'{"prompt": "hi", "cache_salt": "\\ud800", "max_tokens": 1}',
         "cache_salt"),
        ("completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ],
)  # fmt: skip
def test_json_python_takes_but_no_wire_carries_is_a_400(
    daemon: HttpDaemon, route: str, body: bytes, param: str | None
) -> None:
    """A lone surrogate (valid JSON, not valid Unicode: UTF-8 cannot carry it) and JSON
    nested past Python's recursion limit are the client's errors: one 400 naming the field,
    and the daemon serves on."""
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    r = httpx.post(f"{daemon.url}{path}", content=body, timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert ("surrogate" if param else "nested too deeply") in error["message"], error
    assert httpx.get(f"{daemon.url}/health", timeout=10).status_code == 200


def test_an_oversized_body_is_413_declared_or_streamed(daemon: HttpDaemon) -> None:
    body = b'{"prompt": "' + b"x" * (1 << 20) + b'"}'  # over max_body_bytes (1 MiB)
    url = f"{daemon.url}/v1/completions"
    declared = httpx.post(url, content=body, headers={"content-type": "application/json"},
                          timeout=60)  # fmt: skip

    def pieces() -> Iterator[bytes]:  # chunked: no content-length to refuse it by
        for i in range(0, len(body), 1 << 16):
            yield body[i : i + (1 << 16)]

    streamed = httpx.post(url, content=pieces(), timeout=60)
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert "1048576" in error["message"] and error["type"]
    assert httpx.get(f"{daemon.url}/health", timeout=10).status_code == 200  # serving on


def test_unavailable_daemon_is_503() -> None:
    from starlette.testclient import TestClient

    from reprise.daemon.serve.http import create_app
    from reprise.daemon.serve.http_config import HttpConfig

    app = create_app(HttpConfig(), "ipc:///nonexistent/reprise.sock")
    with TestClient(app) as http:
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"


def test_metrics_parse_and_hits_rise_after_a_repeat(daemon: HttpDaemon, api) -> None:
    hits = ("reprise_prefix_cache_hits_tokens_total", (("tier", "device"),))
    complete(api, LONG_PROMPT + " Metrics.", max_tokens=1)
    before = scrape(daemon.url)
    complete(api, LONG_PROMPT + " Metrics.", max_tokens=1)
    after = scrape(daemon.url)
    assert after[hits] > before[hits]
    length = ("reprise_requests_total", (("finish_reason", "length"),))
    assert after[length] == before[length] + 1
    for name in (
        "reprise_time_to_first_token_seconds_count",
        "reprise_e2e_request_latency_seconds_count",
        "reprise_request_queue_seconds_count",
    ):
        assert after[(name, ())] == before[(name, ())] + 1
    assert after[("reprise_num_requests_running", ())] == 0
    itl = ("reprise_inter_token_latency_seconds_count", ())
    list(complete(api, LONG_PROMPT, max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
    assert scrape(daemon.url)[itl] == after[itl] + 3  # the gaps between four streamed tokens
    assert after[("reprise_kv_blocks", (("tier", "device"),))] == 96


def test_metrics_also_carry_vllms_names(daemon: HttpDaemon, api) -> None:
    """Each metric vLLM's dashboards read is there under its vLLM name, model_name
    labelled, with our metric's value (from the same scrape)."""
    complete(api, LONG_PROMPT + " vLLM names.", max_tokens=2)
    complete(api, LONG_PROMPT + " vLLM names.", max_tokens=2)
    got = scrape(daemon.url)
    model = (("model_name", MODEL_NAME),)
    pairs = [
        ("reprise_prompt_tokens_total", (), "vllm:prompt_tokens_total", model),
        ("reprise_generation_tokens_total", (), "vllm:generation_tokens_total", model),
        ("reprise_requests_total", (("finish_reason", "length"),), "vllm:request_success_total",
         (("finished_reason", "length"), *model)),
        ("reprise_time_to_first_token_seconds_count", (),
         "vllm:time_to_first_token_seconds_count", model),
        ("reprise_e2e_request_latency_seconds_bucket", (("le", "+Inf"),),
         "vllm:e2e_request_latency_seconds_bucket", (("le", "+Inf"), *model)),
        ("reprise_request_queue_seconds_sum", (), "vllm:request_queue_time_seconds_sum", model),
        ("reprise_num_requests_running", (), "vllm:num_requests_running", model),
        ("reprise_num_requests_waiting", (), "vllm:num_requests_waiting", model),
        ("reprise_prefix_cache_queries_tokens_total", (), "vllm:prefix_cache_queries_total",
         model),
        ("reprise_preemptions_total", (), "vllm:num_preemptions_total", model),
    ]  # fmt: skip
    for ours, labels, theirs, their_labels in pairs:
        assert got[(theirs, tuple(sorted(their_labels)))] == got[(ours, labels)], theirs
    tiers = [got[("reprise_prefix_cache_hits_tokens_total", (("tier", t),))]
             for t in ("device", "host", "disk")]  # fmt: skip
    assert got[("vllm:prefix_cache_hits_total", model)] == sum(tiers) > 0
    used = got[("reprise_kv_blocks_used", (("tier", "device"),))]
    assert got[("vllm:kv_cache_usage_perc", model)] == used / 96


def test_done_carries_the_queue_time(daemon: HttpDaemon) -> None:
    with Client(daemon.address, timeout_s=60) as client:
        done = client.generate("How long did I wait?", max_tokens=2, temperature=0)
    assert 0 <= done.queue_ms <= done.ttft_ms


def test_the_daemons_own_busy_reply_is_429(daemon: HttpDaemon, api) -> None:
    # The daemon's queue (--max-queue 4) filled by ZeroMQ clients, which the HTTP layer's
    # own count does not see: the 429 comes from the daemon's `busy` reply.
    clients = [Client(daemon.address, timeout_s=60) for _ in range(4)]
    streams = [c.stream("Fill the queue", max_tokens=64, ignore_eos=True) for c in clients]
    try:
        for stream in streams:
            next(stream)  # running
        r = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       timeout=60)  # fmt: skip
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "busy"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for stream, client in zip(streams, clients, strict=True):
            stream.close()  # cancels
            client.close()


def test_each_choice_counts_against_the_daemons_queue(daemon: HttpDaemon) -> None:
    # --max-queue 4 with two streams running: two more choices fit, three do not
    from reprise.ipc import RequestError

    clients = [Client(daemon.address, timeout_s=60) for _ in range(3)]
    streams = [c.stream("Fill the queue", max_tokens=64, ignore_eos=True) for c in clients[:2]]
    try:
        for stream in streams:
            next(stream)  # running
        with pytest.raises(RequestError, match="each choice of n counting as one") as refused:
            clients[2].generate("Three more", n=3, max_tokens=1)
        assert refused.value.code == "busy"
        dones = clients[2].generate("Two more", n=2, max_tokens=1)
        assert [d.index for d in dones] == [0, 1]
    finally:
        for stream in streams:
            stream.close()  # cancels
        for client in clients:
            client.close()


def test_a_client_that_leaves_cancels_its_request(daemon: HttpDaemon) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 60, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{daemon.url}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # the first token came; then hang up
    with Client(daemon.address, timeout_s=30) as client:
        deadline = time.monotonic() + 30
        while (stats := client.stats(check=True))["num_requests"] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert stats["num_requests"] == 0 and stats["used_blocks"] == 0
    assert stats["integrity"] == "ok"
    # the request's line is logged on the detokenizing thread, after its last text
    while not re.search(r"cancelled, \d+ prompt tokens", daemon.read_log()):
        assert time.monotonic() < deadline, daemon.read_log()[-2000:]
        time.sleep(0.05)


# -- the API key, and where the daemon may listen ----------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reprise.daemon.model.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=3)


def test_api_key_is_required_when_set(tmp_path: Path, tiny: Path) -> None:
    d = HttpDaemon(tmp_path, tiny, env={"REPRISE_API_KEY": "sesame"})
    try:
        assert httpx.get(f"{d.url}/health").status_code == 200  # no key needed there
        with pytest.raises(openai.AuthenticationError):
            d.openai("wrong").models.list()
        for path in ("/v1/models", "/metrics", "/version"):
            r = httpx.get(f"{d.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path, body in (("/tokenize", {"prompt": "ab"}), ("/detokenize", {"tokens": [1]})):
            r = httpx.post(f"{d.url}{path}", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            keyed = httpx.post(f"{d.url}{path}", json=body,
                               headers={"Authorization": "Bearer sesame"})  # fmt: skip
            assert keyed.status_code == 200, keyed.text
        assert [m.id for m in d.openai("sesame").models.list().data] == ["tiny"]
        done = d.openai("sesame").completions.create(model="tiny", prompt="ab", max_tokens=2)
        assert done.usage.completion_tokens >= 1
    finally:
        d.stop()
    assert d.proc.returncode == 0


def test_draining_answers_503_while_a_stream_finishes(tmp_path: Path, tiny: Path) -> None:
    d = HttpDaemon(tmp_path, tiny, "--max-model-len", "1024", "--max-tokens-cap", "1000")
    body = {"prompt": "Once", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # in flight
            d.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (health := httpx.get(f"{d.url}/health", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline, "/health never turned 503"
                time.sleep(0.01)
            assert health.status_code == 503 and health.json()["status"] != "ok"
            new = httpx.post(f"{d.url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             timeout=10)  # fmt: skip
            assert new.status_code == 503, new.text
            assert new.json()["error"]["code"] == "shutting_down"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the stream in flight still ends properly
        assert d.proc.wait(timeout=60) == 0
    finally:
        d.stop()


def test_non_loopback_without_a_key_is_refused_before_loading(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_API_KEY"}
    cmd = [sys.executable, "-m", "reprise.cli.main", "serve", "--model", str(tmp_path / "none"),
           "--socket", f"ipc://{tmp_path}/d.sock", "--http", "0.0.0.0:8000"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "needs an API key" in done.stderr and "Traceback" not in done.stderr


def test_with_pieces_keeps_within_a_small_queue(daemon: HttpDaemon) -> None:
    """llama.cpp's /tokenize `with_pieces` decodes each token alone; with --max-queue 4
    (this daemon's) at most 2 at a time, so it is answered, not refused as busy."""
    text = "The capital of France is Paris, and of Italy Rome."
    reply = httpx.post(f"{daemon.url}/tokenize", json={"content": text, "with_pieces": True},
                       timeout=60)  # fmt: skip
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"]
    assert len(tokens) > 8 and "".join(t["piece"] for t in tokens) == text
