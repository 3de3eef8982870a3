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
from http_support import HttpDaemon, served  # noqa: E402

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
    with served(tmp_path_factory.mktemp("responses"), default_model_dir,
                "--served-model-name", MODEL) as d:  # fmt: skip
        yield d


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
    tool's schema), whole or streamed (its arguments as they come); its output, sent
    back as function_call and function_call_output items, is the chat's tool round."""
    kw = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER],
          "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40,
          "temperature": 0}  # fmt: skip
    r = api.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    events = streamed(api, **kw)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments  # as they come
    assert events[-1].type == "response.completed"
    assert without_ids(events[-1].response) == without_ids(r)
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


# Streamed as the answer goes: a server with a reasoning parser and a tool-call parser
THOUGHT = "<think>[a-z ]{8,20}</think>"
CALL = (
    r'Checking\.\n<tool_call>\{"name": "get_weather", '
    r'"arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def parsing(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator:
    with served(tmp_path_factory.mktemp("responses-parsing"), default_model_dir,
                "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                "--tool-call-parser", "hermes") as d:  # fmt: skip
        yield d.openai()


def streamed(api: openai.OpenAI, **kw) -> list:
    """A streamed answer's events, checked as a client may rely on them: numbered from 0
    without a gap; each item added once, in order, and done once as the last event's
    response holds it (the same ids); every event of an item between the two, naming it."""
    events = list(api.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    indices = list(range(len(final.output)))
    assert [e.output_index for e in added] == [e.output_index for e in done] == indices
    assert [e.item.id for e in added] == [item.id for item in final.output]
    assert [e.item for e in done] == final.output
    for e in events:
        if getattr(e, "item_id", None) is not None:
            index = e.output_index
            assert e.item_id == final.output[index].id
            assert added[index].sequence_number < e.sequence_number < done[index].sequence_number
    return events


def without_ids(response) -> dict:
    """A response as a dict, less what differs between two runs of one request: its and
    its items' ids (and calls' ids), its times, and the prompt tokens the cache held."""
    out = response if isinstance(response, dict) else response.model_dump()
    out = {k: v for k, v in out.items() if k not in ("id", "created_at", "completed_at")}
    if out["usage"] is not None:
        out["usage"] = {**out["usage"], "input_tokens_details": None}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                     for item in out["output"]]  # fmt: skip
    return out


def runs(events: list) -> list[str]:
    """The events' types, each run of one type (deltas) once."""
    kinds = [e.type.removeprefix("response.") for e in events]
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


ITEM = ["output_item.added", "content_part.added"]
REASONING = [*ITEM, "reasoning_text.delta", "reasoning_text.done", "content_part.done",
             "output_item.done"]  # fmt: skip
MESSAGE = [*ITEM, "output_text.delta", "output_text.done", "content_part.done", "output_item.done"]
CALL_ITEM = ["output_item.added", "function_call_arguments.delta",
             "function_call_arguments.done", "output_item.done"]  # fmt: skip


@pytest.mark.parametrize("limit", [60, 8])
def test_the_thinking_streams_as_a_reasoning_item_before_the_message(
    parsing: openai.OpenAI, limit: int
) -> None:
    """A reasoning parser's thinking streams as reasoning_text deltas of its own item,
    closed before the message opens; the deltas join to the whole answer's thinking and
    text, and the last event's response is the whole answer. Cut short while thinking
    (max_output_tokens), the reasoning item is incomplete and the message empty."""
    kw = {"model": MODEL, "input": "Think, then answer: hi?", "max_output_tokens": limit,
          "temperature": 0, "extra_body": {"guided_regex": THOUGHT + "[A-Za-z ]{4,30}"}}  # fmt: skip
    whole = parsing.responses.create(**kw)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and message.type == "message"
    events = streamed(parsing, **kw)
    assert without_ids(events[-1].response) == without_ids(whole)
    thinking = [e for e in events if e.type == "response.reasoning_text.delta"]
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in thinking) == reasoning.content[0].text
    assert "".join(e.delta for e in text) == whole.output_text
    [thought] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert thought.text == reasoning.content[0].text
    assert len(thinking) > 1  # as the tokens came, not whole at the end
    if limit == 60:
        assert whole.status == reasoning.status == "completed" and whole.output_text
        assert runs(events) == ["created", "in_progress", *REASONING, *MESSAGE, "completed"]
        assert len(text) > 1
    else:
        assert whole.status == reasoning.status == message.status == "incomplete"
        assert whole.output_text == "" and not text
        assert runs(events) == ["created", "in_progress", *REASONING, *ITEM, *MESSAGE[3:],
                                "incomplete"]  # fmt: skip


@pytest.mark.parametrize("think", [False, True])
def test_auto_streams_the_text_then_the_calls(parsing: openai.OpenAI, think: bool) -> None:
    """tool_choice "auto" (a hermes call forced by a regex): the text before the call
    streams as output_text deltas (never the call's own text), the call comes as a
    function_call item with its arguments (in one delta: the parser reads them from the
    whole answer); the last event's response is the whole answer."""
    kw = {"model": MODEL, "input": "Weather in Lyon?", "tools": [WEATHER], "temperature": 0,
          "max_output_tokens": 64,
          "extra_body": {"guided_regex": (THOUGHT if think else "") + CALL}}  # fmt: skip
    whole = parsing.responses.create(**kw)
    assert whole.status == "completed"
    *thinking, message, call = whole.output
    assert [item.type for item in thinking] == (["reasoning"] if think else [])
    assert message.content[0].text == "Checking.\n"
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"].istitle()
    events = streamed(parsing, **kw)
    assert without_ids(events[-1].response) == without_ids(whole)
    assert runs(events) == ["created", "in_progress", *(REASONING if think else []), *MESSAGE,
                            *CALL_ITEM, "completed"]  # fmt: skip
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in text) == "Checking.\n" and len(text) > 1
    arguments = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert [(e.delta, e.output_index) for e in arguments[:-1]] == [
        (call.arguments, len(thinking) + 1)
    ]
    assert arguments[-1].arguments == call.arguments
    # the SDK's own accumulation of the stream (it checks each item's identity) agrees
    with parsing.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        accumulated = stream.get_final_response()
    assert accumulated.output_text == whole.output_text
    assert [getattr(item, "arguments", item.type) for item in accumulated.output] == [
        getattr(item, "arguments", item.type) for item in whole.output
    ]


