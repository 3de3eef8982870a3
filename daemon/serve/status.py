"""What `health` and `stats` answer: the server's counters and the `Snapshot` the loop
publishes before and after every engine step, which the connections' I/O thread reads
to answer them during a step (a snapshot is replaced, never changed, so it needs no
lock)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ...ipc.messages import HealthReply
from ..engine.engine import Engine
from ..model.fim import find_fim

# How old the engine's counters in a stats reply answered during a step may be.
SNAPSHOT_REFRESH_S = 0.02


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the I/O thread answers health and stats with, replaced (never changed) by
    the loop before and after every engine step."""

    stats: dict[str, object]  # Server.stats() without the counters read live
    status: str  # "ok" or "draining"
    num_requests: int
    step_started: float | None  # time.monotonic() at the start of the running step


@dataclass(slots=True)
class Counters:
    num_requests_total: int = 0
    num_errors_total: int = 0  # the loop's and the detokenizing thread's replies
    num_errors_read: int = 0  # bad messages answered by the I/O thread (its only writer)
    num_disconnect_cancels: int = 0
    num_events_published: int = 0
    started: float = field(default_factory=time.monotonic)


class Status:
    """The counters, and the snapshot with the engine's counters read at most every
    SNAPSHOT_REFRESH_S (about 60 us a read) unless a request came or went."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        vocabulary = engine.tokenizer.backend.get_vocab(with_added_tokens=True)
        self.fim = find_fim(vocabulary)  # the health reply's: the model's FIM tokens
        self.counters = Counters()
        self.snapshot: Snapshot | None = None  # None until serving starts
        self._engine_stats: dict[str, object] = {}
        self._engine_stats_key: tuple[int, int, int] | None = None
        self._engine_stats_at = 0.0

    @property
    def num_errors(self) -> int:
        return self.counters.num_errors_total + self.counters.num_errors_read

    def publish(
        self,
        *,
        num_live: int,
        num_pending: int,
        draining: bool,
        step_started: float | None,
        refresh: bool = False,
    ) -> None:
        """Replace the snapshot. The engine's counters are read again when `refresh`,
        when a request came or went, or when they are SNAPSHOT_REFRESH_S old; the
        server's own are always current."""
        now = time.monotonic()
        counters = self.counters
        key = (counters.num_requests_total, num_live, num_pending)
        if (
            refresh
            or key != self._engine_stats_key
            or now >= self._engine_stats_at + SNAPSHOT_REFRESH_S
        ):
            self._engine_stats = dict(self.engine.stats())
            self._engine_stats_key, self._engine_stats_at = key, now
        stats: dict[str, object] = {
            **self._engine_stats,
            "num_requests": num_live + num_pending,
            "num_requests_total": counters.num_requests_total,
            "num_errors_total": self.num_errors,
            "num_disconnect_cancels": counters.num_disconnect_cancels,
            "num_events_published": counters.num_events_published,
        }
        status = "draining" if draining else "ok"
        self.snapshot = Snapshot(stats, status, num_live, step_started)

    def step_ended(self) -> None:
        """From here stats go to the loop again (a stats asked after the step's replies
        must not predate them)."""
        assert self.snapshot is not None
        self.snapshot = replace(self.snapshot, step_started=None)

    def health(self, snapshot: Snapshot) -> HealthReply:
        engine = self.engine
        return HealthReply(snapshot.status, self.model_name, engine.max_model_len,
                           snapshot.num_requests, engine.config.vocab_size,
                           engine.config.hidden_size, engine.settings.max_num_seqs,
                           engine.tokenizer.chat_template,
                           None if self.fim is None else self.fim.as_wire())  # fmt: skip

    def live_stats(
        self, snapshot: Snapshot, num_connections: int, num_refused: int
    ) -> dict[str, object]:
        """The snapshot's stats with what is read live: connections, uptime, and how long
        the running step has taken so far (`step_running_s`, null between steps)."""
        now = time.monotonic()
        started = snapshot.step_started
        return {
            **snapshot.stats,
            "num_connections": num_connections,
            "num_connections_refused": num_refused,
            "uptime_s": round(now - self.counters.started, 3),
            "step_running_s": None if started is None else round(now - started, 3),
        }
