"""The daemon's listening socket and its client connections, served by one I/O thread.

Who a client is: each accepted connection gets a `ConnId` from a counter the daemon
keeps (never reused, never read from the wire), and a reply goes only to the socket
its id names. A client cannot claim another's id, so it can neither read another's
replies nor make the daemon confuse two clients (issue 19, F1/F2: ZeroMQ ROUTER let
the client choose its routing id, and one id crashed libzmq).

What a connection may cost, each bound checked before the bytes are kept:
- a frame's length is read before its payload (`FrameDecoder`): over
  `max_frame_bytes` it is dropped as it arrives and reported as `Oversize`; over
  `max_skip_bytes` (or not our framing at all) the connection gets one error frame
  and is closed;
- frames handed to the serving loop and not yet taken: past `max_inbox_bytes` the
  connection is not read until the loop catches up;
- replies not yet written: past `max_unread_bytes` the client counts as not reading,
  and is disconnected (its requests are then cancelled by the loop);
- connections: past `max_connections`, a new one gets one error frame and is closed
  at once, so descriptors never run out; if accept() itself finds none left (EMFILE),
  accepting pauses for a moment instead of failing (libzmq's ipc listener aborts).

The serving loop calls `wait` (messages and closes, in arrival order per connection),
`send` and `close`. Sockets are touched only on the I/O thread, except `send`'s first
non-blocking write when nothing is queued before it.

Intake: every frame (and every oversize notice) is first given to `intake`, on the I/O
thread, which decodes and checks it. What it returns goes to the loop, unless it is an
`Answer`: that reply is queued at once and the frame never reaches the loop, so bad
messages, health, and stats during a step are answered even while the loop is inside a
long engine step. Such a reply may overtake replies to messages sent before it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NewType

from ...ipc.codec import error_bytes
from ...ipc.framing import FrameDecoder, FramingError, Oversize, frame
from ...ipc.sockets import socket_target

log = logging.getLogger("reprise.server")
ConnId = NewType("ConnId", int)

READ_CHUNK = 1 << 16
ACCEPT_PAUSE_S = 0.1  # after EMFILE: accept again this much later
ARRIVAL_OVERHEAD = 64  # bytes an arrival counts for beyond its payload


@dataclass(frozen=True, slots=True)
class Answer:
    """What `intake` returns for a frame it answers itself: the reply's bytes."""

    data: bytes


Intake = Callable[[bytes | Oversize], object]  # a frame -> an Answer, or what the loop gets


@dataclass(frozen=True, slots=True)
class Arrival:
    """What came from a connection: what `intake` made of a frame, or None once the
    connection has closed (for good)."""

    conn: ConnId
    payload: object | None
    num_bytes: int = 0  # the frame's size, counted against the connection's inbox


@dataclass(slots=True)
class _Conn:
    id: ConnId
    sock: socket.socket
    decoder: FrameDecoder
    outbox: deque[memoryview] = field(default_factory=deque)
    outbox_bytes: int = 0
    inbox_bytes: int = 0  # frames given to the loop that it has not taken yet
    paused: bool = False  # not read until the loop takes its frames
    hang_up: bool = False  # close at the I/O thread's next turn, dropping the outbox
    events: int = 0  # what the selector watches now


@dataclass(frozen=True, slots=True)
class Limits:
    max_connections: int
    max_frame_bytes: int
    max_skip_bytes: int
    max_inbox_bytes: int
    max_unread_bytes: int


