"""What a request asks for (SamplingParams) and what it gets back (Completion)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "cancelled"]
MAX_SEED = 2**64


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings of one request, validated on construction.

    temperature 0 is greedy (ties go to the lowest id). `seed` keys a
    counter-based generator with the token position, so a seeded request
    draws the same tokens whatever it is batched with; without a seed the
    engine picks one at random per request.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_logits: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_int("max_tokens", self.max_tokens, low=1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number >= 0; got {self.temperature!r}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(
                f"temperature must be finite and >= 0 (0 = greedy); got {self.temperature!r}"
            )
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, int | float)
            or not 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, low=1, hint=" or None (no limit)")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED - 1)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"stop must be a non-empty string or a list of them; got {self.stop!r}"
            )
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(
                f"stop_token_ids must be a list of token ids; got {self.stop_token_ids!r}"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids[]", token_id, low=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(
    name: str, value: object, *, low: int, high: int | None = None, hint: str = ""
) -> None:
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
    ok = ok and low <= value and (high is None or value <= high)  # type: ignore[operator]
    if not ok:
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {allowed}{hint}; got {value!r}")


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
        _check_int("priority", self.priority, low=0, high=100)
        _check_int("generated_priority", self.generated_priority, low=0, high=100)
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


@dataclass(slots=True)
class Completion:
    """The result of one request."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    cached_tokens: int = 0  # prompt tokens served from the cache (either tier)
    host_cached_tokens: int = 0  # the part of them onboarded from the host tier
    logits: np.ndarray | None = None  # [num_generated, vocab] fp32, when return_logits
