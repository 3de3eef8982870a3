"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it, over the chat path.

A request body becomes a chat completion's (`as_chat`): `instructions` the system
message, `input` (a string, or items: messages, and a tool round's `function_call` and
`function_call_output`) the messages, the flat function `tools` and `tool_choice` chat's,
`text.format` the response format, `max_output_tokens` the token limit, and
`include: ["message.output_text.logprobs"]` with `top_logprobs` the logprobs; then
`parse_request` checks it as it checks a chat. The answer comes back as a `response`
object or, streamed, as the Responses API's typed events (responses_answer.py).

Stored responses (responses_store.py): with `store` (OpenAI's default, true) a finished
response is kept, its conversation with it, in a least-recently-used store bounded in
bytes (`serve --responses-store-mb`, 0 to keep none); `GET /v1/responses/{id}` gives it
back, `DELETE` forgets it, and `previous_response_id` continues its conversation (its
input and output, not its instructions, as OpenAI's). Ids are random (uuid4): a response
is read only by whom it was answered to (or whom they gave its id).

Decided where vLLM's and OpenAI's differ or we cannot follow: `background` and a
`conversation` are refused, tools are function tools only, and a reasoning parser's
thinking is a `reasoning` item before the message (complete once the answer went on past
it). Streamed, items open as the answer reaches them (responses_answer.py `EventStream`):
the thinking streams as reasoning_text deltas, the message's text as output_text deltas
(with tools "auto", the text that cannot begin a call, as chat's stream lets it out), a
named function's arguments as they come; what only the whole answer tells comes whole at
its end: "auto"'s calls and a required choice's, each call's arguments in one delta (as
chat's stream, which knows them no sooner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .openai_api import PASSED, ParsedRequest, parse_request
from .openai_chat import CONTENT_RULE
from .openai_errors import ApiError, bad, renamed
from .openai_errors import is_a as _is
from .openai_structured import STRUCTURED
from .responses_store import ResponseStore

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16  # metadata pairs, as OpenAI's
# Accepted, echoed or not, and not acted on: they ask for nothing we would have to do.
HARMLESS = {"user", "metadata", "service_tier", "parallel_tool_calls",
            "prompt_cache_key", "safety_identifier", "max_tool_calls", "truncation",
            "reasoning", "stream_options"}  # fmt: skip
KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens",
         "temperature", "top_p", "top_logprobs", "include", "stream", "cache_salt", "priority",
         "previous_response_id", "store", "background", "conversation", *PASSED, *HARMLESS,
         *STRUCTURED}  # fmt: skip
# The chat parameters (and the daemon's fields) whose errors name a Responses parameter
RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input"}  # fmt: skip


@dataclass(slots=True)
class ResponsesRequest:
    """A Responses API request: the chat it runs as, and what its answer echoes."""

    parsed: ParsedRequest
    echoed: dict[str, Any] = field(default_factory=dict)  # the response object's settings
    # the conversation so far, instructions aside: what a later previous_response_id
    # continues (with this response's output)
    conversation: list[dict[str, Any]] = field(default_factory=list)
    store: bool = True  # keep the response (OpenAI's default; the server may keep none)


def parse_responses(
    body: object,
    *,
    max_tokens_default: int,
    tool_call_parser: str | None,
    store: ResponseStore | None = None,
    defaults: dict[str, Any] | None = None,
) -> ResponsesRequest:
    """A `/v1/responses` body, or ApiError (400) naming the parameter; `store`: where
    `previous_response_id` is looked up (None: the server keeps no responses); `defaults`:
    the model's sampling defaults (parse_request's)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    for key in body:
        if key not in KNOWN:
            raise ApiError(400, f"unsupported parameter: {key}", param=key,
                           code="unsupported_parameter")  # fmt: skip
    if "conversation" in body:
        raise bad("conversation", "conversations are not kept here; give previous_response_id "
                  "or the whole conversation as input")  # fmt: skip
    history: list[dict[str, Any]] = []
    if (previous := body.get("previous_response_id")) is not None:
        if store is None:
            raise bad("previous_response_id", "this server stores no responses "
                      "(--responses-store-mb 0); send the whole conversation as input")  # fmt: skip
        stored = store.conversation(previous) if isinstance(previous, str) else None
        if stored is None:
            raise bad("previous_response_id", f"no stored response {previous!r:.80} (never "
                      "stored, deleted, or evicted)")  # fmt: skip
        history = stored
    if not _is(body.get("store", True), bool):
        raise bad("store", "must be a boolean")
    if body.get("background"):
        raise bad("background", "background responses need a store; this server has none")
    if body.get("truncation", "disabled") != "disabled":
        raise bad(
            "truncation", 'only "disabled" is supported (a prompt past the context is refused)'
        )
    reasoning = body.get("reasoning", {})
    if not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values()):
        raise bad("reasoning", "reasoning settings (effort, summary) are not supported; a "
                  "server's --reasoning-parser gives a reasoning model's thinking as its own item")  # fmt: skip
    metadata = body.get("metadata", {})
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise bad("metadata", f"must be an object of at most {MAX_METADATA} string values")
    chat = as_chat(body, history)
    try:
        parsed = parse_request("chat", chat, max_tokens_default=max_tokens_default,
                               tool_call_parser=tool_call_parser, defaults=defaults)  # fmt: skip
    except ApiError as e:
        raise renamed(e, RENAMED) from None
    text_format = body.get("text", {}).get("format", {"type": "text"})
    echoed = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "text": {"format": text_format},
        "tool_choice": body.get("tool_choice", "auto" if body.get("tools") else "none"),
        "tools": body.get("tools", []),
        "top_p": body.get("top_p", 1.0),
        "top_logprobs": body.get("top_logprobs", 0),
        "truncation": "disabled",
        "user": body.get("user"),
        "previous_response_id": previous,
    }
    conversation = chat["messages"][1:] if "instructions" in body else chat["messages"]
    keep = store is not None and body.get("store", True)
    return ResponsesRequest(parsed, echoed, conversation, keep)


def as_chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat completion body a Responses body runs as (module docstring), after the
    conversation `history` (a previous response's)."""
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "stream",
                            "cache_salt", "priority", "user", *PASSED, *STRUCTURED)
                            if k in body}  # fmt: skip
    messages = []
    if "instructions" in body:
        if not isinstance(body["instructions"], str):
            raise bad("instructions", "must be a string")
        messages.append({"role": "system", "content": body["instructions"]})
    messages += [*(history or ()), *_input_messages(body.get("input"))]
    chat["messages"] = messages
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if (text := body.get("text")) is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise bad("text", 'must be {"format": {...}}')
        if "format" in text:
            chat["response_format"] = _format(text["format"])
    include = body.get("include", [])
    if not isinstance(include, list) or any(item != LOGPROBS_INCLUDE for item in include):
        raise bad("include", f'only "{LOGPROBS_INCLUDE}" is supported; got {include!r:.80}')
    if LOGPROBS_INCLUDE in include:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs", 0)
    elif body.get("top_logprobs"):
        raise bad("top_logprobs", f'needs include: ["{LOGPROBS_INCLUDE}"]')
    return chat


