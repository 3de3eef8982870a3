"""An asyncio client of the daemon's socket, for the HTTP front end.

It speaks what `ipc.Client` speaks (4-byte big-endian length + one msgpack map per
frame, `ipc.framing` and `ipc.codec`), but on the HTTP thread's own event loop: the
daemon's replies are read by that loop and go straight to the request that awaits
them, with no worker thread and no cross-thread hand-off per token.

Each request borrows a connection of its own from a pool (the daemon answers a
request on the connection that sent it, and an id-less reply such as Health's then
belongs to that request alone). A stream left early sends Cancel; its last replies
are skipped by the connection's next user, as `ipc.Client` skips stale replies.

Guarantees: errors are those of `ipc.Client` (`RequestError` for the daemon's error
replies, `DaemonUnavailable` when it cannot be reached, answers nothing within
`timeout_s`, or breaks the framing); a connection that failed is closed, never
reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from ...ipc.client import (
    MAX_REPLY_BYTES,
    DaemonUnavailable,
    RequestError,
    generate_message,
    num_choices,
    tokenize_message,
)
from ...ipc.codec import decode_reply, encode
from ...ipc.framing import FrameDecoder, FramingError, frame
from ...ipc.messages import (
    Cancel,
    Detokenize,
    DetokenizeReply,
    Done,
    ErrorReply,
    Health,
    HealthReply,
    TokenChunk,
    Tokenize,
    TokenizeReply,
)
from ...ipc.sockets import socket_target


class _Connection(asyncio.Protocol):
    """One socket to the daemon; frames are decoded as they arrive and wait in `_frames`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._decoder = FrameDecoder(MAX_REPLY_BYTES)
        self._frames: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.failure: str | None = None  # why the connection is unusable; None while fine

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._frames.extend(self._decoder.feed(data))  # type: ignore[arg-type]
        except FramingError as e:  # not a reprise daemon
            self._fail(str(e))
            return
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"the connection failed: {exc}" if exc else "it closed the connection")

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def send(self, data: bytes) -> None:
        if self.failure is not None or self.transport is None:
            raise DaemonUnavailable(f"sending failed: {self.failure}")
        self.transport.write(frame(data))

    async def next_reply(self, request_id: str | None, timeout_s: float) -> Any:
        """The next reply for `request_id` (None: the next reply without an id); replies
        left from an earlier request on this connection are skipped. Raises TimeoutError
        when none comes within `timeout_s`."""
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(timeout_s):
                return await self._next_reply(request_id)
        # Python 3.10 has no asyncio.timeout; its wait_for raises asyncio.TimeoutError,
        # which is not yet the builtin TimeoutError the callers catch
        try:
            return await asyncio.wait_for(self._next_reply(request_id), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply within {timeout_s} s") from None

    async def _next_reply(self, request_id: str | None) -> Any:
        while True:
            while not self._frames:
                if self.failure is not None:
                    raise DaemonUnavailable(self.failure)
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            reply = decode_reply(self._frames.popleft())
            reply_id = getattr(reply, "id", None)
            if isinstance(reply, ErrorReply) and reply_id in (None, request_id):
                raise RequestError(reply.code, reply.message)
            if reply_id == request_id:
                return reply

    def close(self) -> None:
        self._fail("closed")


class AsyncClient:
    """Pooled connections to the daemon at `address`, used from one event loop."""

    def __init__(self, address: str, timeout_s: float = 300.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._idle: list[_Connection] = []

    async def _take(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.failure is None:
                return conn
        loop = asyncio.get_running_loop()
        _, target = socket_target(self.address)
        try:
            if isinstance(target, str):  # ipc://: the socket file's path
                _, conn = await loop.create_unix_connection(_Connection, target)
            else:
                host, port = target
                _, conn = await loop.create_connection(_Connection, host, port)
        except OSError as e:
            raise DaemonUnavailable(f"no reprise daemon answered at {self.address} "
                                    f"(cannot connect: {e})") from None  # fmt: skip
        return conn

    def _give(self, conn: _Connection, healthy: bool) -> None:
        if healthy and conn.failure is None:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def health(self, *, timeout_s: float | None = None) -> HealthReply:
        conn, healthy = await self._take(), False
        try:
            conn.send(encode(Health()))
            reply = await conn.next_reply(None, timeout_s or self.timeout_s)
            healthy = True
        finally:
            self._give(conn, healthy)
        assert isinstance(reply, HealthReply), reply
        return reply

    async def tokenize(
        self,
        prompt: str | list[dict[str, str]],
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_options: dict[str, Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """As `Client.tokenize`. Raises RequestError."""
        reply = await self._ask(tokenize_message(prompt, tools, chat_options, add_special_tokens))
        assert isinstance(reply, TokenizeReply), reply
        return reply.token_ids

    async def render(
        self,
        messages: list[dict[str, str]],
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_options: dict[str, Any] | None = None,
    ) -> str:
        """The chat prompt `messages` make, as the daemon renders it with its chat template
        (the text of the ids `tokenize` gives them). Raises RequestError."""
        reply = await self._ask(tokenize_message(messages, tools, chat_options, None))
        assert isinstance(reply, TokenizeReply) and reply.text is not None, reply
        return reply.text

    async def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """As `Client.detokenize`. Raises RequestError."""
        request = Detokenize(uuid.uuid4().hex, token_ids, skip_special_tokens)
        reply = await self._ask(request)
        assert isinstance(reply, DetokenizeReply), reply
        return reply.text

    async def _ask(self, request: Tokenize | Detokenize) -> Any:
        """The one reply to `request`, on a pooled connection."""
        conn, healthy = await self._take(), False
        try:
            conn.send(encode(request))
            reply = await conn.next_reply(request.id, self.timeout_s)
            healthy = True
            return reply
        except RequestError:
            healthy = True  # an error reply: the connection is fine
            raise
        finally:
            self._give(conn, healthy)

    async def stream(
        self, prompt: str | list[int] | list[dict[str, str]], **options: Any
    ) -> AsyncGenerator[TokenChunk | Done, None]:
        """TokenChunks as tokens arrive, then the Done (with `n` > 1, each choice's chunks
        and Done, told apart by `index`, until the n-th Done); closing the iterator
        early (or cancelling its task) cancels the request."""
        request = generate_message(prompt, stream=True, **options)
        conn = await self._take()
        finished, healthy = False, True  # finished: the Dones or an error reply ended it
        num_open = num_choices(request)
        try:
            conn.send(encode(request))
            while True:
                try:
                    reply = await conn.next_reply(request.id, self.timeout_s)
                except RequestError:
                    finished = True
                    raise
                except (TimeoutError, DaemonUnavailable):
                    healthy = False  # the daemon stalled or went: not worth reusing
                    raise
                if isinstance(reply, Done):
                    num_open -= 1
                    finished = num_open == 0
                    yield reply
                    if finished:
                        return
                    continue
                assert isinstance(reply, TokenChunk), reply
                yield reply
        finally:
            if not finished and conn.failure is None:
                with contextlib.suppress(DaemonUnavailable):
                    conn.send(encode(Cancel(id=request.id)))
            self._give(conn, healthy)
