"""Tool calls read out of a model's own text, for `tool_choice: "auto"` (vLLM's
`--tool-call-parser`): the model decides whether to call a tool, in the format its chat
template taught it, and the answer's text is parsed after the fact.

- "hermes" (Hermes, Qwen2 and Qwen2.5 templates, and others): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the first
  call is the message's content. A last call the model did not close counts.
- "llama3_json" (Llama 3.1 and later templates): the whole answer is one or more JSON
  objects `{"name": ..., "parameters": {...}}` (or "arguments"), separated by ";", maybe
  after `<|python_tag|>`; no content.

Guarantees: an answer that is no well-formed call (text, or a call whose JSON does not
parse or lacks a name) comes back as content, whole, with no tool call, as vLLM gives it;
`streamable` never lets out text that turns out to belong to a call, so the content
streamed plus the content at the end is the content of the whole answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    content: str | None  # the text before the calls, as written (None when only whitespace)
    calls: list[tuple[str, str]]  # (function name, arguments as JSON text); [] for none


def parse(parser: str, text: str) -> ParsedAnswer:
    """The tool calls in an answer's text, and its content."""
    calls = _hermes(text) if parser == "hermes" else _llama3_json(text)
    if calls is None:
        return ParsedAnswer(text, [])
    content = text[: text.find(_HERMES_OPEN)] if parser == "hermes" else ""
    return ParsedAnswer(content if content.strip() else None, calls)


def streamable(parser: str, text: str) -> int:
    """How many characters of a growing answer may be streamed as content now: none of
    a call, nor of what may still become the start of one."""
    if parser == "hermes":
        start = text.find(_HERMES_OPEN)
        if start >= 0:
            return start
        for keep in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
            if _HERMES_OPEN.startswith(text[-keep:]):
                return len(text) - keep  # the tail may begin a call
        return len(text)
    head = text.lstrip()
    if not head or head[0] == "{" or _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]):
        return 0  # an answer that is (or may be) a call: held whole
    return len(text)


def _call(obj: object, arguments_key: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _hermes(text: str) -> list[tuple[str, str]] | None:
    if _HERMES_OPEN not in text:
        return None
    calls = []
    for body in _HERMES_CALL.findall(text):
        try:
            call = _call(json.loads(body), "arguments")
        except (ValueError, RecursionError):
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _llama3_json(text: str) -> list[tuple[str, str]] | None:
    rest = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not rest.startswith("{"):
        return None
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except (ValueError, RecursionError):
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip().removeprefix(";").strip()
    return calls
