"""The HTTP front end's settings (`HttpConfig`), checked when built, before any model
loads: a non-loopback address without an API key, an unknown tool-call or reasoning
parser, a bad port or store size each raise ValueError naming it."""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass, field
from typing import Any

from .reasoning_parsers import PARSERS as REASONING_PARSERS
from .tool_parsers import PARSERS


@dataclass(slots=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "default"
    max_queue: int = 256  # choices in flight; more get 429 (the daemon's own limit)
    max_body_bytes: int = 1 << 20  # larger bodies get 413 (the daemon's max_message_bytes)
    max_tokens_default: int = 16  # a completion's max_tokens when it gives none (OpenAI's)
    # the daemon's max_tokens_cap: a chat's (or a response's) max_tokens when it gives none,
    # so the answer runs to its end, the context's or this cap (vLLM's: to the context)
    max_tokens_cap: int = 4096
    # tool_choice "auto": the model's tool calls read from its text (tool_parsers.PARSERS)
    tool_call_parser: str | None = None
    # chat answers' thinking apart from their content (reasoning_parsers.PARSERS)
    reasoning_parser: str | None = None
    # the Responses API's stored responses (responses_store.ResponseStore), MiB; 0: none
    responses_store_mb: int = 64
    # sampling defaults of requests that set none (generation_defaults.py: the model's
    # generation_config.json, as vLLM's --generation-config), SamplingParams' names
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # browser origins allowed to call the API (CORS; vLLM's --allowed-origins): none by
    # default, so no web page a user visits can reach a loopback server; "*" for any
    allowed_origins: tuple[str, ...] = ()
    # TLS (vLLM's --ssl-keyfile, --ssl-certfile): both or neither, loaded when checked
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None

    def __post_init__(self) -> None:
        check_bind(self.host, self.api_key)
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}; "
                f"got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(
                f"tool call parser must be one of {', '.join(PARSERS)}; "
                f"got {self.tool_call_parser!r}"
            )
        if isinstance(self.responses_store_mb, bool) or not (
            isinstance(self.responses_store_mb, int) and self.responses_store_mb >= 0
        ):
            raise ValueError(
                f"responses store must be an integer >= 0 (MiB); got {self.responses_store_mb!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"http port must be in [0, 65535]; got {self.port}")
        for origin in self.allowed_origins:
            if origin != "*" and not _is_origin(origin):
                raise ValueError(
                    f"allowed origin must be '*' or scheme://host[:port] (no path); got {origin!r}"
                )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
        if self.ssl_certfile is not None:
            check_tls(self.ssl_certfile, self.ssl_keyfile)

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"


def _is_origin(value: str) -> bool:
    """scheme://host[:port], as a browser's Origin header spells it."""
    scheme, sep, rest = value.partition("://")
    return bool(sep) and scheme in ("http", "https") and bool(rest) and "/" not in rest


def check_tls(certfile: str, keyfile: str | None) -> None:
    """Load the certificate chain and its key as uvicorn will (ValueError saying why not)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: {e}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse a non-loopback address without an API key (ValueError saying so)."""
    if not is_loopback(host) and not api_key:
        raise ValueError(f"--http {host}: serving beyond loopback needs an API key "
                         "(--api-key or REPRISE_API_KEY)")  # fmt: skip


def parse_host_port(value: str) -> tuple[str, int]:
    """HOST:PORT (or [v6]:PORT, or :PORT for loopback) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http must be HOST:PORT; got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)
