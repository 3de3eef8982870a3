"""Which tokens run in the next step, and which blocks they write to.

Continuous batching: each step takes every running request's pending tokens (a
decode token, or the next chunk of a prompt) and then admits waiting requests in
priority order (lower first, then arrival), all within a token budget and up to
`max_num_seqs` running requests. A request is admitted with its longest cached
prefix, so only the rest of its prompt is computed. A waiting request that needs
a block some running request is computing right now (requests that arrive
together with a shared prefix) waits for it and then reuses it, so the prefix is
computed once. When a running request needs a block and none is free, the
running request that sorts last (lowest priority, youngest) is preempted: its
blocks go back to the pool (its full blocks stay cached) and it waits to be
resumed.
The scheduler never touches arrays: what a step must do is a `StepPlan`, which
the model runner executes (the pool's planned block copies, then the forward).
An exact repeat (a prompt whose last logits row is stored, logits_cache.py, and
whose every token's KV is cached) is scheduled with no token to compute: the
plan hands the runner the stored row to sample from. With a `Speculator`, a
decoding request may carry a draft of its next tokens (speculative.py), within
the budget left after one token for each running request after it, and while at
most `max_drafted_seqs` requests run (with decode graphs, a larger drafted step
would run eagerly, which costs every request in it more than drafts save); a
draft that finds no blocks is dropped, never a reason to preempt.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from ...blockpool.copies import BlockCopy
from .kvmanager import KVCacheManager
from .logits_cache import LogitsCache, embedding_key
from .sequence import SeqStatus, Sequence
from .speculative import Speculator


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in this step
    # an exact repeat (num_tokens 0): its prompt's stored last logits row, passed on
    # untouched for the runner to sample from
    stored_logits: np.ndarray | None = None
    # a decode token's draft (speculative.py): computed after it in this step, num_tokens
    # counting them; the step samples at each of their positions
    draft: list[int] = field(default_factory=list)
    # an exact repeat of an embedding request: its prompt's stored embedding, passed on
    stored_embedding: np.ndarray | None = None

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so it samples the next."""
        return bool(self.draft) or (
            self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens
        )


@dataclass(slots=True)
class StepPlan:
    """One engine step: run `copies` in order (whole blocks: offload, onboard, and
    partial-reuse device copies), then the forward over `scheduled`; afterwards
    the engine registers the full blocks of `to_register` (and of the drafted requests,
    once it knows which draft tokens were kept) and releases the copies' pins
    (`BlockPool.complete_copies`)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    to_register: list[ScheduledSeq] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.scheduled or self.copies)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        logits_cache: LogitsCache | None = None,
        speculator: Speculator | None = None,
        max_drafted_seqs: int | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {max_num_batched_tokens}")
        self.kv = kv
        self.logits_cache = logits_cache  # None: no exact repeats
        self.speculator = speculator  # None: no drafts
        self.max_drafted_seqs = max_drafted_seqs  # None: drafts at any batch size
        self.max_num_seqs = max_num_seqs  # running requests at most; None: no bound
        self.max_num_batched_tokens = max_num_batched_tokens
        # NOTE: `waiting` stays sorted by Sequence.sort_key; `running` is in admission order.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.prefill_tokens_skipped = 0  # prompt tokens admissions took from the cache
        self.num_preemptions = 0
        self.num_prefix_waits = 0  # admissions put off to reuse a block being computed
        self.num_exact_repeats = 0  # admissions that sample from a stored logits row

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """The next step: every running request's pending tokens, then waiting
        requests in order, within the token budget, with the block copies the
        pool planned on the way."""
        scheduled = self._schedule()
        bs = self.kv.block_size
        fills = [  # a block of theirs becomes full (prompt or generated tokens alike)
            item
            for item in scheduled
            if (item.seq.num_computed_tokens + item.num_tokens) // bs > len(item.seq.block_hashes)
            and not item.draft
        ]
        return StepPlan(scheduled, self.kv.pool.take_copies(), fills)

    def _schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        self.running.sort(key=_sort_key)  # so the preemption victim is never already scheduled
        idx = 0
        drafting = self.speculator is not None and (
            self.max_drafted_seqs is None or len(self.running) <= self.max_drafted_seqs
        )
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            num = min(seq.num_pending_tokens, budget)
            if drafting and num == 1:
                assert self.speculator is not None
                # room left after one token for each running request from here on
                draft = self.speculator.draft(seq, budget - (len(self.running) - idx))
                if draft and self.kv.grow(seq, 1 + len(draft)):
                    scheduled.append(ScheduledSeq(seq, 1 + len(draft), draft=draft))
                    budget -= 1 + len(draft)
                    idx += 1
                    continue
            if self.kv.grow(seq, num):
                scheduled.append(ScheduledSeq(seq, num))
                budget -= num
                idx += 1
                continue
            self._preempt(self.running[-1])  # the last in order gives way, possibly seq itself
        # blocks the running requests are computing, which an arriving request waits for
        in_flight = (
            {h for seq in self.running for h in self.kv.blocks_in_flight(seq)}
            if self.waiting
            else set()
        )
        idx = 0
        cap = self.max_num_seqs
        while idx < len(self.waiting) and budget > 0 and (cap is None or len(self.running) < cap):
            seq = self.waiting[idx]
            if self.kv.waits_for(seq, in_flight):
                self.num_prefix_waits += 1
                idx += 1  # its prefix is being computed: later requests may go first
                continue
            stored, stored_embedding = self._stored_rows(seq)
            num_cached = self.kv.admit(seq, whole_prompt=stored is not None)
            num_cached = min(num_cached, len(seq.prompt_token_ids))
            num = min(seq.num_pending_tokens, budget)  # 0: an exact repeat
            if not self.kv.grow(seq, num):
                self.kv.release(seq)
                break  # no room: nobody behind it jumps the queue
            self.prefill_tokens_skipped += num_cached
            if seq.num_cached_tokens is None:  # first admission: what the cache saved it
                seq.num_cached_tokens = num_cached
                seq.num_cached_host_tokens = min(seq.num_host_hit_tokens, num_cached)
                seq.num_cached_disk_tokens = min(seq.num_disk_hit_tokens, num_cached)
            del self.waiting[idx]
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            in_flight.update(self.kv.blocks_in_flight(seq))
            if num == 0:
                self.num_exact_repeats += 1
            if num == 0:  # an exact repeat: the stored rows stand in for its forward
                scheduled.append(ScheduledSeq(seq, 0, stored, stored_embedding=stored_embedding))
            else:
                scheduled.append(ScheduledSeq(seq, num))
            budget -= num
        return scheduled

    def _stored_rows(self, seq: Sequence) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The stored last logits row of a waiting request's prompt, if it has sampled
        nothing yet, and for an embedding request its stored embedding (both or neither:
        an embedding not stored needs its last token's forward); whether its KV is all
        still cached is for admission to find out (short of it, the request computes the
        rest, the last token too)."""
        if self.logits_cache is None or seq.output_token_ids:
            return None, None
        key = self.kv.prompt_key(seq)
        if not seq.params.embed:
            return self.logits_cache.get(key), None
        embedding = self.logits_cache.get(embedding_key(key))
        logits = None if embedding is None else self.logits_cache.get(key)
        return (None, None) if logits is None else (logits, embedding)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or cancelled) request's blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.release(seq)
        seq.status = SeqStatus.FINISHED
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_sort_key)


def _sort_key(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key
