"""A client of the reprise daemon, for the CLI and for other programs.

    from reprise.ipc import Client
    with Client() as client:                       # REPRISE_SOCKET or the default socket
        done = client.generate("The capital of France is", max_tokens=8, temperature=0)
        for item in client.stream("Tell me a story", max_tokens=64):
            print(item.text, end="") if isinstance(item, TokenChunk) else print()

One DEALER socket per Client; a Client is not thread-safe (use one per thread).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import zmq

from .codec import decode_reply, encode
from .messages import (
    SAMPLING_FIELDS,
    Cancel,
    Done,
    ErrorReply,
    Generate,
    Health,
    HealthReply,
    StatsReply,
    StatsRequest,
    TokenChunk,
)
from .sockets import client_address, ipc_path, is_ipv6


class DaemonUnavailable(ConnectionError):
    """No daemon answered at the address."""


class RequestError(RuntimeError):
    """The daemon answered with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Client:
    def __init__(self, address: str | None = None, *, timeout_s: float = 300.0) -> None:
        """`timeout_s` bounds each wait for the daemon's next reply."""
        self.address = client_address(address)
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Our own routing id, random and never starting with a 0 byte (libzmq's own ids
        # do): the daemon's ROUTER then never makes up a predictable id for us.
        self._sock.setsockopt(zmq.ROUTING_ID, b"r" + secrets.token_bytes(15))
        self._sock.setsockopt(zmq.IPV6, int(is_ipv6(self.address)))
        self._sock.connect(self.address)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------------------

    def health(self, *, timeout_s: float | None = None) -> HealthReply:
        self._send(encode(Health()))
        reply = self._recv(None, timeout_s)
        assert isinstance(reply, HealthReply), reply
        return reply

    def stats(self, *, check: bool = False) -> dict[str, Any]:
        self._send(encode(StatsRequest(check=check)))
        reply = self._recv(None)
        assert isinstance(reply, StatsReply), reply
        return reply.stats

    def cancel(self, request_id: str) -> None:
        """Ask the daemon to stop a request; its Done (finish "cancelled") ends its stream."""
        self._send(encode(Cancel(id=request_id)))

    def generate(self, prompt: str | list[int] | list[dict[str, str]], **options: Any) -> Done:
        """Send one request and wait for its Done (no chunks). Raises RequestError."""
        request = self._request(prompt, stream=False, **options)
        self._send(encode(request))
        reply = self._recv(request.id)
        assert isinstance(reply, Done), reply
        return reply

    def stream(
        self, prompt: str | list[int] | list[dict[str, str]], **options: Any
    ) -> Iterator[TokenChunk | Done]:
        """Yield TokenChunks as tokens arrive, then the Done. Closing the iterator early
        cancels the request."""
        request = self._request(prompt, stream=True, **options)
        self._send(encode(request))
        finished = False  # the daemon ended the request: a Done or an error reply came
        try:
            while True:
                try:
                    reply = self._recv(request.id)
                except RequestError:
                    finished = True
                    raise
                if isinstance(reply, Done):
                    finished = True
                    yield reply
                    return
                assert isinstance(reply, TokenChunk), reply
                yield reply
        finally:
            if not finished:
                self.cancel(request.id)

    # -- internals ---------------------------------------------------------------------------

    def _request(
        self,
        prompt: str | list[int] | list[dict[str, str]],
        *,
        stream: bool,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        queue_priority: int = 0,
        return_logits: bool = False,
        **sampling: Any,
    ) -> Generate:
        unknown = set(sampling) - set(SAMPLING_FIELDS)
        if unknown:
            raise TypeError(
                f"unknown option(s) {sorted(unknown)}; sampling: {sorted(SAMPLING_FIELDS)}"
            )
        sampling = {k: v for k, v in sampling.items() if v is not None}
        kind = "prompt"
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            kind = "messages"
        elif isinstance(prompt, list):
            kind = "token_ids"
        return Generate(
            id=request_id or uuid.uuid4().hex,
            **{kind: prompt},
            sampling=sampling,
            cache_salt=cache_salt,
            priority=priority,
            queue_priority=queue_priority,
            stream=stream,
            return_logits=return_logits,
        )

    def _send(self, data: bytes) -> None:
        path = ipc_path(self.address)
        if path is not None and not path.exists():
            raise DaemonUnavailable(self._no_daemon(f"no socket file at {path}"))
        self._sock.send(data)

    def _recv(self, request_id: str | None, timeout_s: float | None = None) -> Any:
        """The next reply for `request_id` (None: the next reply without an id); replies
        left over from earlier requests are skipped."""
        timeout_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        while True:
            if not self._sock.poll(timeout_ms, zmq.POLLIN):
                raise DaemonUnavailable(
                    self._no_daemon(f"no answer within {timeout_ms / 1000:g} s")
                )
            reply = decode_reply(self._sock.recv())
            reply_id = getattr(reply, "id", None)
            if isinstance(reply, ErrorReply) and reply_id in (None, request_id):
                raise RequestError(reply.code, reply.message)
            if reply_id == request_id:
                return reply

    def _no_daemon(self, why: str) -> str:
        return (
            f"no reprise daemon answered at {self.address} ({why}). "
            "Start one with `reprise serve`, or point --socket / REPRISE_SOCKET at a running one."
        )
