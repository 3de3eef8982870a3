"""OpenAI's Responses API (`POST /v1/responses`, daemon/serve/responses_api.py) on a real
`reprise serve --http` (NumPy backend, the default model), driven by the official
`openai` package: every answer is checked against the chat completion it runs as (the
same messages, tools and settings through /v1/chat/completions), whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
from http_support import HttpDaemon  # noqa: E402

pytestmark = pytest.mark.model

MODEL = "smol"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("responses"), default_model_dir,
                   "--served-model-name", MODEL)  # fmt: skip
    yield d
    d.stop()
    assert d.proc.returncode == 0, d.read_log()[-2000:]


@pytest.fixture(scope="module")
def api(daemon: HttpDaemon) -> openai.OpenAI:
    return daemon.openai()


def chat(api: openai.OpenAI, messages: list, **kw):
    return api.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_a_text_answer_is_the_chat_answer(api: openai.OpenAI) -> None:
    """instructions are the system message and input the user's; the answer, its usage
    and its status (incomplete at max_output_tokens) are the chat completion's."""
    for limit in (6, 40):
        r = api.responses.create(model=MODEL, input="Name a color.", instructions="Be brief.",
                                 max_output_tokens=limit, temperature=0)  # fmt: skip
        want = chat(api, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Name a color."}], max_tokens=limit)  # fmt: skip
        assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
        assert r.output_text == want.choices[0].message.content
        [message] = r.output
        assert message.type == "message" and message.role == "assistant"
        assert message.content[0].type == "output_text"
        assert r.usage.input_tokens == want.usage.prompt_tokens
        assert r.usage.output_tokens == want.usage.completion_tokens
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        if want.choices[0].finish_reason == "length":
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        else:
            assert r.status == "completed" and r.incomplete_details is None
        assert r.instructions == "Be brief." and r.max_output_tokens == limit and r.store is True


def test_streamed_events_carry_the_same_answer(api: openai.OpenAI) -> None:
    """The typed events in order, numbered from 0; the deltas join to the whole answer,
    which the last event's response holds; logprobs (include) are chat's, in the deltas too."""
    kw = {"model": MODEL, "input": [{"role": "user", "content": "Say hello."}],
          "max_output_tokens": 8, "temperature": 0,
          "include": ["message.output_text.logprobs"], "top_logprobs": 2}  # fmt: skip
    whole = api.responses.create(**kw)
    events = list(api.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text == events[-1].response.output_text
    want = chat(api, kw["input"], max_tokens=8, logprobs=True, top_logprobs=2)
    entries = whole.output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in entries] == [
        (e.token, e.logprob) for e in want.choices[0].logprobs.content
    ]
    assert [len(e.top_logprobs) for e in entries] == [2] * len(entries)
    streamed = [lp for e in deltas for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(e.token, e.logprob) for e in entries]
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_input_items_are_the_conversation(api: openai.OpenAI) -> None:
    """Message items with text parts, "developer" as the system role, an assistant turn:
    the chat of those messages."""
    items = [
        {"type": "message", "role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                     {"type": "input_text", "text": " there"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "Your name?"},
    ]  # fmt: skip
    r = api.responses.create(model=MODEL, input=items, max_output_tokens=10, temperature=0)
    want = chat(api, [{"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": "Hi there"},
                      {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "Your name?"}], max_tokens=10)  # fmt: skip
    assert r.output_text == want.choices[0].message.content
    assert r.usage.input_tokens == want.usage.prompt_tokens


def test_text_format_holds_the_answer_to_a_schema(api: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    r = api.responses.create(model=MODEL, input="Pick a number.", max_output_tokens=30,
                             temperature=0, text={"format": {"type": "json_schema",
                             "name": "pick", "schema": schema, "strict": True}})  # fmt: skip
    assert 0 <= json.loads(r.output_text)["n"] <= 99
    assert r.text.format.type == "json_schema"


def test_a_named_function_is_called_and_the_round_goes_on(api: openai.OpenAI) -> None:
    """A named tool choice answers with one function_call item (its arguments in the
    tool's schema), whole or streamed (the arguments events carry them); its output, sent
    back as function_call and function_call_output items, is the chat's tool round."""
    kw = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER],
          "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40,
          "temperature": 0}  # fmt: skip
    r = api.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    events = list(api.responses.create(**kw, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == call.arguments
    follow = [{"role": "user", "content": "What is the weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id,
               "output": "18 C and sunny"}]  # fmt: skip
    r2 = api.responses.create(model=MODEL, input=follow, tools=[WEATHER], tool_choice="none",
                              max_output_tokens=12, temperature=0)  # fmt: skip
    tool_call = {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    want = chat(api, [follow[0], {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                      {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"}],
                max_tokens=12)  # fmt: skip
    assert r2.output_text == want.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),  # never stored
        ({"store": "yes"}, "store"),
        ({"background": True}, "background"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"max_output_tokens": "many"}, "max_output_tokens"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"include": [[1]]}, "include"),  # not even a string (once a 500)
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"model": "gpt-nothing"}, "model"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_it(
    daemon: HttpDaemon, body: dict, param: str
) -> None:
    r = httpx.post(f"{daemon.url}/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **body})  # fmt: skip
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_stored_response_is_read_continued_and_deleted(
    api: openai.OpenAI, daemon: HttpDaemon
) -> None:
    """store (OpenAI's default): GET gives the response back; previous_response_id runs
    the chat of its conversation and output, then the new input (its instructions not
    carried over), whole or streamed; DELETE forgets it; store false keeps nothing."""
    first = api.responses.create(model=MODEL, input="My name is Ann.", instructions="Be brief.",
                                 max_output_tokens=8, temperature=0)  # fmt: skip
    assert first.store is True
    assert api.responses.retrieve(first.id).output_text == first.output_text
    kw = {"model": MODEL, "input": "What is my name?", "max_output_tokens": 8, "temperature": 0}
    second = api.responses.create(**kw, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    want = chat(api, [{"role": "user", "content": "My name is Ann."},
                      {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "What is my name?"}], max_tokens=8)  # fmt: skip
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == want.usage.prompt_tokens
    events = list(api.responses.create(**kw, previous_response_id=first.id, stream=True))
    streamed = events[-1].response
    assert streamed.output_text == second.output_text
    third = api.responses.create(model=MODEL, input="And again?", previous_response_id=streamed.id,
                                 max_output_tokens=2, temperature=0)  # a chain of three  # fmt: skip
    assert third.usage.input_tokens > second.usage.input_tokens
    r = httpx.delete(f"{daemon.url}/v1/responses/{first.id}", timeout=10)
    assert r.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{daemon.url}/v1/responses/{first.id}", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        api.responses.create(**kw, previous_response_id=first.id)
    unkept = api.responses.create(**kw, store=False)
    assert unkept.store is False
    assert httpx.get(f"{daemon.url}/v1/responses/{unkept.id}", timeout=10).status_code == 404


def test_the_store_keeps_the_most_recently_used_within_its_bytes() -> None:
    from reprise.daemon.serve.responses_store import ResponseStore

    def response(i: int, words: int) -> dict:
        text = " ".join(["word"] * words)
        return {"id": f"resp_{i}", "output": [{"type": "message", "content": [
            {"type": "output_text", "text": text}]}]}  # fmt: skip

    store = ResponseStore(max_bytes=4000)
    for i in range(3):
        store.put(response(i, 100), [{"role": "user", "content": f"q{i}"}])
    assert len(store) == 3 and store.num_bytes <= 4000
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(response(3, 100), [])
    assert store.get("resp_1") is None and store.get("resp_0") is not None
    assert store.conversation("resp_0")[-1] == {
        "role": "assistant",
        "content": " ".join(["word"] * 100),
    }
    assert not store.put(response(4, 2000), [])  # larger than the store: not kept, none evicted
    assert store.get("resp_4") is None and len(store) == 3
    assert store.delete("resp_0") and not store.delete("resp_0")
    assert store.num_bytes == sum(e[0] for e in store._entries.values())
