"""Tool use on the wire and in the chat template: `tools` go to the template (which
renders them as the model's own), an assistant message's tool calls reach it with
their arguments as the object they spell (as vLLM hands them over), a tool message
keeps its tool_call_id; malformed tools and tool calls are refused in one line naming
the field. (The HTTP side, tool_choice and the answers as tool_calls: test_http.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from reprise.daemon.model.synth import synth_model
from reprise.daemon.model.tokenizer import Tokenizer
from reprise.daemon.serve.intake import RequestChecks, RequestLimits
from reprise.ipc.codec import decode_request, encode
from reprise.ipc.messages import MAX_TOOLS, Generate, ProtocolError, Tokenize

TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
    "{{ '\\n' }}{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} city={{ c.function.arguments.city }}"
    "{% endfor %}{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TURNS = [
    {"role": "user", "content": "Weather in Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
    {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
]  # fmt: skip


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RequestChecks]:
    folder = synth_model("tiny", tmp_path_factory.mktemp("tools") / "tiny")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(Path(folder))
    limits = RequestLimits(
        max_tokens_cap=64, max_stop_strings=4, max_stop_chars=64, max_logits_bytes=0
    )
    yield RequestChecks(limits, tokenizer, vocab_size=1024, max_model_len=4096)


def rendered(checks: RequestChecks, request: Generate | Tokenize) -> str:
    back = decode_request(encode(request))  # as the daemon receives it
    return checks.tokenizer.decode(checks.text_ids(back), skip_special_tokens=False)


def test_tools_and_tool_calls_reach_the_template(checks: RequestChecks) -> None:
    text = rendered(checks, Generate(id="g", messages=TURNS, tools=[WEATHER, CLOCK]))
    assert text == (
        "TOOLS get_weather,get_time\n[user]Weather in Lyon?\n"
        "[assistant]CALL get_weather city=Lyon\n[tool]18 C, sunny for call_1\n[assistant]"
    )
    assert rendered(checks, Tokenize(id="t", messages=TURNS, tools=[WEATHER])) == text.replace(
        ",get_time", ""
    )
    plain = rendered(checks, Generate(id="g", messages=TURNS[:1]))
    assert plain == "[user]Weather in Lyon?\n[assistant]"  # no tools: none rendered


def test_arguments_that_spell_no_object_reach_the_template_as_text(checks) -> None:
    turns = [dict(TURNS[1], tool_calls=[{"function": {"name": "f", "arguments": "{oops"}}])]
    text = rendered(checks, Generate(id="g", messages=turns))
    assert text == "[assistant]CALL f city=\n[assistant]"  # a string has no .city


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"prompt": "x", "tools": [WEATHER]}, "tools go with messages"),
        ({"tools": {"a": 1}}, "tools must be"),
        ({"tools": [{"type": "retrieval"}]}, r'tools\[0\] must be \{"type": "function"'),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]},
         r"tools\[0\].function.name must be"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name must not be empty"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
         r"tools\[0\].function.parameters must be"),
        ({"tools": [{"type": "function", "function": {"name": "f", "code": 1}}]},
         r"unknown field\(s\) \['code'\]"),
        ({"tools": [CLOCK] * (MAX_TOOLS + 1)}, f"at most {MAX_TOOLS} tools"),
        ({"messages": [{"role": "assistant", "content": None}]}, r"messages\[0\].content must be"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
         "must have name and arguments"),
        ({"messages": [{"role": "assistant", "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
         r"arguments must be"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
         r"tool_call_id must be"),
        ({"messages": [{"role": "user", "content": "x", "images": []}]}, "may have tool_calls"),
    ],
)  # fmt: skip
def test_malformed_tools_and_calls_are_refused(fields: dict, says: str) -> None:
    fields = {"messages": TURNS[:1], **fields}
    if "prompt" in fields:
        del fields["messages"]
    with pytest.raises(ProtocolError, match=says) as refused:
        Generate(id="g", **fields)
    assert refused.value.code == "bad_request" and "\n" not in refused.value.message
