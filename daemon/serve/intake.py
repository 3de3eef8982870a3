"""A request's way in, before the serving loop sees it (DESIGN §6, issue 19).

`RequestChecks.read` runs on the connections' I/O thread, once per frame: it decodes
the msgpack message and checks it against the schema (`decode_request`), and for a
generate builds its SamplingParams and checks the daemon's limits (max_tokens_cap,
max_stop_strings, max_stop_chars, max_logits_bytes, and the prompt's bytes of text
against what the context can hold). What fails raises ProtocolError, answered from
that thread: a bad message costs the loop nothing. The loop gets `Ready` generates
(and the other requests as decoded), and keeps only what needs its own state: the
queue length, duplicate ids, draining.

`RequestChecks.prompt_ids` runs on the tokenizing thread, for requests the loop has
queued: the prompt's token ids (a chat template rendered first), checked against the
context.

Guarantee: both read only what never changes while the daemon serves (the config, the
tokenizer, the model's vocabulary size and context), so they need no lock.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...ipc.codec import decode_request, prompt_table_from_wire
from ...ipc.messages import (
    Detokenize,
    Generate,
    ProtocolError,
    Request,
    Tokenize,
    logit_bias_from_wire,
)
from ..engine.params import SamplingParams
from ..model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The daemon's limits on one generate request (ServerConfig's fields)."""

    max_tokens_cap: int
    max_stop_strings: int
    max_stop_chars: int
    max_logits_bytes: int