def test_a_text_answer_with_tools_streams_as_it_comes(parsing: openai.OpenAI) -> None:
    """With tools ("auto") and no call, the text streams token by token, not whole at
    the end; required calls (a JSON list) come whole, as the whole answer's."""
    kw = {"model": MODEL, "input": "Say hello.", "tools": [WEATHER], "temperature": 0,
          "max_output_tokens": 12}  # fmt: skip
    whole = parsing.responses.create(**kw)
    [message] = whole.output
    assert message.type == "message" and whole.output_text
    events = streamed(parsing, **kw)
    assert without_ids(events[-1].response) == without_ids(whole)
    kinds = [e.type for e in events]
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert len(text) > 1 and "".join(e.delta for e in text) == whole.output_text
    assert text[0].sequence_number < kinds.index("response.output_text.done")
    clock = {"type": "function", "name": "get_time", "parameters": {"type": "object",
             "properties": {}, "additionalProperties": False}}  # fmt: skip
    required = {**kw, "input": "The time?", "tools": [clock], "tool_choice": "required",
                "max_output_tokens": 64}  # fmt: skip
    whole = parsing.responses.create(**required)
    assert [(item.type, item.name) for item in whole.output] == [("function_call", "get_time")]
    events = streamed(parsing, **required)
    assert without_ids(events[-1].response) == without_ids(whole)


def test_each_piece_goes_out_with_the_chunk_that_makes_it_known() -> None:
    """EventStream fed a hermes answer with qwen3 thinking piece by piece: the thinking
    streams as it comes, less what may begin `</think>`; the reasoning item closes when
    the text begins; whitespace alone opens no message, nor text that may begin a call;
    the call comes whole at the end. Every event has the `openai` package's shape."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from reprise.daemon.serve.responses_answer import EventStream, answer
    from reprise.daemon.serve.responses_api import parse_responses
    from reprise.ipc.messages import Done, TokenChunk

    asked = parse_responses({"model": MODEL, "input": "hi", "tools": [WEATHER]},
                            max_tokens_default=64, tool_call_parser="hermes")  # fmt: skip
    asked.parsed.reasoning_parser = "qwen3"
    stream, shape = EventStream(asked, "resp_1", MODEL), TypeAdapter(ResponseStreamEvent)
    call = '_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>'
    pieces = ["<think>", "let me ", "see</th", "ink>", " ", "Checking", ".\n<tool", call]

    def brief(events: list[str]) -> list[str]:
        out = []
        for event in events:
            kind, data = event.removeprefix("event: ").split("\ndata: ")
            body = json.loads(data)
            if "response" in body:  # a usage field the newest SDK requires is not ours
                body["response"]["usage"] = None
            shape.validate_python(body)
            assert body["type"] == kind
            out.append(
                kind.removeprefix("response.") + (f":{body['delta']}" if "delta" in body else "")
            )
        return out

    assert brief(stream.start()) == ["created", "in_progress"]
    got = [brief(stream.chunk(TokenChunk("x", [1], piece))) for piece in pieces]
    assert (
        got
        == [
            [],
            [*REASONING[:2], "reasoning_text.delta:let me "],
            ["reasoning_text.delta:see"],  # "</th" held back
            [],
            REASONING[3:],  # the text began: the thinking is over
            [*ITEM, "output_text.delta: Checking"],
            ["output_text.delta:.\n"],  # "<tool" held back
            [],
        ]
    )
    done = Done("x", "stop", "".join(pieces), [1] * len(pieces), 3, 0, 0, 0.0, 0.0)
    assert brief(stream.done(done)) == [
        *MESSAGE[3:], "output_item.added", 'function_call_arguments.delta:{"city": "Lyon"}',
        *CALL_ITEM[2:], "completed",
    ]  # fmt: skip
    assert stream.final is not None
    assert without_ids(stream.final) == without_ids(answer(asked, "resp_2", MODEL, done))
    assert [item["type"] for item in stream.final["output"]] == ["reasoning", "message",
                                                                 "function_call"]  # fmt: skip
