"""OpenAI's request shapes, mapped to the daemon's protocol (the responses: openai_responses.py).

`parse_request` turns a `/v1/completions` or `/v1/chat/completions` body into
the keyword arguments of `Client.stream` (our Generate fields), or raises
`ApiError` naming the offending parameter. Values are checked by the daemon
(SamplingParams, Generate), whose messages come back as 400s: one set of
limits and validation for both front ends.

Unknown parameters are refused with a 400 naming them, so a client never
believes a setting took effect when it did not; `HARMLESS` lists the ones
accepted because they change nothing we compute (or only in the value given).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...cuda.dtypes import BF16
from ...ipc.messages import ProtocolError, check_chat_options, check_tools
from .openai_errors import ApiError, bad
from .openai_errors import is_a as _is
from .openai_structured import STRUCTURED, tool_calls
from .openai_structured import structured as structured_of
from .openai_structured import tools as tools_of

MAX_CHOICES = 16  # `n`: choices one request may ask for
MAX_BATCH = 64  # prompts one /v1/completions request may give (each runs as a request)
MAX_TOP_LOGPROBS = 20  # as OpenAI's (and SamplingParams')


# Accepted and not acted on, when their value asks for nothing we would have to do.
HARMLESS: dict[str, Callable[[Any], bool]] = {
    "user": lambda v: _is(v, str),  # logged with the request
    "suffix": lambda v: v is None,
    "best_of": lambda v: v in (None, 1),
    "store": lambda v: v in (None, False),
    "metadata": lambda v: True,
    "service_tier": lambda v: True,
    "parallel_tool_calls": lambda v: True,
    # chat parses its own (_tools); completions take only these
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    # SGLang's extensions, which sglang-router writes into every body it forwards, at
    # their defaults (we have no reasoning parser, so its two flags change nothing).
    "no_stop_trim": lambda v: v in (None, False),
    "return_hidden_states": lambda v: v in (None, False),
    "separate_reasoning": lambda v: _is(v, bool),
    "stream_reasoning": lambda v: _is(v, bool),
}
# Sampling parameters passed to the daemon as they are (its names are OpenAI's and vLLM's).
PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
          "include_stop_str_in_output", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
          "min_tokens")  # fmt: skip
COMMON = {"model", "stream", "stream_options", "n", "stop", "cache_salt", "priority",
          "max_tokens", "logit_bias", "prompt_logprobs", "return_token_ids",
          "return_tokens_as_token_ids", "add_special_tokens", *PASSED, *HARMLESS}  # fmt: skip
COMMON |= set(STRUCTURED)
# vLLM's chat options: how the chat template renders the messages (Generate.chat_options)
CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                "documents")  # fmt: skip
KNOWN = {
    "completions": COMMON | {"prompt", "prompt_embeds", "logprobs", "echo"},
    "chat": COMMON
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "echo", *CHAT_OPTIONS},
}


@dataclass(slots=True)
class ParsedRequest:
    """One HTTP request: what to send the daemon, and how to answer."""

    kind: str  # "completions" | "chat"
    model: str | None
    # None: the prompt is every row of `options["prompt_table"]` (`prompt_embeds` without
    # `prompt`), ids vocab_size .. vocab_size + rows - 1, filled in by `table_prompt`.
    prompt: str | list[int] | list[dict[str, str]] | None
    options: dict[str, Any]  # Client.stream keywords, without the prompt
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's)
    num_logprobs: int | None = None  # top alternatives per token; None: no logprobs
    echo: bool = False  # completions: the answer starts with the prompt (its logprobs too)
    # chat's echo (vLLM's): the answer's content starts with the last message's, when that
    # is the assistant's (a message continued with continue_final_message, say)
    chat_echo: str = ""
    # vLLM's return_token_ids: the prompt's ids and each choice's ids in the answer
    return_token_ids: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"
    tokens_as_ids: bool = False
    # chat: the server's reasoning parser (reasoning_parsers.py), unless the request's
    # SGLang-style separate_reasoning is false or its tool choice holds it to a grammar
    reasoning_parser: str | None = None
    separate_reasoning: bool = True
    # vLLM's prompt_logprobs: top alternatives per prompt token, in the answer's own field
    num_prompt_logprobs: int | None = None
    # chat with tools: "named" (the answer is the arguments of `tool_name`), "required"
    # (a JSON list of {"name", "parameters"}) or a tool-call parser's name (tool_choice
    # "auto": the calls read from the model's text): the answer comes back as tool_calls
    tool_mode: str | None = None
    tool_name: str | None = None
    user: str | None = None
    # /v1/completions given a list of prompts: each runs as a request of its own, and its
    # choices are indices i * n .. i * n + n - 1 (as OpenAI's); None: the one `prompt`
    batch: list[str | list[int]] | None = None

    @property
    def prompts(self) -> list[Any]:
        """Every prompt of the request, in order (one unless a batch)."""
        return [self.prompt] if self.batch is None else self.batch

    @property
    def num_choices(self) -> int:
        """Choices in the answer: n for each prompt."""
        return len(self.prompts) * self.n

    def table_prompt(self, vocab_size: int) -> None:
        """Fill in the prompt of a `prompt_embeds` request without `prompt`: the table's
        rows in order, as fake ids (the daemon derives their extra ids from the rows)."""
        if self.prompt is None:
            rows = self.options["prompt_table"].shape[0]
            self.prompt = list(range(vocab_size, vocab_size + rows))


def parse_request(
    kind: str, body: object, *, max_tokens_default: int = 16, tool_call_parser: str | None = None
) -> ParsedRequest:
    """A request body (parsed JSON) -> ParsedRequest, or ApiError (400) naming the parameter.
    `tool_call_parser`: the server's, for tool_choice "auto" (None: "auto" is refused)."""
    body = _object_body(body)
    echo = _echo(body)
    # takes tools and tool_choice out of the body
    tools = tools_of(body, tool_call_parser) if kind == "chat" else None
    for key, value in body.items():
        if key not in KNOWN[kind]:
            raise ApiError(400, f"unsupported parameter: {key}", param=key,
                           code="unsupported_parameter")  # fmt: skip
        if key in HARMLESS and not HARMLESS[key](value):
            raise ApiError(400, f"unsupported value for {key}: {value!r:.60}", param=key,
                           code="unsupported_parameter")  # fmt: skip
    options: dict[str, Any] = {k: body[k] for k in PASSED if k in body}
    if options.get("top_k") in (-1, 0):  # vLLM's spelling of "no limit"
        del options["top_k"]
    batch: list[str | list[int]] | None = None  # /v1/completions' list of prompts
    if kind == "chat":
        prompt: Any = _messages(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if (chat_options := _chat_options(body, prompt)) is not None:
            options["chat_options"] = chat_options
    elif "prompt_embeds" in body:
        options["prompt_table"] = prompt_embeds(body["prompt_embeds"])
        prompt = body.get("prompt")
        if prompt in ("", [""]):  # vLLM's examples send an empty prompt with the embeds
            prompt = None
        if prompt is not None:
            prompt = _prompt(prompt)
            if isinstance(prompt, str):
                raise bad("prompt", "must be a list of token ids when prompt_embeds is given "
                          "(ids >= the vocabulary size select its rows)")  # fmt: skip
        max_tokens = body.get("max_tokens")
    else:
        batch = _batch(body.get("prompt"))
        prompt = batch[0]
        max_tokens = body.get("max_tokens")
    options["max_tokens"] = max_tokens_default if max_tokens is None else max_tokens
    if kind == "chat" and max_tokens is None:  # vLLM's: to its end, what fits after the prompt
        options["fit_max_tokens"] = True
    if "stop" in body:
        stop = body["stop"]
        options["stop"] = [stop] if isinstance(stop, str) else stop
    for name in ("cache_salt", "priority"):
        if name in body:
            options[name] = body[name]
    if "logit_bias" in body:
        options["logit_bias"] = _logit_bias(body["logit_bias"])
    if (structured := structured_of(body)) is not None:
        options["structured"] = structured
    if tools is not None:
        if structured is not None and tools.spec is not None:
            raise bad("tool_choice", "a required or named tool choice cannot be combined with "
                      "response_format or structured outputs (it makes the answer's grammar)")  # fmt: skip
        options["tools"] = tools.tools
        if tools.spec is not None:
            options["structured"] = tools.spec
    # vLLM's `priority` orders the queue (lower first), as our queue_priority does.
    if "priority" in options:
        options["queue_priority"] = options.pop("priority")
    parsed = ParsedRequest(kind, body.get("model"), prompt, options, user=body.get("user"))
    if tools is not None:
        parsed.tool_mode, parsed.tool_name = tools.mode, tools.name
    parsed.separate_reasoning = body.get("separate_reasoning", True)
    if kind == "chat" and echo:
        if tools is not None:
            raise bad("echo", "is not supported with tools")
        if prompt[-1]["role"] == "assistant":
            parsed.chat_echo = prompt[-1]["content"] or ""
    if batch is not None and len(batch) > 1:
        parsed.batch = batch
    n = body.get("n", 1)
    if not _is(n, int) or not 1 <= n <= MAX_CHOICES:
        raise bad("n", f"must be an integer in [1, {MAX_CHOICES}]; got {n!r}")
    parsed.n = n
    if n > 1:  # the daemon runs the choices, sharing the prompt's prefill (seeds seed + i)
        options["n"] = n
    stream = body.get("stream", False)
    if not _is(stream, bool):
        raise bad("stream", f"must be a boolean; got {stream!r}")
    parsed.stream = stream
    stream_options = body.get("stream_options") or {}
    known = {"include_usage", "continuous_usage_stats"}
    if not isinstance(stream_options, dict) or set(stream_options) - known:
        raise bad(
            "stream_options", f"only {sorted(known)} are supported; got {stream_options!r:.80}"
        )
    for key, value in stream_options.items():
        if value is not None and not _is(value, bool):
            raise bad("stream_options", f"{key} must be a boolean; got {value!r:.60}")
    parsed.include_usage = bool(stream_options.get("include_usage"))
    # vLLM's: each chunk carries its choice's usage so far (only with include_usage)
    parsed.continuous_usage = parsed.include_usage and bool(
        stream_options.get("continuous_usage_stats")
    )
    if "add_special_tokens" in body:  # vLLM's: BOS / EOS around the text (or rendered chat)
        if not _is(body["add_special_tokens"], bool):
            raise bad(
                "add_special_tokens", f"must be a boolean; got {body['add_special_tokens']!r:.60}"
            )
        options["add_special_tokens"] = body["add_special_tokens"]
    for name in ("return_token_ids", "return_tokens_as_token_ids"):
        if not _is(body.get(name, False), bool):
            raise bad(name, f"must be a boolean; got {body[name]!r:.60}")
    parsed.return_token_ids = body.get("return_token_ids", False)
    parsed.tokens_as_ids = body.get("return_tokens_as_token_ids", False)
    if parsed.return_token_ids:
        options["return_token_ids"] = True
    parsed.num_logprobs = _num_logprobs(kind, body)
    if parsed.num_logprobs is not None:
        options["logprobs"] = parsed.num_logprobs
    if (top := body.get("prompt_logprobs")) is not None:
        if not _is(top, int) or top < 0:
            raise bad("prompt_logprobs", f"must be an integer >= 0; got {top!r:.60}")
        if stream:
            raise bad("prompt_logprobs", "is not supported with stream: true")
        parsed.num_prompt_logprobs = options["prompt_logprobs"] = top
    if echo and kind == "completions":
        text_prompts = all(isinstance(p, str) for p in parsed.prompts)
        if stream and not (text_prompts and parsed.num_logprobs is None):
            raise bad("echo", "with stream: true takes text prompts without logprobs (the "
                      "prompt's text goes first; its tokens' logprobs come whole only)")  # fmt: skip
        if "prompt_table" in options:
            raise bad("echo", "is not supported with prompt_embeds")
        parsed.echo = True
        # the prompt's tokens and texts come with its logprobs (the cache serves them);
        # a text prompt without logprobs echoes as it came
        if parsed.num_logprobs is not None or not all(isinstance(p, str) for p in parsed.prompts):
            wanted = (parsed.num_logprobs or 0, parsed.num_prompt_logprobs or 0)
            options["prompt_logprobs"] = max(wanted)
    return parsed


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
    body = _object_body(body)
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
        messages = _messages(body["messages"])
        options = _chat_options(body, messages)
        return TokenizeRequest(body.get("model"), messages, tools, options, special)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", "must be a string (or give messages)")
    return TokenizeRequest(body.get("model"), prompt, add_special_tokens=special)


def parse_detokenize(body: object) -> tuple[str | None, list[int]]:
    """A `/detokenize` body (vLLM's: `tokens`) -> (model, token ids), or ApiError (400)."""
    body = _object_body(body)
    for key in body:
        if key not in ("model", "tokens"):
            raise ApiError(400, f"unsupported parameter: {key}", param=key,
                           code="unsupported_parameter")  # fmt: skip
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is(t, int) for t in tokens):
        raise bad("tokens", "must be a list of token ids")
    return body.get("model"), tokens