@dataclass(frozen=True, slots=True)
class Ready:
    """A generate whose message and settings passed every check that needs no loop state."""

    request: Generate
    params: SamplingParams  # with the stop strings; the engine gets them without
    prompt_table: np.ndarray | None  # [num_virtual, hidden] BF16, from the wire
    t_received: float  # time.monotonic() when its frame was read


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as chat templates take them: a tool call's arguments (JSON text on
    the wire, as OpenAI's) as the object they spell (as vLLM hands them over; templates
    write them with `tojson`), left as text when they spell none; and a tool-call
    message's null content as "" (vLLM's: templates read `content`)."""
    if not any("tool_calls" in m for m in messages):
        return messages
    out = []
    for m in messages:
        if "tool_calls" in m:
            m = {**m, "tool_calls": [_parsed_call(call) for call in m["tool_calls"]]}
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


def _parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**call["function"], "arguments": arguments}}


class RequestChecks:
    def __init__(
        self,
        limits: RequestLimits,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # the server's default chat template variables (a request's own win)
        self.template_kwargs = template_kwargs or {}

    def read(self, payload: bytes) -> Ready | Request:
        """A frame's message, checked (on the I/O thread); raises ProtocolError."""
        t_received = time.monotonic()
        request = decode_request(payload)
        if not isinstance(request, Generate):
            return request
        try:
            try:
                sampling = request.sampling
                if "logit_bias" in sampling:
                    bias = logit_bias_from_wire(sampling["logit_bias"])
                    sampling = {**sampling, "logit_bias": bias}
                params = SamplingParams(**sampling, return_logits=request.return_logits)
            except (ValueError, TypeError) as e:
                raise ProtocolError("bad_request", str(e)) from None
            self._check_limits(params)
            self._check_prompt_bytes(request)  # cheap, so a huge prompt is never tokenized
        except ProtocolError as e:
            e.request_id = request.id
            raise
        table = request.prompt_table
        return Ready(request, params, None if table is None else prompt_table_from_wire(table),
                     t_received)  # fmt: skip

    def prompt_ids(self, request: Generate) -> list[int]:
        """The request's prompt as token ids (on the tokenizing thread)."""
        ids = request.token_ids if request.token_ids is not None else self.text_ids(request)
        keep = request.sampling.get("truncate_prompt_tokens")  # checked by `read`
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
        if not ids:
            raise ProtocolError("bad_request", "prompt is empty; it must hold at least one token")
        max_len = self.max_model_len
        if len(ids) >= max_len:
            raise ProtocolError(
                "prompt_too_long",
                f"prompt has {len(ids)} tokens; the context holds {max_len} (max_model_len), "
                f"so a prompt may have at most {max_len - 1}",
            )
        return ids

    def text_ids(self, request: Generate | Tokenize) -> list[int]:
        """A text or chat prompt's token ids (on a tokenizing thread): the text encoded,
        or the messages in the chat template (with a generation prompt unless its
        chat_options say otherwise). Its length is the caller's to check."""
        special = request.add_special_tokens
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt, add_special_tokens=special is not False)
        return self.chat_ids(request)[0]

    def chat_ids(self, request: Generate | Tokenize) -> tuple[list[int], str]:
        """A chat prompt's token ids and their text: its messages in the chat template (on
        a tokenizing thread), encoded with special tokens only if it asks for them."""
        assert request.messages is not None
        options = request.chat_options or {}
        try:
            text = self.tokenizer.apply_chat_template(
                for_template(request.messages),
                add_generation_prompt=options.get("add_generation_prompt", True),
                continue_final_message=options.get("continue_final_message", False),
                tools=request.tools,
                **{**self.template_kwargs, **options.get("kwargs", {})},
            )
        except Exception as e:  # a template may reject a conversation (e.g. bad role order)
            raise ProtocolError("bad_request", f"cannot render the prompt: {e}") from None
        special = bool(request.add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=special), text

    def text_of(self, request: Detokenize) -> str:
        """The text of vocabulary token ids (on a tokenizing thread)."""
        ids = request.token_ids
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = [t for t in ids if not 0 <= t < self.vocab_size][:5]
            raise ProtocolError(
                "bad_request", f"token_ids must be in [0, {self.vocab_size}); got {bad}"
            )
        return self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token stands for (the longest vocabulary entry)."""
        return self.tokenizer.max_token_bytes()

    def _check_limits(self, params: SamplingParams) -> None:
        cfg = self.limits
        if params.max_tokens > cfg.max_tokens_cap:
            raise ProtocolError("bad_request", f"max_tokens must be at most {cfg.max_tokens_cap} "
                                f"(max_tokens_cap); got {params.max_tokens}")  # fmt: skip
        if len(params.stop) > cfg.max_stop_strings:
            raise ProtocolError("bad_request", f"stop: at most {cfg.max_stop_strings} stop "
                                f"strings (max_stop_strings); got {len(params.stop)}")  # fmt: skip
        longest = max(map(len, params.stop), default=0)
        if longest > cfg.max_stop_chars:
            raise ProtocolError("bad_request", f"stop: a stop string may have at most "
                                f"{cfg.max_stop_chars} characters (max_stop_chars); got {longest}")  # fmt: skip
        if params.return_logits:
            logits_bytes = params.max_tokens * self.vocab_size * 4
            if logits_bytes > cfg.max_logits_bytes:
                most = cfg.max_logits_bytes // (self.vocab_size * 4)
                raise ProtocolError("bad_request", f"return_logits with max_tokens "
                                    f"{params.max_tokens} would return {logits_bytes} bytes; "
                                    f"max_logits_bytes is {cfg.max_logits_bytes}, so at most "
                                    f"{most} tokens with logits")  # fmt: skip

    def _check_prompt_bytes(self, request: Generate) -> None:
        """Refuse, before tokenizing, text that cannot fit the context: a token covers at
        most `max_token_bytes` bytes of text, so more than max_model_len times that many
        bytes is more than max_model_len tokens (no tokenizer work spent on it)."""
        if self.max_token_bytes is None:
            return  # the message size limit is the only bound
        texts = [request.prompt] if request.prompt is not None else []
        # an assistant's tool-call message may have no content
        texts += [m["content"] for m in request.messages or () if m["content"] is not None]
        num_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        bound = self.max_model_len * self.max_token_bytes
        if num_bytes > bound:
            raise ProtocolError(
                "prompt_too_long",
                f"prompt has {num_bytes} bytes of text, more than the context of "
                f"{self.max_model_len} tokens (max_model_len) can hold (at most {bound} bytes)",
            )
