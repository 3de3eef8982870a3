"""The serving loop: one listening socket (`Connections`) in front of one in-process Engine.

Each turn of the loop takes every message that arrived (without waiting while
the engine has work), runs one engine step, sends each request's new tokens to
the connection that sent the request, and publishes the step's KV events.

Guarantees:
- every message gets exactly one reply per request: an ErrorReply, or (for a
  generate) optional TokenChunks and then exactly one Done or ErrorReply;
- replies go only to the connection the request came on: the daemon names
  connections itself (`ConnId`), a client never chooses or claims one;
- the loop never blocks on a client: sends are queued for the I/O thread, and a
  client that vanished or stopped reading has its requests cancelled, so their
  blocks return to the pool;
- bad input never stops the daemon: any failure handling one message becomes an
  ErrorReply ("internal" for our own bugs) and the loop goes on;
- `health` and `stats` are answered within milliseconds even during a long engine
  step: the connections' I/O thread answers them from the `Snapshot` the loop
  publishes before and after every step. Between steps, and with `check` (the pool's
  integrity check), stats is the loop's, so its counters never predate a reply the
  client has already received.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import zmq

from ...ipc.codec import (
    decode_request,
    encode,
    error_bytes,
    logits_to_wire,
    logprobs_to_wire,
    prompt_table_from_wire,
)
from ...ipc.framing import Oversize
from ...ipc.kv_events import KVEventLayout, batch_frames, check_layout, encode_batch
from ...ipc.messages import (
    Cancel,
    Done,
    Generate,
    Health,
    HealthReply,
    ProtocolError,
    StatsReply,
    StatsRequest,
    TokenChunk,
)
from ...ipc.sockets import check_address, ipc_path, is_ipv6, prepare_ipc_path
from ..engine.engine import Engine
from ..engine.params import Completion, Retention, SamplingParams, StepOutput
from ..engine.sampling.logprobs import TokenLogprobs
from ..engine.sequence import RequestId
from .connections import Arrival, Connections, ConnId, Limits
from .detokenize import Detokenizing
from .service import Notifier, StopFlag, default_max_connections

log = logging.getLogger("reprise.server")
# On exit, how long the last replies (drain errors) may take to reach clients that are slow
# to read them. A SIGTERM is answered within drain_timeout_s + one step + this.
CLOSE_LINGER_S = 2.0
# How old the engine's counters in a stats reply answered during a step may be.
SNAPSHOT_REFRESH_S = 0.02
Route = ConnId  # the connection a request came on, the only one its replies go to


@dataclass(slots=True)
class ServerConfig:
    address: str
    events_address: str | None = None
    max_queue: int = 256  # requests waiting or running; more get "busy"
    max_tokens_cap: int = 4096  # the largest max_tokens a request may ask for
    max_message_bytes: int = 1 << 20  # larger messages get "too_large"
    max_connections: int | None = None  # more are refused; None: from the open-file limit
    max_logits_bytes: int = 64 << 20  # the logits a request may ask back (max_tokens * vocab * 4)
    max_stop_strings: int = 16  # stop strings a request may give
    max_stop_chars: int = 256  # characters in one stop string
    kv_events_layout: KVEventLayout = "vllm"
    drain_timeout_s: float = 5.0  # on SIGTERM, how long running requests may take
    idle_poll_ms: int = 100
    max_unread_bytes: int = 64 << 20  # replies queued per client before it counts as gone
    model_name: str = ""

    def __post_init__(self) -> None:
        check_address(self.address)
        if self.events_address is not None:
            check_address(self.events_address)
        check_layout(self.kv_events_layout)
        numbers = ("max_queue", "max_tokens_cap", "max_message_bytes", "max_logits_bytes",
                   "max_stop_strings", "max_stop_chars", "idle_poll_ms", "max_unread_bytes")  # fmt: skip
        if self.max_connections is not None:
            numbers += ("max_connections",)
        for name in numbers:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0; got {self.drain_timeout_s!r}")


@dataclass(slots=True)
class LiveRequest:
    route: Route
    client_id: str
    stream: bool
    t_received: float
    t_first: float | None = None
    text_off_loop: bool = False  # no stop strings: detokenized on Server.text's thread
    t_first_step: float | None = None  # when the step that gave the first token began


@dataclass(slots=True)
class PendingRequest:
    """A generate whose prompt is being tokenized off the loop (Server._admit_ready)."""

    request: Generate
    params: SamplingParams
    prompt_ids: Future[list[int]]
    t_received: float


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
    num_errors_total: int = 0
    num_disconnect_cancels: int = 0
    num_events_published: int = 0
    started: float = field(default_factory=time.monotonic)


def prepare_endpoints(config: ServerConfig) -> None:
    """Check what binding will need before any model loads: each ipc:// socket's folder is
    ours and private, and no live daemon listens there (raises RuntimeError saying why)."""
    for address in (config.address, config.events_address):
        path = ipc_path(address) if address else None
        if path is not None:
            prepare_ipc_path(path)


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
        self.by_client: dict[tuple[Route, str], RequestId] = {}
        # Prompts are tokenized (and chat templates rendered) on this thread, never on the
        # loop; the tokenizer releases the GIL while it encodes.
        self.pending: dict[tuple[Route, str], PendingRequest] = {}
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.text = Detokenizing(engine.tokenizer)  # the text of requests without stop strings
        self.counters = Counters()
        self.draining = False
        self.event_seq = 0  # the next KV event batch's number (vLLM numbers them from 0)
        self._ctx = zmq.Context()  # for the KV events socket only
        self.conns: Connections | None = None
        self.pub: zmq.Socket | None = None
        self.snapshot: Snapshot | None = None  # None until serving starts
        self._engine_stats: dict[str, object] = {}
        self._engine_stats_key: tuple[int, int, int] | None = None
        self._engine_stats_at = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Make the first client pay no start-up cost: on the GPU, capture the decode
        graph of every batch size a step can have; on every backend, run one tiny request
        (3 prompt tokens, 2 generated) through admission, prefill, sampling, decode and
        retirement. `progress(done, total)` counts these stages."""
        engine, start = self.engine, time.perf_counter()
        report = progress or (lambda done, total: None)
        _ = self.max_token_bytes  # the prompt-size bound, read once from the vocabulary
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
        self.conns = Connections(cfg.address, limits, quick=self._quick_reply)
        self.conns.bind()
        if path is not None:
            path.chmod(0o600)
        log.info("up to %d client connections", limits.max_connections)
        if cfg.events_address:
            self.pub = self._ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 1000)
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
            self.counters.num_errors_total,
        )
        for address in (self.config.address, self.config.events_address):
            path = ipc_path(address) if address else None
            if path is not None:
                path.unlink(missing_ok=True)

    def serve(self) -> None:
        assert self.conns is not None
        deadline = float("inf")
        while True:
            if self.stop.is_set and not self.draining:
                self.draining = True
                deadline = time.monotonic() + self.config.drain_timeout_s
                self.notifier.notify("STOPPING=1")
                log.info("stopping: draining %d request(s)", len(self.live) + len(self.pending))
            idle = not self.live and not self.pending
            if self.draining and (idle or time.monotonic() >= deadline):
                self._abort_all("shutting_down", "the daemon is shutting down")
                self._publish_events()
                return
            busy = self.engine.has_work()
            timeout = 0 if busy else (5 if self.pending else self.config.idle_poll_ms)
            if self.notifier.watchdog_interval_s is not None:
                timeout = min(timeout, int(self.notifier.watchdog_interval_s * 1000))
            self._on_arrivals(self.conns.wait(timeout / 1000))
            self._admit_ready()
            if self.engine.has_work():
                t_step = time.monotonic()
                self._publish_snapshot(step_started=t_step)
                outputs = self.engine.step()
                # From here stats go to the loop again: the replies of this step are about
                # to go out, and a stats asked after one must not predate it.
                self.snapshot = replace(self.snapshot, step_started=None)
                for output in outputs:
                    self._on_output(output, t_step)
            self._publish_snapshot(step_started=None)
            self._publish_events()
            self.notifier.ping_watchdog()

    # -- incoming ----------------------------------------------------------------------------

    def _on_arrivals(self, arrivals: list[Arrival]) -> None:
        for arrival in arrivals:
            route, payload = arrival.conn, arrival.payload
            if payload is None:  # the connection closed: nobody is left to answer
                self._drop_client(route)
            elif isinstance(payload, Oversize):  # dropped unread by the connection's reader
                self._send_error(route, "too_large", f"message has {payload.num_bytes} bytes; "
                                 f"the limit is {self.config.max_message_bytes}")  # fmt: skip
            else:
                try:
                    self._handle(route, payload)
                except ProtocolError as e:
                    self._send_error(route, e.code, e.message, e.request_id)
                except Exception as e:  # our bug: answer it, log it, keep serving
                    log.exception("internal error handling a message")
                    self._send_error(route, "internal", f"{type(e).__name__}: {e}")

    def _handle(self, route: Route, payload: bytes) -> None:
        request = decode_request(payload)
        if isinstance(request, Generate):
            try:
                self._start(route, request)
            except ProtocolError as e:
                e.request_id = request.id
                raise
        elif isinstance(request, Cancel):
            pending = self.pending.pop((route, request.id), None)
            if pending is not None:  # not admitted yet: nothing to free
                pending.prompt_ids.cancel()
                self._send(route, encode(Done(id=request.id, finish_reason="cancelled", text="",
                                              token_ids=[], prompt_tokens=0, cached_tokens=0,
                                              host_cached_tokens=0, ttft_ms=0.0,
                                              tokens_per_s=0.0)))  # fmt: skip
                return
            request_id = self.by_client.get((route, request.id))
            if request_id is None:
                raise ProtocolError("not_found", f"no running request {request.id!r}", request.id)
            self.engine.cancel(request_id)
            self._finish(request_id)
        elif isinstance(request, StatsRequest):
            self._send(route, encode(StatsReply(stats=self.stats(check=request.check))))
        elif isinstance(request, Health):
            self._publish_snapshot(step_started=None, refresh=True)
            reply = self._answer_health(self.snapshot)
            self._send(route, encode(reply))

    def _quick_reply(self, payload: bytes) -> bytes | None:
        """On the I/O thread: the reply to a health message, or to a stats message while
        a step runs, from the last snapshot; None for every other message (and for stats
        between steps, or with `check`), which the loop answers. Reads only the snapshot,
        the fixed config and live counters."""
        snapshot = self.snapshot
        if snapshot is None:
            return None
        try:
            request = decode_request(payload)
        except ProtocolError:
            return None  # the loop answers it with the error
        if isinstance(request, Health):
            return encode(self._answer_health(snapshot))
        if isinstance(request, StatsRequest) and not request.check and snapshot.step_started:
            return encode(StatsReply(stats=self._live_stats(snapshot)))
        return None

    def _answer_health(self, snapshot: Snapshot) -> HealthReply:
        return HealthReply(snapshot.status, self.config.model_name, self.engine.max_model_len,
                           snapshot.num_requests, self.engine.config.vocab_size)  # fmt: skip

    def _publish_snapshot(self, *, step_started: float | None, refresh: bool = False) -> None:
        """Replace the snapshot. The engine's counters (about 60 us to read) are read
        again when `refresh`, when a request came or went, or when they are
        SNAPSHOT_REFRESH_S old; the server's own are always current."""
        now = time.monotonic()
        key = (self.counters.num_requests_total, len(self.live), len(self.pending))
        if (
            refresh
            or key != self._engine_stats_key
            or now >= self._engine_stats_at + SNAPSHOT_REFRESH_S
        ):
            self._engine_stats = dict(self.engine.stats())
            self._engine_stats_key, self._engine_stats_at = key, now
        stats: dict[str, object] = {
            **self._engine_stats,
            "num_requests": len(self.live) + len(self.pending),
            "num_requests_total": self.counters.num_requests_total,
            "num_errors_total": self.counters.num_errors_total,
            "num_disconnect_cancels": self.counters.num_disconnect_cancels,
            "num_events_published": self.counters.num_events_published,
        }
        status = "draining" if self.draining else "ok"
        self.snapshot = Snapshot(stats, status, len(self.live), step_started)

    def _start(self, route: Route, request: Generate) -> None:
        if self.draining:
            raise ProtocolError(
                "shutting_down", "the daemon is shutting down; not accepting requests"
            )
        if len(self.live) + len(self.pending) >= self.config.max_queue:
            raise ProtocolError(
                "busy", f"the queue is full ({self.config.max_queue} requests); retry later"
            )
        if (route, request.id) in self.by_client or (route, request.id) in self.pending:
            raise ProtocolError("duplicate_id", f"request {request.id!r} is already running")
        try:
            params = SamplingParams(**request.sampling, return_logits=request.return_logits)
        except (ValueError, TypeError) as e:
            raise ProtocolError("bad_request", str(e)) from None
        self._check_limits(params)
        if not params.stop:  # token ids alone decide its end: detokenized off the loop
            params = replace(params, detokenize=False)
        self._check_prompt_bytes(request)  # cheap, so a huge prompt never reaches the thread
        future = self._tokenizing.submit(self._prompt_ids, request)
        self.pending[(route, request.id)] = PendingRequest(
            request, params, future, time.monotonic()
        )

    def _admit_ready(self) -> None:
        """Hand the engine every request whose prompt is tokenized, in arrival order."""
        for key in [key for key, p in self.pending.items() if p.prompt_ids.done()]:
            route, pending = key[0], self.pending.pop(key)
            request = pending.request
            try:
                self._admit(route, pending)
            except ProtocolError as e:
                self._send_error(route, e.code, e.message, request.id)
            except Exception as e:  # our bug: answer it, log it, keep serving
                log.exception("internal error admitting a request")
                self._send_error(route, "internal", f"{type(e).__name__}: {e}", request.id)

    def _admit(self, route: Route, pending: PendingRequest) -> None:
        request = pending.request
        prompt_ids = pending.prompt_ids.result()  # a ProtocolError raised there comes here
        retention = Retention(priority=request.priority) if request.priority is not None else None
        try:
            request_id = self.engine.add_request(
                prompt_ids,
                pending.params,
                cache_salt=request.cache_salt,
                retention=retention,
                priority=request.queue_priority,
                prompt_table=None
                if request.prompt_table is None
                else prompt_table_from_wire(request.prompt_table),
                extra_ids=request.extra_ids,
            )
        except ValueError as e:
            raise ProtocolError("bad_request", str(e)) from None
        self.counters.num_requests_total += 1
        off_loop = not pending.params.detokenize
        if off_loop:  # the detokenizer's context is the prompt's text tokens (no table ids)
            vocab = self.engine.config.vocab_size
            text_ids = [t for t in prompt_ids if t < vocab]
            self.text.open(request_id, text_ids, pending.params.skip_special_tokens)
        self.live[request_id] = LiveRequest(
            route, request.id, request.stream, pending.t_received, text_off_loop=off_loop
        )
        self.by_client[(route, request.id)] = request_id

    def _check_limits(self, params: SamplingParams) -> None:
        cfg = self.config
        if params.max_tokens > cfg.max_tokens_cap:
            raise ProtocolError("bad_request", f"max_tokens must be at most {cfg.max_tokens_cap} "
                                f"(max_tokens_cap); got {params.max_tokens}")  # fmt: skip
        if len(params.stop) > cfg.max_stop_strings:
            raise ProtocolError("bad_request", f"at most {cfg.max_stop_strings} stop strings "
                                f"(max_stop_strings); got {len(params.stop)}")  # fmt: skip
        longest = max(map(len, params.stop), default=0)
        if longest > cfg.max_stop_chars:
            raise ProtocolError("bad_request", f"a stop string may have at most "
                                f"{cfg.max_stop_chars} characters (max_stop_chars); got {longest}")  # fmt: skip
        if params.return_logits:
            logits_bytes = params.max_tokens * self.engine.config.vocab_size * 4
            if logits_bytes > cfg.max_logits_bytes:
                most = cfg.max_logits_bytes // (self.engine.config.vocab_size * 4)
                raise ProtocolError("bad_request", f"return_logits with max_tokens "
                                    f"{params.max_tokens} would return {logits_bytes} bytes; "
                                    f"max_logits_bytes is {cfg.max_logits_bytes}, so at most "
                                    f"{most} tokens with logits")  # fmt: skip

    def _prompt_ids(self, request: Generate) -> list[int]:
        """The request's prompt as token ids (on the tokenizing thread: it reads only the
        tokenizer and the engine's fixed max_model_len)."""
        tokenizer = self.engine.tokenizer
        try:
            if request.prompt is not None:
                ids = tokenizer.encode(request.prompt)
            elif request.messages is not None:
                text = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
            else:
                assert request.token_ids is not None
                ids = request.token_ids
        except ProtocolError:
            raise
        except Exception as e:  # a template may reject a conversation (e.g. bad role order)
            raise ProtocolError("bad_request", f"cannot render the prompt: {e}") from None
        if not ids:
            raise ProtocolError("bad_request", "prompt is empty; it must hold at least one token")
        max_len = self.engine.max_model_len
        if len(ids) >= max_len:
            raise ProtocolError(
                "prompt_too_long",
                f"prompt has {len(ids)} tokens; the context holds {max_len}, "
                f"so a prompt may have at most {max_len - 1}",
            )
        return ids

    def _check_prompt_bytes(self, request: Generate) -> None:
        """Refuse, before tokenizing, text that cannot fit the context: a token covers at
        most `max_token_bytes` bytes of text, so more than max_model_len times that many
        bytes is more than max_model_len tokens (no tokenizer work spent on it)."""
        if self.max_token_bytes is None:
            return  # the message size limit is the only bound
        texts = [request.prompt] if request.prompt is not None else []
        texts += [m["content"] for m in request.messages or ()]
        num_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        bound = self.engine.max_model_len * self.max_token_bytes
        if num_bytes > bound:
            raise ProtocolError(
                "prompt_too_long",
                f"prompt has {num_bytes} bytes of text, more than the context of "
                f"{self.engine.max_model_len} tokens can hold (at most {bound} bytes)",
            )

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token stands for (the longest vocabulary entry)."""
        return self.engine.tokenizer.max_token_bytes()

    # -- outgoing ----------------------------------------------------------------------------

    def _on_output(self, output: StepOutput, t_step: float) -> None:
        request_id = RequestId(output.request_id)
        live = self.live.get(request_id)
        if live is None:
            return  # cancelled earlier in this turn (its client vanished)
        if live.t_first is None:
            live.t_first, live.t_first_step = time.monotonic(), t_step
        if live.text_off_loop:
            self._push_text(request_id, live, output)
        elif live.stream:
            logprobs = self._logprobs_wire(output.logprobs)
            chunk = TokenChunk(live.client_id, output.token_ids, output.text_delta, logprobs)
            if not self._send(live.route, encode(chunk)):
                self._drop_client(live.route)
                return
        if output.finish_reason is not None:
            self._finish(request_id)

    def _push_text(self, request_id: RequestId, live: LiveRequest, output: StepOutput) -> None:
        """Hand new tokens to the detokenizing thread, which streams their text."""
        route, client_id, token_ids = live.route, live.client_id, output.token_ids
        logprobs = output.logprobs

        def send_chunk(text: str) -> None:  # on the detokenizing thread
            chunk = TokenChunk(client_id, token_ids, text, self._logprobs_wire(logprobs))
            self._send_quietly(route, encode(chunk))

        last = output.finish_reason is not None
        self.text.push(request_id, token_ids, last=last, then=send_chunk if live.stream else None)

    def _finish(self, request_id: RequestId) -> None:
        """Send the Done of a request the engine finished or cancelled, and forget it."""
        live = self.live.pop(request_id)
        del self.by_client[(live.route, live.client_id)]
        completion = self.engine.take_completion(request_id)
        now = time.monotonic()
        t_first = live.t_first if live.t_first is not None else now

        def done_bytes(text: str) -> bytes:  # on the loop, or on the detokenizing thread
            done = Done(
                id=live.client_id,
                finish_reason=completion.finish_reason,
                text=text,
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
            )
            self._log_done(done, (now - live.t_received) * 1000)
            return encode(done)

        if live.text_off_loop:
            self.text.close(
                request_id, then=lambda text: self._send_quietly(live.route, done_bytes(text))
            )
        elif not self._send(live.route, done_bytes(completion.text)):
            self._drop_client(live.route)

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
            self.pending.pop(key).prompt_ids.cancel()
        for (r, _), request_id in list(self.by_client.items()):
            if r == route:
                self.counters.num_disconnect_cancels += 1
                self._cancel_silently(request_id)

    def _cancel_silently(self, request_id: RequestId) -> None:
        live = self.live.pop(request_id)
        del self.by_client[(live.route, live.client_id)]
        self.engine.cancel(request_id)
        self.engine.take_completion(request_id)
        if live.text_off_loop:
            self.text.discard(request_id)

    def _abort_all(self, code: str, message: str) -> None:
        for (route, client_id), pending in list(self.pending.items()):
            pending.prompt_ids.cancel()
            self._send_error(route, code, message, client_id)
        self.pending.clear()
        for request_id, live in list(self.live.items()):
            self._cancel_silently(request_id)
            if live.text_off_loop:  # after the chunks still queued there
                self.counters.num_errors_total += 1
                data = error_bytes(code, message, live.client_id)
                self.text.then(functools.partial(self._send_quietly, live.route, data))
            else:
                self._send_error(live.route, code, message, live.client_id)

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
        """Engine and server counters (on the loop, between steps); `check` adds the
        pool's integrity check."""
        self._publish_snapshot(step_started=None, refresh=True)
        assert self.snapshot is not None
        stats = self._live_stats(self.snapshot)
        if check:
            try:
                self.engine.pool.check_integrity()
                stats["integrity"] = "ok"
            except AssertionError as e:
                stats["integrity"] = f"FAILED: {e}"
        return stats

    def _live_stats(self, snapshot: Snapshot) -> dict[str, object]:
        """The snapshot's stats with what is read live: connections, uptime, and how long
        the running step has taken so far (`step_running_s`, null between steps)."""
        now = time.monotonic()
        conns = self.conns
        started = snapshot.step_started
        return {
            **snapshot.stats,
            "num_connections": conns.num_open if conns is not None else 0,
            "num_connections_refused": conns.num_refused if conns is not None else 0,
            "uptime_s": round(now - self.counters.started, 3),
            "step_running_s": None if started is None else round(now - started, 3),
        }

    def _publish_events(self) -> None:
        events = self.engine.take_events()
        if not events or self.pub is None:
            return
        payload = encode_batch(events, ts=time.time(), layout=self.config.kv_events_layout)
        self.pub.send_multipart(batch_frames(self.event_seq, payload))
        self.event_seq += 1
        self.counters.num_events_published += len(events)
