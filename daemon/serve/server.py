"""The serving loop: one listening socket (`Connections`) in front of one in-process Engine.

Each turn of the loop takes every message that arrived (without waiting while
the engine has work), runs one engine step, sends each request's new tokens to
the connection that sent the request, and publishes the step's KV events. The
requests themselves, from admission to their final reply, are requests.py's; the
replies are built and sent by replies.py; the KV events socket is publisher.py's.

Guarantees:
- every message gets exactly one reply per request: an ErrorReply, or (for a
  generate) optional TokenChunks and then exactly one Done or ErrorReply; a generate
  of n choices (`sampling.n`) runs n engine requests, each with its own chunks and
  Done (`index`), ended early for all by one ErrorReply;
- replies go only to the connection the request came on: the daemon names
  connections itself (`ConnId`), a client never chooses or claims one;
- the loop never blocks on a client: sends are queued for the I/O thread, and a
  client that vanished or stopped reading has its requests cancelled, so their
  blocks return to the pool;
- bad input never stops the daemon: any failure handling one message becomes an
  ErrorReply ("internal" for our own bugs) and the loop goes on;
- messages are decoded and checked off the loop, on the connections' I/O thread
  (intake.py), which answers a bad one itself; prompts are tokenized on a few threads
  (a slow one holds up no other request's) and text is made on another
  (detokenize.py), so the loop spends its time on engine steps;
- `health` and `stats` are answered within milliseconds even during a long engine
  step: the connections' I/O thread answers them from the `Snapshot` the loop
  publishes before and after every step. Between steps, and with `check` (the pool's
  integrity check), stats is the loop's, so its counters never predate a reply the
  client has already received.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import cast

from ...ipc.codec import encode, error_bytes
from ...ipc.framing import Oversize
from ...ipc.messages import (
    Cancel,
    Detokenize,
    Health,
    ProtocolError,
    Request,
    StatsReply,
    StatsRequest,
    Tokenize,
)
from ...ipc.sockets import ipc_path, prepare_ipc_path
from ..engine.engine import Engine
from .connections import Answer, Arrival, Connections, Limits
from .drain import Drain, StepKind, next_step_kind
from .intake import Ready, RequestChecks, RequestLimits
from .publisher import EventPublisher
from .replies import Outbox, Route
from .requests import Requests
from .service import Notifier, StopFlag, default_max_connections
from .settings import ServerConfig, prepare_endpoints, socket_flag
from .status import Snapshot, Status
from .warmup import warm_up

__all__ = ["CLOSE_LINGER_S", "Server", "ServerConfig", "prepare_endpoints"]

log = logging.getLogger("reprise.server")
# On exit, how long the last replies (drain errors) may take to reach clients that are slow
# to read them. A SIGTERM is answered within drain_timeout_s + HARD_STOP_GRACE_S + this
# (drain.py).
CLOSE_LINGER_S = 2.0
# Past the drain deadline, how long a step still running may take before the drain's
# thread answers its requests and exits the process without it.
HARD_STOP_GRACE_S = 0.5
SHUTTING_DOWN = ("shutting_down", "the daemon is shutting down")


class Server:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        *,
        notifier: Notifier | None = None,
        stop: StopFlag | None = None,
    ) -> None:
        if config.events_address is not None and not engine.settings.kv_events:
            raise ValueError(
                "events_address publishes KV events: the engine must keep them "
                "(EngineConfig kv_events=True; `reprise serve --events` sets it)"
            )
        self.engine = engine
        self.config = config
        self.notifier = notifier or Notifier()
        self.stop = stop or StopFlag()
        limits = RequestLimits(config.max_tokens_cap, config.max_stop_strings,
                               config.max_stop_chars, config.max_logits_bytes)  # fmt: skip
        if config.chat_template is not None:
            engine.tokenizer.use_chat_template(config.chat_template)
        self.checks = RequestChecks(limits, engine.tokenizer, vocab_size=engine.config.vocab_size,
                                    max_model_len=engine.max_model_len,
                                    template_kwargs=config.default_chat_template_kwargs)  # fmt: skip
        self.status = Status(engine, config.model_name)
        self.counters = self.status.counters
        self.outbox = Outbox(self.counters)
        self.requests = Requests(engine, self.checks, self.counters, self.outbox,
                                 max_queue=config.max_queue)  # fmt: skip
        self.draining = False
        self.drain: Drain | None = None  # set on SIGTERM
        self.step_s: dict[StepKind, float] = {}  # how long the last step of each kind took
        # Held by the loop for all of its turn but the engine step: whoever holds it may
        # read and answer the requests (the drain's thread, when a step overruns).
        self._turn = threading.Lock()
        self._serving = False
        self.events = EventPublisher(config.events_address, config.kv_events_layout,
                                     self.counters)  # fmt: skip
        self.conns: Connections | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self) -> None:
        cfg = self.config
        limits = Limits(
            max_connections=cfg.max_connections or default_max_connections(),
            max_frame_bytes=cfg.max_message_bytes,
            # A hard ceiling well above the polite limit: up to it, an oversize message is
            # read and dropped and the client gets "too_large"; past it, it is hung up on.
            max_skip_bytes=4 * cfg.max_message_bytes + 4096,
            max_inbox_bytes=2 * cfg.max_message_bytes + (64 << 10),
            max_unread_bytes=cfg.max_unread_bytes,
        )
        path = ipc_path(cfg.address)
        if path is not None:  # again: prepare_endpoints checked it before the model loaded
            prepare_ipc_path(path, socket_flag(cfg.address))
        self._publish_snapshot(step_started=None)
        self.conns = Connections(cfg.address, limits, intake=self._intake)
        self.outbox.conns = self.conns
        self.conns.bind()
        if path is not None:
            path.chmod(0o600)
        log.info("up to %d client connections", limits.max_connections)
        self.events.bind()

    def run(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Warm up (`progress` counts its stages), bind, tell systemd we are ready, serve
        until stopped, drain, close."""
        engine = self.engine
        pool = engine.pool
        host = pool.host_tier.num_blocks if pool.host_tier is not None else 0
        log.info("backend %s; KV pool of %d blocks of %d tokens, host tier of %d blocks; "
                 "context %d tokens", engine.runner.model.ops.name, pool.num_blocks,
                 pool.block_size, host, engine.max_model_len)  # fmt: skip
        warm_up(engine, self.checks, self.config.max_queue, progress)
        self.bind()
        self.notifier.notify(f"READY=1\nSTATUS=serving on {self.config.address}")
        log.info("serving on %s", self.config.address)
        try:
            self.serve()
        finally:
            self.close()

    def close(self) -> None:
        self.requests.shutdown()  # the replies still to build go out first
        self.engine.close()  # the disk tier's last writes, before the socket goes away
        if self.conns is not None:  # the last replies (drain errors) still go out
            self.conns.stop(linger_s=CLOSE_LINGER_S)
        self.events.close()
        log.info(
            "stopped after %d request(s), %d error repl(ies)",
            self.counters.num_requests_total,
            self.num_errors,
        )
        self._remove_socket_files()

    def _remove_socket_files(self) -> None:
        for address in (self.config.address, self.config.events_address):
            path = ipc_path(address) if address else None
            if path is not None:
                path.unlink(missing_ok=True)

    def serve(self) -> None:
        assert self.conns is not None
        self._serving = True
        threading.Thread(target=self._watch_drain, name="drain", daemon=True).start()
        with self._turn:
            self._serve()
            self._serving = False

    def _serve(self) -> None:
        assert self.conns is not None  # bound before serving
        while True:
            if self.stop.is_set and not self.draining:
                self._start_drain()
            if self.drain is not None and self._drained(self.drain):
                self.requests.abort_all(*SHUTTING_DOWN)
                self.events.publish(self.engine.take_events())
                return
            busy = self.engine.has_work()
            waiting = self.requests.pending or self.requests.texts  # on the tokenizing threads
            timeout = 0 if busy else (5 if waiting else self.config.idle_poll_ms)
            if self.notifier.watchdog_interval_s is not None:
                timeout = min(timeout, int(self.notifier.watchdog_interval_s * 1000))
            self._on_arrivals(self.conns.wait(timeout / 1000))
            self.requests.cancel_stopped()
            self.requests.admit_ready()
            self.requests.answer_texts()
            if self.engine.has_work():
                t_step = time.monotonic()
                self._publish_snapshot(step_started=t_step)
                # From here the I/O thread answers stats itself; what it gave the loop
                # before (a stats would wait behind the whole step) is answered now.
                self._on_arrivals(self.conns.wait(0))
                kind = next_step_kind(self.engine.scheduler)
                self._turn.release()  # the drain's thread may answer for us meanwhile
                try:
                    outputs = self.engine.step()
                finally:
                    self._turn.acquire()
                self.step_s[kind] = time.monotonic() - t_step
                # From here stats go to the loop again: the replies of this step are about
                # to go out, and a stats asked after one must not predate it.
                self.status.step_ended()
                for output in outputs:
                    self.requests.on_output(output, t_step)
            self._publish_snapshot(step_started=None)
            self.events.publish(self.engine.take_events())
            self.notifier.ping_watchdog()

    def _start_drain(self) -> None:
        self.draining = True
        self.drain = Drain(deadline=self._drain_deadline())
        log.info("stopping: draining %d request(s)", self.requests.num_open)

    def _drain_deadline(self) -> float:
        at = self.stop.at if self.stop.at is not None else time.monotonic()
        return at + self.config.drain_timeout_s

    def _watch_drain(self) -> None:
        """The drain's thread: on SIGTERM, STOPPING=1 at once; then, if the loop is still
        inside one engine step HARD_STOP_GRACE_S past the drain deadline (a step on a
        loaded machine can take many seconds), answer every request with its final
        reply, close the sockets and exit 0 without waiting for the step. The disk
        tier's queued writes are then dropped; its files are written whole or not at all."""
        self.stop.event.wait()
        self.notifier.notify("STOPPING=1")
        time.sleep(max(0.0, self._drain_deadline() + HARD_STOP_GRACE_S - time.monotonic()))
        # Between steps the loop holds the lock, and past the deadline it starts no step:
        # it ends the drain by itself, unless it is inside a step when it lets go.
        while not self._turn.acquire(timeout=0.05):
            if not self._serving:
                return
        if not self._serving:
            self._turn.release()
            return
        log.warning("stopping: the engine step in progress ran past the drain deadline "
                    "(%d request(s) left); answering them and exiting without it",
                    self.requests.num_open)  # fmt: skip
        self.requests.abort_all_now(*SHUTTING_DOWN)
        assert self.conns is not None
        self.conns.stop(linger_s=CLOSE_LINGER_S)
        self._remove_socket_files()
        log.info("stopped after %d request(s), %d error repl(ies)",
                 self.counters.num_requests_total, self.num_errors)  # fmt: skip
        logging.shutdown()
        os._exit(0)

    def _drained(self, drain: Drain) -> bool:
        """While draining: cancel (with their final replies) the requests that cannot
        finish by the deadline; True when nothing is left, or no step fits before the
        deadline (what is left is then cancelled by the caller)."""
        now = time.monotonic()
        requests = self.requests
        requests.cancel_stopped()  # their Done is due, not a drain error
        scheduler = self.engine.scheduler
        hopeless = [r for r in drain.hopeless(scheduler, now, self.step_s.get("prefill"))
                    if r in requests.live]  # fmt: skip
        if hopeless:
            log.info("stopping: cancelling %d request(s) that cannot finish by the deadline",
                     len(hopeless))  # fmt: skip
        requests.cancel_with(hopeless, SHUTTING_DOWN)
        if not requests.num_open:
            return True
        if now >= drain.deadline:
            return True
        step_s = self.step_s.get(next_step_kind(scheduler))
        return self.engine.has_work() and not drain.step_fits(now, step_s)

    # -- incoming ----------------------------------------------------------------------------

    def _on_arrivals(self, arrivals: list[Arrival]) -> None:
        for arrival in arrivals:
            route, payload = arrival.conn, arrival.payload
            if payload is None:  # the connection closed: nobody is left to answer
                assert self.conns is not None
                self.conns.close(route)
                self.requests.drop_client(route)
            else:  # what `_intake` gave the loop (Connections types it `object`)
                request = cast("Ready | Request", payload)
                handle = functools.partial(self._handle, route, request)
                self.outbox.answering(route, "handling a message", handle)

    def _handle(self, route: Route, request: Ready | Request) -> None:
        """A message `_intake` read and checked (a generate as `Ready`)."""
        if isinstance(request, Ready | Tokenize | Detokenize):
            try:
                if self.draining:
                    raise ProtocolError(
                        "shutting_down", "the daemon is shutting down; not accepting requests"
                    )
                if isinstance(request, Ready):
                    self.requests.start(route, request)
                else:
                    self.requests.start_text(route, request)
            except ProtocolError as e:
                e.request_id = request.request.id if isinstance(request, Ready) else request.id
                raise
        elif isinstance(request, Cancel):
            self.requests.cancel(route, request.id)
        elif isinstance(request, StatsRequest):
            self.outbox.send(route, encode(StatsReply(stats=self.stats(check=request.check))))
        else:
            raise AssertionError(f"{type(request).__name__} reached the loop")

    def _intake(self, frame: bytes | Oversize) -> Answer | Ready | Request:
        """On the I/O thread, each frame: decoded and checked (intake.py), a bad one
        answered with its error; a health message, or a stats message while a step runs,
        answered from the last snapshot. What else the loop gets: `Ready` generates,
        cancels, stats between steps or with `check`. Reads only the snapshot, the fixed
        config and live counters."""
        if isinstance(frame, Oversize):  # dropped unread by the connection's reader
            return self._refuse("too_large", f"message has {frame.num_bytes} bytes; the limit "
                                f"is {self.config.max_message_bytes} (max_message_bytes)")  # fmt: skip
        try:
            request = self.checks.read(frame)
        except ProtocolError as e:
            return self._refuse(e.code, e.message, e.request_id)
        snapshot = self.status.snapshot
        assert snapshot is not None  # published before the socket is bound
        if isinstance(request, Health):
            return Answer(encode(self.status.health(snapshot)))
        if isinstance(request, StatsRequest) and not request.check and snapshot.step_started:
            return Answer(encode(StatsReply(stats=self._live_stats(snapshot))))
        return request

    def _refuse(self, code: str, message: str, request_id: str | None = None) -> Answer:
        """On the I/O thread: the error reply to a message that failed its checks."""
        self.counters.num_errors_read += 1
        return Answer(error_bytes(code, message, request_id))

    @property
    def num_errors(self) -> int:
        return self.status.num_errors

    def _publish_snapshot(self, *, step_started: float | None, refresh: bool = False) -> None:
        self.status.publish(num_live=len(self.requests.live),
                            num_pending=len(self.requests.pending),
                            draining=self.draining, step_started=step_started,
                            refresh=refresh)  # fmt: skip

    # -- stats -------------------------------------------------------------------------------

    def stats(self, *, check: bool = False) -> dict[str, object]:
        """Engine and server counters (on the loop, between steps, or just before one
        starts); `check` adds the pool's integrity check."""
        snapshot = self.status.snapshot
        started = snapshot.step_started if snapshot is not None else None  # a step about to run
        self._publish_snapshot(step_started=started, refresh=True)
        assert self.status.snapshot is not None
        stats = self._live_stats(self.status.snapshot)
        if check:
            try:
                self.engine.pool.check_integrity()
                stats["integrity"] = "ok"
            except AssertionError as e:
                stats["integrity"] = f"FAILED: {e}"
        return stats

    def _live_stats(self, snapshot: Snapshot) -> dict[str, object]:
        conns = self.conns
        if conns is None:
            return self.status.live_stats(snapshot, 0, 0)
        return self.status.live_stats(snapshot, conns.num_open, conns.num_refused)
