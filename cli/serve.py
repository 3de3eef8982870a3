"""`reprise serve`: load a model and run the daemon until SIGTERM."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from .progress import tqdm_progress

# option name -> (default, type) for the options a config file may also hold
SERVE_OPTIONS: dict[str, tuple[Any, type]] = {
    "model": (None, str),
    "socket": (None, str),
    "events": (None, str),
    "backend": ("auto", str),
    "block_size": (32, int),
    "num_device_blocks": (None, int),
    "memory_fraction": (None, float),
    "reuse": (True, bool),
    "cuda_graphs": (None, bool),
    "host_blocks": (0, int),
    "host_bytes": (None, int),
    "max_batched_tokens": (None, int),
    "max_model_len": (None, int),
    "max_queue": (256, int),
    "max_tokens_cap": (4096, int),
    "max_message_bytes": (1 << 20, int),
    "max_logits_bytes": (64 << 20, int),
    "kv_events_layout": ("vllm", str),
    "drain_timeout": (5.0, float),
    "log_level": ("info", str),
    "log_format": ("text", str),
    "http": (None, str),
    "served_model_name": (None, str),
}


def load_config(path: Path) -> dict[str, Any]:
    """A TOML file of serve options (`block-size = 16` or `block_size = 16`), checked."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise click.ClickException(f"cannot read config {path}: {e}") from None
    raw = raw.get("serve", raw)  # the options may sit under a [serve] table
    config: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in SERVE_OPTIONS:
            raise click.ClickException(
                f"{path}: unknown option {key!r}; known: {sorted(SERVE_OPTIONS)}"
            )
        kind = SERVE_OPTIONS[name][1]
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise click.ClickException(f"{path}: {key} must be a {kind.__name__}; got {value!r}")
        config[name] = value
    return config


@click.command("serve")
@click.option(
    "--model", default=None, help="Model folder (default: the default model, prepared if missing)."
)
@click.option(
    "--socket",
    default=None,
    help="ipc://PATH or tcp://127.0.0.1:PORT (default: under $XDG_RUNTIME_DIR; env REPRISE_SOCKET).",
)
@click.option(
    "--events", default=None, help="Publish KV events (vLLM layout) on this ZeroMQ PUB address."
)
@click.option(
    "--backend", type=click.Choice(["auto", "numpy", "cupy"]), default=None, help="[default: auto]"
)
@click.option("--block-size", type=int, default=None, help="Tokens per KV block [default: 32].")
@click.option(
    "--num-device-blocks",
    type=int,
    default=None,
    help="KV blocks on the device [default: 1 GiB worth].",
)
@click.option(
    "--memory-fraction",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Size the device pool to fill this fraction of the device's memory beside the weights "
    "(GPU memory; RAM on the NumPy backend), instead of --num-device-blocks.",
)
@click.option(
    "--reuse/--no-reuse",
    default=None,
    help="Find cached KV blocks again across requests [default: on].",
)
@click.option(
    "--cuda-graphs/--eager",
    default=None,
    help="Replay decode steps as CUDA graphs, one per batch-size bucket, each bucket up to "
    "--max-queue captured at start-up [default: on with the GPU backend; --cuda-graphs on "
    "NumPy runs the same padded steps].",
)
@click.option("--host-blocks", type=int, default=None, help="Blocks in the host tier [default: 0].")
@click.option(
    "--host-bytes",
    type=int,
    default=None,
    help="Host tier size in bytes (instead of --host-blocks).",
)
@click.option(
    "--max-batched-tokens",
    type=int,
    default=None,
    help="Token budget per engine step, which bounds a step's time [default: 2048 on the GPU, "
    "256 on NumPy, where a 256-token step of the default model takes about 2 s].",
)
@click.option(
    "--max-model-len", type=int, default=None, help="Context length [default: the model's]."
)
@click.option(
    "--max-queue",
    type=int,
    default=None,
    help="Requests waiting or running; more get `busy` [default: 256].",
)
@click.option(
    "--max-tokens-cap",
    type=int,
    default=None,
    help="Largest max_tokens a request may ask [default: 4096].",
)
@click.option(
    "--max-message-bytes", type=int, default=None, help="Largest request message [default: 1 MiB]."
)
@click.option(
    "--max-logits-bytes",
    type=int,
    default=None,
    help="Largest logits reply a request may ask for (max_tokens x vocab x 4) [default: 64 MiB].",
)
@click.option(
    "--kv-events-layout",
    type=click.Choice(["vllm", "vllm-legacy"]),
    default=None,
    help="KV events as today's vLLM encodes them, or its older array layout [default: vllm].",
)
@click.option(
    "--drain-timeout",
    type=float,
    default=None,
    help="Seconds running requests get on SIGTERM before they are cancelled with a "
    "final error reply [default: 5].",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default=None,
    help="Least severe log lines shown [default: info].",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default=None,
    help="Log lines as text (time, level, logger) or one JSON object each; under systemd, "
    "text goes to the journal with its level [default: text].",
)
@click.option(
    "--http",
    default=None,
    metavar="HOST:PORT",
    help="Also serve the OpenAI-compatible HTTP API (and /health, /metrics) here, e.g. "
    "127.0.0.1:8000; a non-loopback host needs --api-key.",
)
@click.option(
    "--api-key",
    envvar="REPRISE_API_KEY",
    default=None,
    help="Require `Authorization: Bearer KEY` on every HTTP route but /health "
    "(env REPRISE_API_KEY).",
)
@click.option(
    "--served-model-name",
    default=None,
    help="The model id of the HTTP API [default: the model folder's name].",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="TOML file with the same options; flags win.",
)
def serve_cmd(config_file: Path | None, api_key: str | None, **flags: Any) -> None:
    """Load a model and serve it on a ZeroMQ socket (and HTTP with --http) until SIGTERM
    (then drain and exit 0)."""
    from ..daemon import Engine
    from ..daemon.serve.server import Server, ServerConfig, prepare_endpoints
    from ..daemon.serve.service import Notifier, StopFlag, raise_fd_limit
    from ..ipc.sockets import server_address

    options = {name: default for name, (default, _) in SERVE_OPTIONS.items()}
    if config_file is not None:
        options.update(load_config(config_file))
    options.update({k: v for k, v in flags.items() if v is not None})
    from ..daemon.serve.logs import configure

    http_config = _http_config(options, api_key)  # a bad --http is refused before anything
    configure(options["log_level"], options["log_format"])
    logging.getLogger("reprise.server").info("open files: up to %d", raise_fd_limit())
    stop = StopFlag()
    stop.install()  # before loading, so a SIGTERM during the load is not fatal
    try:
        config = ServerConfig(
            address=server_address(options["socket"]),
            events_address=options["events"],
            max_queue=options["max_queue"],
            max_tokens_cap=options["max_tokens_cap"],
            max_message_bytes=options["max_message_bytes"],
            max_logits_bytes=options["max_logits_bytes"],
            kv_events_layout=options["kv_events_layout"],
            drain_timeout_s=options["drain_timeout"],
            model_name=str(options["model"] or "default"),
        )
        prepare_endpoints(config)  # a bad or busy socket is refused before the model loads
        http = None
        if http_config is not None:  # up while loading, so /health answers 503 meanwhile
            from ..daemon.serve.http import HttpThread

            http = HttpThread(http_config, config.address)
            http.start()
        with tqdm_progress("loading model", unit="layer") as progress:
            engine = Engine.from_pretrained(
                options["model"],
                backend=options["backend"],
                block_size=options["block_size"],
                num_device_blocks=options["num_device_blocks"],
                memory_fraction=options["memory_fraction"],
                enable_reuse=options["reuse"],
                cuda_graphs=options["cuda_graphs"],
                max_num_batched_tokens=_step_budget(options),
                max_model_len=options["max_model_len"],
                num_host_blocks=_host_blocks(options, progress),
                progress=progress,
            )
        server = Server(engine, config, notifier=Notifier(), stop=stop)
        try:
            if not stop.is_set:
                server.run()
        finally:
            if http is not None:
                http.stop()
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


