"""vLLM's /tokenize and /detokenize bodies, and llama.cpp's.

`parse_tokenize` reads a prompt, or chat messages with their tools and chat options,
so that the ids the daemon answers are those a completion (or chat completion) of
them would be given; or llama.cpp's body (`content`, `add_special`, `with_pieces`,
`parse_special`). `parse_detokenize` reads the token ids (both servers' body is
`tokens`). Both raise ApiError (400) naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...ipc.messages import ProtocolError, check_tools
from .openai_api import object_body
from .openai_chat import CHAT_OPTIONS, parse_chat_options, parse_messages
from .openai_embeddings import known_only
from .openai_errors import ApiError, bad
from .openai_errors import is_a as _is

# llama.cpp's /tokenize body; its `add_special` (the tokenizer's BOS) is false by default
LLAMA_TOKENIZE = {"model", "content", "add_special", "with_pieces", "parse_special"}


@dataclass(slots=True)
class TokenizeRequest:
    """A `/tokenize` body: the prompt (text, or chat messages with their tools and chat
    options, as a chat completion's)."""

    model: str | None
    prompt: str | list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_options: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    with_pieces: bool = False  # llama.cpp's: each id with its text, {"id", "piece"}


def parse_tokenize(body: object) -> TokenizeRequest:
    """A `/tokenize` body (vLLM's: `prompt`, or chat `messages`), or ApiError (400) naming
    the parameter. Its ids are those a completion of the prompt (or a chat completion of
    the messages) with the same chat options and add_special_tokens is given."""
    body = object_body(body)
    if "content" in body:
        return _llama_tokenize(body)
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


def _llama_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """llama.cpp's /tokenize body: `content` (text), `add_special` (default false),
    `with_pieces`, and `parse_special` true only (a special token's text in the content
    is always read as that token, as the daemon reads every prompt)."""
    known_only(body, LLAMA_TOKENIZE)
    if not isinstance(body["content"], str):
        raise bad("content", "must be a string")
    for name in ("add_special", "with_pieces", "parse_special"):
        if not _is(body.get(name, False), bool):
            raise bad(name, f"must be a boolean; got {body[name]!r:.60}")
    if body.get("parse_special") is False:
        raise bad("parse_special", "only true is served: the text of a special token is "
                  "read as that token, as in every prompt the daemon reads")  # fmt: skip
    return TokenizeRequest(body.get("model"), body["content"],
                           add_special_tokens=body.get("add_special", False),
                           with_pieces=body.get("with_pieces", False))  # fmt: skip


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
