"""Client commands: `reprise generate`, `reprise chat`, `reprise stats` (they talk to a
running daemon; `reprise serve` starts one)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from reprise.ipc.client import Client, DaemonUnavailable, RequestError
from reprise.ipc.messages import Done, TokenChunk

socket_option = click.option(
    "--socket",
    envvar="REPRISE_SOCKET",
    default=None,
    help="Daemon address, ipc://PATH or tcp://127.0.0.1:PORT (env REPRISE_SOCKET).",
)
timeout_option = click.option(
    "--timeout",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds to wait for each reply.",
)


def sampling_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            click.option(
                "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True
            ),
            click.option(
                "--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."
            ),
            click.option("--top-p", type=float, default=1.0, show_default=True),
            click.option("--top-k", type=click.IntRange(min=1), default=None),
            click.option("--seed", type=click.IntRange(min=0, max=2**64 - 1), default=None),
            click.option(
                "--salt", default=None, help="Cache salt: requests with other salts share no KV."
            ),
            click.option(
                "--priority",
                type=click.IntRange(0, 100),
                default=None,
                help="Retention priority of the prompt's blocks.",
            ),
            click.option(
                "--queue-priority",
                type=int,
                default=0,
                show_default=True,
                help="Scheduling priority: lower is admitted first.",
            ),
        ]
    ):
        f = option(f)
    return f


def _connect(socket: str | None, timeout: float) -> Client:
    """A client whose daemon has answered a health check, or a ClickException saying
    where we looked and how to start a daemon."""
    client = Client(socket, timeout_s=timeout)
    try:
        client.health(timeout_s=min(timeout, 5.0))
    except DaemonUnavailable as e:
        client.close()
        raise click.ClickException(str(e)) from None
    return client


def _options(kw: dict[str, Any]) -> dict[str, Any]:
    return {
        "max_tokens": kw["max_tokens"],
        "temperature": kw["temperature"],
        "top_p": kw["top_p"],
        "top_k": kw["top_k"],
        "seed": kw["seed"],
        "cache_salt": kw["salt"],
        "priority": kw["priority"],
        "queue_priority": kw["queue_priority"],
    }


@click.command("generate")
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message in the chat template.")
@click.option("--system", default=None, help="System message for --chat.")
@sampling_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text."
)
@click.option(
    "--logits-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Save float32 logits [num_generated, vocab] as .npy.",
)
@socket_option
@timeout_option
def generate_cmd(
    prompt: str,
    chat: bool,
    system: str | None,
    as_json: bool,
    logits_out: Path | None,
    socket: str | None,
    timeout: float,
    **kw: Any,
) -> None:
    """Send PROMPT to the daemon and stream the answer."""
    request: str | list[dict[str, str]] = prompt
    if chat:
        request = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
    options = _options(kw)
    options["return_logits"] = logits_out is not None
    with _connect(socket, timeout) as client:
        try:
            if as_json:
                done = client.generate(request, **options)
            else:
                done = _stream_to_stdout(client, request, options)
        except (RequestError, DaemonUnavailable) as e:
            raise click.ClickException(str(e)) from None
    if logits_out is not None and done.logits is not None:
        import numpy as np

        from reprise.ipc.codec import logits_from_wire

        np.save(logits_out, logits_from_wire(done.logits))
    if as_json:
        click.echo(json.dumps(_done_json(done)))
    else:
        click.echo(
            f"[{done.prompt_tokens} prompt tokens ({done.cached_tokens} cached), "
            f"{len(done.token_ids)} generated, finish: {done.finish_reason}, "
            f"ttft {done.ttft_ms:.0f} ms, {done.tokens_per_s:.1f} tok/s]",
            err=True,
        )


def _stream_to_stdout(client: Client, request: Any, options: dict[str, Any]) -> Done:
    for item in client.stream(request, **options):
        if isinstance(item, TokenChunk):
            click.echo(item.text, nl=False)
        else:
            click.echo()
            return item
    raise AssertionError("stream ended without a Done")


def _done_json(done: Done) -> dict[str, Any]:
    return {
        "text": done.text,
        "token_ids": done.token_ids,
        "prompt_tokens": done.prompt_tokens,
        "cached_tokens": done.cached_tokens,
        "host_cached_tokens": done.host_cached_tokens,
        "ttft_ms": done.ttft_ms,
        "tokens_per_s": done.tokens_per_s,
        "finish_reason": done.finish_reason,
    }


@click.command("chat")
@click.option("--system", default=None, help="System message.")
@sampling_options
@socket_option
@timeout_option
def chat_cmd(system: str | None, socket: str | None, timeout: float, **kw: Any) -> None:
    """Talk with the model; each turn resends the conversation, whose prefix is cached.
    An empty line or Ctrl-D ends it."""
    messages = [{"role": "system", "content": system}] if system else []
    options = _options(kw)
    with _connect(socket, timeout) as client:
        while True:
            try:
                line = click.prompt("you", prompt_suffix="> ", default="", show_default=False)
            except (EOFError, click.Abort):
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            try:
                done = _stream_to_stdout(client, messages, options)
            except (RequestError, DaemonUnavailable) as e:
                raise click.ClickException(str(e)) from None
            click.echo(
                f"[{done.cached_tokens}/{done.prompt_tokens} prompt tokens cached]", err=True
            )
            messages.append({"role": "assistant", "content": done.text})


STATS_ROWS = [
    ("blocks (used / max)", lambda s: f"{s.get('used_blocks')} / {s.get('max_blocks')}"),
    ("free blocks", lambda s: s.get("free_blocks")),
    ("hit rate", lambda s: f"{100 * float(s.get('hit_rate', 0)):.1f} %"),
    ("prefill tokens computed", lambda s: s.get("prefill_tokens_computed")),
    ("prefill tokens skipped", lambda s: s.get("prefill_tokens_skipped")),
    (
        "requests (running / total)",
        lambda s: f"{s.get('num_requests')} / {s.get('num_requests_total')}",
    ),
    ("errors", lambda s: s.get("num_errors_total")),
    ("uptime", lambda s: f"{float(s.get('uptime_s', 0)):.0f} s"),
]


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print the stats as one JSON object.")
@click.option("--all", "show_all", is_flag=True, help="Show every counter, not just the summary.")
@click.option(
    "--watch",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until Ctrl-C.",
)
@socket_option
@timeout_option
def stats_cmd(
    as_json: bool, show_all: bool, watch: float | None, socket: str | None, timeout: float
) -> None:
    """Show the daemon's KV cache and request counters."""
    with _connect(socket, timeout) as client:
        while True:
            try:
                stats = client.stats()
            except DaemonUnavailable as e:
                raise click.ClickException(str(e)) from None
            if as_json:
                click.echo(json.dumps(stats))
            else:
                if watch:
                    click.clear()
                rows = (
                    [(k, v) for k, v in stats.items()]
                    if show_all
                    else [(n, f(stats)) for n, f in STATS_ROWS]
                )
                for name, value in rows:
                    click.echo(f"{name:<28} {value}")
            if not watch:
                return
            try:
                time.sleep(watch)
            except KeyboardInterrupt:
                return