def _http_config(options: dict[str, Any], api_key: str | None) -> Any:
    """The HTTP front end's settings, or None without --http (click.UsageError when a
    non-loopback host has no key)."""
    if options["http"] is None:
        return None
    from ..daemon.serve.http import HttpConfig, parse_host_port

    try:
        host, port = parse_host_port(options["http"])
        name = options["served_model_name"] or (Path(options["model"]).name if options["model"]
                                                else "default")  # fmt: skip
        return HttpConfig(host=host, port=port, api_key=api_key or None, model_name=name,
                          max_queue=options["max_queue"],
                          max_body_bytes=options["max_message_bytes"])  # fmt: skip
    except ValueError as e:
        raise click.UsageError(str(e)) from None


GPU_STEP_TOKENS, NUMPY_STEP_TOKENS = 2048, 256


def _step_budget(options: dict[str, Any]) -> int:
    """The chunked-prefill token budget: the flag, or one that keeps a step (and so the
    watchdog ping and a SIGTERM's answer) to seconds on the backend that will run."""
    if options["max_batched_tokens"] is not None:
        return int(options["max_batched_tokens"])
    from ..cuda.backend import cuda_device_available

    on_gpu = options["backend"] == "cupy" or (
        options["backend"] == "auto" and cuda_device_available()
    )
    return GPU_STEP_TOKENS if on_gpu else NUMPY_STEP_TOKENS


def _host_blocks(options: dict[str, Any], progress: Any) -> int:
    if options["host_bytes"] is None:
        return int(options["host_blocks"])
    from ..daemon.model.config import ModelConfig
    from ..daemon.model.prepare import default_model_dir

    path = Path(options["model"]) if options["model"] else default_model_dir()
    block_bytes = ModelConfig.from_dir(path).kv_bytes_per_token() * options["block_size"]
    return int(options["host_bytes"]) // block_bytes
