"""`reprise`: prepare and inspect models, run prompts, serve the daemon and talk to it.

Commands parse their options, call into `reprise.daemon`, and print.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import click

from .bench_cmd import bench_cmd
from .chat import chat_cmd
from .client_cmds import chat_request, generate_cmd, stats_cmd
from .display import terminal_safe
from .model_cmds import hidden_size, model, model_option
from .options import engine_settings, sampling_from, sampling_options
from .progress import complete_with_progress, tqdm_progress
from .serve import serve_cmd


class Reprise(click.Group):
    """The top-level group: every failure is one line (exit 1; usage errors exit 2),
    unless --debug or REPRISE_DEBUG=1 asks for the traceback."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """--debug may also come after the command (`reprise stats --debug`)."""
        end = args.index("--") if "--" in args else len(args)
        if "--debug" in args[1:end]:
            args = ["--debug", *[a for a in args[:end] if a != "--debug"], *args[end:]]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        debug = bool(ctx.params.get("debug"))
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.UsageError):
            raise
        except click.ClickException as e:
            cause = e.__cause__ or e.__context__
            if debug and cause is not None:
                traceback.print_exception(cause)
            raise
        except (KeyboardInterrupt, BrokenPipeError):  # click ends these quietly
            raise
        except Exception as e:
            if debug:
                raise
            text = " ".join(str(e).split()) or "no message"
            raise click.ClickException(
                f"{type(e).__name__}: {text} (--debug shows the traceback)"
            ) from e


@click.group(cls=Reprise, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="reprise")
@click.option(
    "--debug",
    is_flag=True,
    envvar="REPRISE_DEBUG",
    help="Show the traceback of a failure (env REPRISE_DEBUG=1).",
)
def main(debug: bool) -> None:
    """reprise: a Llama inference engine with bit-exact KV-block reuse."""


@main.command("run")
@click.argument("prompt")
@model_option
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
@click.option(
    "--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True
)
@click.option(
    "--speculative-tokens",
    type=int,
    default=0,
    show_default=True,
    help="Draft tokens a decode step checks (prompt lookup, as serve's); the answer is the same.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text.")
def run_cmd(
    prompt: str,
    model_dir: Path | None,
    chat: bool,
    system: str | None,
    backend: str,
    speculative_tokens: int,
    as_json: bool,
    **kw: Any,
) -> None:
    """Load a model in this process and answer PROMPT once (no daemon needed)."""
    import time

    from ..daemon import Engine, SamplingParams

    request = chat_request(prompt, chat, system)
    try:
        params = SamplingParams(**sampling_from(kw))
        settings = engine_settings(backend=backend, speculative_tokens=speculative_tokens)
        with tqdm_progress("loading model", unit="layer") as progress:
            engine = Engine.from_pretrained(model_dir, settings, progress=progress)
        start = time.perf_counter()
        tokenizer = engine.tokenizer
        if isinstance(request, list):
            text = tokenizer.apply_chat_template(request, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt_ids = tokenizer.encode(request)
        with tqdm_progress("prefill", unit="tok") as progress:
            completion = complete_with_progress(engine, prompt_ids, params, progress)
        elapsed = time.perf_counter() - start
    except ValueError as e:
        raise click.ClickException(" ".join(str(e).split())) from e
    if completion.error is not None:  # no token could come next: as the daemon, an error
        raise click.ClickException(completion.error)
    generated = len(completion.token_ids)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "prompt_tokens": len(completion.prompt_token_ids),
                    "cached_tokens": completion.cached_tokens,
                    "finish_reason": completion.finish_reason,
                    "seconds": round(elapsed, 3),
                }
            )
        )
        return
    click.echo(terminal_safe(completion.text) if sys.stdout.isatty() else completion.text)
    finish = ", cut at --max-tokens" if completion.finish_reason == "length" else ""
    click.echo(
        f"[{len(completion.prompt_token_ids)} prompt tokens, {generated} generated, "
        f"{elapsed:.2f} s, {generated / elapsed if elapsed > 0 else 0:.0f} tok/s{finish}]",
        err=True,
    )


@main.command("embed")
@click.argument("texts", nargs=-1)
@model_option
@click.option(
    "--file",
    "text_file",
    type=click.File("r", encoding="utf-8"),
    default=None,
    help="Read one text a line from this file ('-': standard input), after TEXTS.",
)
@click.option("--raw", is_flag=True, help="The model's row as it is, not scaled to unit length.")
@click.option(
    "--dimensions",
    type=click.IntRange(min=1),
    default=None,
    help="Keep the first N values (then normalize), as /v1/embeddings' dimensions.",
)
@click.option(
    "--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True
)
def embed_cmd(
    texts: tuple[str, ...],
    model_dir: Path | None,
    text_file: Any,
    raw: bool,
    dimensions: int | None,
    backend: str,
) -> None:
    """Print each text's embedding as one JSON line, {"index", "embedding"}: the final
    hidden state at its last token (last-token pooling), normalized to unit length as
    /v1/embeddings gives it. Texts run together, their prefixes reused as in a daemon."""
    from ..daemon import Engine
    from ..daemon.serve.openai_embeddings import EmbeddingFormat, shaped

    try:
        inputs = list(texts) + ([line.rstrip("\n") for line in text_file] if text_file else [])
    except UnicodeDecodeError as e:
        raise click.BadParameter(
            f"{text_file.name} is not UTF-8 text: {e}", param_hint="'--file'"
        ) from None
    if not inputs:
        raise click.UsageError("give TEXTS or --file")
    if any(not text for text in inputs):
        raise click.UsageError("a text is empty: each needs at least one token")
    if dimensions is not None:  # refused before the load where the size can be read so
        _check_dimensions(dimensions, hidden_size(model_dir))
    try:
        settings = engine_settings(backend=backend)
        with tqdm_progress("loading model", unit="layer") as progress:
            engine = Engine.from_pretrained(model_dir, settings, progress=progress)
        if dimensions is not None:
            _check_dimensions(dimensions, engine.config.hidden_size)
        rows = engine.embed([engine.tokenizer.encode(text) for text in inputs])
    except ValueError as e:
        raise click.ClickException(" ".join(str(e).split())) from e
    fmt = EmbeddingFormat(base64=False, dimensions=dimensions, normalize=not raw)
    for index, row in enumerate(rows):
        click.echo(json.dumps({"index": index, "embedding": shaped(row, fmt).tolist()}))


def _check_dimensions(dimensions: int, hidden: int | None) -> None:
    """embed's --dimensions keeps at most the model's whole row (None: not known yet)."""
    if hidden is not None and dimensions > hidden:
        raise click.UsageError(
            f"--dimensions must be at most {hidden}, the model's hidden size (allowed: 1 to "
            f"{hidden}); got {dimensions}"
        )


main.add_command(model)
main.add_command(serve_cmd)
main.add_command(generate_cmd)
main.add_command(chat_cmd)
main.add_command(stats_cmd)
main.add_command(bench_cmd)


if __name__ == "__main__":
    sys.exit(main())
