"""Client commands: `reprise generate` and `reprise stats` (they talk to a running
daemon; `reprise serve` starts one, `reprise chat` is in chat.py). The connection they
share is connect.py's, what they print display.py's."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from ..ipc.client import DaemonUnavailable, RequestError
from .connect import connect, request_failed
from .display import done_json, print_choices, print_logprobs, stats_table, stream_to, turn_summary
from .options import (
    client_options,
    finite,
    in_a_folder,
    prompt_table_from,
    prompt_table_options,
    request_from,
    request_options,
    sampling_options,
)


def chat_request(prompt: str, chat: bool, system: str | None) -> str | list[dict[str, str]]:
    """PROMPT as a user message, after the --system message if one is given: `--system ""`
    sends an empty system message (as llama-cli and the OpenAI API take it), so a chat
    template does not put its default one in its place; None sends none."""
    if not chat:
        if system is not None:
            raise click.UsageError("--system needs the chat template; drop --raw")
        return prompt
    return [*system_message(system), {"role": "user", "content": prompt}]


def system_message(system: str | None) -> list[dict[str, str]]:
    """The messages a system message given as `system` opens a chat with: none for None,
    one (even an empty one) for a string."""
    return [] if system is None else [{"role": "system", "content": system}]


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
@click.option(
    "--system",
    default=None,
    help='System message (with --chat; --system "" sends an empty one, in place of the '
    "chat template's default).",
)
@sampling_options
@request_options
@prompt_table_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text."
)
@click.option(
    "--logits-out",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    callback=in_a_folder,
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


# -- stats -----------------------------------------------------------------------------------


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print the stats as one JSON object.")
@click.option("--all", "show_all", is_flag=True, help="Show every counter, not just the summary.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    callback=finite,
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
