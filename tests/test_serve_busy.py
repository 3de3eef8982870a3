"""A daemon inside a long engine step still answers `health` and `stats` (issue 21), and
bad messages (issue 19: messages are decoded and checked off the loop): the default
model on NumPy with a 2,048-token step budget prefills a 2,000-token prompt in one step
of many seconds, and `reprise stats` answers within a second meanwhile, as does the
error to a malformed message and to a generate over a limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_daemon import Daemon, Raw, recv

from reprise.ipc import Client, DaemonUnavailable, RequestError
from reprise.ipc.codec import encode
from reprise.ipc.messages import ErrorReply, Generate, Tokenize, TokenizeReply

pytestmark = pytest.mark.model


def test_stats_and_health_answer_during_a_long_step(
    tmp_path: Path, default_model_dir: Path
) -> None:
    d = Daemon(tmp_path, default_model_dir, "--max-model-len", "4096", "--num-device-blocks",
               "256", "--max-batched-tokens", "2048")  # fmt: skip
    try:
        replies: list[object] = []

        def run() -> None:
            with d.client(timeout_s=300) as client:
                try:
                    replies.extend(client.stream(list(range(1000, 3000)), max_tokens=2))
                except (RequestError, DaemonUnavailable) as e:  # killed at the end
                    replies.append(e)

        threading.Thread(target=run, daemon=True).start()
        with Client(d.address, timeout_s=1.0) as client:  # each reply within 1 s, or it fails
            deadline = time.monotonic() + 30
            while client.stats()["step_running_s"] is None:
                assert time.monotonic() < deadline, "the long step never started"
                time.sleep(0.05)
            time.sleep(1.0)  # well inside the step (the prefill takes many seconds)
            start = time.monotonic()
            health = client.health()
            took = time.monotonic() - start
            assert took < 1.0 and health.status == "ok" and health.num_requests == 1
        bad = Raw(d.address)
        for payload, code in [
            (b"\x93not a map", "bad_message"),
            (encode(Generate(id="big", token_ids=[1], sampling={"max_tokens": 10**6})),
             "bad_request"),
            (encode(Generate(id="long", prompt="a " * 200_000)), "prompt_too_long"),
        ]:  # fmt: skip
            start = time.monotonic()
            bad.send(payload)
            reply = recv(bad, timeout_s=1.0)
            took = time.monotonic() - start
            assert isinstance(reply, ErrorReply) and reply.code == code, reply
            assert took < 1.0, (code, took)
        bad.close()
        env = {k: v for k, v in os.environ.items() if k != "REPRISE_SOCKET"}
        done = subprocess.run(
            [sys.executable, "-m", "reprise.cli.main", "stats", "--json", "--socket", d.address,
             "--timeout", "1"],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        stats = json.loads(done.stdout)
        assert stats["num_requests"] == 1 and stats["step_running_s"] >= 1.0, stats
        assert not replies, "the prefill ended before stats was asked; the test proves nothing"
    finally:
        d.proc.kill()  # not worth waiting for the step (a minute on a loaded machine)
        d.stop()


def test_tokenizes_in_flight_are_bounded_by_max_queue(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """Tokenize requests queued behind an engine step reach the loop together: with
    --max-queue 2, two are answered and the rest get `busy` (each under its own id), so a
    client cannot queue unbounded tokenizer work."""
    d = Daemon(tmp_path, default_model_dir, "--max-queue", "2", "--max-batched-tokens", "1024",
               "--max-model-len", "1024")  # fmt: skip
    try:
        done: list[object] = []

        def run() -> None:
            with d.client(timeout_s=300) as client:
                done.append(client.generate(list(range(1000, 1800)), max_tokens=1))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        with Client(d.address, timeout_s=5.0) as client:
            deadline = time.monotonic() + 30
            while client.stats()["step_running_s"] is None:
                assert time.monotonic() < deadline, "the long step never started"
                time.sleep(0.02)
        burst = Raw(d.address)
        for i in range(5):
            burst.send(encode(Tokenize(id=f"t{i}", prompt="a few words " * 50)))
        replies = [recv(burst, timeout_s=120) for _ in range(5)]
        burst.close()
        thread.join(timeout=120)
        assert done, "the generate did not finish"
        answered = sorted(r.id for r in replies if isinstance(r, TokenizeReply))
        busy = sorted(r.id for r in replies if isinstance(r, ErrorReply) and r.code == "busy")
        assert len(answered) == 2 and len(busy) == 3, replies
        assert sorted(answered + busy) == [f"t{i}" for i in range(5)]
        with d.client() as client:  # and the next one is answered
            assert len(client.tokenize("a few words")) == 3
    finally:
        d.stop()
    assert d.proc.returncode == 0
