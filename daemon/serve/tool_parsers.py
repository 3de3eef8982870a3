"""Tool calls read out of a model's own text, for `tool_choice: "auto"` (vLLM's
`--tool-call-parser`): the model decides whether to call a tool, in the format its chat
template taught it, and the answer's text is parsed after the fact.

- "hermes" (Hermes, Qwen2 and Qwen2.5 templates, and others): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the first
  call is the message's content. A last call the model did not close counts.
- "llama3_json" (Llama 3.1 and later templates): the whole answer is one or more JSON
  objects `{"name": ..., "parameters": {...}}` (or "arguments"), separated by ";", maybe
  after `<|python_tag|>`; no content.
- "pythonic" (Llama 3.2 and 4, ToolACE and other templates that ask for Python): the
  whole answer is one Python list of calls, `[get_weather(city="Lyon"), get_time()]`,
  maybe between Llama 4's `<|python_start|>` and `<|python_end|>`; each argument a keyword
  whose value is a literal (str, number, bool, None, and lists and dicts of them), read
  by `ast.literal_eval`, never evaluated; no content.
- "mistral" (Mistral's templates): the text before `[TOOL_CALLS]` is the content; after
  it, a JSON list (or object) of `{"name", "arguments"}` (Mistral 7B v0.3, Nemo), or
  `name[ARGS]{...}` calls, each after its own `[TOOL_CALLS]` (the v11 tokenizer's:
  Mistral Small 3.2, Magistral, Devstral). `[TOOL_CALLS]` is a special token, so the
  request keeps special tokens in its text (openai_api.py), and its call ids are 9
  letters and digits, the only ids Mistral's templates take back.

Guarantees: an answer that is no well-formed call (text, or a call whose JSON does not
parse or lacks a name) comes back as content, whole, with no tool call, as vLLM gives it;
`streamable` (and `ContentStream`, which chat's and the Responses API's streams share)
never lets out text that turns out to belong to a call, so the content streamed plus the
content at the end is the content of the whole answer.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")
_HERMES_OPEN = "<tool_call>"
_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's, and a dot
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
_MAX_PYTHONIC_CHARS = 1 << 20  # ast's parser is recursive; an answer past this is content


# the parsers whose calls come after text (the content), from this mark on
_OPENINGS = {"hermes": _HERMES_OPEN, "mistral": _MISTRAL_CALLS}


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    content: str | None  # the text before the calls, as written (None when only whitespace)
    calls: list[tuple[str, str]]  # (function name, arguments as JSON text); [] for none


def parse(parser: str, text: str) -> ParsedAnswer:
    """The tool calls in an answer's text, and its content."""
    readers = {"hermes": _hermes, "llama3_json": _llama3_json, "pythonic": _pythonic,
               "mistral": _mistral}  # fmt: skip
    calls = readers[parser](text)
    if calls is None:
        return ParsedAnswer(text, [])
    opening = _OPENINGS.get(parser)
    content = text[: text.find(opening)] if opening is not None else ""
    return ParsedAnswer(content if content.strip() else None, calls)


def streamable(parser: str, text: str) -> int:
    """How many characters of a growing answer may be streamed as content now: none of
    a call, nor of what may still become the start of one."""
    if parser in _OPENINGS:
        opening = _OPENINGS[parser]
        start = text.find(opening)
        if start >= 0:
            return start
        for keep in range(min(len(opening) - 1, len(text)), 0, -1):
            if opening.startswith(text[-keep:]):
                return len(text) - keep  # the tail may begin a call
        return len(text)
    head = text.lstrip()
    opening, tag = ("[", _PYTHON_START) if parser == "pythonic" else ("{", _PYTHON_TAG)
    if not head or head[0] == opening or tag.startswith(head[: len(tag)]):
        return 0  # an answer that is (or may be) a call: held whole
    return len(text)


class ContentStream:
    """One streamed "auto" answer's content as `streamable` lets it out: what went out
    only grows, and begins the whole answer's content as written (`rest` is the remainder)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""  # the answer so far
        self.sent = 0  # characters of it already let out

    def push(self, delta: str) -> str:
        """The content that `delta` lets out."""
        self.text += delta
        ready = max(streamable(self.parser, self.text), self.sent)
        out, self.sent = self.text[self.sent : ready], ready
        return out

    def rest(self, content: str) -> str:
        """What of the whole answer's `content` was not let out."""
        return content[self.sent :]


def content_stream(tool_mode: str | None) -> ContentStream | None:
    """The content stream of a request whose tool choice is "auto" (its tool mode is the
    parser's name); None for no tools, or a named or required choice (no free text)."""
    return ContentStream(tool_mode) if tool_mode in PARSERS else None


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


def _pythonic(text: str) -> list[tuple[str, str]] | None:
    rest = text.strip()
    if rest.startswith(_PYTHON_START):
        rest = rest.removeprefix(_PYTHON_START).removesuffix(_PYTHON_END).strip()
    if not rest.startswith("[") or len(rest) > _MAX_PYTHONIC_CHARS:
        return None
    try:
        tree = ast.parse(rest, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [_pythonic_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return None if None in calls else calls  # type: ignore[return-value]


def _pythonic_call(node: ast.expr) -> tuple[str, str] | None:
    """One `name(key=literal, ...)`; positional arguments, `**kwargs` or anything but a
    literal make it no call. Raises ValueError (literal_eval) on a non-literal value."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(keyword.arg is None for keyword in node.keywords):
        return None
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    try:
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a literal JSON has no spelling for: bytes, a set, ...
        return None


def _mistral(text: str) -> list[tuple[str, str]] | None:
    start = text.find(_MISTRAL_CALLS)
    if start < 0:
        return None
    rest = text[start + len(_MISTRAL_CALLS) :].strip()
    if rest.startswith(("[", "{")):  # one JSON list of calls (or a lone call)
        try:
            value = json.loads(rest)
        except (ValueError, RecursionError):
            return None
        calls = [_call(obj, "arguments") for obj in (value if isinstance(value, list) else [value])]
        return None if not calls or None in calls else calls  # type: ignore[return-value]
    found = []
    for piece in text[start:].split(_MISTRAL_CALLS)[1:]:  # name[ARGS]{...} each
        name, marker, arguments = piece.partition(_MISTRAL_ARGS)
        name = name.strip()
        if not marker or not _FUNCTION_NAME.fullmatch(name):
            return None
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict):
            return None
        found.append((name, json.dumps(value, ensure_ascii=False)))
    return found or None


def call_id(parser: str | None) -> str:
    """A new tool call's id: 9 letters and digits for Mistral's templates (the only ids
    they take back in the next turn), else vLLM's `chatcmpl-tool-` and 32 hex digits."""
    if parser == "mistral":
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "chatcmpl-tool-" + uuid.uuid4().hex
