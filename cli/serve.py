"""`reprise serve`: load a model and run the daemon until SIGTERM."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from ..daemon.engine.config import setting_fields
from ..daemon.serve.reasoning_parsers import PARSERS as REASONING_PARSERS
from ..daemon.serve.tool_parsers import PARSERS as TOOL_PARSERS
from .model_cmds import check_model
from .options import (
    ENGINE_OPTIONS,
    FiniteFloat,
    engine_option,
    engine_options,
    engine_settings,
    speculative_config,
)
from .progress import tqdm_progress

# option name -> (default, type) for the options a config file may also hold
SERVE_OPTIONS: dict[str, tuple[Any, type]] = {
    **{name: (default, kind) for name, _, kind, default in map(engine_option, setting_fields())},
    "socket": (None, str),
    "events": (None, str),
    "max_queue": (256, int),
    "max_tokens_cap": (4096, int),
    "max_message_bytes": (1 << 20, int),
    "max_connections": (None, int),
    "max_logits_bytes": (64 << 20, int),
    "max_stop_strings": (16, int),
    "max_stop_chars": (256, int),
    "kv_events_layout": ("vllm", str),
    "drain_timeout": (5.0, float),
    "log_level": ("info", str),
    "log_format": ("text", str),
    "http": (None, str),
    "served_model_name": (None, str),
    "tool_call_parser": (None, str),
    "reasoning_parser": (None, str),
    "responses_store_mb": (64, int),
    "chat_template": (None, str),
    "default_chat_template_kwargs": (None, str),
    "speculative_config": (None, str),
    "generation_config": ("auto", str),
    "override_generation_config": (None, str),
    "allowed_origins": (None, str),
    "ssl_keyfile": (None, str),
    "ssl_certfile": (None, str),
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
    params = {p.name: p for p in serve_cmd.params}
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
        try:  # the flag's own check (its choices, its range), as on the command line
            params[name].type.convert(value, params[name], None)
        except click.BadParameter as e:
            raise click.ClickException(f"{path}: {key}: {e.message}") from None
        config[name] = value
    return config


@click.command("serve")
@click.option(
    "--socket",
    default=None,
    help="ipc://PATH or tcp://127.0.0.1:PORT (default: under $XDG_RUNTIME_DIR; env REPRISE_SOCKET).",
)
@click.option(
    "--events", default=None, help="Publish KV events (vLLM layout) on this ZeroMQ PUB address."
)
@engine_options
@click.option(
    "--max-queue",
    type=click.IntRange(min=1),
    default=None,
    help="Requests waiting or running; more get `busy` [default: 256].",
)
@click.option(
    "--max-tokens-cap",
    type=click.IntRange(min=1),
    default=None,
    help="Largest max_tokens a request may ask [default: 4096].",
)
@click.option(
    "--max-message-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="Largest request message [default: 1 MiB].",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=None,
    help="Client connections open at once; more are refused with one `busy` error "
    "[default: the open-file limit less 256].",
)
@click.option(
    "--max-logits-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="Largest logits reply a request may ask for (max_tokens x vocab x 4) [default: 64 MiB].",
)
@click.option(
    "--max-stop-strings",
    type=click.IntRange(min=1),
    default=None,
    help="Stop strings a request may give [default: 16].",
)
@click.option(
    "--max-stop-chars",
    type=click.IntRange(min=1),
    default=None,
    help="Characters in one stop string [default: 256].",
)
@click.option(
    "--kv-events-layout",
    type=click.Choice(["vllm", "vllm-legacy"]),
    default=None,
    help="KV events as today's vLLM encodes them, or its older array layout [default: vllm].",
)
@click.option(
    "--drain-timeout",
    type=FiniteFloat(low=0.0, unit="seconds"),
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
    "--tool-call-parser",
    type=click.Choice(TOOL_PARSERS),
    default=None,
    help="Answer HTTP tool_choice 'auto' (the default with tools) by reading tool calls out of "
    "the model's text in this format (vLLM's --tool-call-parser); without it, 'auto' is a 400.",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(REASONING_PARSERS),
    default=None,
    help="Give HTTP chat answers' thinking apart from their content, as reasoning_content, "
    "in this model's format (vLLM's --reasoning-parser).",
)
@click.option(
    "--responses-store-mb",
    type=click.IntRange(min=0),
    default=None,
    help="MiB of finished Responses API responses kept for GET and previous_response_id, "
    "least recently used out first; 0 keeps none [default: 64].",
)
@click.option(
    "--chat-template",
    default=None,
    metavar="FILE|TEMPLATE",
    help="Render every chat with this Jinja template (a file, or the template itself) in "
    "place of the model folder's (vLLM's --chat-template).",
)
@click.option(
    "--default-chat-template-kwargs",
    default=None,
    metavar="JSON",
    help="Template variables every chat gets, e.g. '{\"enable_thinking\": false}'; a "
    "request's chat_template_kwargs win (vLLM's --default-chat-template-kwargs).",
)
@click.option(
    "--allowed-origins",
    default=None,
    metavar="ORIGINS",
    help="Browser origins that may call the HTTP API (CORS), comma-separated or a JSON list, "
    "e.g. 'http://localhost:3000' or '*' (any) [default: none].",
)
@click.option(
    "--ssl-keyfile",
    default=None,
    metavar="FILE",
    help="Serve HTTPS with this private key (PEM), with --ssl-certfile.",
)
@click.option(
    "--ssl-certfile",
    default=None,
    metavar="FILE",
    help="Serve HTTPS with this certificate chain (PEM), with --ssl-keyfile.",
)
@click.option(
    "--generation-config",
    default=None,
    metavar="auto|vllm|FOLDER",
    help="Sampling defaults of HTTP requests that set none (temperature, top_p, top_k, min_p, "
    "repetition_penalty, max_new_tokens): the model folder's generation_config.json (auto), "
    "none (vllm), or a folder's (vLLM's --generation-config) [default: auto].",
)
@click.option(
    "--override-generation-config",
    default=None,
    metavar="JSON",
    help="Sampling defaults set on top of --generation-config's, e.g. "
    '\'{"temperature": 0.6, "top_p": 0.95}\' (vLLM\'s --override-generation-config).',
)
@click.option(
    "--speculative-config",
    default=None,
    metavar="JSON",
    help="vLLM's spelling of --speculative-tokens, --prompt-lookup-min and --prompt-lookup-max: "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (the lookup '
    "sizes default to each other, or both to 5, as vLLM's).",
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

    # refused before the model loads, as a usage error (exit 2)
    engine_fields = {field: options[name] for name, field in ENGINE_OPTIONS.items()}
    if options["speculative_config"] is not None:
        given = [f for f in ("speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                             "speculative_disable_by_batch_size")
                 if options[f] != SERVE_OPTIONS[f][0]]  # fmt: skip
        if given:
            raise click.UsageError(
                f"give --speculative-config or --{given[0].replace('_', '-')}, not both"
            )
        engine_fields.update(speculative_config(options["speculative_config"]))
    if options["events"] is not None:  # published: the engine keeps its KV events
        engine_fields["kv_events"] = True
    settings = engine_settings(**engine_fields)
    http_config = _http_config(options, api_key)  # a bad --http is refused before anything
    chat_template = _chat_template(options["chat_template"])
    template_kwargs = _template_kwargs(options["default_chat_template_kwargs"])
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
            max_connections=options["max_connections"],
            max_logits_bytes=options["max_logits_bytes"],
            max_stop_strings=options["max_stop_strings"],
            max_stop_chars=options["max_stop_chars"],
            kv_events_layout=options["kv_events_layout"],
            drain_timeout_s=options["drain_timeout"],
            model_name=str(options["model"] or "default"),
            chat_template=chat_template,
            default_chat_template_kwargs=template_kwargs,
        )
        prepare_endpoints(config)  # a bad or busy socket is refused before the model loads
        check_model(settings.model)
        http = None
        if http_config is not None:  # up while loading, so /health answers 503 meanwhile
            from ..daemon.serve.http import HttpThread

            http = HttpThread(http_config, config.address)
            http.start()
        try:  # the HTTP thread stops however this ends, a failed load too
            with tqdm_progress("loading model", unit="layer") as progress:
                engine = Engine.from_pretrained(settings=settings, progress=progress)
            server = Server(engine, config, notifier=Notifier(), stop=stop)
            if not stop.is_set:
                with tqdm_progress("warming up", unit="stage") as progress:
                    server.run(progress)
        finally:
            if http is not None:
                http.stop()
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given itself (vLLM's rule)."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and not path.is_file():
        raise click.UsageError(f"--chat-template: no file {value!r} (nor a template: no '{{')")
    source = value
    if path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise click.UsageError(f"--chat-template: cannot read {value}: {e}") from None
    from ..daemon.model.tokenizer import check_chat_template

    try:
        check_chat_template(source)
    except ValueError as e:
        raise click.UsageError(f"--chat-template: {e}") from None
    return source


def _template_kwargs(value: str | None) -> dict[str, Any] | None:
    """--default-chat-template-kwargs: a JSON object (its names checked by ServerConfig)."""
    if value is None:
        return None
    import json

    try:
        kwargs = json.loads(value)
    except ValueError as e:
        raise click.UsageError(f"--default-chat-template-kwargs is not JSON: {e}") from None
    from ..ipc.messages import ProtocolError, check_chat_options

    try:
        check_chat_options({"kwargs": kwargs})
    except ProtocolError as e:
        message = e.message.removeprefix("chat_options.kwargs ").removeprefix("chat_options: ")
        raise click.UsageError(f"--default-chat-template-kwargs: {message}") from None
    return kwargs


def _origins(value: str | None) -> tuple[str, ...]:
    """--allowed-origins: a JSON list of strings, or comma-separated (ValueError if not)."""
    if value is None:
        return ()
    if value.lstrip().startswith("["):
        import json

        try:
            origins = json.loads(value)
        except ValueError as e:
            raise ValueError(f"--allowed-origins is not a JSON list: {e}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError("--allowed-origins must be a JSON list of strings")
        return tuple(origins)
    return tuple(o.strip() for o in value.split(",") if o.strip())


def _http_config(options: dict[str, Any], api_key: str | None) -> Any:
    """The HTTP front end's settings, or None without --http (click.UsageError when a
    non-loopback host has no key)."""
    if options["http"] is None:
        if options["tool_call_parser"] is not None:
            raise click.UsageError("--tool-call-parser reads HTTP tool calls: it needs --http")
        if options["reasoning_parser"] is not None:
            raise click.UsageError("--reasoning-parser reads HTTP chat answers: it needs --http")
        for name in ("served_model_name", "responses_store_mb", "generation_config",
                     "override_generation_config", "allowed_origins", "ssl_keyfile",
                     "ssl_certfile"):  # fmt: skip
            if options[name] != SERVE_OPTIONS[name][0]:
                flag = "--" + name.replace("_", "-")
                raise click.UsageError(f"{flag} is an HTTP setting: it needs --http")
        return None
    from ..daemon.serve.http_config import HttpConfig, parse_host_port

    try:
        host, port = parse_host_port(options["http"])
        name = options["served_model_name"] or (Path(options["model"]).name if options["model"]
                                                else "default")  # fmt: skip
        from ..daemon.serve.generation_defaults import generation_defaults

        model = options["model"]
        folder = Path(model) if model is not None and Path(model).is_dir() else None
        defaults = generation_defaults(options["generation_config"], folder,
                                       options["override_generation_config"])  # fmt: skip
        return HttpConfig(host=host, port=port, api_key=api_key or None, model_name=name,
                          max_queue=options["max_queue"],
                          max_body_bytes=options["max_message_bytes"],
                          max_tokens_cap=options["max_tokens_cap"],
                          tool_call_parser=options["tool_call_parser"],
                          reasoning_parser=options["reasoning_parser"],
                          responses_store_mb=options["responses_store_mb"],
                          generation_defaults=defaults,
                          allowed_origins=_origins(options["allowed_origins"]),
                          ssl_keyfile=options["ssl_keyfile"],
                          ssl_certfile=options["ssl_certfile"])  # fmt: skip
    except ValueError as e:
        raise click.UsageError(str(e)) from None
