"""tool_choice "auto" (`serve --tool-call-parser`): tool calls read out of the model's own
text, hermes's `<tool_call>` blocks, Llama 3's JSON objects and the pythonic list of
calls; text that is no
well-formed call stays content; streaming never lets out text that belongs to a call,
and streamed content plus the last chunk's equals the whole answer's. End to end, a
daemon started with each parser, its answer forced into calls by a regex."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from reprise.daemon.serve.tool_parsers import ParsedAnswer, call_id, parse, streamable

CALL = '{"name": "get_weather", "arguments": {"city": "Lyon"}}'


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", f"<tool_call>\n{CALL}\n</tool_call>", None,
         [("get_weather", '{"city": "Lyon"}')]),
        ("hermes", f"Let me look.\n<tool_call>{CALL}</tool_call>\n<tool_call>"
         '{"name": "get_time", "arguments": {}}</tool_call>', "Let me look.\n",
         [("get_weather", '{"city": "Lyon"}'), ("get_time", "{}")]),
        ("hermes", f"<tool_call>{CALL}", None, [("get_weather", '{"city": "Lyon"}')]),  # unclosed
        ("hermes", "Just text, no call.", "Just text, no call.", []),
        ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>',
         '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lyon"}}', None,
         [("get_weather", '{"city": "Lyon"}')]),
        ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
         '{"name": "b", "arguments": {"y": "é"}}', None, [("a", '{"x": 1}'), ("b", '{"y": "é"}')]),
        ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
        ("llama3_json", '{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),
        ("pythonic", '[get_weather(city="Lyon")]', None, [("get_weather", '{"city": "Lyon"}')]),
        ("pythonic", "  [a(x=1, y=-2.5, z=[True, None], w={'k': 'é'}), b()]\n", None,
         [("a", '{"x": 1, "y": -2.5, "z": [true, null], "w": {"k": "é"}}'), ("b", "{}")]),
        ("pythonic", "<|python_start|>[get_time(zone='UTC')]<|python_end|>", None,
         [("get_time", '{"zone": "UTC"}')]),
        ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),  # a list, of no calls
        ("pythonic", "[a('positional')]", "[a('positional')]", []),
        ("pythonic", "[a(x=open('f'))]", "[a(x=open('f'))]", []),  # never evaluated
        ("pythonic", "[a(**kw)]", "[a(**kw)]", []),
        ("pythonic", "[a(x=float('nan'))]", "[a(x=float('nan'))]", []),
        ("pythonic", "[a(x={1, 2})]", "[a(x={1, 2})]", []),  # a set: no JSON for it
        ("pythonic", "[a(x=1)", "[a(x=1)", []),  # unclosed
        ("pythonic", "[" * 5000 + "]" * 5000, "[" * 5000 + "]" * 5000, []),
        ("pythonic", "The answer is [a(x=1)].", "The answer is [a(x=1)].", []),
        ("pythonic", "[]", "[]", []),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}]', None,
         [("get_weather", '{"city": "Lyon"}')]),
        ("mistral", 'Let me check. [TOOL_CALLS][{"name": "a", "arguments": {}}, '
         '{"name": "b", "arguments": {"x": [1]}}]', "Let me check. ",
         [("a", "{}"), ("b", '{"x": [1]}')]),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{}',
         None, [("get_weather", '{"city": "Lyon"}'), ("get_time", "{}")]),
        ("mistral", '[TOOL_CALLS] {"name": "a", "arguments": {"é": 1}}', None, [("a", '{"é": 1}')]),
        ("mistral", "Paris is the capital.", "Paris is the capital.", []),
        ("mistral", "[TOOL_CALLS] [{not json}]", "[TOOL_CALLS] [{not json}]", []),
        ("mistral", "[TOOL_CALLS]a b[ARGS]{}", "[TOOL_CALLS]a b[ARGS]{}", []),  # no name
        ("mistral", "[TOOL_CALLS]a[ARGS][1]", "[TOOL_CALLS]a[ARGS][1]", []),  # not an object
        ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ],
)  # fmt: skip
def test_calls_and_content_read_from_the_text(parser, text, content, calls) -> None:
    assert parse(parser, text) == ParsedAnswer(content, calls)


@pytest.mark.parametrize(
    ("parser", "text", "ends_at"),
    [
        ("hermes", f"Sure.\n<tool_call>{CALL}</tool_call>", len("Sure.\n")),
        ("hermes", "A < B, and <tool is not <tool_call", len("A < B, and <tool is not ")),
        ("hermes", "plain text to the end", len("plain text to the end")),
        ("llama3_json", f"  {CALL}", 0),
        ("llama3_json", "<|python_tag|>" + CALL, 0),
        ("llama3_json", "<|not a tag, just text", len("<|not a tag, just text")),
        ("pythonic", '  [get_weather(city="Lyon")]', 0),
        ("pythonic", "<|python_start|>[a()]<|python_end|>", 0),
        ("pythonic", "Sure, [1] is a list.", len("Sure, [1] is a list.")),
        ("mistral", "Sure. [TOOL_CALLS]a[ARGS]{}", len("Sure. ")),
        ("mistral", "A [TOOL is not [TOOL_C", len("A [TOOL is not ")),
    ],
)
def test_streaming_never_lets_out_a_call(parser: str, text: str, ends_at: int) -> None:
    """Character by character, what may be streamed only grows, never reaches into a
    call (nor into what may still begin one), and ends where the content ends."""
    readies = [streamable(parser, text[:end]) for end in range(len(text) + 1)]
    assert readies == sorted(readies) and readies[-1] == ends_at


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator:
    pytest.importorskip("openai")
    from http_support import HttpDaemon

    d = HttpDaemon(tmp_path_factory.mktemp("parser"), default_model_dir, "--served-model-name",
                   "smol", "--tool-call-parser", "hermes")  # fmt: skip
    yield d
    d.stop()
    assert d.proc.returncode == 0, d.read_log()[-2000:]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
FORCED = (
    r'Checking\.\n<tool_call>\{"name": "get_weather", '
    r'"arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}</tool_call>'
)


@pytest.mark.model
def test_auto_reads_the_models_calls_whole_and_streamed(daemon) -> None:
    api = daemon.openai()
    messages = [{"role": "user", "content": "Weather in Lyon?"}]
    kw = {"model": "smol", "messages": messages, "max_tokens": 48, "temperature": 0,
          "tools": [TOOL], "extra_body": {"guided_regex": FORCED}}  # fmt: skip
    whole = api.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", json.loads(call.function.arguments)["city"])
    events = list(api.chat.completions.create(**kw, stream=True))
    content = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert content == "Checking.\n"  # the call's text never streamed as content
    deltas = [d for e in events if e.choices for d in e.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (call.function.name, call.function.arguments)
    ]
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"
    # unforced, the default model (whose template shows no tools) answers in text: content
    plain = api.chat.completions.create(**{**kw, "extra_body": {}, "max_tokens": 6})
    assert not plain.choices[0].message.tool_calls and plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "length"


FORCED_BY_PARSER = {
    "pythonic": r'\[get_weather\(city="[A-Z][a-z]{2,8}"\), get_time\(\)\]',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": '
    r'"[A-Z][a-z]{2,8}"\}\}, \{"name": "get_time", "arguments": \{\}\}\]',
}


@pytest.mark.model
@pytest.mark.parametrize("parser", sorted(FORCED_BY_PARSER))
def test_more_parsers_end_to_end(tmp_path: Path, default_model_dir: Path, parser: str) -> None:
    """`serve --tool-call-parser pythonic` and `mistral`: the calls become tool_calls with
    JSON arguments, whole and streamed, and no content; Mistral's ids are 9 letters and
    digits. (The default model has no [TOOL_CALLS] token: the regex writes it as text.)"""
    pytest.importorskip("openai")
    from http_support import HttpDaemon

    d = HttpDaemon(tmp_path, default_model_dir, "--served-model-name", "smol",
                   "--tool-call-parser", parser)  # fmt: skip
    try:
        api = d.openai()
        kw = {"model": "smol", "messages": [{"role": "user", "content": "Weather?"}],
              "max_tokens": 48, "temperature": 0, "tools": [TOOL],
              "extra_body": {"guided_regex": FORCED_BY_PARSER[parser]}}  # fmt: skip
        choice = api.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        names = [c.function.name for c in choice.message.tool_calls]
        assert names == ["get_weather", "get_time"]
        city = json.loads(choice.message.tool_calls[0].function.arguments)["city"]
        assert re.fullmatch(r"[A-Z][a-z]{2,8}", city)
        assert choice.message.tool_calls[1].function.arguments == "{}"
        if parser == "mistral":
            assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in choice.message.tool_calls)
        events = list(api.chat.completions.create(**kw, stream=True))
        assert not "".join(e.choices[0].delta.content or "" for e in events if e.choices)
        deltas = [x for e in events if e.choices for x in e.choices[0].delta.tool_calls or []]
        assert [(x.function.name, x.function.arguments) for x in deltas] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]
    finally:
        d.stop()
    assert d.proc.returncode == 0, d.read_log()[-2000:]


def test_the_mistral_parser_keeps_special_tokens_in_the_text() -> None:
    """Its [TOOL_CALLS] marker is a special token: an "auto" request with tools keeps
    special tokens in its text (vLLM's), whatever the body says; other parsers leave it."""
    from reprise.daemon.serve.openai_api import parse_request

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
            "skip_special_tokens": True}  # fmt: skip
    mistral = parse_request("chat", body, tool_call_parser="mistral")
    assert mistral.options["skip_special_tokens"] is False
    assert mistral.tool_mode == "mistral" and mistral.tool_call_parser == "mistral"
    assert parse_request("chat", body, tool_call_parser="hermes").options["skip_special_tokens"]
    plain = parse_request("chat", {"messages": body["messages"]}, tool_call_parser="mistral")
    assert "skip_special_tokens" not in plain.options


def test_call_ids_mistrals_templates_take_back() -> None:
    ids = {call_id("mistral") for _ in range(200)}
    assert len(ids) == 200 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call_id("hermes"))
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call_id(None))
