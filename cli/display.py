"""What the client commands print: an answer's text as it streams (control characters
made harmless), its logprobs and summary line, its JSON, and the stats table."""

from __future__ import annotations

import json
import sys
from contextlib import closing
from typing import Any

import click

from ..ipc.client import Client
from ..ipc.messages import Done, TokenChunk

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
        "draft tokens (kept / checked)",
        lambda s: f"{s.get('spec_accepted_tokens', 0)} / {s.get('spec_draft_tokens', 0)}",
    ),
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
