"""The daemon's wire messages: small dataclasses, one per message type.

Every message is a msgpack map with `v` (the protocol version) and `type`
(the tag below); the other keys are the dataclass's fields. Decoding
(`reprise.ipc.codec`) rejects unknown keys, missing required keys and values
of the wrong type or range with a `ProtocolError` whose `code` is one of
`ERROR_CODES`, so the daemon can answer it and keep serving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

PROTOCOL_VERSION = 1
MAX_ID_CHARS = 128
MAX_SALT_CHARS = 256
MAX_EXTRA_ID = (1 << 64) - 1
# msgpack's integers: int64 and uint64; a value outside cannot be sent at all
WIRE_INT_MIN, WIRE_INT_MAX = -(1 << 63), (1 << 64) - 1

ERROR_CODES = frozenset(
    {
        "bad_message",  # not a msgpack map, truncated, or no usable `type`
        "bad_request",  # a field is missing, unknown, or of the wrong type or range
        "unknown_type",
        "unsupported_version",
        "too_large",  # the message is over the daemon's size limit
        "prompt_too_long",  # the prompt does not fit in the model's context
        "busy",  # the request queue is full
        "duplicate_id",  # this client already has a running request with this id
        "not_found",  # cancel of a request the daemon does not know
        "shutting_down",
        "internal",
    }
)

# Sampling fields a generate request may carry, with the types msgpack gives them.
SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int, type(None)),
    "min_p": (int, float),  # 0 to 1 (0: off)
    "seed": (int, type(None)),
    "stop": (list,),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "include_stop_str_in_output": (bool,),  # the stop string stays at the end of the text
    "skip_special_tokens": (bool,),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "repetition_penalty": (int, float),
    "logprobs": (int, type(None)),  # top alternatives per token, 0 to 20 (None: off)
    # top alternatives per prompt token, 0 to the daemon's max_prompt_logprobs (None: off)
    "prompt_logprobs": (int, type(None)),
    "n": (int,),  # completions of the prompt, 1 to 16; each reply carries its choice's index
    "min_tokens": (int,),  # tokens before a stop token or string may end it, 0 to max_tokens
    # the only tokens the request may draw (vLLM's; non-empty), or null for all
    "allowed_token_ids": (list, type(None)),
    # words the answer may not contain (vLLM's; at most 128 of 1 to 256 characters), or null
    "bad_words": (list, type(None)),
    # keep the prompt's last that many tokens (vLLM's; >= 1), or null for the whole prompt
    "truncate_prompt_tokens": (int, type(None)),
    # [[token id, bias], ...] (msgpack map keys are strings here): SamplingParams.logit_bias
    "logit_bias": (list, type(None)),
    # [kind, spec]: SamplingParams.structured (StructuredOutput), e.g. ["json", schema text]
    "structured": (list, type(None)),
}
SAMPLING_ITEMS: dict[str, tuple[type, ...]] = {
    "stop": (str,),
    "stop_token_ids": (int,),
    "allowed_token_ids": (int,),
    "bad_words": (str,),
    "logit_bias": (list,),
    "structured": (str,),
}


class ProtocolError(Exception):
    """A message the daemon cannot accept; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def bad(message: str) -> ProtocolError:
    return ProtocolError("bad_request", message)


