"""Asynchronous scheduling's planning: which steps go ahead, and the step planned ahead.

With `EngineConfig.async_scheduling`, `Engine.step` launches a step of decodes alone
(`goes_ahead`), plans the step after it (`plan_ahead`: each of its requests one token
further, before this step's tokens are recorded) and launches that behind it, the
tokens fed on the device; then it reads this step's tokens back and records them. A
request that ended in between (its stop token, a cancel) is dropped from the step ahead
when that is recorded (`without_ended`): its row computed a token past its end, into a
slot of a block no request sees. docs/architecture.md draws the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace

from ...blockpool.copies import PINNED_KINDS, BlockCopy
from ...blockpool.pool import BlockPool
from .kvmanager import KVCacheManager
from .outputs import room_left
from .runner import RunOutput
from .scheduler import ScheduledSeq, Scheduler, StepPlan
from .sequence import SeqStatus, Sequence


def goes_ahead(plan: StepPlan, running: Seq[Sequence]) -> bool:
    """Whether `plan` is a step that can have the next one launched behind it: one
    decode token for each of the `running` requests (those of `plan` that ended since
    it was planned left out), each of whose next token depends on its logits row and its
    position alone (SamplingState.stateless) and needs no row on the host."""
    alive = [item for item in plan.scheduled if item.seq.status is SeqStatus.RUNNING]
    if not alive or len(alive) != len(running):
        return False
    for item in alive:
        seq = item.seq
        if (
            item.num_tokens != 1
            or item.draft
            or item.stored_logits is not None
            or not seq.output_token_ids  # a prompt's last token: its first sample
            or seq.num_pending_tokens != 1
            or not seq.sampling.stateless
            or seq.sampling.reads_row
            or seq.params.embed
        ):
            return False
    return True


def plan_ahead(
    plan: StepPlan, sched: Scheduler, kv: KVCacheManager, pool: BlockPool, max_model_len: int
) -> StepPlan | None:
    """The step after `plan` (which `goes_ahead`, launched, its tokens not yet recorded),
    for the requests in it that are still running and that its token does not end by
    length, each one token further; None when it is not taken: requests are waiting
    while there is room to admit one (the next step `schedule` plans admits them; at
    max_num_seqs, they wait for a request to end either way), or `plan` had copies that
    pin blocks (their pins are released after it, before a plan ahead takes more), or
    the blocks ran short (the blocks and copies planned stay planned, for the next step)."""
    if pins(plan.copies):
        return None
    if sched.waiting and (sched.max_num_seqs is None or len(sched.running) < sched.max_num_seqs):
        return None
    seqs = [
        item.seq
        for item in plan.scheduled
        if item.seq.status is SeqStatus.RUNNING and room_left(item.seq, max_model_len) > 1
    ]
    if not seqs or any(not kv.grow(seq, 2) for seq in seqs):
        return None
    bs = kv.block_size
    scheduled = [ScheduledSeq(seq, 1) for seq in seqs]
    # a block fills when its last slot is written: position num_computed_tokens + 1 here
    fills = [item for item in scheduled if (item.seq.num_computed_tokens + 2) % bs == 0]
    return StepPlan(scheduled, pool.take_copies(), fills)


def pins(copies: list[BlockCopy]) -> bool:
    """Whether any of `copies` pins its ends until `BlockPool.complete_copies`."""
    return any(copy.kind in PINNED_KINDS for copy in copies)


def without_ended(plan: StepPlan, out: RunOutput) -> tuple[StepPlan, RunOutput]:
    """`plan` and `out` without the requests that are no longer running."""

    def running(seq: Sequence) -> bool:
        return seq.status is SeqStatus.RUNNING

    return (
        replace(
            plan,
            scheduled=[item for item in plan.scheduled if running(item.seq)],
            to_register=[item for item in plan.to_register if running(item.seq)],
        ),
        replace(
            out,
            sampled=[sampled for sampled in out.sampled if running(sampled[0])],
            prompt_entries=[entry for entry in out.prompt_entries if running(entry[0])],
            embeddings=[pair for pair in out.embeddings if running(pair[0])],
        ),
    )