class Connections:
    def __init__(self, address: str, limits: Limits, intake: Intake | None = None) -> None:
        self.address = address
        self.limits = limits
        self.intake: Intake = intake or (lambda frame: frame)
        self.num_accepted = 0
        self.num_refused = 0
        self._conns: dict[ConnId, _Conn] = {}
        self._next_id = 1
        self._lock = threading.Lock()  # guards _conns, each _Conn's queues, _dirty
        self._dirty: set[ConnId] = set()  # connections whose interest or fate changed
        # NOTE: a Queue, not a SimpleQueue: on CPython 3.11 a signal that interrupts
        # SimpleQueue.get(timeout) near its deadline can leave the call blocked for good,
        # with the signal's Python handler never run (its C loop retries the lock with the
        # remaining time gone negative, which means forever), so the loop's timed wait here
        # made a SIGTERM hang the daemon (seen in CI, 2026-11-28; tests/test_server_signals.py).
        self._arrivals: queue.Queue[Arrival] = queue.Queue()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._listener: socket.socket | None = None
        self._accept_again_at: float | None = None  # accepting paused until then
        self._stop_at: float | None = None  # stopping: flush until then, then close all
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None

    # -- the serving loop's side -------------------------------------------------------------

    def bind(self) -> None:
        family, target = socket_target(self.address)
        listener = socket.socket(family, socket.SOCK_STREAM)
        if family != socket.AF_UNIX:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        listener.bind(target)
        listener.listen(socket.SOMAXCONN)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="connections", daemon=True)
        self._thread.start()

    @property
    def num_open(self) -> int:
        return len(self._conns)

    def wait(self, timeout_s: float, max_arrivals: int = 1000) -> list[Arrival]:
        """What arrived, waiting up to `timeout_s` for the first (bounded, so a flood
        cannot starve the engine)."""
        if self.failed is not None:
            raise RuntimeError(f"the connection thread failed: {self.failed!r}")
        out: list[Arrival] = []
        try:
            if timeout_s > 0:
                out.append(self._arrivals.get(timeout=timeout_s))
            while len(out) < max_arrivals:
                out.append(self._arrivals.get_nowait())
        except queue.Empty:
            pass
        wake = False
        with self._lock:
            for arrival in out:
                conn = self._conns.get(arrival.conn)
                if conn is None or arrival.payload is None:
                    continue
                conn.inbox_bytes -= arrival.num_bytes + ARRIVAL_OVERHEAD
                if conn.paused and conn.inbox_bytes <= self.limits.max_inbox_bytes // 2:
                    conn.paused = False
                    self._dirty.add(conn.id)
                    wake = True
        if wake:
            self._wake()
        return out

    def send(self, conn_id: ConnId, payload: bytes) -> bool:
        """Queue one message; False when the connection is gone, or has more unread
        replies than max_unread_bytes (it is then hung up)."""
        data = memoryview(frame(payload))
        with self._lock:
            conn = self._conns.get(conn_id)
            if conn is None or conn.hang_up:
                return False
            if not conn.outbox:  # the usual case: written at once, no thread hop
                try:
                    data = data[conn.sock.send(data) :]
                except BlockingIOError:
                    pass
                except OSError:
                    self._hang_up_locked(conn)
                    return False
                if not data:
                    return True
            elif conn.outbox_bytes > self.limits.max_unread_bytes:
                self._hang_up_locked(conn)
                return False
            conn.outbox.append(data)
            conn.outbox_bytes += len(data)
            self._dirty.add(conn_id)
        self._wake()
        return True

    def close(self, conn_id: ConnId) -> None:
        """Hang up now (replies not yet written are dropped); an Arrival(conn, None)
        follows."""
        with self._lock:
            conn = self._conns.get(conn_id)
            if conn is not None:
                self._hang_up_locked(conn)
        self._wake()

    def stop(self, linger_s: float) -> None:
        """Stop accepting, write what is queued for up to `linger_s`, close everything."""
        if self._thread is not None:
            self._stop_at = time.monotonic() + linger_s
            self._wake()
            self._thread.join(timeout=linger_s + 5)
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._selector.close()

    def _hang_up_locked(self, conn: _Conn) -> None:
        conn.hang_up = True
        self._dirty.add(conn.id)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # already full of wake-ups
            self._wake_w.send(b"\0")

    # -- the I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._finished():
                for key, mask in self._selector.select(self._select_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ and conn.id in self._conns:
                            self._read(conn)
                self._tend()
        except BaseException as e:  # our bug: the loop learns it from wait()
            log.exception("the connection thread failed")
            self.failed = e
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)

    def _select_timeout(self) -> float | None:
        if self._stop_at is not None:
            return 0.05
        if self._accept_again_at is not None:
            return max(0.0, self._accept_again_at - time.monotonic())
        return None

    def _finished(self) -> bool:
        if self._stop_at is None:
            return False
        if self._listener is not None and self._listener.fileno() >= 0:
            self._unwatch_listener()
            self._listener.close()
        with self._lock:
            pending = any(c.outbox and not c.hang_up for c in self._conns.values())
        return not pending or time.monotonic() >= self._stop_at

    def _unwatch_listener(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(KeyError):  # paused after EMFILE: not watched now
            self._selector.unregister(self._listener)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):  # bounded: reads and writes get their turn during a flood
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("cannot accept a connection (%s); pausing accepts", e.strerror)
                    self._unwatch_listener()
                    self._accept_again_at = time.monotonic() + ACCEPT_PAUSE_S
                    return
                continue  # ECONNABORTED and the like: that peer is gone already
            if len(self._conns) >= self.limits.max_connections:
                self.num_refused += 1
                _send_error_now(sock, "busy", f"the daemon has {len(self._conns)} connections "
                                f"open (max_connections); try again later")  # fmt: skip
                sock.close()
                continue
            sock.setblocking(False)
            limits = self.limits
            conn = _Conn(ConnId(self._next_id), sock,
                         FrameDecoder(limits.max_frame_bytes, limits.max_skip_bytes))  # fmt: skip
            self._next_id += 1
            self.num_accepted += 1
            with self._lock:
                self._conns[conn.id] = conn
            self._watch(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        try:
            frames = conn.decoder.feed(data)
        except FramingError as e:
            log.info("connection %d sent what is not a reprise frame (%s); closing it", conn.id, e)
            with self._lock:  # not in the middle of a reply: the error frame stays whole
                if not conn.outbox:
                    _send_error_now(conn.sock, "too_large", f"{e} (max_message_bytes); closing "
                                    f"the connection (expected 4-byte length-prefixed msgpack "
                                    f"frames)")  # fmt: skip
            self._drop(conn)
            return
        arrivals = []
        for item in frames:
            try:
                payload = self.intake(item)
            except Exception as e:  # our bug: answer it, log it, keep serving
                log.exception("internal error reading a message")
                payload = Answer(error_bytes("internal", f"{type(e).__name__}: {e}"))
            if isinstance(payload, Answer):
                self.send(conn.id, payload.data)
            else:
                num_bytes = len(item) if isinstance(item, bytes) else 0
                arrivals.append(Arrival(conn.id, payload, num_bytes))
        if not arrivals:
            return
        with self._lock:
            conn.inbox_bytes += sum(a.num_bytes + ARRIVAL_OVERHEAD for a in arrivals)
            if conn.inbox_bytes > self.limits.max_inbox_bytes and not conn.paused:
                conn.paused = True
                self._dirty.add(conn.id)
        for arrival in arrivals:
            self._arrivals.put(arrival)

    def _flush(self, conn: _Conn) -> None:
        with self._lock:
            while conn.outbox and not conn.hang_up:
                data = conn.outbox[0]
                try:
                    sent = conn.sock.send(data)
                except BlockingIOError:
                    break
                except OSError:
                    self._hang_up_locked(conn)
                    break
                conn.outbox_bytes -= sent
                if sent < len(data):
                    conn.outbox[0] = data[sent:]
                    break
                conn.outbox.popleft()
            self._dirty.add(conn.id)

    def _tend(self) -> None:
        """Apply what changed since the last turn: hang-ups, pauses, new output."""
        if self._accept_again_at is not None and time.monotonic() >= self._accept_again_at:
            self._accept_again_at = None
            if self._listener is not None and self._stop_at is None:
                self._selector.register(self._listener, selectors.EVENT_READ)
        with self._lock:
            dirty = [self._conns[i] for i in self._dirty if i in self._conns]
            self._dirty.clear()
        for conn in dirty:
            if conn.hang_up:
                self._drop(conn)
            else:
                if conn.outbox and not conn.events & selectors.EVENT_WRITE:
                    self._flush(conn)  # often all of it, with no wait for writability
                self._watch(conn)

    def _watch(self, conn: _Conn) -> None:
        events = (0 if conn.paused else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if conn.outbox else 0
        )
        if events == conn.events:
            return
        if conn.events == 0:
            self._selector.register(conn.sock, events, conn)
        elif events == 0:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _drop(self, conn: _Conn) -> None:
        """Close for good and tell the loop (once)."""
        with self._lock:
            if self._conns.pop(conn.id, None) is None:
                return
            conn.outbox.clear()
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0
        conn.sock.close()
        self._arrivals.put(Arrival(conn.id, None))


def _send_error_now(sock: socket.socket, code: str, message: str) -> None:
    """One best-effort error frame, before a close (never waits for the peer)."""
    with contextlib.suppress(OSError):
        sock.send(frame(error_bytes(code, message)), socket.MSG_DONTWAIT)
