"""Progress bars (issue 21): `reprise run` shows the prefill of a prompt longer than one
step, `reprise serve` its warm-up; only on a terminal or when REPRISE_PROGRESS=1 forces
them, so logs and pipes stay clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reprise.daemon.model.synth import synth_model

CLI = [sys.executable, "-m", "reprise.cli.main"]
PROMPT = "one two three four five six seven eight nine ten " * 12  # 3 NumPy steps of 256 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("progress") / "tiny")


def run(tiny: Path, progress: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_PROGRESS"}
    if progress is not None:
        env["REPRISE_PROGRESS"] = progress
    return subprocess.run(
        [*CLI, "run", "--model", str(tiny), "--backend", "numpy", "--raw", PROMPT,
         "--max-tokens", "2", "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip


def test_run_shows_the_prefill_of_a_long_prompt_when_forced(tiny: Path) -> None:
    done = run(tiny, "1")
    prompt_tokens = json.loads(done.stdout)["prompt_tokens"]
    assert prompt_tokens > 512  # more than two NumPy steps of 256 tokens
    # tqdm redraws the bar in place (text mode turns its carriage returns into newlines)
    states = [s for s in done.stderr.splitlines() if s.startswith("prefill:")]
    assert any(f"256/{prompt_tokens}" in s for s in states), (prompt_tokens, states)
    assert any(f"512/{prompt_tokens}" in s for s in states), done.stderr


def test_no_bar_when_stderr_is_not_a_terminal(tiny: Path) -> None:
    done = run(tiny, None)
    assert "prefill" not in done.stderr and "loading model" not in done.stderr
    assert done.stderr == ""  # --json: nothing on stderr at all


def test_serve_shows_what_warm_up_does(tmp_path: Path, tiny: Path) -> None:
    env = {**os.environ, "REPRISE_PROGRESS": "1"}
    env.pop("NOTIFY_SOCKET", None)
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*CLI, "serve", "--model", str(tiny), "--backend", "numpy",
             "--socket", f"ipc://{tmp_path}/d.sock", "--num-device-blocks", "64"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            for _ in range(1200):
                if "serving on" in log.read_text():
                    break
                assert proc.poll() is None, log.read_text()
                subprocess.run(["sleep", "0.1"])
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    text = log.read_text()
    assert "warm-up: no decode graphs on the numpy backend; one tiny request runs" in text
    assert "warming up:" in text and "1/1" in text  # the bar, forced
    assert "warm-up done in" in text
