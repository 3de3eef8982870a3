"""The engine's boundary checks: its settings against the model it runs, and a
request's options against the engine's settings and pool.

Guarantees: each check raises before anything is built or queued, with one message
naming the setting or option, the bad value and what is allowed (a setting as
SettingError, a request option as ValueError); a check that passes changes nothing.
The prompt's own checks are in prompts.py, a prompt table's in prompt_table.py.
"""

from __future__ import annotations

import numpy as np

from ...blockpool.pool import BlockPool
from ..model.config import ModelConfig
from .config import EngineConfig, SettingError
from .params import SamplingParams


def check_settings(settings: EngineConfig, config: ModelConfig) -> int:
    """Refuse settings this model cannot honour; returns the context length
    (`max_model_len`, else the model's)."""
    max_model_len = settings.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise SettingError(
            "max_model_len",
            f"max_model_len must be in [2, {config.max_position_embeddings}] for this model"
            f"; got {settings.max_model_len}",
        )
    if settings.max_prompt_logprobs > config.vocab_size:
        raise SettingError(
            "max_prompt_logprobs",
            f"max_prompt_logprobs must be at most the vocabulary size {config.vocab_size} "
            f"for this model; got {settings.max_prompt_logprobs}",
        )
    return max_model_len


def check_request(params: SamplingParams, priority: object) -> None:
    """One completion per request, and an integer priority."""
    if params.n != 1:
        raise ValueError(
            f"add_request runs one completion; n={params.n} goes through add_choices "
            "(or generate), which adds one request per choice"
        )
    if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
        raise ValueError(f"priority must be an integer (lower runs first); got {priority!r}")


def check_prompt_logprobs(
    params: SamplingParams, prompt_table: object, extra_ids: object, limit: int
) -> None:
    """Prompt logprobs within the engine's `max_prompt_logprobs`, and only for a prompt
    of vocabulary tokens."""
    num_top = params.prompt_logprobs
    if num_top is None:
        return
    if num_top > limit:
        raise ValueError(
            f"prompt_logprobs must be an integer in [0, {limit}] (the engine's "
            f"max_prompt_logprobs) or None (off); got {num_top!r}"
        )
    if prompt_table is not None or extra_ids is not None:
        raise ValueError(
            "prompt_logprobs is not available with prompt_table or extra_ids: a "
            "prompt-table id is no vocabulary token to take a logprob of"
        )


def check_vocab_ids(params: SamplingParams, vocab_size: int) -> None:
    """Every token a logit_bias or allowed_token_ids names is in the vocabulary."""
    for name, ids in (("logit_bias token ids", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):  # fmt: skip
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} must be in [0, {vocab_size}); got {sorted(bad)[:5]}")


def check_drawable(
    params: SamplingParams, bad_words: tuple[tuple[int, ...], ...], held_stop_ids: frozenset[int]
) -> None:
    """allowed_token_ids keep a token the first step may draw: one bad_words do not ban
    everywhere (a one-token word) and min_tokens does not hold back (`held_stop_ids`).
    (logit_bias cannot forbid one: its biases are finite.)"""
    if params.allowed_token_ids is None:
        return
    banned = {seq[0] for seq in bad_words if len(seq) == 1} | held_stop_ids
    if banned.issuperset(params.allowed_token_ids):
        ids = sorted(set(params.allowed_token_ids))
        raise ValueError(
            f"allowed_token_ids {ids[:5]}{'...' if len(ids) > 5 else ''} are all banned by "
            "bad_words or held back by min_tokens (stop tokens), so no token could be drawn: "
            "keep one they allow"
        )


def check_fits(
    num_prompt_tokens: int, params: SamplingParams, max_model_len: int, pool: BlockPool
) -> None:
    """The request's longest sequence fits the device pool on its own: a request that
    could never run is refused rather than left waiting for ever."""
    num_tokens = min(num_prompt_tokens + params.max_tokens, max_model_len)
    num_blocks_needed = -(-num_tokens // pool.block_size)
    if num_blocks_needed > pool.num_blocks:
        raise ValueError(
            f"request needs {num_blocks_needed} KV blocks (prompt {num_prompt_tokens} + "
            f"max_tokens {params.max_tokens} tokens) but the pool has {pool.num_blocks}"
        )