def _object_body(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return {k: v for k, v in body.items() if v is not None}  # null means "not given"


def _chat_options(body: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any] | None:
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


def _echo(body: dict[str, Any]) -> bool:
    """`echo`: OpenAI's legacy one on completions, vLLM's on chat (ParsedRequest.chat_echo)."""
    if "echo" not in body:
        return False
    echo = body.pop("echo")
    if not _is(echo, bool):
        raise bad("echo", f"must be a boolean; got {echo!r:.60}")
    return echo


def _logit_bias(bias: object) -> dict[int, object]:
    """OpenAI's logit_bias, {"token id": bias} (JSON keys are strings), as {id: bias}; the
    daemon checks the ids against the vocabulary and the biases' range."""
    if not isinstance(bias, dict):
        raise bad("logit_bias", f"must be an object of token id -> bias; got {bias!r:.60}")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad("logit_bias", f"keys must be token ids (decimal integers); got {key!r:.40}")
        out[int(key)] = value
    return out


def _prompt(prompt: object) -> str | list[int]:
    """One prompt: a string or a list of token ids (a batch of one too)."""
    batch = _batch(prompt)
    if len(batch) > 1:
        raise bad("prompt", "must be one prompt here (a string or a list of token ids)")
    return batch[0]


def _batch(prompt: object) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, a list of token ids, or a batch (a list of either)."""
    if prompt is None:
        raise bad("prompt", "is required")
    if isinstance(prompt, str) or _token_ids(prompt):
        return [prompt]  # type: ignore[list-item]
    if (
        isinstance(prompt, list)
        and 1 <= len(prompt) <= MAX_BATCH
        and all(isinstance(p, str) or _token_ids(p) for p in prompt)
    ):
        return prompt
    raise bad("prompt", "must be a string, a list of token ids, or a batch of 1 to "
              f"{MAX_BATCH} of either")  # fmt: skip


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is(t, int) for t in value)


NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format
EMBEDS_FORMS = (
    "a base64 string of an .npy file holding a 2-d [rows, hidden] array of bfloat16 "
    "(ml_dtypes, or its uint16 bit patterns) or float32 (rounded to bfloat16), or an "
    'object {"data": base64 of raw little-endian bfloat16, "shape": [rows, hidden]}'
)


def prompt_embeds(value: object) -> np.ndarray:
    """vLLM's `prompt_embeds` (one prompt's [rows, hidden] embeddings) as a BF16 table,
    or a 400 naming `prompt_embeds`. vLLM takes a base64 `torch.save`d tensor; with no
    torch here we take an .npy file or raw BF16 with its shape (EMBEDS_FORMS)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # a batch of one, as vLLM accepts a list
    if isinstance(value, str):
        raw = _base64("prompt_embeds", value)
        if raw.startswith(ZIP_MAGIC):
            raise bad("prompt_embeds", "torch.save'd tensors are not supported (no torch "
                      f"here); send {EMBEDS_FORMS}")  # fmt: skip
        if not raw.startswith(NPY_MAGIC):
            raise bad("prompt_embeds", f"is not an .npy file; send {EMBEDS_FORMS}")
        try:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise bad("prompt_embeds", f"cannot read the .npy file: {e}") from None
        if array.dtype.str == "<f4":
            table = array.astype(BF16)  # round to nearest even, as vLLM casts to the model's
        elif array.dtype.str in ("<u2", "|V2"):  # ml_dtypes' bfloat16 reads back as |V2
            table = np.ascontiguousarray(array).view(BF16)
        else:
            raise bad("prompt_embeds", f"the .npy array is {array.dtype.str}; it must be "
                      "bfloat16 (|V2 from ml_dtypes, or <u2 bit patterns) or <f4")  # fmt: skip
    elif isinstance(value, dict):
        if set(value) - {"data", "shape", "dtype"} or not {"data", "shape"} <= set(value):
            raise bad("prompt_embeds", "an object must have data and shape (and optionally "
                      f"dtype: bfloat16); got {sorted(value)}")  # fmt: skip
        if value.get("dtype", "bfloat16") != "bfloat16":
            raise bad("prompt_embeds", f"dtype must be bfloat16; got {value['dtype']!r:.40}")
        shape = value["shape"]
        if not (isinstance(shape, list) and len(shape) == 2 and all(_is(d, int) for d in shape)):
            raise bad("prompt_embeds", f"shape must be [rows, hidden]; got {shape!r:.60}")
        if not isinstance(value["data"], str):
            raise bad("prompt_embeds", "data must be a base64 string")
        raw = _base64("prompt_embeds", value["data"])
        rows, hidden = shape
        if rows < 1 or hidden < 1 or len(raw) != 2 * rows * hidden:
            raise bad("prompt_embeds", f"data holds {len(raw)} bytes; shape {shape} needs "
                      f"{2 * max(rows, 0) * max(hidden, 0)} (2 per bfloat16, rows and hidden "
                      ">= 1)")  # fmt: skip
        table = np.frombuffer(raw, dtype="<u2").view(BF16).reshape(rows, hidden)
    else:
        raise bad("prompt_embeds", f"must be {EMBEDS_FORMS}")
    if table.ndim != 2 or 0 in table.shape:
        raise bad("prompt_embeds", f"must be 2-d [rows, hidden], non-empty; got shape "
                  f"{list(table.shape)}")  # fmt: skip
    return np.ascontiguousarray(table)


