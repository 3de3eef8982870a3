"""The Responses API's answers (responses_api.py parses the requests): the `response`
object of a finished answer (`answer`), its output items (a reasoning item, the message,
function calls), and, streamed, the typed events (`EventStream`).

Guarantee: a streamed answer's last event carries the same response object a whole
answer would (its output items built from the whole text by `output_items`; the items
the stream opened as the answer went are the first of them, with the ids their events
used, and what each streamed begins its text), and events are numbered from 0 without a
gap (`sequence_number`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ...ipc.messages import Done, TokenChunk
from . import reasoning_parsers, tool_parsers
from .openai_errors import ApiError
from .openai_responses import LogprobsBuilder, finish_reason, tool_answer
from .responses_api import ResponsesRequest


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


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}  # fmt: skip


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def _new_id(prefix: str) -> str:
    return prefix + "_" + uuid.uuid4().hex


def output_items(request: ResponsesRequest, done: Done) -> list[dict[str, Any]]:
    """A finished answer's output items: its text as a message, and with tools, each
    call as a function_call item (the text before the calls, if any, as the message);
    with a reasoning parser, the thinking first as a reasoning item, complete once the
    answer went on past it (else as the answer: incomplete when cut short)."""
    parsed = request.parsed
    logprobs = LogprobsBuilder("chat", parsed.tokens_as_ids).build(done.logprobs)
    entries = None if logprobs is None else logprobs["content"]
    status = "incomplete" if finish_reason(done) == "length" else "completed"
    items: list[dict[str, Any]] = []
    text = done.text
    if parsed.reasoning_parser is not None:  # the thinking as a reasoning item first
        thought, content = reasoning_parsers.split(parsed.reasoning_parser, done.text)
        text = content or ""
        if thought:
            items.append(_reasoning_item(_new_id("rs"), thought, "completed" if text else status))
    if parsed.tool_mode is None:
        return [*items, _message_item(_new_id("msg"), text, entries, status)]
    answer = tool_answer(parsed, text)
    if answer.get("content") or "tool_calls" not in answer:
        items.append(_message_item(_new_id("msg"), answer.get("content") or "", entries, status))
    for call in answer.get("tool_calls", []):
        function = call["function"]
        items.append(_call_item(_new_id("fc"), call["id"], function["name"],
                                function["arguments"], "completed"))  # fmt: skip
    return items


def answer(request: ResponsesRequest, response_id: str, model: str, done: Done) -> dict[str, Any]:
    """The whole (non-streaming) answer."""
    created = int(time.time())
    return response_object(request, response_id, model, created, output_items(request, done), done)


@dataclass(slots=True)
class _Streamed:
    """An output item the stream opened: its ids, and what of its text went out."""

    item: dict[str, Any]  # as opened (its type, id, call_id and name are the answer's)
    text: str = ""  # its thinking, text or arguments streamed so far
    closed: dict[str, Any] | None = None  # the item as its output_item.done gave it


def _text(item: dict[str, Any]) -> str:
    """An item's streamed text: a message's or reasoning's text, a call's arguments."""
    return item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]


class EventStream:
    """A streamed answer's events, as server-sent events named by their type, each with
    its `sequence_number`. Items open (output_item.added) as the answer reaches them:
    with a reasoning parser, the thinking streams as reasoning_text.delta events of a
    reasoning item, closed once the answer goes on past it; the message's text streams
    as output_text.delta events; with tools ("auto"), the text that cannot begin a call
    (tool_parsers.ContentStream, as chat's stream) and, before the message's first word,
    no whitespace alone (an answer of calls has no message); a named choice's arguments
    stream as function_call_arguments.delta events as they come. What is only known from
    the whole answer comes when it is done, each item whole: a required choice's calls
    (a JSON list) and "auto"'s calls, each call's arguments in one delta, as chat's
    stream gives them. The items the stream opened begin the answer's (`output_items`),
    whose ids they lend it, and what they streamed begins each one's text."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str) -> None:
        self.request = request
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.sequence = 0
        parsed = request.parsed
        self.builder = LogprobsBuilder("chat", parsed.tokens_as_ids)
        parser = parsed.reasoning_parser
        self.thinking = None if parser is None else reasoning_parsers.ReasoningStream(parser)
        self.content = tool_parsers.content_stream(parsed.tool_mode)  # "auto" only
        self.held = ""  # "auto": content let out, not sent (whitespace before the message)
        self.pending: list[dict[str, Any]] = []  # logprobs not yet sent with a text delta
        self.num_logprobs_sent = 0
        self.opened: list[_Streamed] = []  # in output order
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

    def _open(self, item: dict[str, Any]) -> list[str]:
        """The events that add `item`, in progress and empty, as the next output item."""
        index = len(self.opened)
        self.opened.append(_Streamed(item))
        if item["type"] == "function_call":
            empty = {**item, "arguments": "", "status": "in_progress"}
            return [self._event("response.output_item.added", output_index=index, item=empty)]
        part = {**item["content"][0], "text": ""}
        if item["type"] == "message":
            part["logprobs"] = []
        return [self._event("response.output_item.added", output_index=index,
                            item={**item, "content": [], "status": "in_progress"}),
                self._event("response.content_part.added", item_id=item["id"],
                            output_index=index, content_index=0, part=part)]  # fmt: skip

    def _delta(self, index: int, delta: str, logprobs: list[dict[str, Any]]) -> str:
        """A piece of item `index`'s text (a message's with its tokens' logprobs)."""
        streamed = self.opened[index]
        streamed.text += delta
        kind, where = streamed.item["type"], {"item_id": streamed.item["id"], "output_index": index}
        if kind == "function_call":
            return self._event("response.function_call_arguments.delta", **where, delta=delta)
        if kind == "reasoning":
            return self._event("response.reasoning_text.delta", **where, content_index=0,
                               delta=delta)  # fmt: skip
        self.num_logprobs_sent += len(logprobs)
        return self._event("response.output_text.delta", **where, content_index=0, delta=delta,
                           logprobs=logprobs)  # fmt: skip

    def _close(self, index: int, item: dict[str, Any]) -> list[str]:
        """The events that end item `index` as `item`, the answer's."""
        self.opened[index].closed = item
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where,
                                  arguments=item["arguments"], name=item["name"])]  # fmt: skip
        else:
            part = item["content"][0]
            if item["type"] == "message":
                text = self._event("response.output_text.done", **where, content_index=0,
                                   text=part["text"], logprobs=part["logprobs"])  # fmt: skip
            else:
                text = self._event("response.reasoning_text.done", **where, content_index=0,
                                   text=part["text"])  # fmt: skip
            events = [text, self._event("response.content_part.done", **where, content_index=0,
                                        part=part)]  # fmt: skip
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]

    def _open_kind(self) -> str | None:
        """The type of the item still open (only the last one opened can be), if any."""
        last = self.opened[-1] if self.opened else None
        return None if last is None or last.closed is not None else last.item["type"]

    def chunk(self, chunk: TokenChunk) -> list[str]:
        built = self.builder.build(chunk.logprobs)
        self.pending += [] if built is None else built["content"]
        thought, text, events = "", chunk.text, []
        if self.thinking is not None:
            thought, text = self.thinking.push(chunk.text)
        if thought:
            if self._open_kind() != "reasoning":
                events += self._open(_reasoning_item(_new_id("rs"), "", "in_progress"))
            events.append(self._delta(len(self.opened) - 1, thought, []))
        if text and self._open_kind() == "reasoning":  # the answer went on past the thinking
            index = len(self.opened) - 1
            thinking = self.opened[index]
            events += self._close(index, _reasoning_item(thinking.item["id"], thinking.text,
                                                         "completed"))  # fmt: skip
        return events + self._answer(text)

    def _answer(self, text: str) -> list[str]:
        """The events of the answer's next piece of `text`, the thinking apart."""
        parsed = self.request.parsed
        if parsed.tool_mode == "required":
            return []  # its calls (a JSON list) are read from the whole answer
        if parsed.tool_mode == "named":  # the answer is the call's arguments
            if not text:
                return []
            events = []
            if self._open_kind() != "function_call":
                assert parsed.tool_name is not None, "a named choice names its function"
                call_id = tool_parsers.call_id(parsed.tool_call_parser)
                events = self._open(_call_item(_new_id("fc"), call_id, parsed.tool_name, "",
                                               "in_progress"))  # fmt: skip
            return [*events, self._delta(len(self.opened) - 1, text, [])]
        if self.content is not None:  # "auto": what cannot begin a call
            self.held += self.content.push(text)
            if self._open_kind() != "message" and not self.held.strip():
                return []  # whitespace alone may be no message: an answer of calls has none
            text, self.held = self.held, ""
        events = []
        if self._open_kind() != "message":
            if not text:
                return []  # its logprobs wait for the message's first text
            events = self._open(_message_item(_new_id("msg"), "", None, "in_progress"))
        if text or self.pending:
            logprobs, self.pending = self.pending, []
            events.append(self._delta(len(self.opened) - 1, text, logprobs))
        return events

    def done(self, done: Done) -> list[str]:
        """The rest of each item the stream opened, then the answer's other items whole,
        then the response, as a whole answer's (`output_items`, with the streamed ids)."""
        items = output_items(self.request, done)
        assert len(items) >= len(self.opened), "the streamed items begin the answer's"
        events: list[str] = []
        for index, item in enumerate(items):
            if index == len(self.opened):
                events += self._open(item)
            elif self._lend_ids(index, item):
                continue  # closed before the end
            events += self._finish(index, item)
        response = self.final = self._response(items, done)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return events

    def _lend_ids(self, index: int, item: dict[str, Any]) -> bool:
        """The answer's `item` takes the ids of the streamed item `index`; whether that
        one is closed already (as `item`)."""
        streamed = self.opened[index]
        assert streamed.item["type"] == item["type"], "the streamed items begin the answer's"
        item["id"] = streamed.item["id"]
        if item["type"] == "function_call":
            item["call_id"] = streamed.item["call_id"]
        assert streamed.closed in (None, item), "an item closed early is the answer's"
        return streamed.closed is not None

    def _finish(self, index: int, item: dict[str, Any]) -> list[str]:
        """The events that send what of item `index`'s text and logprobs did not stream,
        and end it as the answer's `item`."""
        whole, sent = _text(item), self.opened[index].text
        assert whole.startswith(sent), "what streamed begins the item's text"
        rest, entries = whole[len(sent) :], []
        if item["type"] == "message":
            entries = item["content"][0]["logprobs"][self.num_logprobs_sent :]
        events = [self._delta(index, rest, entries)] if rest or entries else []
        return events + self._close(index, item)

    def error(self, e: ApiError) -> str:
        return self._event("error", code=e.code, message=e.message, param=e.param)
