"""The daemon's wire messages: small dataclasses, one per message type.

Every message is a msgpack map with `v` (the protocol version) and `type`
(the tag below); the other keys are the dataclass's fields. Decoding
(`reprise.ipc.codec`) rejects unknown keys, missing required keys and values
of the wrong type or range with a `ProtocolError` whose `code` is one of
`ERROR_CODES`, so the daemon can answer it and keep serving.

The requests live here, the replies in `replies.py` and the checks of the
requests' fields (with `ProtocolError`) in `checks.py`; this module names them
all, so `reprise.ipc.messages` is the one place to import any message from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .checks import ERROR_CODES as ERROR_CODES
from .checks import MAX_ID_CHARS as MAX_ID_CHARS
from .checks import MAX_TEMPLATE_KWARGS as MAX_TEMPLATE_KWARGS
from .checks import MAX_TOOLS as MAX_TOOLS
from .checks import RESERVED_TEMPLATE_NAMES as RESERVED_TEMPLATE_NAMES
from .checks import WIRE_INT_MAX as WIRE_INT_MAX
from .checks import WIRE_INT_MIN as WIRE_INT_MIN
from .checks import ProtocolError as ProtocolError
from .checks import (
    bad,
    check_bias_pair,
    check_chat_extras,
    check_id,
    check_messages,
    check_type,
    short,
)
from .checks import check_chat_options as check_chat_options
from .checks import check_tools as check_tools
from .checks import check_wire_json as check_wire_json
from .checks import logit_bias_from_wire as logit_bias_from_wire
from .checks import logit_bias_to_wire as logit_bias_to_wire
from .replies import (
    DetokenizeReply,
    Done,
    ErrorReply,
    HealthReply,
    StatsReply,
    TokenChunk,
    TokenizeReply,
)

PROTOCOL_VERSION = 1
MAX_SALT_CHARS = 256
MAX_EXTRA_ID = (1 << 64) - 1
MAX_QUEUE_PRIORITY = 1 << 31

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
    # the prompt's last-token embedding comes back on the Done (SamplingParams.embed)
    "embed": (bool,),
}
SAMPLING_ITEMS: dict[str, tuple[type, ...]] = {
    "stop": (str,),
    "stop_token_ids": (int,),
    "allowed_token_ids": (int,),
    "bad_words": (str,),
    "logit_bias": (list,),
    "structured": (str,),
}


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
        check_chat_extras(self.messages, self.tools, self.chat_options)
        if self.token_ids is not None:
            check_type("token_ids", self.token_ids, list)
            for t in self.token_ids:
                check_type("token_ids[]", t, int)
        check_type("sampling", self.sampling, dict)
        for key, value in self.sampling.items():
            if key not in SAMPLING_FIELDS:
                raise bad(
                    f"sampling has an unknown field {short(key)}; known: {sorted(SAMPLING_FIELDS)}"
                )
            check_type(f"sampling.{key}", value, *SAMPLING_FIELDS[key])
            for item in value if isinstance(value, list) else ():  # the range: SamplingParams
                check_type(f"sampling.{key}[]", item, *SAMPLING_ITEMS[key])
                if key == "logit_bias":
                    check_bias_pair(item)
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
            raise bad(f"prompt_table.dtype must be bfloat16; got {short(table['dtype'])}")
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
        check_chat_extras(self.messages, self.tools, self.chat_options)
        if self.add_special_tokens is not None:
            check_type("add_special_tokens", self.add_special_tokens, bool)


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


REQUEST_TYPES: dict[str, type] = {
    c.TYPE: c for c in (Generate, Cancel, StatsRequest, Health, Tokenize, Detokenize)
}
REPLY_TYPES: dict[str, type] = {
    c.TYPE: c
    for c in (TokenChunk, Done, ErrorReply, StatsReply, HealthReply, TokenizeReply, DetokenizeReply)
}
Request = Generate | Cancel | StatsRequest | Health | Tokenize | Detokenize
Reply = TokenChunk | Done | ErrorReply | StatsReply | HealthReply | TokenizeReply | DetokenizeReply