def _input_messages(value: object) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is the user's message; items are messages
    (text content; "developer" is "system"), and a tool round's function_call (an
    assistant's tool call; consecutive calls are one message) and function_call_output
    (the tool's message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(
                    f"{where}.role",
                    f"must be user, assistant, system or developer; got {role!r:.40}",
                )
            content = _text(f"{where}.content", item.get("content"))
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {"id": _string(where, item, "call_id"), "type": "function",
                    "function": {"name": _string(where, item, "name"),
                                 "arguments": _string(where, item, "arguments")}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                # content "": chat templates read it (transformers drops a None one)
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(f"{where}.output", output)
            out.append({"role": "tool", "tool_call_id": _string(where, item, "call_id"),
                        "content": content})  # fmt: skip
        else:
            raise bad(f"{where}.type", "must be message, function_call or function_call_output "
                      f"(this server runs no built-in tools); got {kind!r:.40}")  # fmt: skip
    return out


def _text(param: str, content: object) -> str:
    """A message's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                    and isinstance(part.get("text"), str)):  # fmt: skip
                raise bad(
                    param, f"only input_text and output_text parts are supported; got {part!r:.60}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad(param, f"{CONTENT_RULE}; got {content!r:.60}")


def _string(where: str, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", "must be a string")
    return value


def _tools(tools: object) -> list[dict[str, Any]]:
    """The Responses API's flat function tools as chat's."""
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"tools[{i}]", "only function tools are supported (this server runs no "
                      f"built-in tools); got {tool!r:.60}")  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(value: object) -> dict[str, Any]:
    """`text.format` as chat's response_format."""
    if isinstance(value, dict) and value.get("type") == "json_schema":
        inner = {k: value[k] for k in ("name", "schema", "strict", "description") if k in value}
        return {"type": "json_schema", "json_schema": inner}
    return value  # type: ignore[return-value]
