"""The HTTP API's sampling defaults from the model's generation_config.json
(generation_defaults.py, vLLM's --generation-config and --override-generation-config):
read, checked before anything loads, applied only where a request sets nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reprise.daemon.serve.generation_defaults import generation_defaults
from reprise.daemon.serve.openai_api import parse_request

openai = pytest.importorskip("openai")
from http_support import HttpDaemon  # noqa: E402

QWEN3_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
              "bos_token_id": 1, "eos_token_id": [2, 3], "max_new_tokens": 40}  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_model_folders_sampling_keys_are_read(tmp_path: Path) -> None:
    folder = _folder(tmp_path, QWEN3_LIKE)
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 40}
    assert generation_defaults("auto", folder) == want
    assert generation_defaults(str(folder), None) == want  # a folder named outright
    assert generation_defaults("vllm", folder) == {}
    assert generation_defaults("auto", None) == {}  # no folder (the default model, a GGUF)
    assert generation_defaults("auto", tmp_path / "nowhere") == {}
    override = '{"temperature": 0.0, "min_p": 0.1, "top_k": -1}'
    assert generation_defaults("auto", folder, override) == {
        "temperature": 0.0, "top_p": 0.95, "min_p": 0.1, "max_tokens": 40}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "override", "message"),
    [
        ({"temperature": -0.5}, None, "generation_config: temperature must be finite and >= 0"),
        ({"top_p": 2}, None, "generation_config: top_p must be"),
        ({}, '{"top_k": 1.5}', "--override-generation-config: top_k must be"),
        ({}, '{"temprature": 1}', "unknown key 'temprature'; known: temperature"),
        ({}, "[1]", "--override-generation-config must be a JSON object"),
        ({}, "{", "--override-generation-config is not JSON"),
    ],
)
def test_bad_defaults_are_refused_in_one_line(
    tmp_path: Path, config: dict, override: str | None, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        generation_defaults("auto", _folder(tmp_path, config), override)
    assert "\n" not in str(refused.value)


def test_a_folder_without_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("no generation_config.json there")):
        generation_defaults(str(tmp_path), None)


def test_a_request_sets_what_it_sets_and_the_defaults_fill_the_rest() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 40}
    options = parse_request("chat", CHAT, max_tokens_default=64, defaults=defaults).options
    assert (options["temperature"], options["top_p"], options["top_k"]) == (0.6, 0.95, 20)
    assert options["max_tokens"] == 40 and options["fit_max_tokens"]  # the smaller default
    body = {**CHAT, "temperature": 0, "top_p": None, "top_k": -1, "max_tokens": 50}
    options = parse_request("chat", body, max_tokens_default=64, defaults=defaults).options
    assert options["temperature"] == 0 and options["top_p"] == 0.95  # null: the default
    assert "top_k" not in options  # -1: no limit, as the request says
    assert options["max_tokens"] == 50 and "fit_max_tokens" not in options
    # a completion's default is OpenAI's 16 unless the model's is smaller
    completion = {"prompt": "x"}
    assert parse_request("completions", completion, defaults=defaults).options["max_tokens"] == 16
    few = {"max_tokens": 5}
    assert parse_request("completions", completion, defaults=few).options["max_tokens"] == 5
    assert "temperature" not in parse_request("completions", completion).options


def test_the_command_line_refuses_bad_defaults_before_loading(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "reprise.cli.main", "serve", "--model", str(tmp_path / "none"),
           "--socket", f"ipc://{tmp_path}/s", "--http", "127.0.0.1:0"]  # fmt: skip
    done = subprocess.run([*cmd, "--override-generation-config", '{"temperature": -1}'],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "--override-generation-config: temperature must be finite" in done.stderr
    assert "Traceback" not in done.stderr and "loading" not in done.stderr
    no_http = [c for c in cmd if c not in ("--http", "127.0.0.1:0")]
    done = subprocess.run([*no_http, "--override-generation-config", "{}"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "it needs --http" in done.stderr


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    """The tiny model whose generation_config.json asks for greedy answers of 7 tokens."""
    from reprise.daemon.model.synth import synth_model

    tiny = synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=4)
    config = {"temperature": 0.0, "max_new_tokens": 7}
    (tiny / "generation_config.json").write_text(json.dumps(config))
    d = HttpDaemon(tmp_path_factory.mktemp("defaults"), tiny, "--served-model-name", "tiny")
    yield d
    d.stop()


def test_the_daemon_answers_with_the_models_defaults(greedy_by_default: HttpDaemon) -> None:
    """Without temperature the answers are greedy (the file's 0.0), so two unseeded ones
    agree with an explicit temperature 0, and 7 tokens long (max_new_tokens); a request's
    own temperature 1.0 with seeds draws other tokens."""
    api = openai.OpenAI(base_url=f"{greedy_by_default.url}/v1", api_key="x")

    def answer(**kw: object) -> tuple[str, int]:
        out = api.completions.create(
            model="tiny", prompt="hello there", extra_body={"ignore_eos": True}, **kw
        )
        return out.choices[0].text, out.usage.completion_tokens

    first = answer(max_tokens=7)
    assert answer(max_tokens=7) == first == answer(max_tokens=7, temperature=0)
    drawn = {answer(max_tokens=7, temperature=1.0, seed=s)[0] for s in range(6)}
    assert drawn - {first[0]}, "a request's own temperature must win"
    chat = api.chat.completions.create(model="tiny", messages=CHAT["messages"],
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert chat.usage.completion_tokens == 7
