"""Bad input the CLI used to accept, or refused only after the model had loaded (or the
answer was done), or with a line that did not name the option: each is now refused up
front, in one line naming the option and the value. No daemon or model is needed."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cli_errors import error_lines, run


class Loaded(Exception):
    """Raised in place of loading a model: the settings got past every check."""


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """serve and bench without a model load, signal handlers, log setup or fd limits."""
    from reprise.daemon.engine.engine import Engine
    from reprise.daemon.serve import service

    def load(*_: object, **__: object) -> None:
        raise Loaded("the model load was reached")

    monkeypatch.setattr(Engine, "from_pretrained", load)
    monkeypatch.setattr(service.StopFlag, "install", lambda self: None)
    monkeypatch.setattr(service, "raise_fd_limit", lambda: 1024)
    monkeypatch.setattr("reprise.daemon.serve.logs.configure", lambda *_: None)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback TCP port another program listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        yield listener.getsockname()[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def one_error(
    args: list[str], code: int, words: list[str], env: dict[str, str | None] | None = None
) -> None:
    result = run(*args, env=env)
    assert result.exit_code == code, result.output
    assert "Loaded" not in result.output, "refused only after the model loaded"
    assert isinstance(result.exception, SystemExit)
    [line] = error_lines(result)
    for word in words:
        assert word in line, (word, line)
    assert "Traceback" not in result.output


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--socket", "tcp://127.0.0.1:99999"], ["'tcp://127.0.0.1:99999'", "1-65535"]),
        (["--socket", "tcp://127.0.0.1:abc"], ["'tcp://127.0.0.1:abc'", "1-65535"]),
        (["--events", "tcp://127.0.0.1:0"], ["'tcp://127.0.0.1:0'", "1-65535"]),
        (["--socket", "tcp://127.0.0.1:45671", "--events", "tcp://127.0.0.1:45671"],
         ["KV events", "of their own", "tcp://127.0.0.1:45671"]),
    ],
)  # fmt: skip
def test_serve_refuses_a_bad_tcp_address_before_the_model_loads(
    args: list[str], words: list[str]
) -> None:
    one_error(["serve", *args], 1, words)


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize("option", ["--socket", "--events"])
def test_serve_refuses_a_busy_tcp_port_before_the_model_loads(option: str, busy_port: int) -> None:
    address = f"tcp://127.0.0.1:{busy_port}"
    one_error(["serve", option, address], 1, [address, "Address already in use", option])


@pytest.mark.usefixtures("no_load")
def test_serve_same_ipc_path_for_socket_and_events_is_refused(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/d.sock"
    one_error(["serve", "--socket", address, "--events", address], 1, ["of their own", address])


@pytest.mark.usefixtures("no_load")
def test_serve_on_a_free_tcp_port_gets_as_far_as_loading() -> None:
    """The port probe must not refuse a port nobody listens on."""
    address = f"tcp://127.0.0.1:{free_port()}"
    result = run("serve", "--socket", address, "--events", f"tcp://127.0.0.1:{free_port()}")
    assert "Loaded: the model load was reached" in result.stderr, result.output


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize("command", ["serve", "bench"])
def test_serve_and_bench_name_a_model_that_is_not_one(command: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    one_error([command, "--model", str(empty)], 2, ["'--model'", str(empty), "no config.json"])
    one_error([command, "--model", str(text)], 2, ["'--model'", str(text), "not a GGUF file"])


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize(
    "args",
    [
        ["--served-model-name", "smol"],
        ["--responses-store-mb", "8"],
        ["--generation-config", "vllm"],
    ],
)
def test_serve_http_settings_without_http_are_refused(args: list[str]) -> None:
    one_error(["serve", *args], 2, [args[0], "needs --http"])


@pytest.mark.usefixtures("no_load")
def test_serve_http_settings_with_http_still_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = recorded_http(monkeypatch)
    result = run("serve", "--http", "127.0.0.1:0", "--served-model-name", "smol",
                 "--responses-store-mb", "8", "--generation-config", "vllm")  # fmt: skip
    assert "Loaded: the model load was reached" in result.stderr, result.output
    assert calls == ["start", "stop"], "a failed load stops the HTTP thread it started"


def recorded_http(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """serve's HTTP thread replaced by one that records its start and stop calls."""
    calls: list[str] = []

    class Recorded:
        def __init__(self, *_: object) -> None: ...
        def start(self) -> None:
            calls.append("start")

        def stop(self) -> None:
            calls.append("stop")

    monkeypatch.setattr("reprise.daemon.serve.http.HttpThread", Recorded)
    return calls


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_stats_watch_must_be_finite(value: str) -> None:
    one_error(["stats", "--watch", value], 2, ["--watch", value, "finite", ">= 0.1"])


