"""What a request asks for (SamplingParams, from the sampling package; Retention)
and what it gets back (StepOutput, Completion)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .prompt_logprobs import PromptEntries
from .sampling.logprobs import TokenLogprobs
from .sampling.params import MAX_SEED, SamplingParams, check_int
from .sampling.structured import StructuredOutput

# "error": no token could come next (its mask kept only banned tokens), `error` says why
FinishReason = Literal["stop", "length", "cancelled", "error"]
__all__ = [
    "MAX_SEED",
    "Completion",
    "FinishReason",
    "Retention",
    "SamplingParams",
    "StepOutput",
    "StructuredOutput",
    "TokenLogprobs",
]


@dataclass(slots=True, frozen=True)
class Retention:
    """How long a request's blocks should stay cached once it no longer holds them.

    Priorities run from 0 to 100 (default 35); lower-priority blocks are
    evicted first. After `duration_s` (None: forever) a block's priority falls
    back to the default, as with TensorRT-LLM's KvCacheRetentionConfig.
    """

    priority: int = 35  # blocks of prompt tokens
    generated_priority: int = 35  # blocks holding generated tokens
    duration_s: float | None = None

    def __post_init__(self) -> None:
        check_int("priority", self.priority, low=0, high=100)
        check_int("generated_priority", self.generated_priority, low=0, high=100)
        if self.duration_s is not None and not (
            isinstance(self.duration_s, int | float) and self.duration_s > 0
        ):
            raise ValueError(f"duration_s must be a number > 0 or None; got {self.duration_s!r}")


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request (for streaming)."""

    request_id: int
    token_ids: list[int]  # the new token(s)
    text_delta: str  # new text; text that may still turn into a stop string is held back
    finish_reason: FinishReason | None  # set on the request's last output
    logits: np.ndarray | None = None  # [len(token_ids), vocab] fp32, when return_logits
    logprobs: list[TokenLogprobs] | None = None  # one per token, when logprobs is set
    # the last token is the stop token (eos or stop_token_ids) that ended it: its text is
    # left out (unless include_stop_str_in_output), as the daemon's detokenizer must know
    stop_token: bool = False
    error: str | None = None  # why it ended with finish_reason "error" (one line)


@dataclass(slots=True)
class Completion:
    """The result of one request."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    cached_tokens: int = 0  # prompt tokens served from the cache (either tier)
    host_cached_tokens: int = 0  # the part of them onboarded from the host tier
    disk_cached_tokens: int = 0  # the part of them onboarded from the disk tier
    logits: np.ndarray | None = None  # [num_generated, vocab] fp32, when return_logits
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when logprobs is set
    # one per prompt token (the first None), when prompt_logprobs is set: a sequence whose
    # entries are made when read, equal to their list
    prompt_logprobs: PromptEntries | None = None
    # what ended it with "stop", as vLLM's: the stop string, or the token id of
    # `stop_token_ids` (None for eos, a grammar's end and every other finish reason)
    stop_reason: int | str | None = None
    # the prompt's last-token embedding, fp32 [hidden], when SamplingParams.embed is set
    embedding: np.ndarray | None = None
    error: str | None = None  # why it ended with finish_reason "error" (one line)
