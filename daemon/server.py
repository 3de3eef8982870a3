"""The serving loop: one ZeroMQ ROUTER socket in front of one in-process Engine.

Each turn of the loop reads every pending message (without waiting while the
engine has work), runs one engine step, sends each request's new tokens to
the client that owns it, and publishes the step's KV events.

Guarantees:
- every message gets exactly one reply per request: an ErrorReply, or (for a
  generate) optional TokenChunks and then exactly one Done or ErrorReply;
- the loop never blocks on a client: sends are non-blocking with
  ROUTER_MANDATORY, and a client that vanished or stopped reading has its
  requests cancelled, so their blocks return to the pool;
- bad input never stops the daemon: any failure handling one message becomes an
  ErrorReply ("internal" for our own bugs) and the loop goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgpack
import zmq

from reprise.blockpool.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from reprise.daemon.engine import Engine
from reprise.daemon.params import Retention, SamplingParams, StepOutput
from reprise.daemon.sequence import RequestId
from reprise.daemon.service import Notifier, StopFlag
from reprise.ipc.codec import decode_request, encode, error_bytes, logits_to_wire
from reprise.ipc.messages import (
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
from reprise.ipc.sockets import check_address, ipc_path, prepare_ipc_path

log = logging.getLogger("reprise.server")
Route = tuple[bytes, ...]  # the ROUTER envelope frames that lead back to one client


@dataclass(slots=True)
class ServerConfig:
    address: str
    events_address: str | None = None
    max_queue: int = 256  # requests waiting or running; more get "busy"
    max_tokens_cap: int = 4096  # the largest max_tokens a request may ask for
    max_message_bytes: int = 1 << 20  # larger messages get "too_large"
    drain_timeout_s: float = 30.0  # on SIGTERM, how long running requests may take
    idle_poll_ms: int = 100
    send_hwm: int = 10_000  # queued replies per client before it counts as not reading
    model_name: str = ""

    def __post_init__(self) -> None:
        check_address(self.address)
        if self.events_address is not None:
            check_address(self.events_address)
        for name in ("max_queue", "max_tokens_cap", "max_message_bytes", "idle_poll_ms"):
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


@dataclass(slots=True)
class Counters:
    num_requests_total: int = 0
    num_errors_total: int = 0
    num_disconnect_cancels: int = 0
    num_events_published: int = 0
    started: float = field(default_factory=time.monotonic)


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
        self.counters = Counters()
        self.draining = False
        self.event_seq = 0
        self._ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.pub: zmq.Socket | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Capture the decode graphs, then run one tiny request through every stage, so the
        first client pays no start-up cost."""
        engine, start = self.engine, time.perf_counter()
        sizes = engine.capture_decode_graphs(self.config.max_queue)
        if sizes:
            log.info("decode graphs captured for batch sizes %s in %.1f s",
                     ",".join(map(str, sizes)), time.perf_counter() - start)  # fmt: skip
        elif engine.runner.decode is not None:
            log.warning("decode graphs off: %s", engine.runner.decode.failed)
        params = SamplingParams(max_tokens=2, temperature=0)
        request_id = engine.add_request([1, 2, 3], params, cache_salt="reprise-warm-up")
        while engine.has_work():
            engine.step()
        engine.take_completion(request_id)

    def bind(self) -> None:
        cfg = self.config
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # On close, the last replies (drain errors) still go out to connected clients.
        self.sock.setsockopt(zmq.LINGER, 5000)
        self.sock.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        # A hard ceiling well above the polite limit: past it ZeroMQ drops the peer
        # without reading the message; between the two the client gets "too_large".
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.max_message_bytes + 4096)
        path = ipc_path(cfg.address)
        if path is not None:
            prepare_ipc_path(path)
        self.sock.bind(cfg.address)
        if path is not None:
            path.chmod(0o600)
        if cfg.events_address:
            self.pub = self._ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 1000)
            events_path = ipc_path(cfg.events_address)
            if events_path is not None:
                prepare_ipc_path(events_path)
            self.pub.bind(cfg.events_address)
            if events_path is not None:
                events_path.chmod(0o600)

    def run(self) -> None:
        """Warm up, bind, tell systemd we are ready, serve until stopped, drain, close."""
        engine = self.engine
        pool = engine.pool
        host = pool.host_tier.num_blocks if pool.host_tier is not None else 0
        log.info("backend %s; KV pool of %d blocks of %d tokens, host tier of %d blocks; "
                 "context %d tokens", engine.runner.model.ops.name, pool.num_blocks,
                 pool.block_size, host, engine.max_model_len)  # fmt: skip
        self.warm_up()
        self.bind()
        self.notifier.notify(f"READY=1\nSTATUS=serving on {self.config.address}")
        log.info("serving on %s", self.config.address)
        try:
            self.serve()
        finally:
            self.close()

    def close(self) -> None:
        for sock in (self.sock, self.pub):
            if sock is not None:
                sock.close()
        self._ctx.term()
        log.info(
            "stopped after %d request(s), %d error repl(ies)",
            self.counters.num_requests_total,
            self.counters.num_errors_total,
        )
        path = ipc_path(self.config.address)
        if path is not None:
            path.unlink(missing_ok=True)

    def serve(self) -> None:
        assert self.sock is not None
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        deadline = float("inf")
        while True:
            if self.stop.is_set and not self.draining:
                self.draining = True
                deadline = time.monotonic() + self.config.drain_timeout_s
                self.notifier.notify("STOPPING=1")
                log.info("stopping: draining %d request(s)", len(self.live))
            if self.draining and (not self.live or time.monotonic() >= deadline):
                self._abort_all("shutting_down", "the daemon is shutting down")
                self._publish_events()
                return
            busy = self.engine.has_work()
            timeout = 0 if busy else self.config.idle_poll_ms
            if self.notifier.watchdog_interval_s is not None:
                timeout = min(timeout, int(self.notifier.watchdog_interval_s * 1000))
            if poller.poll(timeout):
                self._read_all()
            if self.engine.has_work():
                for output in self.engine.step():
                    self._on_output(output)
            self._publish_events()
            self.notifier.ping_watchdog()

    # -- incoming ----------------------------------------------------------------------------

    def _read_all(self, max_messages: int = 1000) -> None:
        assert self.sock is not None
        for _ in range(max_messages):  # bounded, so a flood cannot starve the engine
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue  # no route back; nothing to answer
            route, payload = tuple(frames[:-1]), frames[-1]
            try:
                self._handle(route, payload)
            except ProtocolError as e:
                self._send_error(route, e.code, e.message, e.request_id)
            except Exception as e:  # our bug: answer it, log it, keep serving
                log.exception("internal error handling a message")
                self._send_error(route, "internal", f"{type(e).__name__}: {e}")

    def _handle(self, route: Route, payload: bytes) -> None:
        if len(payload) > self.config.max_message_bytes:
            raise ProtocolError(
                "too_large",
                f"message has {len(payload)} bytes; the limit is {self.config.max_message_bytes}",
            )
        request = decode_request(payload)
        if isinstance(request, Generate):
            try:
                self._start(route, request)
            except ProtocolError as e:
                e.request_id = request.id
                raise
        elif isinstance(request, Cancel):
            request_id = self.by_client.get((route, request.id))
            if request_id is None:
                raise ProtocolError("not_found", f"no running request {request.id!r}", request.id)
            self.engine.cancel(request_id)
            self._finish(request_id)
        elif isinstance(request, StatsRequest):
            self._send(route, encode(StatsReply(stats=self.stats(check=request.check))))
        elif isinstance(request, Health):
            status = "draining" if self.draining else "ok"
            reply = HealthReply(
                status,
                self.config.model_name,
                self.engine.max_model_len,
                len(self.live),
                self.engine.config.vocab_size,
            )
            self._send(route, encode(reply))

    def _start(self, route: Route, request: Generate) -> None:
        if self.draining:
            raise ProtocolError(
                "shutting_down", "the daemon is shutting down; not accepting requests"
            )
        if len(self.live) >= self.config.max_queue:
            raise ProtocolError(
                "busy", f"the queue is full ({self.config.max_queue} requests); retry later"
            )
        if (route, request.id) in self.by_client:
            raise ProtocolError("duplicate_id", f"request {request.id!r} is already running")
        try:
            params = SamplingParams(**request.sampling, return_logits=request.return_logits)
        except (ValueError, TypeError) as e:
            raise ProtocolError("bad_request", str(e)) from None
        if params.max_tokens > self.config.max_tokens_cap:
            raise ProtocolError(
                "bad_request",
                f"max_tokens must be at most {self.config.max_tokens_cap}; got {params.max_tokens}",
            )
        prompt_ids = self._prompt_ids(request)
        retention = Retention(priority=request.priority) if request.priority is not None else None
        try:
            request_id = self.engine.add_request(
                prompt_ids,
                params,
                cache_salt=request.cache_salt,
                retention=retention,
                priority=request.queue_priority,
            )
        except ValueError as e:
            raise ProtocolError("bad_request", str(e)) from None
        self.counters.num_requests_total += 1
        self.live[request_id] = LiveRequest(route, request.id, request.stream, time.monotonic())
        self.by_client[(route, request.id)] = request_id

    def _prompt_ids(self, request: Generate) -> list[int]:
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

    # -- outgoing ----------------------------------------------------------------------------

    def _on_output(self, output: StepOutput) -> None:
        request_id = RequestId(output.request_id)
        live = self.live.get(request_id)
        if live is None:
            return  # cancelled earlier in this turn (its client vanished)
        if live.t_first is None:
            live.t_first = time.monotonic()
        if live.stream:
            chunk = TokenChunk(live.client_id, output.token_ids, output.text_delta)
            if not self._send(live.route, encode(chunk)):
                self._drop_client(live.route)
                return
        if output.finish_reason is not None:
            self._finish(request_id)

    def _finish(self, request_id: RequestId) -> None:
        """Send the Done of a request the engine finished or cancelled, and forget it."""
        live = self.live.pop(request_id)
        del self.by_client[(live.route, live.client_id)]
        completion = self.engine.take_completion(request_id)
        now = time.monotonic()
        t_first = live.t_first if live.t_first is not None else now
        done = Done(
            id=live.client_id,
            finish_reason=completion.finish_reason,
            text=completion.text,
            token_ids=completion.token_ids,
            prompt_tokens=len(completion.prompt_token_ids),
            cached_tokens=completion.cached_tokens,
            host_cached_tokens=completion.host_cached_tokens,
            ttft_ms=round((t_first - live.t_received) * 1000, 3),
            tokens_per_s=round(len(completion.token_ids) / max(now - live.t_received, 1e-9), 3),
            logits=logits_to_wire(completion.logits) if completion.logits is not None else None,
        )
        if not self._send(live.route, encode(done)):
            self._drop_client(live.route)

    def _drop_client(self, route: Route) -> None:
        """The client is gone or not reading: cancel its requests so their blocks return."""
        for (r, _), request_id in list(self.by_client.items()):
            if r == route:
                self.counters.num_disconnect_cancels += 1
                self._cancel_silently(request_id)

    def _cancel_silently(self, request_id: RequestId) -> None:
        live = self.live.pop(request_id)
        del self.by_client[(live.route, live.client_id)]
        self.engine.cancel(request_id)
        self.engine.take_completion(request_id)

    def _abort_all(self, code: str, message: str) -> None:
        for request_id, live in list(self.live.items()):
            self._cancel_silently(request_id)
            self._send_error(live.route, code, message, live.client_id)

    def _send(self, route: Route, data: bytes) -> bool:
        """Non-blocking; False when the client is gone or its queue is full."""
        assert self.sock is not None
        try:
            self.sock.send_multipart([*route, data], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH (gone) or EAGAIN (not reading)
            log.info("dropping a reply to client %s: %s", route[0].hex(), e)
            return False
        return True

    def _send_error(
        self, route: Route, code: str, message: str, request_id: str | None = None
    ) -> None:
        self.counters.num_errors_total += 1
        self._send(route, error_bytes(code, message, request_id))

    # -- stats and events --------------------------------------------------------------------

    def stats(self, *, check: bool = False) -> dict[str, object]:
        stats: dict[str, object] = dict(self.engine.stats())
        stats.update(
            num_requests=len(self.live),
            num_requests_total=self.counters.num_requests_total,
            num_errors_total=self.counters.num_errors_total,
            num_disconnect_cancels=self.counters.num_disconnect_cancels,
            num_events_published=self.counters.num_events_published,
            uptime_s=round(time.monotonic() - self.counters.started, 3),
        )
        if check:
            try:
                self.engine.pool.check_integrity()
                stats["integrity"] = "ok"
            except AssertionError as e:
                stats["integrity"] = f"FAILED: {e}"
        return stats

    def _publish_events(self) -> None:
        events = self.engine.take_events()
        if not events or self.pub is None:
            return
        self.event_seq += 1
        payload = msgpack.packb(
            [time.time(), [_event_to_wire(e) for e in events]], use_bin_type=True
        )
        self.pub.send_multipart([b"", self.event_seq.to_bytes(8, "big"), payload])
        self.counters.num_events_published += len(events)


def _event_to_wire(event: KVEvent) -> list[object]:
    """vLLM's KVEventBatch layout: each event a tagged array, fields in declaration order."""
    if isinstance(event, BlockStored):
        wire: list[object] = [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
        ]
        if event.lora_name is not None:
            wire.append(event.lora_name)
        return wire
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"]
