"""The Responses API's stored responses (responses_api.py): each finished response with
the conversation that led to it, so `GET /v1/responses/{id}` gives it back and
`previous_response_id` continues it.

Guarantee: the store never holds more than `max_bytes` of responses and conversations
(their JSON's size); the least recently used go first, and a response larger than the
whole store is not kept (its answer says `store: false`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any


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
