"""Client commands: `reprise generate` and `reprise stats` (they talk to a running
daemon; `reprise serve` starts one, `reprise chat` is in chat.py), and the connection
they share, which tells "no daemon" from "a daemon too busy to answer"."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import click

from ..ipc.client import Client, DaemonUnavailable, RequestError
from ..ipc.messages import Done, TokenChunk
from ..ipc.sockets import client_address, ipc_path
from .options import (
    client_options,
    prompt_table_from,
    prompt_table_options,
    request_from,
    request_options,
    sampling_options,
)

QUICK_S = 1.0  # a daemon that has not answered by then gets a "waiting" notice


# -- connecting ------------------------------------------------------------------------------


def no_daemon(address: str, why: str) -> click.ClickException:
    return click.ClickException(
        f"no reprise daemon at {address} ({why}); start one with `reprise serve`, "
        "or point --socket / REPRISE_SOCKET at a running one"
    )


def busy(address: str, timeout: float) -> click.ClickException:
    return click.ClickException(
        f"the daemon at {address} is busy: it accepted the connection but sent no reply "
        f"within {timeout:g} s; try again, or wait longer with --timeout"
    )


def probe(address: str) -> str | None:
    """Why nothing listens at `address`, or None when something accepts a connection
    there (a daemon, maybe too busy to answer yet)."""
    path = ipc_path(address)
    target: str | tuple[str, int]
    if path is not None:
        if not path.exists():
            return f"no socket file at {path}"
        family, target = socket.AF_UNIX, str(path)
    else:  # tcp://HOST:PORT, checked by the --socket option
        host, port = address[len("tcp://") :].rsplit(":", 1)
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        target = (host, int(port))
    probe_sock = socket.socket(family, socket.SOCK_STREAM)
    probe_sock.settimeout(5.0)
    try:
        probe_sock.connect(target)
    except ConnectionRefusedError:
        if path is not None:
            return f"{path} exists but nothing listens on it"
        return "connection refused"
    except PermissionError:
        return f"permission denied on {path or address}"
    except FileNotFoundError:
        return f"no socket file at {path}"
    except OSError as e:
        return f"cannot connect: {e.strerror or e}"
    finally:
        probe_sock.close()
    return None


@contextmanager
def waiting_notice(text: str) -> Iterator[None]:
    """A spinner on stderr while we wait (nothing when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


def connect(address: str | None, timeout: float) -> Client:
    """A client whose daemon has answered a health check. No daemon listening and a
    daemon that does not answer within `timeout` are different one-line errors."""
    try:
        address = client_address(address)
    except RuntimeError as e:  # the default socket's folder is not safely ours
        raise click.ClickException(str(e)) from None
    why = probe(address)
    if why is not None:
        raise no_daemon(address, why)
    client = Client(address, timeout_s=timeout)
    try:
        try:
            client.health(timeout_s=min(QUICK_S, timeout))
        except DaemonUnavailable:
            if timeout <= QUICK_S:
                raise
            with waiting_notice(f"the daemon at {address} is busy; waiting up to {timeout:g} s"):
                client.health(timeout_s=timeout - QUICK_S)
    except DaemonUnavailable as e:
        client.close()
        raise request_failed(client, e) from e
    except RequestError as e:
        client.close()
        raise click.ClickException(f"the daemon at {address} refused a health check: {e}") from e
    return client


def request_failed(client: Client, error: Exception) -> click.ClickException:
    """One line for a request that failed after we connected."""
    if isinstance(error, RequestError):
        return click.ClickException(f"the daemon refused the request: {error}")
    why = probe(client.address)
    return no_daemon(client.address, why) if why else busy(client.address, client.timeout_s)


# C0 and C1 control characters but tab and newline: a model's text must not drive the
# terminal (escape sequences, bells, charset switches)
_CONTROLS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if c not in (9, 10)}


def terminal_safe(text: str) -> str:
    return text.translate(_CONTROLS)


def stream_to(client: Client, request: Any, options: dict[str, Any], out: Any) -> Done:
    """Write the answer's text to `out` as it arrives (control characters shown as
    U+FFFD on a terminal); return the Done. Leaving early (Ctrl-C) cancels the request
    on the daemon."""
    clean = terminal_safe if out.isatty() else str
    with closing(client.stream(request, **options)) as items:
        for item in items:
            if isinstance(item, TokenChunk):
                out.write(clean(item.text))
                out.flush()
            else:
                assert isinstance(item, Done), item
                return item
    raise AssertionError("the stream ended without a Done")


def chat_request(prompt: str, chat: bool, system: str | None) -> str | list[dict[str, str]]:
    if not chat:
        if system is not None:
            raise click.UsageError("--system needs the chat template; drop --raw")
        return prompt
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]


