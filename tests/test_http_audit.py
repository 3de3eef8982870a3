"""What a user of the `openai` package (or of vLLM's OpenAI server) expects of the HTTP
front end at its edges: a real `reprise serve --http 127.0.0.1:0` (NumPy backend), bad
requests answered as OpenAI's 400s, and the daemon serving on after each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
from http_support import HttpDaemon, served  # noqa: E402

pytestmark = pytest.mark.model

MODEL_NAME = "smol"


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[HttpDaemon]:
    with served(tmp_path_factory.mktemp("http-audit"), default_model_dir,
                "--served-model-name", MODEL_NAME, "--max-queue", "4") as d:  # fmt: skip
        yield d


@pytest.fixture(scope="module")
def api(daemon: HttpDaemon) -> openai.OpenAI:
    return daemon.openai()


def chat(api: openai.OpenAI, messages: list, **kw: object):
    kw.setdefault("max_tokens", 2)
    kw.setdefault("temperature", 0)
    return api.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)


@pytest.mark.parametrize(
    "part",
    [{"type": "text", "text": 5}, {"type": "text", "text": ["a"]}, {"type": "text"}],
)
def test_a_text_part_without_text_is_a_400(daemon: HttpDaemon, api, part: dict) -> None:
    """A content part whose `text` is missing or not a string is the client's error (OpenAI
    requires a string): a 400 naming the message's content, not a 500, nor an empty text."""
    with pytest.raises(openai.BadRequestError) as info:
        chat(api, [{"role": "user", "content": [part]}])
    error = info.value.body
    assert error["param"] == "messages[0].content" and "text" in error["message"], error
    assert httpx.get(f"{daemon.url}/health", timeout=10).status_code == 200


