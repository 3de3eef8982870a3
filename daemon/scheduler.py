"""Which tokens run in the next step, and which blocks they write to.

Each step takes every running request's pending tokens (a decode token, or
the next chunk of a prompt) and then admits waiting requests, all within a
token budget. A request is admitted with its longest cached prefix, so only
the rest of its prompt is computed. When a running request needs a block and
none is free, the youngest running request is preempted: its blocks go back
to the pool (its full blocks stay cached) and it waits to be resumed. The
scheduler never touches arrays.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from reprise.daemon.kvmanager import KVCacheManager
from reprise.daemon.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so it samples the next."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {max_num_batched_tokens}")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefill_tokens_skipped = 0  # prompt tokens admissions took from the cache

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            num = min(seq.num_pending_tokens, budget)
            if self.kv.grow(seq, num):
                scheduled.append(ScheduledSeq(seq, num))
                budget -= num
                idx += 1
                continue
            self._preempt(self.running[-1])  # the youngest gives way, possibly seq itself
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            num_cached = min(self.kv.admit(seq), len(seq.prompt_token_ids))
            num = min(seq.num_pending_tokens, budget)
            if not self.kv.grow(seq, num):
                self.kv.release(seq)
                break
            self.prefill_tokens_skipped += num_cached
            if seq.num_cached_tokens is None:  # first admission: what the cache saved it
                seq.num_cached_tokens = num_cached
                seq.num_cached_host_tokens = min(seq.num_host_hit_tokens, num_cached)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num))
            budget -= num
        return scheduled

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or cancelled) request's blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.release(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