# -- generate --------------------------------------------------------------------------------

# flags the daemon checks further (its errors name them): a refusal is a usage error
USAGE_FIELDS = ("prompt_table", "extra_ids", "prompt_logprobs")


def generate_request(
    prompt: str | None, token_ids: list[int] | None, chat: bool, system: str | None
) -> str | list[int] | list[dict[str, str]]:
    """PROMPT (wrapped in the chat template with --chat), or --token-ids sent as is."""
    if (prompt is None) == (token_ids is None):
        raise click.UsageError("give exactly one of PROMPT or --token-ids")
    if token_ids is None:
        assert prompt is not None
        return chat_request(prompt, chat, system)
    if system is not None:
        raise click.UsageError("--system needs a text PROMPT; --token-ids are sent as is")
    return token_ids


@click.command("generate")
@click.argument("prompt", required=False)
@click.option(
    "--chat/--raw",
    default=True,
    show_default=True,
    help="Wrap PROMPT as a user message in the chat template, or send it as is.",
)
@click.option("--system", default=None, help="System message (with --chat).")
@sampling_options
@request_options
@prompt_table_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text."
)
@click.option(
    "--logits-out",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="Save float32 logits [num_generated, vocab] as .npy.",
)
@click.option(
    "--logprobs",
    type=click.IntRange(0, 20),
    default=None,
    help="Return each token's log-probability and this many most likely alternatives "
    "(printed under the answer, or in --json).",
)
@click.option(
    "-n",
    "num_choices",
    type=click.IntRange(1, 16),  # SamplingParams' MAX_CHOICES
    default=1,
    show_default=True,
    help="Completions of the prompt (they share its prefill; seeded, choice i uses "
    "--seed + i). More than one: printed one after another when done, or a list in --json.",
)
@click.option(
    "--prompt-logprobs",
    type=click.IntRange(min=0),
    default=None,
    help="Return each prompt token's log-probability given the tokens before it, and this "
    "many most likely tokens there (at most the daemon's --max-prompt-logprobs); served "
    "from the cache for cached prompt blocks.",
)
@client_options
def generate_cmd(
    prompt: str | None,
    chat: bool,
    system: str | None,
    as_json: bool,
    logits_out: Path | None,
    logprobs: int | None,
    num_choices: int,
    prompt_logprobs: int | None,
    socket: str | None,
    timeout: float,
    **kw: Any,
) -> None:
    """Send PROMPT (or --token-ids) to the daemon and stream the answer."""
    table_options = prompt_table_from(kw)
    request = generate_request(prompt, kw["token_ids"], chat, system)
    options = {**request_from(kw), **table_options}
    options["return_logits"] = logits_out is not None
    if logprobs is not None:
        options["logprobs"] = logprobs
    if prompt_logprobs is not None:
        options["prompt_logprobs"] = prompt_logprobs
    if num_choices > 1:
        options["n"] = num_choices
        if logits_out is not None:
            raise click.UsageError("--logits-out saves one answer's logits; drop -n")
    with connect(socket, timeout) as client:
        try:
            if as_json or num_choices > 1:
                dones = client.generate(request, **options)
            else:
                dones = stream_to(client, request, options, sys.stdout)
                click.echo()
        except (RequestError, DaemonUnavailable) as e:
            if isinstance(e, RequestError) and any(f in e.message for f in USAGE_FIELDS):
                raise click.UsageError(e.message) from e  # the daemon's check of our flags
            raise request_failed(client, e) from e
    if isinstance(dones, list):
        print_choices(dones, as_json)
        return
    done = dones
    if logits_out is not None and done.logits is not None:
        import numpy as np

        from ..ipc.codec import logits_from_wire

        try:
            np.save(logits_out, logits_from_wire(done.logits))
        except OSError as e:
            raise click.ClickException(f"cannot write --logits-out {logits_out}: {e}") from e
    if as_json:
        click.echo(json.dumps(done_json(done)))
    else:
        print_logprobs(done)
        click.echo(turn_summary(done), err=True)


def print_choices(dones: list[Done], as_json: bool) -> None:
    """The n answers of `generate -n`: a JSON object with a list of them, or each one's
    text (on stdout) under a header line and over its summary (on stderr)."""
    if as_json:
        click.echo(json.dumps({"choices": [{"index": d.index, **done_json(d)} for d in dones]}))
        return
    clean = terminal_safe if sys.stdout.isatty() else str
    for done in dones:
        click.echo(f"[choice {done.index + 1} of {len(dones)}]", err=True)
        click.echo(clean(done.text))
        print_logprobs(done)
        click.echo(turn_summary(done), err=True)


