"""vLLM's /tokenize and /detokenize bodies.

`parse_tokenize` reads a prompt, or chat messages with their tools and chat options,
so that the ids the daemon answers are those a completion (or chat completion) of
them would be given; `parse_detokenize` reads the token ids. Both raise ApiError
(400) naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...ipc.messages import ProtocolError, check_tools
from .openai_api import object_body
from .openai_chat import CHAT_OPTIONS, parse_chat_options, parse_messages
from .openai_errors import ApiError, bad
from .openai_errors import is_a as _is


@dataclass(slots=True)
class TokenizeRequest:
    """A `/tokenize` body: the prompt (text, or chat messages with their tools and chat
    options, as a chat completion's)."""

    model: str | None
    prompt: str | list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_options: dict[str, Any] | None = None
    add_special_tokens: bool | None = None


def parse_tokenize(body: object) -> TokenizeRequest:
    """A `/tokenize` body (vLLM's: `prompt`, or chat `messages`), or ApiError (400) naming
    the parameter. Its ids are those a completion of the prompt (or a chat completion of
    the messages) with the same chat options and add_special_tokens is given."""
    body = object_body(body)
    kind = "chat" if "messages" in body else "completions"
    allowed = {"model", "prompt", "add_special_tokens"}
    if kind == "chat":
        allowed = {"model", "messages", "tools", "add_special_tokens", *CHAT_OPTIONS}
    for key in body:
        if key not in allowed:
            raise ApiError(400, f"unsupported parameter: {key}", param=key,
                           code="unsupported_parameter")  # fmt: skip
    special = body.get("add_special_tokens")
    if special is not None and not _is(special, bool):
        raise bad("add_special_tokens", f"must be a boolean; got {special!r:.60}")
    if kind == "chat":
        tools = body.get("tools") or None
        if tools is not None:
            try:
                check_tools(tools)
            except ProtocolError as e:
                raise bad("tools", e.message) from None
        messages = parse_messages(body["messages"])
        options = parse_chat_options(body, messages)
        return TokenizeRequest(body.get("model"), messages, tools, options, special)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", "must be a string (or give messages)")
    return TokenizeRequest(body.get("model"), prompt, add_special_tokens=special)


def parse_detokenize(body: object) -> tuple[str | None, list[int]]:
    """A `/detokenize` body (vLLM's: `tokens`) -> (model, token ids), or ApiError (400)."""
    body = object_body(body)
    for key in body:
        if key not in ("model", "tokens"):
            raise ApiError(400, f"unsupported parameter: {key}", param=key,
                           code="unsupported_parameter")  # fmt: skip
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is(t, int) for t in tokens):
        raise bad("tokens", "must be a list of token ids")
    return body.get("model"), tokens