@pytest.mark.parametrize("option", ["--regex", "--grammar", "--json-schema"])
def test_an_empty_structured_output_is_refused_not_dropped(option: str) -> None:
    one_error(["generate", "x", option, ""], 2, [option, "empty"])


def test_logits_out_into_a_missing_folder_is_refused_before_generating(tmp_path: Path) -> None:
    target = tmp_path / "nowhere" / "l.npy"
    one_error(["generate", "x", "--logits-out", str(target)], 2,
              ["--logits-out", str(target), "no folder"])  # fmt: skip


def test_embed_names_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    binary = tmp_path / "texts.bin"
    binary.write_bytes(b"\xff\xfe\n")
    one_error(["embed", "--file", str(binary)], 2, ["'--file'", str(binary), "not UTF-8"])


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('log-format = "xml"', ["log-format", "'xml'", "'text', 'json'"]),
        ('log-level = "verbose"', ["log-level", "'verbose'", "'debug'"]),
        ("max-queue = 0", ["max-queue", "0", "x>=1"]),
    ],
)
def test_a_config_file_value_gets_its_flag_s_check(
    line: str, words: list[str], tmp_path: Path
) -> None:
    config = tmp_path / "reprise.toml"
    config.write_text(line + "\n")
    one_error(["serve", "--config", str(config)], 1, [str(config), *words])
    assert "ValueError" not in run("serve", "--config", str(config)).output


@pytest.mark.usefixtures("no_load")
def test_a_good_config_file_gets_as_far_as_loading(tmp_path: Path) -> None:
    config = tmp_path / "reprise.toml"
    config.write_text('log-format = "json"\nmax-queue = 3\nblock-size = 16\nreuse = false\n'
                      "disk-cache-gb = 2\n")  # fmt: skip
    result = run("serve", "--config", str(config))
    assert "Loaded: the model load was reached" in result.stderr, result.output


# -- the socket's folder -------------------------------------------------------------------


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize("option", ["--socket", "--events"])
def test_serve_refuses_a_socket_whose_folder_s_parent_is_missing(
    option: str, tmp_path: Path
) -> None:
    """A typo in a folder above the socket is refused, not made into a tree of folders."""
    address = f"ipc://{tmp_path}/typo/dir/x.sock"
    one_error(["serve", option, address], 1, [option, address, f"no folder {tmp_path}/typo"])
    assert not (tmp_path / "typo").exists()


@pytest.mark.usefixtures("no_load")
def test_a_socket_from_reprise_socket_is_refused_naming_the_variable(tmp_path: Path) -> None:
    """The address came from the environment, not a flag: the line names where it came from."""
    address = f"ipc://{tmp_path}/typo/dir/x.sock"
    words = ["REPRISE_SOCKET", address, f"no folder {tmp_path}/typo"]
    one_error(["serve"], 1, words, env={"REPRISE_SOCKET": address})


@pytest.mark.usefixtures("no_load")
def test_serve_makes_the_socket_s_own_folder(tmp_path: Path) -> None:
    result = run("serve", "--socket", f"ipc://{tmp_path}/run/d.sock")
    assert "Loaded: the model load was reached" in result.stderr, result.output
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700


@pytest.mark.usefixtures("no_load")
def test_serve_makes_the_default_socket_s_runtime_folders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a fresh machine the default socket's runtime folder may not exist yet."""
    runtime = tmp_path / "run" / "user" / "1000"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    result = run("serve")
    assert "Loaded: the model load was reached" in result.stderr, result.output
    assert (runtime / "reprise").stat().st_mode & 0o777 == 0o700


# -- serve --drain-timeout ------------------------------------------------------------------


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_drain_timeout_must_be_a_finite_number_of_seconds(value: str) -> None:
    one_error(["serve", "--drain-timeout", value], 2,
              ["'--drain-timeout'", f"'{value}'", "a finite number of seconds >= 0"])  # fmt: skip


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize("line", ["drain-timeout = nan", "drain_timeout = inf"])
def test_a_config_file_s_drain_timeout_must_be_finite(line: str, tmp_path: Path) -> None:
    config = tmp_path / "reprise.toml"
    config.write_text(line + "\n")
    key = line.split(" ")[0]
    one_error(["serve", "--config", str(config)], 1,
              [str(config), key, "a finite number of seconds >= 0"])  # fmt: skip
    assert "drain_timeout_s" not in run("serve", "--config", str(config)).output