def check_type(name: str, value: object, *types: type) -> None:
    """Raise bad_request unless `value` is one of `types` (bool is never an int here)."""
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise bad(f"{name} must be {names}; got {type(value).__name__} {_short(value)}")
    if isinstance(value, int) and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        raise bad(f"{name} must fit in 64 bits (-2**63 to 2**64 - 1); got {_short(value)}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, as JSON's "\ud800" makes one
            raise bad(
                f"{name} is not valid Unicode: a lone surrogate at character {e.start}"
            ) from None


def check_id(name: str, value: object) -> None:
    check_type(name, value, str)
    assert isinstance(value, str)
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise bad(f"{name} must have 1 to {MAX_ID_CHARS} characters; got {len(value)}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


MAX_QUEUE_PRIORITY = 1 << 31


MAX_TOOLS = (
    128  # tools one chat request may give the chat template (and tool calls a message holds)
)


def check_messages(messages: object) -> None:
    """Chat messages: a non-empty list of {role, content} maps of strings; for tool use,
    an assistant message may hold `tool_calls` (then its content may be None) and a tool
    message a `tool_call_id`, and any message a `name`."""
    check_type("messages", messages, list)
    assert isinstance(messages, list)
    if not messages:
        raise bad("messages must hold at least one message")
    for i, m in enumerate(messages):
        check_type(f"messages[{i}]", m, dict)
        extra = set(m) - {"role", "content", "tool_calls", "tool_call_id", "name"}
        if extra or "role" not in m or "content" not in m:
            raise bad(
                f"messages[{i}] must have role and content (and may have tool_calls, "
                f"tool_call_id, name); got {sorted(m)}"
            )
        check_type(f"messages[{i}].role", m["role"], str)
        if "tool_calls" in m:
            _check_tool_calls(f"messages[{i}].tool_calls", m["tool_calls"])
            check_type(f"messages[{i}].content", m["content"], str, type(None))
        else:
            check_type(f"messages[{i}].content", m["content"], str)
        for key in ("tool_call_id", "name"):
            if key in m:
                check_type(f"messages[{i}].{key}", m[key], str)


MAX_TEMPLATE_KWARGS = 32  # chat_options.kwargs: extra variables one chat template is given
# the variables the renderer itself sets, which kwargs may not replace
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message"}
)


def check_chat_options(options: object) -> None:
    """How a chat template renders a request's messages (vLLM's chat options), a map of:
    `add_generation_prompt` (bool, default true), `continue_final_message` (bool, default
    false: the last message, the assistant's, is left open for the answer to continue;
    add_generation_prompt must then be false) and `kwargs` (extra template variables by
    name, e.g. {"enable_thinking": false}; at most MAX_TEMPLATE_KWARGS)."""
    check_type("chat_options", options, dict)
    assert isinstance(options, dict)
    unknown = set(options) - {"add_generation_prompt", "continue_final_message", "kwargs"}
    if unknown:
        raise bad(
            f"chat_options has unknown field(s) {', '.join(sorted(map(_short, unknown)))}; known: "
            "add_generation_prompt, continue_final_message, kwargs"
        )
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in options:
            check_type(f"chat_options.{name}", options[name], bool)
    if options.get("continue_final_message") and options.get("add_generation_prompt", True):
        raise bad(
            "chat_options: continue_final_message needs add_generation_prompt false (the "
            "answer continues the last message rather than starting a new one)"
        )
    kwargs = options.get("kwargs", {})
    check_type("chat_options.kwargs", kwargs, dict)
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad(f"chat_options.kwargs may name at most {MAX_TEMPLATE_KWARGS} variables")
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier() or len(key) > 64:
            raise bad(
                f"chat_options.kwargs names must be identifiers of at most 64 characters; got {_short(key)}"
            )
        if key in RESERVED_TEMPLATE_NAMES:
            raise bad(f"chat_options.kwargs cannot set {key} (the renderer sets it)")


def _bounded_list(name: str, value: object, what: str) -> list[Any]:
    """`value`, a list of at most MAX_TOOLS items (ProtocolError naming `name` if not)."""
    check_type(name, value, list)
    assert isinstance(value, list)
    if len(value) > MAX_TOOLS:
        raise bad(f"{name} may hold at most {MAX_TOOLS} {what}; got {len(value)}")
    return value


def _check_tool_calls(name: str, calls: object) -> None:
    """An assistant message's tool calls: [{"id", "type": "function", "function": {"name",
    "arguments" (JSON text)}}], at most MAX_TOOLS."""
    for j, call in enumerate(_bounded_list(name, calls, "calls")):
        check_type(f"{name}[{j}]", call, dict)
        function = call.get("function")
        if set(call) - {"id", "type", "function"} or not isinstance(function, dict):
            raise bad(f"{name}[{j}] must be {{id, type, function: {{name, arguments}}}}")
        if set(function) != {"name", "arguments"}:
            raise bad(f"{name}[{j}].function must have name and arguments; got {sorted(function)}")
        check_type(f"{name}[{j}].function.name", function["name"], str)
        check_type(f"{name}[{j}].function.arguments", function["arguments"], str)
        for key in ("id", "type"):
            if key in call:
                check_type(f"{name}[{j}].{key}", call[key], str)


def check_tools(tools: object) -> None:
    """A chat's tools, for its template: [{"type": "function", "function": {"name", and
    optionally "description", "parameters" (a JSON schema), "strict"}}], at most MAX_TOOLS."""
    for i, tool in enumerate(_bounded_list("tools", tools, "tools")):
        check_type(f"tools[{i}]", tool, dict)
        function = tool.get("function")
        if set(tool) != {"type", "function"} or tool["type"] != "function":
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        check_type(f"tools[{i}].function", function, dict)
        if extra := set(function) - {"name", "description", "parameters", "strict"}:
            raise bad(f"tools[{i}].function has unknown field(s) {sorted(extra)}")
        check_type(f"tools[{i}].function.name", function.get("name"), str)
        if not function["name"]:
            raise bad(f"tools[{i}].function.name must not be empty")
        if "description" in function:
            check_type(f"tools[{i}].function.description", function["description"], str)
        if "parameters" in function:
            check_type(f"tools[{i}].function.parameters", function["parameters"], dict)
        if "strict" in function:
            check_type(f"tools[{i}].function.strict", function["strict"], bool)


def _check_bias_pair(pair: list[Any]) -> None:
    if len(pair) != 2:
        raise bad(f"sampling.logit_bias[] must be [token id, bias] pairs; got {_short(pair)}")
    check_type("sampling.logit_bias[] token id", pair[0], int)
    check_type("sampling.logit_bias[] bias", pair[1], int, float)


def logit_bias_to_wire(bias: dict[int, float]) -> list[list[Any]]:
    """SamplingParams' {token id: bias} as the wire's pairs, in ascending id order."""
    return [[token, bias[token]] for token in sorted(bias)]


def logit_bias_from_wire(pairs: list[list[Any]] | None) -> dict[int, float] | None:
    """The wire's pairs (checked by Generate) as {token id: bias}; bad_request if an id
    comes twice."""
    if pairs is None:
        return None
    bias = {token: value for token, value in pairs}
    if len(bias) != len(pairs):
        raise bad("logit_bias names a token id twice")
    return bias


# -- requests (client -> daemon) -----------------------------------------------------------


@dataclass(slots=True)
class Generate:
    """Complete one prompt: exactly one of `prompt` (text), `messages` (chat, the
    template is applied) or `token_ids`. With `stream`, TokenChunk replies come
    before the Done; without, only the Done. With `sampling.n` > 1, each choice
    has its own chunks and its own Done, told apart by `index` (0 to n - 1), and
    the request ends at the n-th Done; an ErrorReply ends all of it."""

    TYPE: ClassVar[str] = "generate"
    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None
    priority: int | None = None  # retention priority of the prompt's blocks, 0-100
    queue_priority: int = 0  # scheduling: lower is admitted first (as vLLM's priority)
    stream: bool = True
    return_logits: bool = False
    # p-tuning, with token_ids only: ids >= the vocabulary size select rows of the table,
    # {"shape": [num_virtual, hidden], "dtype": "bfloat16", "data": bin, row-major,
    # little-endian}; `extra_ids` has one uint64 per token id (0 for text tokens).
    prompt_table: dict[str, Any] | None = None
    extra_ids: list[int] | None = None
    # with messages: the tools the chat template is given (check_tools)
    tools: list[dict[str, Any]] | None = None
    # with messages: how the chat template renders them (check_chat_options)
    chat_options: dict[str, Any] | None = None
    # vLLM's return_token_ids: each choice's first chunk and its Done carry the prompt's ids
    return_token_ids: bool = False
    # vLLM's chat default: sampling.max_tokens is lowered to what fits after the prompt (the
    # context's room, and the KV pool's), so an answer without a limit runs to its end
    fit_max_tokens: bool = False
    # vLLM's add_special_tokens: the tokenizer's BOS / EOS around a text prompt (default
    # true) or a rendered chat (default false: templates write their own); None: default
    add_special_tokens: bool | None = None

    def __post_init__(self) -> None:
        check_id("id", self.id)
        given = [k for k in ("prompt", "messages", "token_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise bad(f"give exactly one of prompt, messages, token_ids; got {given or 'none'}")
        if self.prompt is not None:
            check_type("prompt", self.prompt, str)
        if self.messages is not None:
            check_messages(self.messages)
        _check_chat_extras(self.messages, self.tools, self.chat_options)
        if self.token_ids is not None:
            check_type("token_ids", self.token_ids, list)
            for t in self.token_ids:
                check_type("token_ids[]", t, int)
        check_type("sampling", self.sampling, dict)
        for key, value in self.sampling.items():
            if key not in SAMPLING_FIELDS:
                raise bad(
                    f"sampling has an unknown field {_short(key)}; known: {sorted(SAMPLING_FIELDS)}"
                )
            check_type(f"sampling.{key}", value, *SAMPLING_FIELDS[key])
            for item in value if isinstance(value, list) else ():  # the range: SamplingParams
                check_type(f"sampling.{key}[]", item, *SAMPLING_ITEMS[key])
                if key == "logit_bias":
                    _check_bias_pair(item)
            if isinstance(value, float) and not math.isfinite(value):
                raise bad(f"sampling.{key} must be finite; got {value}")
        if self.cache_salt is not None:
            check_type("cache_salt", self.cache_salt, str)
            if len(self.cache_salt) > MAX_SALT_CHARS:
                raise bad(f"cache_salt may have at most {MAX_SALT_CHARS} characters")
        if self.priority is not None:
            check_type("priority", self.priority, int)
            if not 0 <= self.priority <= 100:
                raise bad(f"priority must be in [0, 100]; got {self.priority}")
        check_type("queue_priority", self.queue_priority, int)
        if not -MAX_QUEUE_PRIORITY <= self.queue_priority <= MAX_QUEUE_PRIORITY:
            raise bad(
                f"queue_priority must be in [-{MAX_QUEUE_PRIORITY}, {MAX_QUEUE_PRIORITY}]; "
                f"got {self.queue_priority}"
            )
        check_type("stream", self.stream, bool)
        check_type("return_logits", self.return_logits, bool)
        check_type("return_token_ids", self.return_token_ids, bool)
        check_type("fit_max_tokens", self.fit_max_tokens, bool)
        if self.add_special_tokens is not None:
            check_type("add_special_tokens", self.add_special_tokens, bool)
            if self.token_ids is not None:
                raise bad("add_special_tokens goes with a text prompt or messages, not token_ids")
        self._check_prompt_table()

    def _check_prompt_table(self) -> None:
        """Types and sizes only; the engine checks the ids against the table."""
        for name in ("prompt_table", "extra_ids"):
            if getattr(self, name) is not None and self.token_ids is None:
                raise bad(f"{name} needs a token_ids prompt; got {self.given_prompt()}")
        if self.extra_ids is not None:
            check_type("extra_ids", self.extra_ids, list)
            for i, e in enumerate(self.extra_ids):
                check_type(f"extra_ids[{i}]", e, int)
                if not 0 <= e <= MAX_EXTRA_ID:
                    raise bad(f"extra_ids[{i}] must be in [0, 2**64); got {e}")
        table = self.prompt_table
        if table is None:
            return
        check_type("prompt_table", table, dict)
        if set(table) != {"shape", "dtype", "data"}:
            raise bad(f"prompt_table must have exactly shape, dtype, data; got {sorted(table)}")
        check_type("prompt_table.dtype", table["dtype"], str)
        if table["dtype"] != "bfloat16":
            raise bad(f"prompt_table.dtype must be bfloat16; got {_short(table['dtype'])}")
        shape = table["shape"]
        check_type("prompt_table.shape", shape, list)
        if len(shape) != 2 or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise bad(f"prompt_table.shape must be [num_virtual, hidden], each >= 1; got {shape}")
        check_type("prompt_table.data", table["data"], bytes)
        if len(table["data"]) != 2 * shape[0] * shape[1]:
            raise bad(
                f"prompt_table.data must hold 2 bytes per element of shape {shape} "
                f"({2 * shape[0] * shape[1]} bytes); got {len(table['data'])}"
            )

    def given_prompt(self) -> str:
        return next(k for k in ("prompt", "messages", "token_ids") if getattr(self, k) is not None)


@dataclass(slots=True)
class Cancel:
    """Stop a request of this client; its Done comes with finish_reason "cancelled"."""

    TYPE: ClassVar[str] = "cancel"
    id: str

    def __post_init__(self) -> None:
        check_id("id", self.id)


@dataclass(slots=True)
class StatsRequest:
    """Ask for the KV cache and server counters; `check` also runs the pool's integrity check."""

    TYPE: ClassVar[str] = "stats"
    check: bool = False

    def __post_init__(self) -> None:
        check_type("check", self.check, bool)


@dataclass(slots=True)
class Health:
    TYPE: ClassVar[str] = "health"


@dataclass(slots=True)
class Tokenize:
    """The token ids a generate of this prompt (text, or chat messages with the template
    applied and a generation prompt added) would have: answered by a TokenizeReply."""

    TYPE: ClassVar[str] = "tokenize"
    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages, as Generate's
    chat_options: dict[str, Any] | None = None  # with messages, as Generate's
    add_special_tokens: bool | None = None  # as Generate's

    def __post_init__(self) -> None:
        check_id("id", self.id)
        if (self.prompt is None) == (self.messages is None):
            raise bad("tokenize needs exactly one of prompt, messages")
        if self.prompt is not None:
            check_type("prompt", self.prompt, str)
        else:
            check_messages(self.messages)
        _check_chat_extras(self.messages, self.tools, self.chat_options)
        if self.add_special_tokens is not None:
            check_type("add_special_tokens", self.add_special_tokens, bool)


def _check_chat_extras(
    messages: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]] | None,
    chat_options: dict[str, Any] | None,
) -> None:
    """The tools and chat options of a request: they go with messages alone."""
    for name, value in (("tools", tools), ("chat_options", chat_options)):
        if value is not None and messages is None:
            raise bad(f"{name} go with messages (the chat template renders them)")
    if tools is not None:
        check_tools(tools)
    if chat_options is not None:
        check_chat_options(chat_options)
        if chat_options.get("continue_final_message") and messages[-1]["role"] != "assistant":  # type: ignore[index]
            raise bad(
                "chat_options: continue_final_message needs the last message to be the "
                f"assistant's; it is {_short(messages[-1]['role'])}'s"  # type: ignore[index]
            )


@dataclass(slots=True)
class Detokenize:
    """The text of these token ids (vocabulary ids only): answered by a DetokenizeReply."""

    TYPE: ClassVar[str] = "detokenize"
    id: str
    token_ids: list[int]
    skip_special_tokens: bool = False

    def __post_init__(self) -> None:
        check_id("id", self.id)
        check_type("token_ids", self.token_ids, list)
        for t in self.token_ids:
            check_type("token_ids[]", t, int)
        check_type("skip_special_tokens", self.skip_special_tokens, bool)


# -- replies (daemon -> client) ------------------------------------------------------------


@dataclass(slots=True)
class TokenChunk:
    TYPE: ClassVar[str] = "chunk"
    id: str
    token_ids: list[int]
    text: str  # new text since the last chunk
    logprobs: list[dict[str, Any]] | None = None  # one per token, when sampling.logprobs is set
    index: int = 0  # the choice these tokens belong to (sampling.n > 1)
    prompt_tokens: int = 0  # the prompt's length (vLLM's continuous usage stats)
    # the prompt's ids, on a choice's first chunk when the generate asked (return_token_ids)
    prompt_token_ids: list[int] | None = None


@dataclass(slots=True)
class Done:
    """The last reply of a request that ran: the whole output and its numbers."""

    TYPE: ClassVar[str] = "done"
    id: str
    finish_reason: str  # stop | length | cancelled
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the cache, either tier
    host_cached_tokens: int  # the part of them onboarded from the host tier
    ttft_ms: float
    tokens_per_s: float  # generated tokens over the time from receipt to the end
    logits: dict[str, Any] | None = None  # {"shape": [n, vocab], "data": float32 bytes}
    # One per generated token when sampling.logprobs is set: {"id", "token" (its text),
    # "logprob", "rank" (vLLM's: the tokens at least as likely), "top": [[id, text,
    # logprob], ...] (at most 20, most likely first)}
    logprobs: list[dict[str, Any]] | None = None
    disk_cached_tokens: int = 0  # the part of cached_tokens onboarded from the disk tier
    # From receipt to the start of the engine step that gave the first token: the time
    # spent waiting (for a prompt prefilled in several chunks, the earlier chunks too).
    queue_ms: float = 0.0
    # One per prompt token when sampling.prompt_logprobs is set, as in `logprobs`: each
    # prompt token's logprob given those before it, and the most likely tokens there;
    # the first token's (no context) has "logprob" and "rank" null and "top" [], as OpenAI's echo.
    prompt_logprobs: list[dict[str, Any]] | None = None
    index: int = 0  # the choice this Done ends (sampling.n > 1: one Done per choice)
    # what ended it with "stop", as vLLM's: the stop string, or the id of a
    # sampling.stop_token_ids token (null for eos, a grammar's end, any other reason)
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # the prompt's ids, when asked (return_token_ids)


@dataclass(slots=True)
class ErrorReply:
    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    id: str | None = None  # the request it answers, when the daemon could read one


@dataclass(slots=True)
class StatsReply:
    TYPE: ClassVar[str] = "stats_reply"
    stats: dict[str, Any]


@dataclass(slots=True)
class HealthReply:
    TYPE: ClassVar[str] = "health_reply"
    status: str  # "ok" or "draining"
    model: str
    max_model_len: int
    num_requests: int
    vocab_size: int = 0  # token ids a prompt may use: [0, vocab_size)


@dataclass(slots=True)
class TokenizeReply:
    TYPE: ClassVar[str] = "tokenize_reply"
    id: str
    token_ids: list[int]


@dataclass(slots=True)
class DetokenizeReply:
    TYPE: ClassVar[str] = "detokenize_reply"
    id: str
    text: str


REQUEST_TYPES: dict[str, type] = {
    c.TYPE: c for c in (Generate, Cancel, StatsRequest, Health, Tokenize, Detokenize)
}
REPLY_TYPES: dict[str, type] = {
    c.TYPE: c
    for c in (TokenChunk, Done, ErrorReply, StatsReply, HealthReply, TokenizeReply, DetokenizeReply)
}
Request = Generate | Cancel | StatsRequest | Health | Tokenize | Detokenize
Reply = TokenChunk | Done | ErrorReply | StatsReply | HealthReply | TokenizeReply | DetokenizeReply
