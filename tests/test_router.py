"""reprise behind a cache-aware router from PyPI (issue 20, "more than one machine"):
sglang-router's `cache_aware` policy in front of three `reprise serve --http` daemons
on loopback (NumPy backend, a tiny random model). Distinct prompts sent together spread
over the daemons; a prompt sent again lands on the daemon that holds its blocks, which
its `cached_tokens` and that daemon's own /metrics hit counter both show."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install "
                    "sglang-router, or the `test` extra)")  # fmt: skip
from http_support import HttpDaemon, scrape

NUM_DAEMONS = 3
HITS = ("reprise_prefix_cache_hits_tokens_total", (("tier", "device"),))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[HttpDaemon]]:
    from reprise.daemon.model.synth import synth_model

    model = synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=3)
    started = [HttpDaemon(tmp_path_factory.mktemp(f"d{i}"), model, "--served-model-name",
                          "tiny", wait=False) for i in range(NUM_DAEMONS)]  # fmt: skip
    try:
        for d in started:
            d.wait_ready()
        yield started
    finally:
        for d in started:
            d.stop()


@pytest.fixture(scope="module")
def router(daemons: list[HttpDaemon], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--policy", "cache_aware",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-urls", *(d.url for d in daemons)]  # fmt: skip
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                workers = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
                if len(workers) == NUM_DAEMONS and all(w["is_healthy"] for w in workers):
                    break
            except (httpx.TransportError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"the router never listed {NUM_DAEMONS} healthy workers; "
                                 f"log:\n{log_path.read_text()[-3000:]}")  # fmt: skip
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def served_by(samples: list[dict]) -> list[float]:
    """Requests each daemon finished, from its own /metrics."""
    return [sum(v for (name, _), v in s.items() if name == "reprise_requests_total")
            for s in samples]  # fmt: skip


def test_repeated_prefixes_land_on_the_daemon_that_holds_them(
    router: str, daemons: list[HttpDaemon]
) -> None:
    rng = random.Random(7)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(200)
    ]
    # Six prompts with nothing in common (~80 tokens each: several full blocks of 16).
    prompts = [" ".join(rng.sample(words, 24)) for _ in range(6)]
    barrier = threading.Barrier(len(prompts))

    def send(prompt: str, wait: bool = False) -> dict:
        if wait:
            barrier.wait()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    before = [scrape(d.url) for d in daemons]
    with ThreadPoolExecutor(len(prompts)) as pool:  # together: the router balances by load
        first = list(pool.map(lambda p: send(p, wait=True), prompts))
    after = [scrape(d.url) for d in daemons]
    # (a few cached tokens at most: prompts share no full block, only maybe a partial one)
    first_cached = [u["prompt_tokens_details"]["cached_tokens"] for u in first]
    assert all(c < 16 for c in first_cached), first_cached
    spread = [a - b for a, b in zip(served_by(after), served_by(before), strict=True)]
    assert sum(spread) == len(prompts)
    assert sum(n > 0 for n in spread) >= 2, f"one daemon served everything: {spread}"

    for prompt, was_cached in zip(
        prompts, first_cached, strict=True
    ):  # one at a time, so each daemon's counters name the one served
        before = [scrape(d.url) for d in daemons]
        usage = send(prompt)
        after = [scrape(d.url) for d in daemons]
        served = [a - b for a, b in zip(served_by(after), served_by(before), strict=True)]
        hits = [a[HITS] - b[HITS] for a, b in zip(after, before, strict=True)]
        assert sorted(served) == [0] * (NUM_DAEMONS - 1) + [1]
        where = served.index(1)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16 + was_cached, f"a repeat found too little cached on daemon {where}"
        assert hits[where] > 0 and sum(hits) == hits[where], (served, hits)
