"""The serving loop: one listening socket (`Connections`) in front of one in-process Engine.

Each turn of the loop takes every message that arrived (without waiting while
the engine has work), runs one engine step, sends each request's new tokens to
the connection that sent the request, and publishes the step's KV events.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import zmq

from ...ipc.codec import encode, error_bytes, logits_to_wire, logprobs_to_wire
from ...ipc.framing import Oversize
from ...ipc.kv_events import batch_frames, encode_batch
from ...ipc.messages import (
    Cancel,
    Done,
    Health,
    ProtocolError,
    Request,
    StatsReply,
    StatsRequest,
    TokenChunk,
)
from ...ipc.sockets import ipc_path, is_ipv6, prepare_ipc_path
from ..engine.engine import Engine
from ..engine.params import Completion, Retention, SamplingParams, StepOutput
from ..engine.prompts import PreparedPrompt
from ..engine.sampling.logprobs import TokenLogprobs
from ..engine.sequence import RequestId
from .connections import Answer, Arrival, Connections, ConnId, Limits
from .detokenize import Detokenizing, TextEnd
from .drain import Drain, StepKind, next_step_kind
from .intake import Ready, RequestChecks, RequestLimits
from .service import Notifier, StopFlag, default_max_connections
from .settings import ServerConfig, prepare_endpoints
from .status import Snapshot, Status

__all__ = ["CLOSE_LINGER_S", "Server", "ServerConfig", "prepare_endpoints"]

log = logging.getLogger("reprise.server")
# On exit, how long the last replies (drain errors) may take to reach clients that are slow
# to read them. A SIGTERM is answered within drain_timeout_s + HARD_STOP_GRACE_S + this
# (drain.py).
CLOSE_LINGER_S = 2.0
# A KV events subscriber sends us only its subscriptions, a topic each: longer messages
# get its connection dropped rather than buffered.
MAX_SUBSCRIPTION_BYTES = 4096
# Past the drain deadline, how long a step still running may take before the drain's
# thread answers its requests and exits the process without it.
HARD_STOP_GRACE_S = 0.5
TOKENIZING_THREADS = 4  # prompts tokenized at once, off the loop
Route = ConnId  # the connection a request came on, the only one its replies go to
SHUTTING_DOWN = ("shutting_down", "the daemon is shutting down")


@dataclass(slots=True)
class LiveRequest:
    route: Route
    client_id: str
    stream: bool
    t_received: float
    index: int = 0  # which of the client request's choices (sampling.n) this is
    num_choices: int = 1
    t_first: float | None = None
    t_first_step: float | None = None  # when the step that gave the first token began


@dataclass(slots=True)
class PreparedRequest:
    """What a tokenizing thread makes of a generate's prompt (Server._prepare)."""

    prompt: PreparedPrompt | list[int]  # the ids, checked and keyed by the engine if it could
    text_ids: list[int]  # its text tokens (no prompt-table ids): the detokenizer's context


@dataclass(slots=True)
class PendingRequest:
    """A generate whose prompt is being tokenized off the loop (Server._admit_ready)."""

    ready: Ready
    prepared: Future[PreparedRequest]


