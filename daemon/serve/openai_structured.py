"""Structured outputs and tools in OpenAI's and vLLM's request shapes: `response_format`,
`structured_outputs` and the `guided_*` fields as one StructuredOutput (checked by
llguidance here, so a bad spec is a 400 naming its field before it reaches the daemon),
and chat's `tools` and `tool_choice` as the tools its template gets and, for a required
or named choice, the grammar of the calls (openai_responses.py turns the answer back
into tool_calls; tool_parsers.py reads "auto"'s out of the model's text)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...ipc.messages import ProtocolError, check_tools
from ..engine.sampling.structured import StructuredOutput
from .openai_errors import bad

# Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
# guided_* fields (at most one of them in a request).
STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
              "guided_choice", "guided_grammar")  # fmt: skip


def structured(body: dict[str, Any]) -> StructuredOutput | None:
    """The request's structured output, from whichever of STRUCTURED it gives (at most
    one), checked by llguidance; None for none (or `response_format: {"type": "text"}`)."""
    given = [name for name in STRUCTURED if name in body]
    if len(given) > 1:
        raise bad(given[1], f"give at most one of {', '.join(STRUCTURED)}; got {', '.join(given)}")
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name == "response_format":
        spec = _response_format(value)
    elif name == "structured_outputs":
        spec = _structured_outputs(value)
    else:  # vLLM's guided_json / _regex / _choice / _grammar
        spec = _spec(name, name.removeprefix("guided_"), value, whitespace=True)
    if spec is not None:
        try:
            spec.validate()
        except ValueError as e:
            raise bad(name, str(e)) from None
    return spec


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A chat's tools for its template, and the grammar its tool choice makes."""

    tools: list[dict[str, Any]]
    spec: StructuredOutput | None  # None for "auto": the model writes its calls freely
    mode: str  # "named" | "required" | the tool-call parser's name ("auto")
    name: str | None  # the named function


def tools(body: dict[str, Any], parser: str | None) -> ToolUse | None:
    """OpenAI's `tools` and `tool_choice` (taken out of `body`), as vLLM serves them:
    "none" (the default without tools) answers in text, the template not given the
    tools; "required" and a named function hold the answer to a grammar of tool calls (a
    JSON list of {"name", "parameters"}, or the named function's parameters) and give the
    template the tools; "auto" (the default with tools) gives the template the tools and
    reads the calls out of the model's text with the server's `parser` (tool_parsers.py),
    and is a 400 on a server started without one."""
    tools, choice = body.pop("tools", None), body.pop("tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice", f"needs tools; got {choice!r:.60}")
        return None
    try:
        check_tools(tools)
    except ProtocolError as e:
        raise bad("tools", e.message) from None
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    if choice == "auto":
        if parser is None:
            raise bad("tool_choice", '"auto" (the default with tools) needs the server '
                      "started with --tool-call-parser (the model's own tool-call format); "
                      'give "required", a named function ({"type": "function", "function": '
                      '{"name": ...}}) or "none"')  # fmt: skip
        return ToolUse(tools, None, parser, None)
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
               for t in tools}  # fmt: skip
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in schemas.items()]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return ToolUse(tools, _spec("tools", "json", schema, whitespace=True), "required", None)
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and named in schemas):
        raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                  f'"function": {{"name": one of {sorted(schemas)}}}}}; got {choice!r:.80}')  # fmt: skip
    return ToolUse(tools, _spec("tools", "json", schemas[named], whitespace=True), "named", named)


def _response_format(value: object) -> StructuredOutput | None:
    """OpenAI's response_format: text, json_object, or json_schema with its `schema`."""
    if isinstance(value, dict):
        kind = value.get("type")
        if kind == "text" and len(value) == 1:
            return None
        if kind == "json_object" and len(value) == 1:
            return StructuredOutput("json_object")
        if kind == "json_schema":
            inner = value.get("json_schema")
            if set(value) - {"type", "json_schema"} or not isinstance(inner, dict):
                raise bad(
                    "response_format", 'json_schema needs {"json_schema": {"name", "schema"}}'
                )
            if set(inner) - {"name", "schema", "strict", "description"}:
                raise bad(
                    "response_format",
                    f"json_schema takes name, schema, strict and description; got {sorted(inner)}",
                )
            schema = inner.get("schema", {})  # OpenAI's default: any JSON value
            return _spec("response_format", "json", schema, whitespace=True)
    raise bad(
        "response_format",
        f'must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": "json_schema", '
        f'"json_schema": {{...}}}}; got {value!r:.80}',
    )


def _structured_outputs(value: object) -> StructuredOutput:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar or
    json_object, and optionally disable_any_whitespace (JSON without free whitespace)."""
    kinds = ("json", "regex", "choice", "grammar", "json_object")
    if not isinstance(value, dict):
        raise bad("structured_outputs", f"must be an object; got {value!r:.60}")
    value = {k: v for k, v in value.items() if v is not None and v is not False}
    if extra := set(value) - {*kinds, "disable_any_whitespace"}:
        raise bad("structured_outputs", f"unsupported field(s) {sorted(extra)}; takes "
                  f"one of {', '.join(kinds)}, and disable_any_whitespace")  # fmt: skip
    given = [k for k in kinds if k in value]
    if len(given) != 1:
        raise bad("structured_outputs", f"give exactly one of {', '.join(kinds)}; got {given}")
    kind, whitespace = given[0], not value.get("disable_any_whitespace", False)
    if kind == "json_object":
        if value[kind] is not True:
            raise bad("structured_outputs", f"json_object must be true; got {value[kind]!r:.40}")
        return _spec("structured_outputs", "json", {"type": "object"}, whitespace=whitespace)
    return _spec("structured_outputs", kind, value[kind], whitespace=whitespace)


def _spec(param: str, kind: str, value: object, *, whitespace: bool) -> StructuredOutput:
    """A StructuredOutput of `kind` from a body's value: a JSON schema as an object or its
    text, a regex or grammar as a string, choices as a list of strings."""
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict | bool):
                raise ValueError(f"a JSON schema must be an object; got {value!r:.60}")
            if not whitespace:  # llguidance's option: no whitespace between JSON's tokens
                schema = {**(schema if isinstance(schema, dict) else {}),
                          "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
            return StructuredOutput("json", json.dumps(schema))
        if kind == "choice":
            if not isinstance(value, list):
                raise ValueError(f"choice must be a list of strings; got {value!r:.60}")
            return StructuredOutput.choice(value)
        if not isinstance(value, str):
            raise ValueError(f"{kind} must be a string; got {value!r:.60}")
        return StructuredOutput(kind, value)
    except (ValueError, TypeError, RecursionError) as e:
        raise bad(param, str(e)) from None


def tool_calls(param: str, calls: object) -> list[dict[str, Any]]:
    """An assistant message's tool calls, each {"id", "type", "function": {"name",
    "arguments"}} with the arguments as JSON text (an object given is written as it)."""
    if not isinstance(calls, list):
        raise bad(param, f"must be a list of tool calls; got {calls!r:.60}")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad(param, f'each must be {{"id", "type", "function": {{"name", '
                      f'"arguments"}}}}; got {call!r:.60}')  # fmt: skip
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        kept = {k: call[k] for k in ("id", "type") if k in call}
        out.append({**kept, "function": {"name": function.get("name"), "arguments": arguments}})
    return out
