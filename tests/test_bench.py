"""`reprise bench` on a tiny synthetic model, in process and against a daemon: every
scenario runs, its figures say what reuse did, and the JSON and the plot are written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reprise.daemon.model.synth import synth_model

BS = 16
SMALL = ["--block-size", str(BS), "--prompt-tokens", "64", "--prefix-lengths", "0,32,64",
         "--suffix-tokens", "8", "--users", "4", "--system-tokens", "48", "--turns", "3",
         "--batch-sizes", "1,2,4", "--decode-tokens", "4", "--repeats", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("bench") / "tiny")


def reprise(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reprise.cli.main", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_every_scenario_in_process(tiny: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    done = reprise("bench", "--model", str(tiny), "--backend", "numpy", *SMALL,
                   "--out", str(out), "--plot", str(png))  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert results["meta"]["backend"] == "numpy" and results["meta"]["target"] == "in-process"
    # every prompt token: an exact repeat (its first token from the stored logits row)
    assert results["repeat"]["cached_tokens_repeat"] == 64
    assert [p["cached_tokens"] for p in results["prefix"]["points"]] == [0, 32, 64]
    shared = results["shared"]
    assert shared["on"]["prefill_tokens_computed"] == 48 + 4 * 8  # the prompt once, then questions
    assert shared["off"]["prefill_tokens_computed"] == 4 * (48 + 8)
    chat = results["chat"]
    assert chat["on"]["prefill_tokens_computed"] < chat["off"]["prefill_tokens_computed"]
    assert (
        chat["off"]["turns"][-1]["prefill_tokens_computed"]
        == chat["off"]["turns"][-1]["prompt_tokens"]
    )
    assert results["hosttier"]["on"]["host_cached_tokens"] > 0
    assert results["hosttier"]["off"]["cached_tokens"] == 0
    assert [p["batch_size"] for p in results["sweep"]["points"]] == [1, 2, 4]
    assert all(p["tokens_per_s"] > 0 for p in results["sweep"]["points"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for title in ("repeat:", "prefix:", "shared:", "chat:", "sweep:", "hosttier:"):
        assert title in done.stdout


def test_against_a_daemon(tiny: Path, tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/d.sock"
    serve = subprocess.Popen(
        [sys.executable, "-m", "reprise.cli.main", "serve", "--model", str(tiny), "--backend",
         "numpy", "--socket", address, "--block-size", str(BS), "--num-device-blocks", "256"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while reprise("stats", "--socket", address, "--timeout", "1", timeout=30).returncode:
            assert time.monotonic() < deadline and serve.poll() is None, "the daemon did not start"
        out = tmp_path / "d.json"
        done = reprise("bench", "--socket", address, "--scenario", "repeat", "--scenario", "shared",
                       "--scenario", "hosttier", *SMALL, "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
        results = json.loads(out.read_text())
        assert results["meta"]["target"] == "daemon"
        assert results["repeat"]["cached_tokens_repeat"] == 64  # an exact repeat
        assert results["shared"]["on"]["prefill_tokens_computed"] == 48 + 4 * 8
        assert "hosttier" in results["skipped"]
        assert "skipped hosttier: needs two in-process engines" in done.stderr  # said, not silent
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


def test_bad_options_are_refused(tiny: Path) -> None:
    done = reprise("bench", "--model", str(tiny), "--scenario", "warp-speed")
    assert done.returncode != 0 and "unknown scenario" in done.stderr
    done = reprise("bench", "--model", str(tiny), "--batch-sizes", "1,two")
    assert done.returncode != 0 and "comma-separated integers" in done.stderr


def test_host_step_bench_runs_with_a_backend_that_does_no_math(tiny: Path, tmp_path: Path) -> None:
    """bench/bench_host_step.py runs, and its NullBackend replaces every math op of the
    Backend protocol (one it missed would run NumPy's twin and time arithmetic)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_host_step import NullBackend

    from reprise.cuda.backend import NumpyBackend
    from reprise.cuda.protocol import Backend

    math_ops = set(Backend.__annotations__) - {"name"}
    assert {op for op in math_ops if getattr(NullBackend, op) is getattr(NumpyBackend, op)} == set()
    out = tmp_path / "host.json"
    done = subprocess.run(
        [sys.executable, "bench/bench_host_step.py", "--model", str(tiny), "--prompt-tokens", "256",
         "--batch", "4", "--context", "64", "--repeats", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["cached_prompt"]["total_ms"] > 0 and result["decode"]["step_ms"] > 0
    # the prepared prompt was served from the cache too (the bench asserts its hits)
    assert result["cached_prompt_prepared"]["total_ms"] > 0
    assert [d["batch"] for d in result["decode_steps"]] == [1, 4]
    assert result["host_tier_prompt"]["host_cached_tokens"] > 0  # the bench asserts it too
    for case in [result["cached_prompt"], result["cached_prompt_prepared"],
                 result["host_tier_prompt"], *result["decode_steps"]]:  # fmt: skip
        total = case.get("total_ms", case.get("step_ms"))
        assert 0 < case["forward_ms"] < total  # the forward ran inside the step, timed apart
    assert "host time" in done.stdout


def test_block_keys_bench_checks_both_chains_agree_and_prints_the_ratio() -> None:
    done = subprocess.run(
        [sys.executable, "bench/bench_block_keys.py", "--prompt-tokens", "320", "--block-size", "16",
         "--rounds", "1"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "320-token prompt, 20 blocks of 16: hash_block per block" in done.stdout