class Server:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        *,
        notifier: Notifier | None = None,
        stop: StopFlag | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.notifier = notifier or Notifier()
        self.stop = stop or StopFlag()
        self.live: dict[RequestId, LiveRequest] = {}
        # a client request's choices still running, in choice order
        self.by_client: dict[tuple[Route, str], list[RequestId]] = {}
        # Prompts are tokenized (and chat templates rendered) on these threads, never on
        # the loop; the tokenizer releases the GIL while it encodes. Several, so that one
        # long prompt (up to the message size limit) holds up no other request's admission.
        self.pending: dict[tuple[Route, str], PendingRequest] = {}
        self._tokenizing = ThreadPoolExecutor(
            max_workers=TOKENIZING_THREADS, thread_name_prefix="tokenize"
        )
        self.text = Detokenizing(engine.tokenizer)  # every request's text and stop strings
        limits = RequestLimits(config.max_tokens_cap, config.max_stop_strings,
                               config.max_stop_chars, config.max_logits_bytes)  # fmt: skip
        self.checks = RequestChecks(limits, engine.tokenizer, vocab_size=engine.config.vocab_size,
                                    max_model_len=engine.max_model_len)  # fmt: skip
        self.status = Status(engine, config.model_name)
        self.counters = self.status.counters
        self.draining = False
        self.drain: Drain | None = None  # set on SIGTERM
        self.step_s: dict[StepKind, float] = {}  # how long the last step of each kind took
        # Held by the loop for all of its turn but the engine step: whoever holds it may
        # read and answer the requests (the drain's thread, when a step overruns).
        self._turn = threading.Lock()
        self._serving = False
        self.event_seq = 0  # the next KV event batch's number (vLLM numbers them from 0)
        self._ctx = zmq.Context()  # for the KV events socket only
        self.conns: Connections | None = None
        self.pub: zmq.Socket | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Make the first client pay no start-up cost: on the GPU, capture the decode
        graph of every batch size a step can have; on every backend, run one tiny request
        (3 prompt tokens, 2 generated) through admission, prefill, sampling, decode and
        retirement. `progress(done, total)` counts these stages."""
        engine, start = self.engine, time.perf_counter()
        report = progress or (lambda done, total: None)
        _ = self.checks.max_token_bytes  # the prompt-size bound, read once from the vocabulary
        graphs = engine.runner.decode is not None
        total = 2 if graphs else 1
        report(0, total)
        if graphs:
            log.info("warm-up: capturing the decode graphs (CUDA graphs) of every batch size")
            sizes = engine.capture_decode_graphs(self.config.max_queue)
            if sizes:
                log.info("decode graphs captured for batch sizes %s in %.1f s",
                         ",".join(map(str, sizes)), time.perf_counter() - start)  # fmt: skip
            else:
                log.warning("decode graphs off: %s", engine.runner.decode.failed)
            report(1, total)
        else:
            log.info("warm-up: no decode graphs on the %s backend; one tiny request runs "
                     "through every stage", engine.runner.model.ops.name)  # fmt: skip
        params = SamplingParams(max_tokens=2, temperature=0)
        request_id = engine.add_request([1, 2, 3], params, cache_salt="reprise-warm-up")
        while engine.has_work():
            engine.step()
        engine.take_completion(request_id)
        report(total, total)
        log.info("warm-up done in %.1f s", time.perf_counter() - start)

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
        if path is not None:
            prepare_ipc_path(path)
        self._publish_snapshot(step_started=None)
        self.conns = Connections(cfg.address, limits, intake=self._intake)
        self.conns.bind()
        if path is not None:
            path.chmod(0o600)
        log.info("up to %d client connections", limits.max_connections)
        if cfg.events_address:
            self.pub = self._ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 1000)
            self.pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            self.pub.setsockopt(zmq.IPV6, int(is_ipv6(cfg.events_address)))
            events_path = ipc_path(cfg.events_address)
            if events_path is not None:
                prepare_ipc_path(events_path)
            self.pub.bind(cfg.events_address)
            if events_path is not None:
                events_path.chmod(0o600)

    def run(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Warm up (`progress` counts its stages), bind, tell systemd we are ready, serve
        until stopped, drain, close."""
        engine = self.engine
        pool = engine.pool
        host = pool.host_tier.num_blocks if pool.host_tier is not None else 0
        log.info("backend %s; KV pool of %d blocks of %d tokens, host tier of %d blocks; "
                 "context %d tokens", engine.runner.model.ops.name, pool.num_blocks,
                 pool.block_size, host, engine.max_model_len)  # fmt: skip
        self.warm_up(progress)
        self.bind()
        self.notifier.notify(f"READY=1\nSTATUS=serving on {self.config.address}")
        log.info("serving on %s", self.config.address)
        try:
            self.serve()
        finally:
            self.close()

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self.text.shutdown()  # the replies it still has to build go out first
        self.engine.close()  # the disk tier's last writes, before the socket goes away
        if self.conns is not None:  # the last replies (drain errors) still go out
            self.conns.stop(linger_s=CLOSE_LINGER_S)
        if self.pub is not None:
            self.pub.close()
        self._ctx.term()
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
        while True:
            if self.stop.is_set and not self.draining:
                self._start_drain()
            if self.drain is not None and self._drained(self.drain):
                self._abort_all(*SHUTTING_DOWN)
                self._publish_events()
                return
            busy = self.engine.has_work()
            timeout = 0 if busy else (5 if self.pending else self.config.idle_poll_ms)
            if self.notifier.watchdog_interval_s is not None:
                timeout = min(timeout, int(self.notifier.watchdog_interval_s * 1000))
            self._on_arrivals(self.conns.wait(timeout / 1000))
            self._cancel_stopped()
            self._admit_ready()
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
                    self._on_output(output, t_step)
            self._publish_snapshot(step_started=None)
            self._publish_events()
            self.notifier.ping_watchdog()

    def _start_drain(self) -> None:
        self.draining = True
        self.drain = Drain(deadline=self._drain_deadline())
        log.info("stopping: draining %d request(s)", len(self.live) + len(self.pending))

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
                    len(self.live) + len(self.pending))  # fmt: skip
        code, message = SHUTTING_DOWN
        for (route, client_id), pending in list(self.pending.items()):
            pending.prepared.cancel()
            self._send_error(route, code, message, client_id)
        for route, client_id in self.by_client:  # after the chunks still queued on that thread
            data = error_bytes(code, message, client_id)
            self.text.then(functools.partial(self._send_quietly, route, data))
        self.counters.num_errors_total += len(self.by_client)
        self.text.shutdown()
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
        self._cancel_stopped()  # their Done is due, not a drain error
        scheduler = self.engine.scheduler
        hopeless = [r for r in drain.hopeless(scheduler, now, self.step_s.get("prefill"))
                    if r in self.live]  # fmt: skip
        if hopeless:
            log.info("stopping: cancelling %d request(s) that cannot finish by the deadline",
                     len(hopeless))  # fmt: skip
        for request_id in hopeless:
            if request_id in self.live:  # else a choice cancelled with an earlier one
                self.engine.cancel(request_id)
                self._finish(request_id, abort=SHUTTING_DOWN)
        if not self.live and not self.pending:
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
                self._drop_client(route)
            else:
                try:
                    self._handle(route, payload)
                except ProtocolError as e:
                    self._send_error(route, e.code, e.message, e.request_id)
                except Exception as e:  # our bug: answer it, log it, keep serving
                    log.exception("internal error handling a message")
                    self._send_error(route, "internal", f"{type(e).__name__}: {e}")

    def _handle(self, route: Route, request: Ready | Request) -> None:
        """A message `_intake` read and checked (a generate as `Ready`)."""
        if isinstance(request, Ready):
            try:
                self._start(route, request)
            except ProtocolError as e:
                e.request_id = request.request.id
                raise
        elif isinstance(request, Cancel):
            pending = self.pending.pop((route, request.id), None)
            if pending is not None:  # not admitted yet: nothing to free
                pending.prepared.cancel()
                for index in range(pending.ready.params.n):
                    self._send(route, encode(Done(id=request.id, finish_reason="cancelled",
                                                  text="", token_ids=[], prompt_tokens=0,
                                                  cached_tokens=0, host_cached_tokens=0,
                                                  ttft_ms=0.0, tokens_per_s=0.0,
                                                  index=index)))  # fmt: skip
                return
            request_ids = self.by_client.get((route, request.id))
            if request_ids is None:
                raise ProtocolError("not_found", f"no running request {request.id!r}", request.id)
            for request_id in list(request_ids):
                self.engine.cancel(request_id)
                self._finish(request_id)
        elif isinstance(request, StatsRequest):
            self._send(route, encode(StatsReply(stats=self.stats(check=request.check))))
        else:
            raise AssertionError(f"{type(request).__name__} reached the loop")

    def _intake(self, frame: bytes | Oversize) -> object:
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
        self.status.publish(num_live=len(self.live), num_pending=len(self.pending),
                            draining=self.draining, step_started=step_started,
                            refresh=refresh)  # fmt: skip

    def _start(self, route: Route, ready: Ready) -> None:
        request = ready.request
        if self.draining:
            raise ProtocolError(
                "shutting_down", "the daemon is shutting down; not accepting requests"
            )
        queued = len(self.live) + sum(p.ready.params.n for p in self.pending.values())
        if queued + ready.params.n > self.config.max_queue:
            raise ProtocolError(
                "busy", f"the queue is full ({self.config.max_queue} requests, max_queue, "
                "each choice of n counting as one); retry later"
            )
        if (route, request.id) in self.by_client or (route, request.id) in self.pending:
            raise ProtocolError("duplicate_id", f"request {request.id!r} is already running")
        future = self._tokenizing.submit(self._prepare, request)
        self.pending[(route, request.id)] = PendingRequest(ready, future)

    def _prepare(self, request: Request) -> PreparedRequest:
        """On a tokenizing thread: the prompt's ids (ProtocolError for a bad one), then
        what of its admission depends on them alone (Engine.prepare_prompt: the checks,
        the blocks' keys) and its text tokens, so the loop does none of it. A prompt the
        engine refuses goes on as ids, for `add_choices` to refuse on the loop."""
        ids = self.checks.prompt_ids(request)
        vocab = self.engine.config.vocab_size
        text_ids = [t for t in ids if t < vocab]
        try:
            return PreparedRequest(
                self.engine.prepare_prompt(ids, cache_salt=request.cache_salt), text_ids
            )
        except (TypeError, ValueError):
            return PreparedRequest(ids, text_ids)

    def _admit_ready(self) -> None:
        """Hand the engine every request whose prompt is tokenized, in arrival order (one
        still tokenizing lets those behind it that are done go first)."""
        for key in [key for key, p in self.pending.items() if p.prepared.done()]:
            route, pending = key[0], self.pending.pop(key)
            request = pending.ready.request
            try:
                self._admit(route, pending)
            except ProtocolError as e:
                self._send_error(route, e.code, e.message, request.id)
            except Exception as e:  # our bug: answer it, log it, keep serving
                log.exception("internal error admitting a request")
                self._send_error(route, "internal", f"{type(e).__name__}: {e}", request.id)

    def _admit(self, route: Route, pending: PendingRequest) -> None:
        request, params = pending.ready.request, pending.ready.params
        prepared = pending.prepared.result()  # a ProtocolError raised there comes here
        retention = Retention(priority=request.priority) if request.priority is not None else None
        try:
            # Token ids alone end it in the engine; its text and stop strings are the
            # detokenizing thread's (detokenize.py), which has the loop cancel it at a stop.
            request_ids = self.engine.add_choices(
                prepared.prompt,
                replace(params, stop=[], detokenize=False),
                cache_salt=request.cache_salt,
                retention=retention,
                priority=request.queue_priority,
                prompt_table=pending.ready.prompt_table,
                extra_ids=request.extra_ids,
            )
        except ValueError as e:
            raise ProtocolError("bad_request", str(e)) from None
        self.counters.num_requests_total += 1
        for index, request_id in enumerate(request_ids):
            self.text.open(
                request_id, prepared.text_ids, params.skip_special_tokens, params.stop
            )
            self.live[request_id] = LiveRequest(
                route, request.id, request.stream, pending.ready.t_received, index,
                len(request_ids),
            )
        self.by_client[(route, request.id)] = list(request_ids)

    # -- outgoing ----------------------------------------------------------------------------

    def _on_output(self, output: StepOutput, t_step: float) -> None:
        request_id = RequestId(output.request_id)
        live = self.live.get(request_id)
        if live is None:
            return  # cancelled earlier in this turn (its client vanished)
        if live.t_first is None:
            live.t_first, live.t_first_step = time.monotonic(), t_step
        self._push_text(request_id, live, output)
        if output.finish_reason is not None:
            self._finish(request_id)

    def _push_text(self, request_id: RequestId, live: LiveRequest, output: StepOutput) -> None:
        """Hand new tokens to the detokenizing thread, which streams their text (and the
        tokens up to a stop string, when one ends the request)."""
        route, client_id, token_ids = live.route, live.client_id, output.token_ids
        logprobs, index = output.logprobs, live.index

        def send_chunk(text: str, num_tokens: int) -> None:  # on the detokenizing thread
            kept = None if logprobs is None else logprobs[:num_tokens]
            chunk = TokenChunk(client_id, token_ids[:num_tokens], text, self._logprobs_wire(kept),
                               index)  # fmt: skip
            self._send_quietly(route, encode(chunk))

        self.text.push(
            request_id,
            token_ids,
            finish_reason=output.finish_reason,
            then=send_chunk if live.stream else None,
        )

    def _cancel_stopped(self) -> None:
        """Cancel in the engine the requests a stop string ended on the detokenizing thread
        (the engine may have computed a token or two more; the reply leaves them out).
        Their one Done comes from `_finish`, with the text and tokens cut at the stop."""
        for request_id in self.text.take_stopped():
            if request_id in self.live:  # else the engine finished it first, or it was dropped
                self.engine.cancel(request_id)
                self._finish(request_id)

    def _finish(self, request_id: RequestId, abort: tuple[str, str] | None = None) -> None:
        """Send the Done of a request the engine finished or cancelled (or a stop string
        ended), and forget it. With `abort` (code, message), a request no stop string
        ended gets that error instead of a Done; a choice of n gets it in any case, for
        the whole client request, whose other choices still running end with it."""
        live = self.live.pop(request_id)
        key = (live.route, live.client_id)
        siblings = self.by_client.pop(key)
        siblings.remove(request_id)
        if abort is not None:
            for sibling in siblings:  # their chunks already queued still go out first
                self.engine.cancel(sibling)
                self._forget(sibling)
        elif siblings:
            self.by_client[key] = siblings
        whole = self.engine.take_completion(request_id)
        now = time.monotonic()
        t_first = live.t_first if live.t_first is not None else now

        def send_done(end: TextEnd) -> None:  # on the detokenizing thread, after the chunks
            if abort is not None and (live.num_choices > 1 or not end.stopped):
                self.counters.num_errors_total += 1
                self._send_quietly(live.route, error_bytes(*abort, live.client_id))
                return
            completion = _cut(whole, end)
            done = Done(
                id=live.client_id,
                finish_reason=completion.finish_reason,
                text=completion.text,
                token_ids=completion.token_ids,
                prompt_tokens=len(completion.prompt_token_ids),
                cached_tokens=completion.cached_tokens,
                host_cached_tokens=completion.host_cached_tokens,
                disk_cached_tokens=completion.disk_cached_tokens,
                ttft_ms=round((t_first - live.t_received) * 1000, 3),
                tokens_per_s=round(len(completion.token_ids) / max(now - live.t_received, 1e-9), 3),
                logits=logits_to_wire(completion.logits) if completion.logits is not None else None,
                logprobs=self._logprobs_wire(completion.logprobs),
                prompt_logprobs=self._prompt_logprobs_wire(completion),
                queue_ms=round(((live.t_first_step or now) - live.t_received) * 1000, 3),
                index=live.index,
            )
            self._log_done(done, (now - live.t_received) * 1000)
            self._send_quietly(live.route, encode(done))

        self.text.close(request_id, then=send_done)

    @staticmethod
    def _log_done(done: Done, total_ms: float) -> None:
        log.info(
            "request %s: %s, %d prompt tokens (%d cached, %d from the host tier, %d from disk), "
            "%d generated, first token %.0f ms, total %.0f ms",
            done.id, done.finish_reason, done.prompt_tokens, done.cached_tokens,
            done.host_cached_tokens, done.disk_cached_tokens, len(done.token_ids), done.ttft_ms,
            total_ms,
            extra={"fields": {
                "request_id": done.id, "finish_reason": done.finish_reason,
                "prompt_tokens": done.prompt_tokens, "cached_tokens": done.cached_tokens,
                "host_cached_tokens": done.host_cached_tokens,
                "disk_cached_tokens": done.disk_cached_tokens,
                "generated_tokens": len(done.token_ids), "ttft_ms": done.ttft_ms,
                "total_ms": round(total_ms, 3),
            }},
        )  # fmt: skip

    def _logprobs_wire(self, logprobs: list[TokenLogprobs] | None) -> list[dict] | None:
        return None if logprobs is None else logprobs_to_wire(logprobs, self._token_text)

    def _prompt_logprobs_wire(self, completion: Completion) -> list[dict] | None:
        """Prompt entries on the wire, as `logprobs`; the first token's (no context) has a
        null logprob and no top tokens, but its id and text, which an echo needs."""
        entries = completion.prompt_logprobs
        if entries is None:
            return None
        texts: dict[int, str] = {}  # a long prompt's top tokens repeat: decode each once

        def text(token_id: int) -> str:
            if token_id not in texts:
                texts[token_id] = self._token_text(token_id)
            return texts[token_id]

        first_id = completion.prompt_token_ids[0]
        first = {"id": first_id, "token": text(first_id), "logprob": None, "top": []}
        rest = entries[1:]
        assert None not in rest, "only the first prompt token has no entry"
        return [first, *logprobs_to_wire(rest, text)]  # type: ignore[arg-type]

    def _token_text(self, token_id: int) -> str:
        """One token's text on its own (a piece of a multi-byte character shows as U+FFFD)."""
        return self.engine.tokenizer.decode([token_id])

    def _drop_client(self, route: Route) -> None:
        """The client is gone or not reading: hang up and cancel its requests, so their
        blocks return to the pool."""
        assert self.conns is not None
        self.conns.close(route)
        for key in [key for key in self.pending if key[0] == route]:
            self.pending.pop(key).prepared.cancel()
        for key in [key for key in self.by_client if key[0] == route]:
            self.counters.num_disconnect_cancels += 1
            for request_id in self.by_client.pop(key):
                self.engine.cancel(request_id)
                self._forget(request_id)

    def _forget(self, request_id: RequestId) -> None:
        """Drop a cancelled request with no reply (its client is gone, or is answered
        for the whole client request by another choice's reply)."""
        del self.live[request_id]
        self.engine.take_completion(request_id)
        self.text.discard(request_id)

    def _abort_all(self, code: str, message: str) -> None:
        for (route, client_id), pending in list(self.pending.items()):
            pending.prepared.cancel()
            self._send_error(route, code, message, client_id)
        self.pending.clear()
        self._cancel_stopped()
        for request_id in list(self.live):  # the error follows the chunks still queued
            if request_id in self.live:  # else a choice cancelled with an earlier one
                self.engine.cancel(request_id)
                self._finish(request_id, abort=(code, message))

    def _send(self, route: Route, data: bytes) -> bool:
        """Non-blocking; False when the client is gone or not reading."""
        assert self.conns is not None
        if not self.conns.send(route, data):
            log.info("dropping a reply to connection %d: gone, or not reading", route)
            return False
        return True

    def _send_quietly(self, route: Route, data: bytes) -> None:
        """Send from the detokenizing thread. A refused send needs nothing more here: the
        connection is gone or hung up, and its closing Arrival makes the loop drop it."""
        assert self.conns is not None
        self.conns.send(route, data)

    def _send_error(
        self, route: Route, code: str, message: str, request_id: str | None = None
    ) -> None:
        self.counters.num_errors_total += 1
        self._send(route, error_bytes(code, message, request_id))

    # -- stats and events --------------------------------------------------------------------

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

    def _publish_events(self) -> None:
        events = self.engine.take_events()
        if not events or self.pub is None:
            return
        payload = encode_batch(events, ts=time.time(), layout=self.config.kv_events_layout)
        self.pub.send_multipart(batch_frames(self.event_seq, payload))
        self.event_seq += 1
        self.counters.num_events_published += len(events)


def _cut(completion: Completion, end: TextEnd) -> Completion:
    """The completion as the reply gives it: with the text the detokenizing thread made,
    and cut after the token a stop string ended on (the engine, which never sees stop
    strings in the daemon, may have computed more)."""
    if not end.stopped:
        return replace(completion, text=end.text)
    n = end.num_tokens
    return replace(
        completion,
        token_ids=completion.token_ids[:n],
        text=end.text,
        finish_reason="stop",
        logits=None if completion.logits is None else completion.logits[:n],
        logprobs=None if completion.logprobs is None else completion.logprobs[:n],
    )
