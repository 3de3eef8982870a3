"""The Responses API's answers (responses_api.py parses the requests): the `response`
object of a finished answer (`answer`), its output items (a reasoning item, the message,
function calls), and, streamed, the typed events (`EventStream`).

Guarantee: a streamed answer's last event carries the same response object a whole
answer would (its output items built from the whole text by `output_items`), and events
are numbered from 0 without a gap (`sequence_number`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ...ipc.messages import Done, TokenChunk
from . import reasoning_parsers
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
