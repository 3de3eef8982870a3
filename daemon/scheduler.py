"""Which tokens run in the next step, and which blocks they write to.

Each step takes every running request's pending tokens (a decode token, or
the next chunk of a prompt) and then admits waiting requests, all within a
token budget. When a running request needs a block and none is free, the
youngest running request is preempted: its blocks go back to the pool and
it waits to be recomputed. The scheduler never touches arrays.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from reprise.blockpool.pool import BlockPool
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
    def __init__(self, pool: BlockPool, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {max_num_batched_tokens}")
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
            if self._grow(seq, num):
                scheduled.append(ScheduledSeq(seq, num))
                budget -= num
                idx += 1
                continue
            victim = self.running[-1]  # the youngest gives way, possibly seq itself
            self._preempt(victim)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            num = min(seq.num_pending_tokens, budget)
            if not self._grow(seq, num):
                break
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
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` the blocks to hold `num_tokens` more tokens; False if the pool is short."""
        bs = self.pool.block_size
        needed = -(-(seq.num_computed_tokens + num_tokens) // bs) - len(seq.block_ids)
        if needed <= 0:
            return True
        block_ids = self.pool.allocate(needed)
        if block_ids is None:
            return False
        seq.block_ids.extend(block_ids)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