def _base64(param: str, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad(param, "is not valid base64") from None


def _messages(messages: object) -> list[dict[str, Any]]:
    """OpenAI's chat messages as the daemon takes them: text content (parts joined), and
    for tool use an assistant's `tool_calls` (its content may then be null) and a tool
    message's `tool_call_id`; `name` kept."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not _is(m.get("role"), str):
            raise bad(f"messages[{i}]", "must be an object with a role and a content")
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if extra:
            raise bad(f"messages[{i}]", f"unsupported field(s) {sorted(extra)}")
        m = {k: v for k, v in m.items() if v is not None}
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"messages[{i}].content", "only text parts are supported")
                texts.append(part.get("text", ""))
            content = "".join(texts)
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if "tool_calls" in m:
            message["tool_calls"] = tool_calls(f"messages[{i}].tool_calls", m["tool_calls"])
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        message.update({k: m[k] for k in ("name", "tool_call_id") if k in m})
        out.append(message)
    return out


def _num_logprobs(kind: str, body: dict[str, Any]) -> int | None:
    if kind == "completions":
        value = body.get("logprobs")
        if value is None:
            return None
        if not _is(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {value!r}")
        return value
    wanted = body.get("logprobs", False)
    if not _is(wanted, bool):
        raise bad("logprobs", f"must be a boolean; got {wanted!r}")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {top!r}")
        if not wanted:
            raise bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None
