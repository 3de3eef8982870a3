"""Bad input on the command line: a usage error (exit 2) whose one `Error:` line names the
option, the value and what is allowed; runtime failures exit 1 with one line; never a
traceback unless --debug or REPRISE_DEBUG=1 asks for one. No daemon is needed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from reprise.cli.main import main

# (arguments, words the Error line must hold: the option, the value, what is allowed)
USAGE_ERRORS = [
    (["generate", "x", "--temperature", "nan"], ["--temperature", "'nan'", ">= 0"]),
    (["generate", "x", "--temperature", "inf"], ["--temperature", "'inf'", ">= 0"]),
    (["generate", "x", "--temperature", "-0.5"], ["--temperature", "'-0.5'", ">= 0"]),
    (["generate", "x", "--temperature", "hot"], ["--temperature", "'hot'", ">= 0"]),
    (["generate", "x", "--top-p", "0"], ["--top-p", "'0'", "(0, 1]"]),
    (["generate", "x", "--top-p", "1.5"], ["--top-p", "'1.5'", "(0, 1]"]),
    (["generate", "x", "--top-p", "nan"], ["--top-p", "'nan'", "(0, 1]"]),
    (["generate", "x", "--min-p", "1.5"], ["--min-p", "'1.5'", "[0, 1]"]),
    (["run", "x", "--min-p", "-0.1"], ["--min-p", "'-0.1'", "[0, 1]"]),
    (["generate", "x", "--top-k", "0"], ["--top-k", "0", "x>=1"]),
    (["generate", "x", "--max-tokens", "0"], ["--max-tokens", "0", "x>=1"]),
    (["generate", "x", "--seed", "-1"], ["--seed", "-1", "0<=x<=18446744073709551615"]),
    (["generate", "x", "--seed", str(2**64)], ["--seed", str(2**64), "x<=18446744073709551615"]),
    (["generate", "x", "--queue-priority", str(2**31)], ["--queue-priority", str(2**31), "2147483647"]),
    (["generate", "x", "--queue-priority", str(-(2**31) - 1)], ["--queue-priority", "-2147483648<="]),
    (["generate", "x", "--queue-priority", "9" * 30], ["--queue-priority", "9" * 30]),
    (["generate", "x", "--priority", "101"], ["--priority", "101", "0<=x<=100"]),
    (["generate", "x", "--salt", "s" * 257], ["--salt", "257 characters", "at most 256"]),
    (["generate", "x", "--stop", ""], ["--stop", "at least one character"]),
    (["generate", "x", "--raw", "--system", "Be brief."], ["--system", "--raw"]),
    (["generate", "x", "--timeout", "0"], ["--timeout", "'0'", "> 0"]),
    (["generate", "x", "--prompt-logprobs", "-1"], ["--prompt-logprobs", "-1", "x>=0"]),
    (["generate", "x", "--timeout", "nan"], ["--timeout", "'nan'", "> 0"]),
    (["stats", "--socket", "bogus"], ["--socket", "'bogus'", "ipc://PATH or tcp://127.0.0.1:PORT"]),
    (["stats", "--socket", "tcp://10.1.2.3:5555"], ["--socket", "tcp://10.1.2.3:5555", "loopback"]),
    (["stats", "--socket", "tcp://127.0.0.1:99999"], ["--socket", "99999", "1-65535"]),
    (["stats", "--socket", "ipc://"], ["--socket", "'ipc://'", "ipc://PATH"]),
    (["stats", "--watch", "0"], ["--watch", "0", "x>=0.1"]),
    (["chat", "--temperature", "nan"], ["--temperature", "'nan'", ">= 0"]),
    (["chat", "--queue-priority", str(2**31)], ["--queue-priority", str(2**31)]),
    (["run", "x", "--temperature", "nan"], ["--temperature", "'nan'", ">= 0"]),
    (["run", "x", "--top-p", "2"], ["--top-p", "'2'", "(0, 1]"]),
    (["run", "x", "--raw", "--system", "Be brief."], ["--system", "--raw"]),
    (["generate", "x", "--presence-penalty", "3"], ["--presence-penalty", "'3'", "[-2, 2]"]),
    (["run", "x", "--frequency-penalty", "nan"], ["--frequency-penalty", "'nan'", "[-2, 2]"]),
    (["chat", "--repetition-penalty", "0"], ["--repetition-penalty", "'0'", "> 0"]),
    (["run", "x", "--logit-bias", "5=200"], ["--logit-bias", "'5=200'", "[-100, 100]"]),
    (["generate", "x", "--logit-bias", "5"], ["--logit-bias", "ID=BIAS", "'5'"]),
    (["chat", "--logit-bias", "5=1", "--logit-bias", "5=2"], ["--logit-bias", "token 5", "twice"]),
    (["run", "x", "--min-tokens", "-1"], ["--min-tokens", "-1", "x>=0"]),
    (["generate", "x", "--bad-word", " "], ["--bad-word", "bad_words[]", "not only spaces"]),
    (["run", "x", "--regex", "[a-"], ["--regex", "structured output regex", "unclosed character class"]),
    (["generate", "x", "--json-schema", "{nope"], ["--json-schema", "not valid JSON"]),
    (["generate", "x", "--json-schema", '{"type": "strong"}'], ["--json-schema", "strong"]),
    (["generate", "x", "--json-schema", "@/nonexistent/s.json"], ["--json-schema", "cannot read", "/nonexistent/s.json"]),
    (["run", "x", "--grammar", "start: undefined_rule"], ["--grammar", "undefined_rule"]),
    (["generate", "x", "--regex", "a", "--choice", "b"], ["at most one of", "--regex, --choice"]),
    (["run", "x", "--json-object", "--json-schema", "{}"], ["at most one of", "--json-schema, --json-object"]),
    (["chat", "--regex", "[a-"], ["--regex", "unclosed character class"]),
    (["serve", "--tool-call-parser", "hermes"], ["--tool-call-parser", "needs --http"]),
    (["serve", "--http", "127.0.0.1:0", "--tool-call-parser", "xml"], ["--tool-call-parser", "'xml'", "hermes"]),
]  # fmt: skip


# serve's and bench's engine settings (EngineConfig): refused before any model loads
SETTING_ERRORS = [
    (["serve", "--block-size", "0"], ["--block-size", "0", "power of two"]),
    (["serve", "--block-size", "-4"], ["--block-size", "-4", "power of two"]),
    (["serve", "--block-size", "48"], ["--block-size", "48", "power of two in [1, 1024]"]),
    (["serve", "--num-device-blocks", "-1"], ["--num-device-blocks", "-1", ">= 1"]),
    (["serve", "--max-model-len", "0"], ["--max-model-len", "0", ">= 2"]),
    (["serve", "--max-prompt-logprobs", "1001"], ["--max-prompt-logprobs", "1001", "[0, 1000]"]),
    (["serve", "--max-batched-tokens", "0"], ["--max-batched-tokens", "0", ">= 1"]),
    (["serve", "--max-num-seqs", "0"], ["--max-num-seqs", "0", ">= 1"]),
    (["serve", "--speculative-disable-by-batch-size", "0"],
     ["--speculative-disable-by-batch-size", "0", ">= 1"]),
    (["serve", "--host-blocks", "-2"], ["--host-blocks", "-2", ">= 0"]),
    (["serve", "--host-bytes", "0"], ["--host-bytes", "0", ">= 1"]),
    (["serve", "--host-blocks", "4", "--host-bytes", "4096"], ["--host-bytes", "not both"]),
    (["serve", "--memory-fraction", "2"], ["--memory-fraction", "2.0", "(0, 1]"]),
    (["serve", "--memory-fraction", "0.5", "--num-device-blocks", "8"], ["--memory-fraction", "not both"]),
    (["serve", "--max-queue", "0"], ["--max-queue", "0", "x>=1"]),
    (["serve", "--max-message-bytes", "-1"], ["--max-message-bytes", "-1", "x>=1"]),
    (["serve", "--max-logits-bytes", "0"], ["--max-logits-bytes", "0", "x>=1"]),
    (["serve", "--max-stop-strings", "0"], ["--max-stop-strings", "0", "x>=1"]),
    (["serve", "--max-stop-chars", "0"], ["--max-stop-chars", "0", "x>=1"]),
    (["serve", "--drain-timeout", "-1"], ["--drain-timeout", "'-1'", "a finite number of seconds >= 0"]),
    (["serve", "--no-reuse", "--logits-cache-mb", "8"], ["--logits-cache-mb", "needs reuse"]),
    (["serve", "--chat-template", "{% for %}"], ["--chat-template", "does not compile"]),
    (["serve", "--chat-template", "/nonexistent/t.jinja"], ["--chat-template", "no file"]),
    (["serve", "--default-chat-template-kwargs", "{"], ["--default-chat-template-kwargs", "not JSON"]),
    (["serve", "--default-chat-template-kwargs", "[1]"], ["--default-chat-template-kwargs", "must be dict"]),
    (["serve", "--default-chat-template-kwargs", '{"messages": 1}'], ["--default-chat-template-kwargs", "cannot set messages"]),
    (["serve", "--reasoning-parser", "qwen3"], ["--reasoning-parser", "needs --http"]),
    (["serve", "--speculative-tokens", "33"], ["--speculative-tokens", "33", "[0, 32]"]),
    (["serve", "--prompt-lookup-min", "0"], ["--prompt-lookup-min", "0", "[1, 64]"]),
    (["serve", "--prompt-lookup-min", "4", "--prompt-lookup-max", "3"], ["--prompt-lookup-min", "at most"]),
    (["serve", "--speculative-config", "{"], ["--speculative-config", "JSON object"]),
    (["serve", "--hf-overrides", "{"], ["--hf-overrides", "JSON object of config.json fields"]),
    (["serve", "--hf-overrides", "[4]"], ["--hf-overrides", "JSON object", "'[4]'"]),
    (["serve", "--speculative-config", "[4]"], ["--speculative-config", "JSON object"]),
    (["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], ["method", "ngram", "'eagle'"]),
    (["serve", "--speculative-config", '{"method": "ngram"}'], ["needs num_speculative_tokens"]),
    (["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}'], ["unknown key", "'model'"]),
    (["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 40}'], ["--speculative-tokens", "40", "[0, 32]"]),
    (["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}'], ["--prompt-lookup-min", "got 0"]),
    (["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--speculative-tokens", "3"], ["--speculative-tokens", "not both"]),
    (["run", "--speculative-tokens", "-1", "hi"], ["--speculative-tokens", "-1", "[0, 32]"]),
    (["bench", "--block-size", "3"], ["--block-size", "3", "power of two"]),
    (["bench", "--max-batched-tokens", "0"], ["--max-batched-tokens", "0", ">= 1"]),
]  # fmt: skip


def run(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env={"REPRISE_SOCKET": None, **(env or {})})


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if "Error" in line]


@pytest.mark.parametrize(("args", "words"), USAGE_ERRORS, ids=lambda a: " ".join(a)[:60])
def test_bad_settings_are_usage_errors_naming_option_value_and_range(
    args: list[str], words: list[str]
) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not an uncaught exception
    [line] = error_lines(result)
    for word in words:
        assert word in line, (word, line)
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "words"), SETTING_ERRORS, ids=lambda a: " ".join(a)[:60])
def test_engine_settings_are_refused_before_the_model_loads(
    args: list[str], words: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from reprise.daemon.engine.engine import Engine

    def never(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(Engine, "from_pretrained", never)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    test_bad_settings_are_usage_errors_naming_option_value_and_range(args, words)


def test_the_socket_from_the_environment_is_checked_too() -> None:
    result = run("stats", env={"REPRISE_SOCKET": "nonsense"})
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert "--socket" in line and "'nonsense'" in line


def test_a_folder_without_a_model_is_named_as_such(tmp_path: Path) -> None:
    for args, option in ((["model", "info", str(tmp_path)], "PATH"), (["run", "x", "--model", str(tmp_path)], "--model")):  # fmt: skip
        result = run(*args)
        assert result.exit_code == 2
        [line] = error_lines(result)
        assert option in line and str(tmp_path) in line and "no config.json" in line
        assert "model prepare" not in line  # preparing the default model would not help


def test_a_bad_conversation_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text('{"messages": "hello"}')
    result = run("chat", "--load", str(bad))
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert "--load" in line and '"messages" must be a list' in line


# -- runtime failures: exit 1, one line ------------------------------------------------------


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Addresses where nothing, a stale socket file, and a silent listener wait."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()  # the file stays; nobody listens
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen(8)  # accepts connections (the kernel does) and never answers
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    yield {
        "missing": f"ipc://{tmp_path}/missing.sock",
        "stale": f"ipc://{tmp_path}/stale.sock",
        "silent": f"ipc://{tmp_path}/silent.sock",
        "refused": f"tcp://127.0.0.1:{port}",
    }
    silent.close()


@pytest.mark.parametrize(
    ("where", "command", "words"),
    [
        ("missing", ["stats"], ["no reprise daemon", "no socket file", "reprise serve"]),
        ("missing", ["generate", "hi"], ["no reprise daemon", "no socket file"]),
        ("missing", ["chat"], ["no reprise daemon", "no socket file"]),
        ("stale", ["stats"], ["no reprise daemon", "exists but nothing listens"]),
        ("refused", ["stats"], ["no reprise daemon", "connection refused"]),
        ("silent", ["stats"], ["is busy", "accepted the connection", "1.5 s", "--timeout"]),
        ("silent", ["generate", "hi"], ["is busy", "accepted the connection"]),
    ],
)
def test_no_daemon_and_a_busy_one_are_told_apart(
    sockets: dict[str, str], where: str, command: list[str], words: list[str]
) -> None:
    result = run(*command, "--socket", sockets[where], "--timeout", "1.5")
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: ") and sockets[where] in line
    for word in words:
        assert word in line, (word, line)


def test_debug_shows_the_traceback(sockets: dict[str, str]) -> None:
    args = ["stats", "--socket", sockets["silent"], "--timeout", "1.5"]
    for result in (
        run("--debug", *args),
        run(*args, "--debug"),  # after the command too
        run(*args, env={"REPRISE_DEBUG": "1"}),
    ):
        assert result.exit_code == 1
        assert "Traceback" in result.stderr and "DaemonUnavailable" in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("Error: the daemon at")


def test_an_unexpected_failure_is_one_line_unless_debugging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(address: str) -> str | None:
        raise OSError("the disk\nis on fire")

    monkeypatch.setattr("reprise.cli.connect.probe", broken)
    result = run("stats")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: OSError: the disk is on fire (--debug shows the traceback)"
    ]
    result = run("--debug", "stats")
    assert result.exit_code == 1 and isinstance(result.exception, OSError)


def test_a_real_process_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REPRISE_SOCKET", "REPRISE_DEBUG")}
    cli = [sys.executable, "-m", "reprise.cli.main"]
    for args, code in (
        (["generate", "x", "--temperature", "nan"], 2),
        (["stats", "--socket", "bogus"], 2),
        (["stats", "--socket", f"ipc://{tmp_path}/none.sock"], 1),
    ):
        done = subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == code, done.stderr
        assert "Traceback" not in done.stderr
        assert len([line for line in done.stderr.splitlines() if "Error" in line]) == 1