def test_an_answers_message_dumped_with_its_nulls_continues_the_chat(api) -> None:
    """`message.model_dump()` of an answer (the usual way to keep a conversation) carries
    refusal, audio, function_call and annotations as null: null counts as not given, so the
    chat goes on as with the message's role and content alone."""
    messages = [{"role": "user", "content": "Hi"}]
    answer = chat(api, messages).choices[0].message
    dumped = answer.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= set(dumped)
    follow = {"role": "user", "content": "And then?"}
    got = chat(api, [*messages, dumped, follow]).choices[0].message.content
    plain = {"role": "assistant", "content": answer.content}
    assert got == chat(api, [*messages, plain, follow]).choices[0].message.content
    # a non-null value of a field we do not take is still refused, naming the message
    with pytest.raises(openai.BadRequestError) as info:
        chat(api, [*messages, {**plain, "refusal": "no"}, follow])
    assert info.value.body["param"] == "messages[1]", info.value.body


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"extra_body": {"chat_template_kwargs": {"x": 2**70}}}, "chat_template_kwargs"),
        ({"extra_body": {"chat_template_kwargs": {"x": [1, {"y": -(2**64)}]}}},
         "chat_template_kwargs"),
        ({"tools": [{**TOOL, "function": {"name": "f", "parameters": {"maxItems": 2**70}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [{**TOOL, "function": {"name": "f", "parameters": {"maxItems": 2**70}}}],
          "tool_choice": NAMED}, "tools"),
    ],
)  # fmt: skip
def test_a_json_integer_past_64_bits_is_a_400(daemon: HttpDaemon, api, kw: dict, param) -> None:
    """Free-form JSON (template variables, a tool's parameters) goes to the daemon in a
    msgpack message, whose integers have 64 bits: a larger one is a 400 naming the field
    (OpenAI's shape, which the SDK does not retry), not a plain-text 500."""
    with pytest.raises(openai.BadRequestError) as info:
        chat(api, [{"role": "user", "content": "Hi"}], **kw)
    error = info.value.body
    assert error["param"] == param and "64 bits" in error["message"], error
    assert httpx.get(f"{daemon.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (b'"chat_template_kwargs": {"x": "\\ud800"}', "chat_template_kwargs"),
        (b'"chat_template_kwargs": {"x": {"\\udfff": 1}}', "chat_template_kwargs"),
        (b'"documents": [{"title": "\\ud800"}]', "documents"),
        (b'"tools": [{"type": "function", "function": {"name": "f", "parameters": '
         b'{"description": "\\ud800"}}}], "tool_choice": "required"', "tools"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_in_free_form_json_is_a_400(
    daemon: HttpDaemon, extra: bytes, param: str
) -> None:
    """A lone surrogate (valid JSON, not valid Unicode) anywhere in template variables,
    documents or a tool's parameters is one 400 naming the field, as in a message's
    content, and the daemon serves on."""
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, ' + extra + b"}"
    r = httpx.post(f"{daemon.url}/v1/chat/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"], error
    assert httpx.get(f"{daemon.url}/health", timeout=10).status_code == 200


def test_a_bug_in_a_route_is_openais_json_500_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A route that fails unexpectedly answers OpenAI's JSON error body (the SDK reads it
    as an InternalServerError), not Starlette's plain-text page, and logs the traceback."""
    from starlette.testclient import TestClient

    from reprise.daemon.serve import http
    from reprise.daemon.serve.http_config import HttpConfig

    async def broken(frontend: object, request: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(http, "version", broken)
    client = TestClient(
        http.create_app(HttpConfig(), "ipc:///nowhere"), raise_server_exceptions=False
    )
    with caplog.at_level("ERROR", logger="reprise.http"):
        answer = client.get("/version")
    assert answer.status_code == 500
    assert answer.json()["error"]["code"] == "internal", answer.text
    assert "RuntimeError" in answer.json()["error"]["message"]
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)
    assert client.get("/health").status_code == 503  # the app answers on (no daemon behind it)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_options_without_stream_is_a_400(api, endpoint: str) -> None:
    """stream_options only means something for a stream: OpenAI and vLLM refuse it on a
    request that does not stream (an empty one passes, as in vLLM)."""
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            chat(api, [{"role": "user", "content": "x"}], stream_options={"include_usage": True})
        else:
            api.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1,
                                   stream_options={"include_usage": True})  # fmt: skip
    assert info.value.body["param"] == "stream_options", info.value.body
    assert "stream" in info.value.body["message"]
    answer = api.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1,
                                    extra_body={"stream_options": {}})  # fmt: skip
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize("model", [5, ["smol"], {"name": "smol"}])
def test_a_model_that_is_not_a_string_is_a_400(daemon: HttpDaemon, model: object) -> None:
    """A `model` of the wrong type is a bad request (400 naming it), not an unknown model
    (404): no name could have matched."""
    answer = httpx.post(f"{daemon.url}/v1/completions", timeout=30,
                        json={"model": model, "prompt": "x", "max_tokens": 1})  # fmt: skip
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "model"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", 10**6])
def test_a_bad_max_completion_tokens_is_named_as_sent(daemon: HttpDaemon, api, bad) -> None:
    """A chat's token limit comes from max_completion_tokens or its deprecated alias
    max_tokens: a bad value's 400 names the field the client sent (the daemon checks the
    value, so too large is past --max-tokens-cap), streamed or not."""
    hi = [{"role": "user", "content": "Hi"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            api.chat.completions.create(model=MODEL_NAME, messages=hi, stream=stream,
                                        max_completion_tokens=bad)  # fmt: skip
        error = info.value.body
        named = error["message"].removeprefix("sampling.")
        assert error["param"] == "max_completion_tokens" and named.startswith(error["param"]), error
    with pytest.raises(openai.BadRequestError) as info:
        chat(api, hi, max_tokens=bad)
    assert info.value.body["param"] == "max_tokens", info.value.body
    # both given: max_completion_tokens wins (as vLLM's), so it is the one a 400 names
    with pytest.raises(openai.BadRequestError) as info:
        chat(api, hi, max_tokens=2, max_completion_tokens=bad)
    assert info.value.body["param"] == "max_completion_tokens", info.value.body
    answer = chat(api, hi, max_tokens=bad, max_completion_tokens=1)
    assert answer.usage.completion_tokens == 1
    # the Responses API's limit runs as max_completion_tokens: its errors name its own
    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=bad)
    error = info.value.body
    named = error["message"].removeprefix("sampling.")
    assert error["param"] == "max_output_tokens" and named.startswith(error["param"]), error


@pytest.mark.parametrize("role", ["user", "assistant", "system"])
def test_an_empty_list_of_content_parts_is_a_400(daemon: HttpDaemon, api, role: str) -> None:
    """`content: []` is no message (OpenAI refuses it): a 400 naming the message's content
    and what it may be, in chat and in the Responses API's input; `content: ""` is an
    empty text, accepted."""
    messages = [{"role": "user", "content": "Hi"}, {"role": role, "content": []},
                {"role": "user", "content": "Go on"}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        chat(api, messages)
    error = info.value.body
    assert error["param"] == "messages[1].content", error
    assert "non-empty list" in error["message"] and "string" in error["message"], error
    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(model=MODEL_NAME, input=messages, max_output_tokens=2)
    error = info.value.body
    assert error["param"] == "input[1].content", error
    assert "non-empty list" in error["message"] and "string" in error["message"], error
    messages[1]["content"] = ""
    assert chat(api, messages).choices[0].finish_reason == "length"
    assert api.responses.create(model=MODEL_NAME, input=messages, max_output_tokens=2).output_text
    assert httpx.get(f"{daemon.url}/health", timeout=10).status_code == 200


def test_logprobs_0_lists_the_chosen_token_as_its_top(api) -> None:
    """Completions' logprobs 0 asks for no alternatives: each position's top_logprobs holds
    the chosen token alone, as vLLM's (not an empty object), whole, streamed and echoed (the
    prompt's first token's null aside); tokens and token_logprobs are logprobs 1's."""
    kw = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4,
          "temperature": 0}  # fmt: skip
    zero = api.completions.create(**kw, logprobs=0).choices[0].logprobs
    one = api.completions.create(**kw, logprobs=1).choices[0].logprobs
    assert (zero.tokens, zero.token_logprobs) == (one.tokens, one.token_logprobs)
    pairs = zip(zero.tokens, zero.token_logprobs, strict=True)
    assert zero.top_logprobs == [{token: logprob} for token, logprob in pairs]
    streamed = [c.logprobs.top_logprobs for e in api.completions.create(**kw, logprobs=0,
                stream=True) for c in e.choices if c.logprobs]  # fmt: skip
    assert [top for tops in streamed for top in tops] == zero.top_logprobs
    echoed = api.completions.create(**kw, logprobs=0, echo=True).choices[0].logprobs
    assert echoed.top_logprobs[0] is None and echoed.token_logprobs[0] is None
    pairs = zip(echoed.tokens[1:], echoed.token_logprobs[1:], strict=True)
    assert echoed.top_logprobs[1:] == [{token: logprob} for token, logprob in pairs]
    assert echoed.top_logprobs[-4:] == zero.top_logprobs
