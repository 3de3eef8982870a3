"""The serving loop's settings (`ServerConfig`), checked when built, and the checks of its
sockets that run before any model loads (`prepare_endpoints`)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Any

from ...ipc.kv_events import KVEventLayout, check_layout
from ...ipc.messages import ProtocolError, check_chat_options
from ...ipc.sockets import SOCKET_ENV, check_address, ipc_path, prepare_ipc_path, socket_target
from ..model.tokenizer import check_chat_template


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
    # vLLM's --chat-template: the template every chat is rendered with (its source), in
    # place of the model folder's; None: the folder's
    chat_template: str | None = None
    # vLLM's --default-chat-template-kwargs: template variables every chat gets, a
    # request's own chat_options kwargs winning
    default_chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_address(self.address)
        if self.chat_template is not None:
            check_chat_template(self.chat_template)  # a ValueError naming the error
        if self.default_chat_template_kwargs is not None:
            try:
                check_chat_options({"kwargs": self.default_chat_template_kwargs})
            except ProtocolError as e:
                raise ValueError(
                    "default_chat_template_kwargs: "
                    + e.message.removeprefix("chat_options.kwargs ").removeprefix("chat_options: ")
                ) from None
        if self.events_address is not None:
            check_address(self.events_address)
        if self.events_address == self.address:
            raise ValueError(
                f"KV events need an address of their own; {self.address} is the daemon's socket"
            )
        check_layout(self.kv_events_layout)
        numbers: tuple[str, ...] = ("max_queue", "max_tokens_cap", "max_message_bytes",
                                    "max_logits_bytes", "max_stop_strings", "max_stop_chars",
                                    "idle_poll_ms", "max_unread_bytes")  # fmt: skip
        if self.max_connections is not None:
            numbers += ("max_connections",)
        for name in numbers:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        drain = self.drain_timeout_s
        if not (isinstance(drain, int | float) and math.isfinite(drain) and drain >= 0):
            raise ValueError(
                f"drain_timeout_s must be a finite number of seconds >= 0; got {drain!r}"
            )


def socket_flag(address: str | None) -> str:
    """What set the daemon's own address, for an error to name: REPRISE_SOCKET when the
    address is its, else --socket."""
    if address is not None and os.environ.get(SOCKET_ENV) == address:
        return f"{SOCKET_ENV} (--socket)"
    return "--socket"


def prepare_endpoints(config: ServerConfig) -> None:
    """Check what binding will need before any model loads: each ipc:// socket's folder is
    ours and private, and no live daemon listens there; each tcp:// port is free (raises
    RuntimeError saying why, naming the flag, or REPRISE_SOCKET when the address is its)."""
    endpoints = ((config.address, socket_flag(config.address)), (config.events_address, "--events"))
    for address, flag in endpoints:
        path = ipc_path(address) if address else None
        if path is not None:
            prepare_ipc_path(path, flag)
        elif address is not None:
            family, target = socket_target(address)
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
                try:
                    probe.bind(target)
                except OSError as e:
                    raise RuntimeError(
                        f"cannot serve on {address}: {e.strerror} (choose another {flag})"
                    ) from None
