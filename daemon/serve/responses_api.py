"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it, over the chat path.

A request body becomes a chat completion's (`as_chat`): `instructions` the system
message, `input` (a string, or items: messages, and a tool round's `function_call` and
`function_call_output`) the messages, the flat function `tools` and `tool_choice` chat's,
`text.format` the response format, `max_output_tokens` the token limit, and
`include: ["message.output_text.logprobs"]` with `top_logprobs` the logprobs; then
`parse_request` checks it as it checks a chat. The answer comes back as a `response`
object (`answer`) or, streamed, as the Responses API's typed events (`EventStream`):
response.created, the output items' added / delta / done events, response.completed
(or response.incomplete when max_output_tokens ended it).

Stored responses (`ResponseStore`): with `store` (OpenAI's default, true) a finished
response is kept, its conversation with it, in a least-recently-used store bounded in
bytes (`serve --responses-store-mb`, 0 to keep none); `GET /v1/responses/{id}` gives it
back, `DELETE` forgets it, and `previous_response_id` continues its conversation (its
input and output, not its instructions, as OpenAI's). Ids are random (uuid4): a response
is read only by whom it was answered to (or whom they gave its id).

Decided where vLLM's and OpenAI's differ or we cannot follow: `background` and a
`conversation` are refused, tools are function tools only,
and a streamed answer with tools or a reasoning parser sends its items whole at its end
(the calls and the thinking are read from the whole text); a reasoning parser's thinking
is a `reasoning` item before the message.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ...ipc.messages import Done, TokenChunk
from . import reasoning_parsers
from .openai_api import PASSED, ParsedRequest, parse_request
from .openai_errors import ApiError, bad
from .openai_responses import LogprobsBuilder, finish_reason, tool_answer
from .openai_structured import STRUCTURED

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
) -> ResponsesRequest:
    """A `/v1/responses` body, or ApiError (400) naming the parameter; `store`: where
    `previous_response_id` is looked up (None: the server keeps no responses)."""
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
        if not isinstance(previous, str) or (history := store.conversation(previous)) is None:
            raise bad("previous_response_id", f"no stored response {previous!r:.80} (never "
                      "stored, deleted, or evicted)")  # fmt: skip
    if not _is_bool(body.get("store", True)):
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
                               tool_call_parser=tool_call_parser)  # fmt: skip
    except ApiError as e:
        raise renamed(e) from None
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


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def renamed(e: ApiError) -> ApiError:
    """`e`, naming the Responses parameter where it names the chat's (RENAMED)."""
    if e.param is not None:
        head, bracket, rest = e.param.partition("[")
        if head in RENAMED:
            new = RENAMED[head] + bracket + rest
            e.message = e.message.replace(head, RENAMED[head], 1)
            e.param = new
    return e


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
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                    and isinstance(part.get("text"), str)):  # fmt: skip
                raise bad(
                    param, f"only input_text and output_text parts are supported; got {part!r:.60}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad(param, "must be a string or a list of text parts")


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


# -- the answer ---------------------------------------------------------------------------


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _usage(done: Done) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": len(done.token_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + len(done.token_ids)}  # fmt: skip


def _status(done: Done | None) -> tuple[str, dict[str, str] | None]:
    if done is None:
        return "in_progress", None
    if finish_reason(done) == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(
    request: ResponsesRequest, response_id: str, model: str, created: int,
    output: list[dict[str, Any]], done: Done | None,
) -> dict[str, Any]:  # fmt: skip
    """The `response` object: its settings, output items, status and usage."""
    status, incomplete = _status(done)
    completed = None if done is None else int(time.time())
    return {"id": response_id, "object": "response", "created_at": created, "status": status,
            "completed_at": completed,
            "background": False, "error": None, "incomplete_details": incomplete,
            "model": model, "output": output, "reasoning": None, "store": request.store,
            "usage": None if done is None else _usage(done), **request.echoed}  # fmt: skip


def _message_item(item_id: str, text: str, logprobs: list | None, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part]}  # fmt: skip


def output_items(request: ResponsesRequest, done: Done) -> list[dict[str, Any]]:
    """A finished answer's output items: its text as a message, and with tools, each
    call as a function_call item (the text before the calls, if any, as the message)."""
    parsed = request.parsed
    logprobs = LogprobsBuilder("chat", parsed.tokens_as_ids).build(done.logprobs)
    entries = None if logprobs is None else logprobs["content"]
    status = "incomplete" if finish_reason(done) == "length" else "completed"
    items: list[dict[str, Any]] = []
    text = done.text
    if parsed.reasoning_parser is not None:  # the thinking as a reasoning item first
        thought, text = reasoning_parsers.split(parsed.reasoning_parser, done.text)
        text = text or ""
        if thought:
            items.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                          "content": [{"type": "reasoning_text", "text": thought}],
                          "status": status})  # fmt: skip
    if parsed.tool_mode is None:
        return [*items, _message_item("msg_" + uuid.uuid4().hex, text, entries, status)]
    answer = tool_answer(parsed, text)
    if answer.get("content") or "tool_calls" not in answer:
        items.append(_message_item("msg_" + uuid.uuid4().hex, answer.get("content") or "",
                                   entries, status))  # fmt: skip
    for call in answer.get("tool_calls", []):
        items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})  # fmt: skip
    return items


