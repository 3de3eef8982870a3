"""A client of the reprise daemon, for the CLI and for other programs.

    from reprise.ipc import Client
    with Client() as client:                       # REPRISE_SOCKET or the default socket
        done = client.generate("The capital of France is", max_tokens=8, temperature=0)
        for item in client.stream("Tell me a story", max_tokens=64):
            print(item.text, end="") if isinstance(item, TokenChunk) else print()

One connection per Client, opened at its first request (and again after the
daemon closed it); a Client is not thread-safe (use one per thread). The daemon
knows a client by its connection: replies come back only on the connection
that sent the request.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Generator
from typing import Any

import numpy as np

from .codec import decode_reply, encode, prompt_table_to_wire
from .framing import FrameDecoder, FramingError, frame
from .messages import (
    SAMPLING_FIELDS,
    Cancel,
    Detokenize,
    DetokenizeReply,
    Done,
    ErrorReply,
    Generate,
    Health,
    HealthReply,
    StatsReply,
    StatsRequest,
    TokenChunk,
    Tokenize,
    TokenizeReply,
    logit_bias_to_wire,
)
from .sockets import client_address, ipc_path, socket_target

MAX_REPLY_BYTES = (1 << 32) - 1  # the daemon is trusted; its own limits bound replies


class DaemonUnavailable(ConnectionError):
    """No daemon answered at the address."""


class RequestError(RuntimeError):
    """The daemon answered with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def generate_message(
    prompt: str | list[int] | list[dict[str, str]],
    *,
    stream: bool,
    request_id: str | None = None,
    cache_salt: str | None = None,
    priority: int | None = None,
    queue_priority: int = 0,
    return_logits: bool = False,
    prompt_table: np.ndarray | None = None,
    extra_ids: list[int] | None = None,
    tools: list[dict[str, Any]] | None = None,
    chat_options: dict[str, Any] | None = None,
    return_token_ids: bool = False,
    fit_max_tokens: bool = False,
    add_special_tokens: bool | None = None,
    **sampling: Any,
) -> Generate:
    """The Generate message of `Client.generate`/`stream`'s arguments (a text prompt, token
    ids or chat messages; a prompt table and extra ids with token ids; tools and chat
    options (Generate.chat_options) for the chat template with messages; sampling options
    by name, None meaning "not given")."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; sampling: {sorted(SAMPLING_FIELDS)}")
    sampling = {k: v for k, v in sampling.items() if v is not None}
    bias = sampling.get("logit_bias")
    if isinstance(bias, dict):  # {token id: bias}, as SamplingParams takes it
        if bias:
            sampling["logit_bias"] = logit_bias_to_wire(bias)
        else:
            del sampling["logit_bias"]
    structured = sampling.get("structured")
    # a StructuredOutput, as SamplingParams takes it
    if structured is not None and hasattr(structured, "to_wire"):
        sampling["structured"] = structured.to_wire()
    kind = "prompt"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        kind = "messages"
    elif isinstance(prompt, list):
        kind = "token_ids"
    prompt_field: dict[str, Any] = {kind: prompt}  # the field is chosen at run time
    return Generate(
        id=request_id or uuid.uuid4().hex,
        **prompt_field,
        sampling=sampling,
        cache_salt=cache_salt,
        priority=priority,
        queue_priority=queue_priority,
        stream=stream,
        return_logits=return_logits,
        prompt_table=None if prompt_table is None else prompt_table_to_wire(prompt_table),
        extra_ids=extra_ids,
        tools=tools,
        chat_options=chat_options,
        return_token_ids=return_token_ids,
        fit_max_tokens=fit_max_tokens,
        add_special_tokens=add_special_tokens,
    )


def tokenize_message(
    prompt: str | list[dict[str, str]],
    tools: list[dict[str, Any]] | None = None,
    chat_options: dict[str, Any] | None = None,
    add_special_tokens: bool | None = None,
) -> Tokenize:
    """The Tokenize message of a text prompt or chat messages (and their tools, chat
    options and add_special_tokens)."""
    kind = "messages" if isinstance(prompt, list) else "prompt"
    prompt_field: dict[str, Any] = {kind: prompt}  # the field is chosen at run time
    return Tokenize(uuid.uuid4().hex, **prompt_field, tools=tools, chat_options=chat_options,
                    add_special_tokens=add_special_tokens)  # fmt: skip


def num_choices(request: Generate) -> int:
    """How many Dones end `request` (its `sampling.n`)."""
    return int(request.sampling.get("n", 1))


class Client:
    def __init__(self, address: str | None = None, *, timeout_s: float = 300.0) -> None:
        """`timeout_s` bounds each wait for the daemon's next reply."""
        self.address = client_address(address)
        self.timeout_s = timeout_s
        self._target = socket_target(self.address)
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(MAX_REPLY_BYTES)
        self._replies: list[bytes] = []  # framed replies read but not yet returned

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

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

    def tokenize(
        self,
        prompt: str | list[dict[str, str]],
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_options: dict[str, Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """The token ids a generate of this prompt (text, or chat messages, the template
        applied, with `tools` and `chat_options`) would have. Raises RequestError."""
        request = tokenize_message(prompt, tools, chat_options, add_special_tokens)
        self._send(encode(request))
        reply = self._recv(request.id)
        assert isinstance(reply, TokenizeReply), reply
        return reply.token_ids

    def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The text of these vocabulary token ids. Raises RequestError."""
        request = Detokenize(uuid.uuid4().hex, list(token_ids), skip_special_tokens)
        self._send(encode(request))
        reply = self._recv(request.id)
        assert isinstance(reply, DetokenizeReply), reply
        return reply.text

    def cancel(self, request_id: str) -> None:
        """Ask the daemon to stop a request; its Done (finish "cancelled") ends its stream."""
        self._send(encode(Cancel(id=request_id)))

    def generate(
        self, prompt: str | list[int] | list[dict[str, str]], **options: Any
    ) -> Done | list[Done]:
        """Send one request and wait for its Done (no chunks); with `n` > 1, the n
        choices' Dones, in index order. Raises RequestError."""
        request = generate_message(prompt, stream=False, **options)
        self._send(encode(request))
        dones: list[Done] = []
        while len(dones) < num_choices(request):
            reply = self._recv(request.id)
            assert isinstance(reply, Done), reply
            dones.append(reply)
        dones.sort(key=lambda done: done.index)
        return dones if num_choices(request) > 1 else dones[0]

    def stream(
        self, prompt: str | list[int] | list[dict[str, str]], **options: Any
    ) -> Generator[TokenChunk | Done, None, None]:
        """Yield TokenChunks as tokens arrive, then the Done (with `n` > 1, each choice's
        chunks and Done, told apart by `index`, until the n-th Done). Closing the
        iterator early cancels the request."""
        request = generate_message(prompt, stream=True, **options)
        self._send(encode(request))
        finished = False  # the daemon ended the request: the Dones or an error reply came
        num_open = num_choices(request)
        try:
            while True:
                try:
                    reply = self._recv(request.id)
                except RequestError:
                    finished = True
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
            if not finished and self._sock is not None:  # a closed connection cancelled it
                with contextlib.suppress(DaemonUnavailable):
                    self.cancel(request.id)

    # -- internals ---------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        if self._sock is None:
            self._connect()
        assert self._sock is not None
        try:
            self._sock.settimeout(self.timeout_s)
            self._sock.sendall(frame(data))
        except OSError as e:
            self.close()
            raise DaemonUnavailable(self._no_daemon(f"sending failed: {e}")) from None

    def _connect(self) -> None:
        path = ipc_path(self.address)
        if path is not None and not path.exists():
            raise DaemonUnavailable(self._no_daemon(f"no socket file at {path}"))
        family, target = self._target
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(target)
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(self._no_daemon(f"cannot connect: {e}")) from None
        self._sock = sock
        self._decoder = FrameDecoder(MAX_REPLY_BYTES)
        self._replies.clear()

    def _recv(self, request_id: str | None, timeout_s: float | None = None) -> Any:
        """The next reply for `request_id` (None: the next reply without an id); replies
        left over from earlier requests are skipped."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            reply = decode_reply(self._next_frame(deadline, wait_s))
            reply_id = getattr(reply, "id", None)
            if isinstance(reply, ErrorReply) and reply_id in (None, request_id):
                raise RequestError(reply.code, reply.message)
            if reply_id == request_id:
                return reply

    def _next_frame(self, deadline: float, wait_s: float) -> bytes:
        while not self._replies:
            if self._sock is None:
                raise DaemonUnavailable(self._no_daemon("not connected"))
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                self._sock.settimeout(remaining)
                data = self._sock.recv(1 << 20)
            except TimeoutError:
                raise DaemonUnavailable(self._no_daemon(f"no answer within {wait_s:g} s")) from None
            except OSError as e:
                data, why = b"", f"the connection failed: {e}"
            else:
                why = "it closed the connection"
            if not data:
                self.close()
                raise DaemonUnavailable(self._no_daemon(why))
            try:
                self._replies.extend(self._decoder.feed(data))  # type: ignore[arg-type]
            except FramingError as e:  # not a reprise daemon
                self.close()
                raise DaemonUnavailable(self._no_daemon(str(e))) from None
        return self._replies.pop(0)

    def _no_daemon(self, why: str) -> str:
        return (
            f"no reprise daemon answered at {self.address} ({why}). "
            "Start one with `reprise serve`, or point --socket / REPRISE_SOCKET at a running one."
        )
