"""A chat body's messages and chat options, as the daemon takes them.

`parse_messages` reads OpenAI's chat messages as Generate.messages (text content, an
assistant's tool calls, a tool message's call id); `parse_chat_options` reads vLLM's
chat options (CHAT_OPTIONS) as Generate.chat_options, checked as the daemon checks
them. Both raise ApiError (400) naming the parameter. Chat completions and /tokenize
read their messages with these, so both render the same prompt.
"""

from __future__ import annotations

from typing import Any

from ...ipc.messages import ProtocolError, check_chat_options, check_wire_json
from .openai_errors import bad
from .openai_errors import is_a as _is
from .openai_structured import tool_calls

# A message's content, as OpenAI takes it: "" is an empty text, [] is refused (no part)
CONTENT_RULE = "must be a string or a non-empty list of text parts"
# vLLM's chat options: how the chat template renders the messages (Generate.chat_options)
CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                "documents")  # fmt: skip


def parse_chat_options(
    body: dict[str, Any], messages: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs as
    the daemon's chat_options (None: the defaults), or a 400 naming the parameter."""
    options: dict[str, Any] = {}
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in body:
            if not _is(body[name], bool):
                raise bad(name, f"must be a boolean; got {body[name]!r:.60}")
            options[name] = body[name]
    if options.get("continue_final_message"):
        if options.get("add_generation_prompt", True):
            raise bad("continue_final_message", "needs add_generation_prompt: false (the answer "
                      "continues the last message rather than starting a new one)")  # fmt: skip
        if messages[-1]["role"] != "assistant":
            raise bad("continue_final_message", "needs the last message to be the assistant's")
    if "chat_template_kwargs" in body:
        options["kwargs"] = body["chat_template_kwargs"]
    if "documents" in body:  # vLLM's: the template's documents (retrieval-augmented chats)
        documents = body["documents"]
        if not isinstance(documents, list) or not all(
            isinstance(d, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in documents
        ):
            raise bad("documents", "must be a list of objects of strings (e.g. title, text)")
        try:
            check_wire_json("documents", documents)
        except ProtocolError as e:
            raise bad("documents", e.message.removeprefix("documents ")) from None
        if isinstance(options.get("kwargs"), dict):
            options["kwargs"] = {**options["kwargs"], "documents": documents}
        else:
            options.setdefault("kwargs", {"documents": documents})
    if not options:
        return None
    try:
        check_chat_options(options)
    except ProtocolError as e:
        raise bad("chat_template_kwargs", e.message.removeprefix("chat_options.kwargs ")) from None
    return options


def parse_messages(messages: object) -> list[dict[str, Any]]:
    """OpenAI's chat messages as the daemon takes them: text content (parts joined), and
    for tool use an assistant's `tool_calls` (its content may then be null) and a tool
    message's `tool_call_id`; `name` kept."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not _is(m.get("role"), str):
            raise bad(f"messages[{i}]", "must be an object with a role and a content")
        # null counts as not given (an answer's model_dump() has refusal, audio, ... null)
        m = {k: v for k, v in m.items() if v is not None}
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if extra:
            raise bad(f"messages[{i}]", f"unsupported field(s) {sorted(extra)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not content:
                raise bad(f"messages[{i}].content", f"{CONTENT_RULE}; got []")
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"messages[{i}].content", "only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content", "a text part's text must be a string; "
                              f"got {part.get('text')!r:.60}")  # fmt: skip
                texts.append(part["text"])
            content = "".join(texts)
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if "tool_calls" in m:
            message["tool_calls"] = tool_calls(f"messages[{i}].tool_calls", m["tool_calls"])
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"{CONTENT_RULE}; got {content!r:.60}")
        message.update({k: m[k] for k in ("name", "tool_call_id") if k in m})
        out.append(message)
    return out