def print_logprobs(done: Done) -> None:
    if done.prompt_logprobs is not None:
        click.echo("prompt:", err=True)
        for lp in done.prompt_logprobs:
            click.echo(logprob_line(lp), err=True)
        if done.logprobs:
            click.echo("answer:", err=True)
    for lp in done.logprobs or ():
        click.echo(logprob_line(lp), err=True)


def logprob_line(lp: dict[str, Any]) -> str:
    """One token's logprob and its most likely alternatives (a prompt's first token has
    no logprob: nothing comes before it)."""
    top = "  ".join(f"{i}:{t!r} {v:.3f}" for i, t, v in lp["top"])
    token = f"{lp['id']}:{lp['token']!r}"
    logprob = "-" if lp["logprob"] is None else f"{lp['logprob']:.3f}"
    return f"{token:>20} {logprob:>8}   {top}"


def turn_summary(done: Done) -> str:
    """The line under an answer: how much of the prompt the cache served, and speed."""
    dot = separator()
    parts = [
        f"reused {done.cached_tokens} of {done.prompt_tokens} prompt tokens",
        f"{len(done.token_ids)} tokens",
        f"{done.tokens_per_s:.0f} tok/s",
        f"first token {done.ttft_ms:.0f} ms",
    ]
    if done.finish_reason == "length":
        parts.append("cut at --max-tokens")
    elif done.finish_reason == "cancelled":
        parts.append("cancelled")
    return dot.join(parts)


def separator() -> str:
    """A middle dot between the parts of a status line, where stderr can print one."""
    try:
        " · ".encode(sys.stderr.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return ", "
    return " · "


def done_json(done: Done) -> dict[str, Any]:
    return {
        "text": done.text,
        "token_ids": done.token_ids,
        "prompt_tokens": done.prompt_tokens,
        "cached_tokens": done.cached_tokens,
        "host_cached_tokens": done.host_cached_tokens,
        "disk_cached_tokens": done.disk_cached_tokens,
        "ttft_ms": done.ttft_ms,
        "tokens_per_s": done.tokens_per_s,
        "finish_reason": done.finish_reason,
        **({"logprobs": done.logprobs} if done.logprobs is not None else {}),
        **({"prompt_logprobs": done.prompt_logprobs} if done.prompt_logprobs is not None else {}),
    }


# -- stats -----------------------------------------------------------------------------------

STATS_ROWS = [
    ("blocks (used / max)", lambda s: f"{s.get('used_blocks')} / {s.get('max_blocks')}"),
    ("free blocks", lambda s: s.get("free_blocks")),
    ("hit rate", lambda s: f"{100 * float(s.get('hit_rate', 0)):.1f} %"),
    ("prefill tokens computed", lambda s: s.get("prefill_tokens_computed")),
    ("prefill tokens skipped", lambda s: s.get("prefill_tokens_skipped")),
    ("exact repeats (no forward)", lambda s: s.get("exact_repeats")),
    (
        "requests (running / total)",
        lambda s: f"{s.get('num_requests')} / {s.get('num_requests_total')}",
    ),
    ("errors", lambda s: s.get("num_errors_total")),
    ("uptime", lambda s: f"{float(s.get('uptime_s', 0)):.0f} s"),
]


def stats_table(stats: dict[str, Any], show_all: bool = False) -> Any:
    """A rich table of the daemon's stats: the summary rows, or every counter."""
    from rich.table import Table

    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("counter", style="bold")
    table.add_column("value", justify="right")
    rows = list(stats.items()) if show_all else [(n, f(stats)) for n, f in STATS_ROWS]
    for name, value in rows:
        table.add_row(str(name), str(value))
    return table


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print the stats as one JSON object.")
@click.option("--all", "show_all", is_flag=True, help="Show every counter, not just the summary.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS (at least 0.1) until Ctrl-C.",
)
@client_options
def stats_cmd(
    as_json: bool, show_all: bool, watch: float | None, socket: str | None, timeout: float
) -> None:
    """Show the daemon's KV cache and request counters."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    with connect(socket, timeout) as client:

        def fetch() -> dict[str, Any]:
            try:
                return client.stats()
            except (RequestError, DaemonUnavailable) as e:
                raise request_failed(client, e) from e

        if not watch:
            stats = fetch()
            if as_json:
                click.echo(json.dumps(stats))
            else:
                console.print(stats_table(stats, show_all))
            return
        if as_json:  # one JSON object a line, for a script to follow
            try:
                while True:
                    click.echo(json.dumps(fetch()))
                    time.sleep(watch)
            except KeyboardInterrupt:
                return
        try:
            with Live(stats_table(fetch(), show_all), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(watch)
                    live.update(stats_table(fetch(), show_all), refresh=True)
        except KeyboardInterrupt:
            return