def answer(request: ResponsesRequest, response_id: str, model: str, done: Done) -> dict[str, Any]:
    """The whole (non-streaming) answer."""
    created = int(time.time())
    return response_object(request, response_id, model, created, output_items(request, done), done)


class EventStream:
    """A streamed answer's events, as server-sent events named by their type, each with
    its `sequence_number`. Without tools, text streams as output_text.delta events of
    one message item; with tools, the items come whole when the answer is done."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str) -> None:
        self.request = request
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.sequence = 0
        self.item_id = "msg_" + uuid.uuid4().hex
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.builder = LogprobsBuilder("chat", request.parsed.tokens_as_ids)
        self.item_open = False
        self.final: dict[str, Any] | None = None  # the finished response, once done

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _response(self, output: list[dict[str, Any]], done: Done | None) -> dict[str, Any]:
        return response_object(self.request, self.response_id, self.model, self.created,
                               output, done)  # fmt: skip

    def start(self) -> list[str]:
        response = self._response([], None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]  # fmt: skip

    def _open_item(self) -> list[str]:
        self.item_open = True
        item = _message_item(self.item_id, "", None, "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.item_id,
                            output_index=0, content_index=0, part=part)]  # fmt: skip

    def chunk(self, chunk: TokenChunk) -> list[str]:
        if self._whole:
            return []  # the items come whole at the end
        built = self.builder.build(chunk.logprobs)
        entries = [] if built is None else built["content"]
        self.logprobs += entries
        self.text += chunk.text
        events = [] if self.item_open else self._open_item()
        if chunk.text or entries:
            events.append(self._event("response.output_text.delta", item_id=self.item_id,
                                      output_index=0, content_index=0, delta=chunk.text,
                                      logprobs=entries))  # fmt: skip
        return events

    @property
    def _whole(self) -> bool:
        """Its items are read from the whole answer (tool calls, or thinking apart)."""
        parsed = self.request.parsed
        return parsed.tool_mode is not None or parsed.reasoning_parser is not None

    def done(self, done: Done) -> list[str]:
        events: list[str] = []
        if self._whole:
            items = output_items(self.request, done)
            for index, item in enumerate(items):
                events.append(self._event("response.output_item.added", output_index=index,
                                          item={**item, "status": "in_progress"}))  # fmt: skip
                if item["type"] == "message":
                    part = item["content"][0]
                    events.append(self._event(
                        "response.output_text.delta", item_id=item["id"], output_index=index,
                        content_index=0, delta=part["text"], logprobs=part["logprobs"]))  # fmt: skip
                if item["type"] == "function_call":
                    events.append(self._event(
                        "response.function_call_arguments.delta", item_id=item["id"],
                        output_index=index, delta=item["arguments"]))  # fmt: skip
                    events.append(self._event(
                        "response.function_call_arguments.done", item_id=item["id"],
                        output_index=index, arguments=item["arguments"], name=item["name"]))  # fmt: skip
                events.append(self._event("response.output_item.done", output_index=index,
                                          item=item))  # fmt: skip
        else:
            if not self.item_open:
                events += self._open_item()
            status = "incomplete" if finish_reason(done) == "length" else "completed"
            item = _message_item(self.item_id, self.text, self.logprobs, status)
            part = item["content"][0]
            events += [
                self._event("response.output_text.done", item_id=self.item_id, output_index=0,
                            content_index=0, text=self.text, logprobs=self.logprobs),
                self._event("response.content_part.done", item_id=self.item_id, output_index=0,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=0, item=item),
            ]  # fmt: skip
            items = [item]
        response = self.final = self._response(items, done)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return events

    def error(self, e: ApiError) -> str:
        return self._event("error", code=e.code, message=e.message, param=e.param)


def as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation is given: its text as
    the assistant's message, its calls as one assistant message's tool calls (thinking is
    not given back)."""
    messages: list[dict[str, Any]] = []
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]  # fmt: skip
    texts = [part["text"] for item in output if item["type"] == "message"
             for part in item["content"]]  # fmt: skip
    if texts or not calls:
        messages.append({"role": "assistant", "content": "".join(texts)})
    if calls:
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
    return messages


class ResponseStore:
    """Finished responses by id, each with the conversation that led to it and its output
    (as messages), least recently used first out past `max_bytes` (their JSON's size).
    Safe on the HTTP front end's event loop (one thread)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[int, dict[str, Any], list[dict[str, Any]]]] = (
            OrderedDict()
        )

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep `response`, continued by `conversation` + its output; False when it is
        larger than the whole store (then not kept)."""
        history = [*conversation, *as_messages(response["output"])]
        size = len(json.dumps(response)) + len(json.dumps(history))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = (size, response, history)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, (evicted, _, _) = self._entries.popitem(last=False)
            self.num_bytes -= evicted
        return True

    def get(self, response_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[1]

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The messages a continuation of `response_id` starts with (None: not kept)."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[2]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry[0]
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)
