"""The daemon's replies (daemon -> client): small dataclasses, one per message type.

Each is a msgpack map on the wire as the requests are (`messages.py`, whose
`REPLY_TYPES` lists them by their `type` tag). Replies are the daemon's own, so
they carry no checks: the client trusts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


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
    # the prompt's last-token embedding when sampling.embed is set: {"shape": [hidden],
    # "data": float32 bytes}, the final norm's output, not normalized
    embedding: dict[str, Any] | None = None


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
    hidden_size: int = 0  # an embedding's length (Done.embedding)
    max_num_seqs: int = 0  # requests the engine runs at once (its batch)
    chat_template: str | None = None  # the template chats are rendered with; None: none
    # fill-in-the-middle tokens (model/fim.py FimTokens.as_wire: prefix, suffix, middle,
    # file separator); None: the model has none
    fim: list[str | None] | None = None


@dataclass(slots=True)
class TokenizeReply:
    TYPE: ClassVar[str] = "tokenize_reply"
    id: str
    token_ids: list[int]
    text: str | None = None  # chat messages' rendered prompt, the text of token_ids


@dataclass(slots=True)
class DetokenizeReply:
    TYPE: ClassVar[str] = "detokenize_reply"
    id: str
    text: str
