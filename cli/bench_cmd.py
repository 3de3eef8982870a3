"""`reprise bench`: run benchmark scenarios in process or against a daemon; print a
table, write JSON and a PNG plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from .model_cmds import check_model
from .options import ENGINE_OPTIONS, engine_options, engine_settings
from .progress import tqdm_progress


def _ints(value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers; got {value!r}") from None
    if not numbers or min(numbers) < 0:
        raise click.BadParameter(f"expected non-negative integers; got {value!r}")
    return numbers


@click.command("bench")
@click.option(
    "--scenario",
    "scenario_names",
    multiple=True,
    default=("all",),
    show_default=True,
    help="repeat, prefix, shared, chat, sweep, hosttier, or all (repeatable).",
)
@click.option(
    "--socket", default=None, help="Measure the daemon here instead of an in-process engine."
)
@engine_options  # in process: every EngineConfig setting, its flag, help and default
@click.option("--prompt-tokens", type=click.IntRange(min=2), default=1024, show_default=True)
@click.option("--prefix-lengths", default="0,256,512,768,1024", show_default=True)
@click.option("--suffix-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--users", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--system-tokens", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--turns", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--batch-sizes", default="1,2,4,8,16,32", show_default=True)
@click.option("--decode-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-results.json"),
              show_default=True)  # fmt: skip
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("bench-results.png"), show_default=True)  # fmt: skip
def bench_cmd(scenario_names: tuple[str, ...], socket: str | None, **options: Any) -> None:
    """Measure prefix reuse and throughput: each scenario runs with reuse on and off
    side by side (off: every request in a cache namespace of its own)."""
    from ..bench import report
    from ..bench.scenarios import Sizes
    from ..bench.suite import SCENARIOS, run_suite

    names = list(SCENARIOS) if "all" in scenario_names else list(dict.fromkeys(scenario_names))
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise click.BadParameter(
            f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)} or all",
            param_hint="--scenario",
        )
    settings = engine_settings(  # checked before any model loads; unset: the field's default
        **{
            field: options[name]
            for name, field in ENGINE_OPTIONS.items()
            if options[name] is not None
        }
    )
    check_model(settings.model)
    sizes = Sizes(
        prompt_tokens=options["prompt_tokens"],
        prefix_lengths=_ints(options["prefix_lengths"]),
        suffix_tokens=options["suffix_tokens"],
        users=options["users"],
        system_tokens=options["system_tokens"],
        turns=options["turns"],
        batch_sizes=_ints(options["batch_sizes"]),
        decode_tokens=options["decode_tokens"],
        repeats=options["repeats"],
    )
    try:
        target, pair, meta, sizes = _targets(socket, names, sizes, settings)
        meta["command"] = " ".join(["reprise", *sys.argv[1:]])
        results = run_suite(names, target, sizes, hosttier_targets=pair, progress=_bar, meta=meta)
    except (ValueError, RuntimeError, ConnectionError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(report.tables(results))
    for name, why in results.get("skipped", {}).items():  # never silently
        click.echo(f"skipped {name}: {why}", err=True)
    options["out"].write_text(json.dumps(results, indent=2) + "\n")
    click.echo(f"results: {options['out']}", err=True)
    if report.plot(results, options["plot_path"]):
        click.echo(f"plot: {options['plot_path']}", err=True)
    elif any(n in results for n in ("prefix", "sweep")):
        click.echo("no plot: matplotlib is not installed (pip install 'reprise[bench]')", err=True)


def _bar(items: Any, label: str) -> Any:
    from tqdm import tqdm

    return tqdm(items, desc=label, file=sys.stderr, leave=False)


def _targets(socket: str | None, names: list[str], sizes: Any, settings: Any) -> tuple:
    """(target, (with host tier, without) or None, metadata, sizes with the vocab)."""
    import dataclasses

    from ..bench.targets import Daemon, InProcess

    if socket is not None:
        daemon = Daemon(socket)
        sizes = dataclasses.replace(sizes, vocab=daemon.vocab_size or sizes.vocab)
        return daemon, None, {"socket": socket}, sizes
    from ..daemon import Engine

    with tqdm_progress("loading model", unit="layer") as progress:
        engine = Engine.from_pretrained(settings=settings, progress=progress)
    sizes = dataclasses.replace(sizes, vocab=engine.config.vocab_size)
    meta = {"model": str(settings.model or "default"), "backend": engine.runner.model.ops.name,
            "block_size": settings.block_size,
            "cuda_graphs": engine.runner.decode is not None}  # fmt: skip
    pair = None
    if "hosttier" in names:
        # a device pool of half the working set, and a host tier for all of it (or none)
        blocks = -(-(sizes.prompt_tokens + 1) // settings.block_size)
        device = max(blocks + 1, sizes.users * blocks // 2)

        def make(host_blocks: int) -> InProcess:
            sized = dataclasses.replace(settings, num_device_blocks=device,
                                        num_host_blocks=host_blocks)  # fmt: skip
            return InProcess(Engine(engine.config, engine.tokenizer, engine.runner.model, sized,
                                    model_fingerprint=b"bench"))  # fmt: skip

        pair = (make(2 * sizes.users * blocks), make(0))
    return InProcess(engine), pair, meta, sizes
