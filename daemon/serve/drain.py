"""How a SIGTERM drains the daemon within a bound (DESIGN §7, issue 19 F8).

The drain deadline is the signal's time plus `drain_timeout_s`. From the signal on, no
new request is accepted; then, at every turn of the loop:

- a request whose tokens still to compute (the rest of its prompt, for one in prefill)
  need more steps than fit before the deadline is cancelled at once, with its final
  reply: it could not finish anyway, and its steps would only delay the exit. The
  estimate: a step computes at most the step budget's tokens, each step as long as
  the last prefill step (a request decoding is never cancelled by this rule: it runs
  until the deadline);
- no step starts that would end past the deadline, by the duration of the last step
  of its kind (prefill or decode: they differ tenfold): the requests still running are
  cancelled with their final replies instead, and the daemon closes;
- the drain's own thread (server.py) sees to the step running at the deadline: one
  still running HARD_STOP_GRACE_S later is not waited for; every request gets its
  final reply from that thread, which closes the sockets and exits 0.

So a SIGTERM is answered within drain_timeout_s + HARD_STOP_GRACE_S plus closing (the
last replies get CLOSE_LINGER_S; a disk tier's queued writes, when the loop ends by
itself, up to their own timeout), however loaded the machine and however long a step:
the estimates only make the common case end sooner and by the loop itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..engine.scheduler import Scheduler
from ..engine.sequence import RequestId

StepKind = Literal["prefill", "decode"]


def next_step_kind(scheduler: Scheduler) -> StepKind:
    """ "prefill" when a request has more than one token to compute (a prompt's rest),
    else "decode": the two take very different times, so each is timed on its own."""
    seqs = [*scheduler.running, *scheduler.waiting]
    return "prefill" if any(seq.num_pending_tokens > 1 for seq in seqs) else "decode"


@dataclass(frozen=True, slots=True)
class Drain:
    deadline: float  # time.monotonic() by which the loop should have cancelled what is left

    def step_fits(self, now: float, step_s: float | None) -> bool:
        """Whether a step started now, as long as the last of its kind (`step_s`, None
        when none was timed: it is allowed), should end by the deadline."""
        return now < self.deadline and (step_s is None or now + step_s <= self.deadline)

    def hopeless(
        self, scheduler: Scheduler, now: float, prefill_step_s: float | None
    ) -> list[RequestId]:
        """Requests in prefill whose pending tokens cannot be computed by the deadline:
        each step computes at most the step budget's tokens and takes `prefill_step_s`
        (the last prefill step's time). A request decoding is never hopeless."""
        if prefill_step_s is None:
            return []
        budget = scheduler.max_num_batched_tokens
        out = []
        for seq in [*scheduler.running, *scheduler.waiting]:
            if seq.num_pending_tokens <= 1:
                continue
            steps = math.ceil(seq.num_pending_tokens / budget)
            if now + steps * prefill_step_s > self.deadline:
                out.append(seq.request_id)
        return out
