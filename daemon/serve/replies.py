"""The daemon's replies: how they go out (`Outbox`) and how a request's last one is built.

Guarantees: a send never blocks (the connections' I/O thread queues it), and a refused
send (the client gone or not reading) is not retried: the connection's closing Arrival
makes the loop drop the client and cancel its requests. A `Done` carries the
completion as the client sees it: the text the detokenizing thread made, cut after the
token a stop string ended on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from ...ipc.codec import (
    encode,
    error_bytes,
    logits_to_wire,
    logprob_columns_to_wire,
    logprobs_to_wire,
)
from ...ipc.messages import Done, ProtocolError
from ..engine.params import Completion
from ..engine.sampling.logprobs import TokenLogprobs
from .connections import Connections, ConnId
from .detokenize import TextEnd
from .status import Counters

log = logging.getLogger("reprise.server")
Route = ConnId  # the connection a request came on, the only one its replies go to
TokenText = Callable[[int], str]


class Outbox:
    """Sends to one connection. Set `conns` before the first send (`Server.bind`)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.conns: Connections | None = None

    def send(self, route: Route, data: bytes) -> bool:
        """From the loop; False (and logged) when the client is gone or not reading."""
        assert self.conns is not None
        if not self.conns.send(route, data):
            log.info("dropping a reply to connection %d: gone, or not reading", route)
            return False
        return True

    def send_quietly(self, route: Route, data: bytes) -> None:
        """From the detokenizing thread (or the drain's, at a hard stop)."""
        assert self.conns is not None
        self.conns.send(route, data)

    def send_error(
        self, route: Route, code: str, message: str, request_id: str | None = None
    ) -> None:
        self.counters.num_errors_total += 1
        self.send(route, error_bytes(code, message, request_id))

    def answering(
        self, route: Route, what: str, fn: Callable[[], None], request_id: str | None = None
    ) -> None:
        """Run `fn` (on the loop), answering a failure: a ProtocolError with its error
        reply, anything else (our bug) with an "internal" one, logged. The loop goes on."""
        try:
            fn()
        except ProtocolError as e:
            rid = e.request_id if e.request_id is not None else request_id
            self.send_error(route, e.code, e.message, rid)
        except Exception as e:
            log.exception("internal error %s", what)
            self.send_error(route, "internal", f"{type(e).__name__}: {e}", request_id)


def cancelled_done(client_id: str, index: int) -> bytes:
    """The Done of a choice cancelled before its prompt reached the engine."""
    return encode(Done(id=client_id, finish_reason="cancelled", text="", token_ids=[],
                       prompt_tokens=0, cached_tokens=0, host_cached_tokens=0, ttft_ms=0.0,
                       tokens_per_s=0.0, index=index))  # fmt: skip


def done_reply(
    whole: Completion,
    end: TextEnd,
    *,
    client_id: str,
    index: int,
    t_received: float,
    t_first: float,
    t_first_step: float | None,
    now: float,
    token_text: TokenText,
    with_prompt_ids: bool = False,
) -> Done:
    """A finished request's Done; times are `time.monotonic()` readings: its arrival,
    its first token, the start of the step that computed that token, and now. With
    `with_prompt_ids`, it carries the prompt's ids (Generate.return_token_ids)."""
    completion = cut(whole, end)
    return Done(
        id=client_id,
        finish_reason=completion.finish_reason,
        text=completion.text,
        token_ids=completion.token_ids,
        prompt_tokens=len(completion.prompt_token_ids),
        cached_tokens=completion.cached_tokens,
        host_cached_tokens=completion.host_cached_tokens,
        disk_cached_tokens=completion.disk_cached_tokens,
        ttft_ms=round((t_first - t_received) * 1000, 3),
        tokens_per_s=round(len(completion.token_ids) / max(now - t_received, 1e-9), 3),
        logits=logits_to_wire(completion.logits) if completion.logits is not None else None,
        logprobs=logprobs_wire(completion.logprobs, token_text),
        prompt_logprobs=prompt_logprobs_wire(completion, token_text),
        queue_ms=round(((t_first_step or now) - t_received) * 1000, 3),
        index=index,
        stop_reason=completion.stop_reason,
        prompt_token_ids=list(completion.prompt_token_ids) if with_prompt_ids else None,
        embedding=None if completion.embedding is None else logits_to_wire(completion.embedding),
    )


def log_done(done: Done, total_ms: float) -> None:
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


def logprobs_wire(logprobs: list[TokenLogprobs] | None, token_text: TokenText) -> list[dict] | None:
    return None if logprobs is None else logprobs_to_wire(logprobs, token_text)


def prompt_logprobs_wire(completion: Completion, token_text: TokenText) -> list[dict] | None:
    """Prompt entries on the wire, as `logprobs`; the first token's (no context) has a
    null logprob and no top tokens, but its id and text, which an echo needs."""
    entries = completion.prompt_logprobs
    if entries is None:
        return None
    texts: dict[int, str] = {}  # a long prompt's top tokens repeat: decode each once

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = token_text(token_id)
        return texts[token_id]

    first_id = completion.prompt_token_ids[0]
    first = {"id": first_id, "token": text(first_id), "logprob": None, "rank": None, "top": []}
    rows = entries.rows()  # from the arrays: no entry object made
    rest = logprob_columns_to_wire(
        completion.prompt_token_ids[1:],
        rows.logprobs[1:].tolist(),
        rows.ranks[1:].tolist(),
        map(zip, rows.top_ids[1:].tolist(), rows.top_logprobs[1:].tolist()),
        text,
    )
    return [first, *rest]


def cut(completion: Completion, end: TextEnd) -> Completion:
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
        stop_reason=end.stop_string,
        logits=None if completion.logits is None else completion.logits[:n],
        logprobs=None if completion.logprobs is None else completion.logprobs[:n],
    )