# -- embed --dimensions ----------------------------------------------------------------------


def tiny_folder(tmp_path: Path) -> Path:
    """A model folder of only a config.json (hidden size 128): enough to be refused by."""
    import json

    from reprise.daemon.model.synth import SHAPES

    folder = tmp_path / "tiny"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "rms_norm_eps": 1e-5, **SHAPES["tiny"]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tiny_gguf(tmp_path: Path) -> Path:
    """A GGUF file of only a header that says hidden size 128 (no converted folder)."""
    from gguf_support import write_gguf

    return write_gguf(tmp_path / "tiny.gguf", "llama", {"llama.embedding_length": 128}, {})


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize("make", [tiny_folder, tiny_gguf])
def test_embed_dimensions_past_the_hidden_size_are_refused_before_loading(
    make: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    model = make(tmp_path)
    one_error(["embed", "x", "--model", str(model), "--dimensions", "129"], 2,
              ["--dimensions", "got 129", "hidden size", "1 to 128"])  # fmt: skip
    result = run("embed", "x", "--model", str(model), "--dimensions", "128")
    assert "Loaded: the model load was reached" in result.stderr, result.output


# -- --system "" -----------------------------------------------------------------------------

DEFAULT_SYSTEM = "You are a helpful AI assistant."
# as SmolLM2's and Qwen2's templates: their own system message when the chat opens without one
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + DEFAULT_SYSTEM
    + "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)  # fmt: skip


class Sent(Exception):
    """Raised in place of sending a request: what the CLI built is recorded."""


def sent_request(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> Any:
    """What `args` would send: to the daemon (generate, chat), or to the chat template of
    the model loaded in process (run)."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from click.testing import CliRunner

    from reprise.cli.main import main
    from reprise.daemon.engine.engine import Engine

    sent: list[Any] = []

    def record(request: Any, **_: object) -> None:
        sent.append(request)
        raise Sent

    @contextmanager
    def connect(*_: object) -> Iterator[Any]:
        yield SimpleNamespace(stream=record, generate=record)

    monkeypatch.setattr("reprise.cli.client_cmds.connect", connect)
    monkeypatch.setattr("reprise.cli.chat.connect", connect)
    engine = SimpleNamespace(tokenizer=SimpleNamespace(apply_chat_template=record))
    monkeypatch.setattr(Engine, "from_pretrained", lambda *_, **__: engine)
    CliRunner().invoke(main, args, input="Hi\n", env={"REPRISE_SOCKET": None})
    [request] = sent
    return request


@pytest.fixture
def template(tmp_path: Path) -> Any:
    """A tokenizer whose chat template writes a default system message of its own."""
    from reprise.daemon.model.synth import write_tokenizer
    from reprise.daemon.model.tokenizer import Tokenizer

    write_tokenizer(tmp_path, 512)
    tokenizer = Tokenizer.from_dir(tmp_path)
    tokenizer.use_chat_template(TEMPLATE)
    return tokenizer


@pytest.mark.parametrize("command", [["generate", "Hi"], ["run", "Hi"], ["chat"]])
@pytest.mark.parametrize("system", [None, "", "Be brief."])
def test_an_empty_system_flag_sends_an_empty_system_message(
    command: list[str], system: str | None, template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--system ""` is an empty system message (llama-cli's, the OpenAI API's), so the
    template's default one does not appear; no --system leaves the template's default."""
    flags = [] if system is None else ["--system", system]
    request = sent_request(monkeypatch, [*command, *flags])
    opening = [] if system is None else [{"role": "system", "content": system}]
    assert request == [*opening, {"role": "user", "content": "Hi"}]
    assert (DEFAULT_SYSTEM in template.apply_chat_template(request)) == (system is None)


def test_a_saved_chat_s_empty_system_message_stays_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = tmp_path / "chat.json"
    saved.write_text('{"system": "", "messages": []}')
    request = sent_request(monkeypatch, ["chat", "--load", str(saved)])
    assert request == [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]
