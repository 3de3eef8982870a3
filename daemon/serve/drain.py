"""How a SIGTERM drains the daemon within a bound (DESIGN §7, issue 19 F8).

The drain deadline is the signal's time plus `drain_timeout_s`. From the signal on, no
new request is accepted; then, at every turn of the loop:

- a request whose tokens still to compute (the rest of its prompt, for one in prefill)
  need more steps than fit before the deadline is cancelled at once, with its final
  reply: it could not finish anyway, and its steps would only delay the exit. The
  estimate: a step computes at most the step budget's tokens, each step as long as
  the last one (a request decoding has one token to compute: it is never cancelled
  by this rule, it runs until the deadline);
- no step starts that would end past the deadline by the last step's duration: the
  requests still running (decoding ones run until then) are cancelled with their final
  replies instead, and the daemon closes.

So a SIGTERM is answered within max(the step running when it came, drain_timeout_s)
plus closing (the last replies get CLOSE_LINGER_S; a disk tier's queued writes up to
their own timeout), however loaded the machine is: the steps' own length is what the
step budget bounds, and no estimate decides a step past the deadline. When a step
turns out longer than the one before it, the deadline is overrun by at most that
difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine.scheduler import Scheduler
from ..engine.sequence import RequestId


@dataclass(frozen=True, slots=True)
class Drain:
    deadline: float  # time.monotonic() by which the loop should have cancelled what is left

    def step_fits(self, now: float, last_step_s: float | None) -> bool:
        """Whether a step started now should end by the deadline (unknown before the
        first step: it is allowed)."""
        return now < self.deadline and (last_step_s is None or now + last_step_s <= self.deadline)

    def hopeless(
        self, scheduler: Scheduler, now: float, last_step_s: float | None
    ) -> list[RequestId]:
        """Requests whose pending tokens cannot be computed by the deadline: each step
        computes at most the step budget's tokens and takes `last_step_s`."""
        if last_step_s is None:
            return []
        budget = scheduler.max_num_batched_tokens
        out = []
        for seq in [*scheduler.running, *scheduler.waiting]:
            steps = math.ceil(seq.num_pending_tokens / budget)
            if now + steps * last_step_s > self.deadline:
                out.append(seq.request_id)
        return out
