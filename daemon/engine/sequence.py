"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

import numpy as np

from ...blockpool.hashing import DEFAULT_NAMESPACE, BlockHash, Namespace, encode_ids
from ...blockpool.pool import BlockId
from .params import FinishReason, Retention, SamplingParams
from .prompt_logprobs import PromptLogprobs
from .sampling import Grammar, SamplingState, TokenLogprobs

RequestId = NewType("RequestId", int)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Token ids, blocks and progress of one request.

    NOTE: tokens [0, num_computed_tokens) have their K/V in `block_ids`, but for the
    first `num_released_blocks`, given back once every later query's sliding window
    starts past them (KVCacheManager.release_past_window: their ids stay, unread);
    `len(block_ids) * block_size >= num_computed_tokens` always, and
    `block_hashes[i]` is the key of `block_ids[i]` for every full block so far.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one drawn for it
    namespace: Namespace = DEFAULT_NAMESPACE
    retention: Retention | None = None  # None: the default, and leaves matched blocks' alone
    priority: int = 0  # scheduling: lower goes first (as vLLM's), then earlier request ids
    # p-tuning (prompt_table.py): prompt ids >= vocab size select rows of `prompt_table`
    prompt_table: np.ndarray | None = None  # [num_virtual, hidden] BF16
    prompt_extra_ids: list[int] | None = None  # one per prompt token, 0 for text tokens
    # the vocabulary tokens that would end it, held back until params.min_tokens are out
    stop_ids: frozenset[int] = frozenset()
    grammar: Grammar | None = None  # its structured output's, started (params.structured)
    bad_words: tuple[tuple[int, ...], ...] = ()  # the token sequences params.bad_words ban
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[BlockId] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of its registered full blocks
    num_released_blocks: int = 0  # its first blocks, given back: no later query sees them
    hash_chain: list[BlockHash] = field(default_factory=list)  # keys of its first full blocks, memo
    tail_digest: BlockHash | None = None  # KVCacheManager.tail_hash's, memo (the prompt is fixed)
    # the prompt's ids as block keys encode them (encode_ids), memo: converted once, not per block
    prompt_id_bytes: bytes | None = field(default=None, repr=False)
    num_computed_tokens: int = 0
    num_host_hit_tokens: int = 0  # of the tokens matched at the last admission
    num_cached_tokens: int | None = None  # prompt tokens served from cache at first admission
    num_cached_host_tokens: int = 0
    num_disk_hit_tokens: int = 0  # of the tokens matched at the last admission
    num_cached_disk_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it ended with finish_reason "error"
    stop_reason: int | str | None = None  # Completion.stop_reason
    ended_on_stop_token: bool = False  # its last token is the stop token that ended it
    text: str = ""
    num_text_emitted: int = 0  # characters of `text` already handed out as deltas
    logits: list[np.ndarray] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # when params.prompt_logprobs is set
    embedding: np.ndarray | None = None  # fp32 [hidden], once computed (params.embed)
    sampling: SamplingState = field(init=False)  # built from params, seed and the prompt

    def __post_init__(self) -> None:
        # fake ids are no vocabulary entries: penalties see the text tokens only
        self.sampling = SamplingState.build(
            self.params, self.seed, self.text_prompt_ids(), self.stop_ids, self.grammar,
            self.bad_words,
        )  # fmt: skip

    @property
    def sort_key(self) -> tuple[int, int]:
        """Admission order: priority, then arrival; preemption takes the largest."""
        return (self.priority, self.request_id)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V are not yet in the cache (the prompt's rest, or the last sampled)."""
        return self.num_tokens - self.num_computed_tokens

    def token_at(self, pos: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        return (
            self.prompt_token_ids[pos]
            if pos < num_prompt
            else self.output_token_ids[pos - num_prompt]
        )

    def token_ids(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:  # the decode case: no copy of the whole sequence
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def encoded_ids(self, start: int, end: int) -> bytes:
        """Tokens [start, end) as block keys encode them (8 bytes each, big-endian)."""
        num_prompt = len(self.prompt_token_ids)
        if self.prompt_id_bytes is None and start < num_prompt:
            self.prompt_id_bytes = encode_ids(self.prompt_token_ids)
        if end <= num_prompt:
            assert self.prompt_id_bytes is not None
            return self.prompt_id_bytes[8 * start : 8 * end]
        generated = encode_ids(self.output_token_ids[max(start - num_prompt, 0) : end - num_prompt])
        if start >= num_prompt:
            return generated
        assert self.prompt_id_bytes is not None
        return self.prompt_id_bytes[8 * start :] + generated

    def text_prompt_ids(self) -> list[int]:
        """The prompt's text tokens (prompt-table ids left out)."""
        extra = self.prompt_extra_ids
        if extra is None:
            return self.prompt_token_ids
        return [t for t, e in zip(self.prompt_token_ids, extra, strict=True) if e == 0]

    def extra_ids(self, start: int, end: int) -> list[int] | None:
        """The extra ids of tokens [start, end) for a block key: None when all of them are
        text tokens (generated tokens always are), so text blocks key as they do without
        a prompt table and are shared with requests that have none."""
        extra = self.prompt_extra_ids
        if extra is None or start >= len(extra):
            return None
        ids = extra[start:end]
        if not any(ids):
            return None
        return ids + [0] * (end - start - len(ids))
