"""The HTTP front end against ZeroMQ on the same daemon (issue 20).

    python bench/bench_http.py [--model DIR] [--requests 200] [--clients 32] [--out FILE]

Starts `reprise serve --http 127.0.0.1:0` (NumPy backend; by default on a `tiny`
random-weight model, so the engine's own time is small and the front end's shows),
then measures, on that one daemon:
- time to first token of one request at a time, ZeroMQ (`Client.stream`) and HTTP
  (`POST /v1/completions`, `stream: true`, over a kept-alive connection), interleaved;
  the extra time HTTP costs is the difference of the two at p50 and at p99
  (target: <= 1 ms at p50 on loopback);
- requests/s with `--clients` concurrent streaming clients, each sending requests of
  `--tokens` tokens back to back, over each front end.
The HTTP layer is itself a ZeroMQ client of the daemon (one more local hop, a worker
thread and an asyncio queue per request), which the first figure prices.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from reprise.ipc import Client, TokenChunk

TARGET_EXTRA_TTFT_MS = 1.0
PROMPT = "The quick brown fox jumps over the lazy dog"


def start_daemon(model: Path, tmp: Path) -> tuple[subprocess.Popen, str, str, Path]:
    address = f"ipc://{tmp}/d.sock"
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_SOCKET"}
    cmd = [sys.executable, "-m", "reprise.cli.main", "serve", "--model", str(model),
           "--backend", "numpy", "--socket", address, "--http", "127.0.0.1:0",
           "--block-size", "16", "--max-model-len", "1024"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline, url = time.monotonic() + 300, None
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"HTTP on (http://\S+:\d+)", log.read_text())
        if found:
            url = found.group(1)
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    return proc, address, url, log
            except httpx.TransportError:
                pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise SystemExit(f"the daemon did not start; log:\n{log.read_text()[-2000:]}")


def ttft_zmq(client: Client, max_tokens: int) -> float:
    t0 = time.perf_counter()
    stream = client.stream(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    first = None
    for item in stream:
        if first is None and isinstance(item, TokenChunk):
            first = time.perf_counter() - t0
    assert first is not None
    return first


def ttft_http(http: httpx.Client, url: str, max_tokens: int) -> float:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    assert first is not None
    return first


def throughput(send_one, num_clients: int, per_client: int) -> float:
    """Requests/s of `num_clients` threads each calling `send_one(state)` `per_client` times."""
    barrier = threading.Barrier(num_clients + 1)
    errors: list[BaseException] = []

    def run() -> None:
        state = None
        try:
            barrier.wait()
            for _ in range(per_client):
                state = send_one(state)
        except BaseException as e:  # reported after the run
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(num_clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return num_clients * per_client / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: a tiny random model")
    parser.add_argument("--requests", type=int, default=200, help="sequential requests each way")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--per-client", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per throughput request")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tmp.chmod(0o700)
        model = args.model
        if model is None:
            from reprise.daemon.model.synth import synth_model

            model = synth_model("tiny", tmp / "tiny", seed=3)
        proc, address, url, _ = start_daemon(model, tmp)
        try:
            figures = measure(args, address, url)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    figures["model"] = str(args.model or "synth tiny")
    figures["cpus"] = os.cpu_count()
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)  # other work on the machine
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


def measure(args: argparse.Namespace, address: str, url: str) -> dict:
    zmq_s, http_s = [], []
    with Client(address) as client, httpx.Client(timeout=300) as http:
        for _ in range(10):  # warm both paths (connections, threads, caches)
            ttft_zmq(client, 1)
            ttft_http(http, url, 1)
        for _ in range(args.requests):
            zmq_s.append(ttft_zmq(client, 1))
            http_s.append(ttft_http(http, url, 1))
    zmq_ms, http_ms = np.array(zmq_s) * 1e3, np.array(http_s) * 1e3
    figures: dict = {"requests": args.requests}
    for q in (50, 99):
        z, h = float(np.percentile(zmq_ms, q)), float(np.percentile(http_ms, q))
        figures[f"ttft_ms_p{q}"] = {"zmq": round(z, 3), "http": round(h, 3),
                                    "extra": round(h - z, 3)}  # fmt: skip
    extra_p50 = figures["ttft_ms_p50"]["extra"]
    print(f"time to first token, p50: ZeroMQ {figures['ttft_ms_p50']['zmq']:.3f} ms, HTTP "
          f"{figures['ttft_ms_p50']['http']:.3f} ms: +{extra_p50:.3f} ms "
          f"(target <= {TARGET_EXTRA_TTFT_MS} ms: {'met' if extra_p50 <= TARGET_EXTRA_TTFT_MS else 'MISSED'})")  # fmt: skip
    print(f"time to first token, p99: ZeroMQ {figures['ttft_ms_p99']['zmq']:.3f} ms, HTTP "
          f"{figures['ttft_ms_p99']['http']:.3f} ms: +{figures['ttft_ms_p99']['extra']:.3f} ms")  # fmt: skip

    def zmq_one(client: Client | None) -> Client:
        client = client or Client(address)
        for _ in client.stream(PROMPT, max_tokens=args.tokens, ignore_eos=True):
            pass
        return client

    def http_one(http: httpx.Client | None) -> httpx.Client:
        http = http or httpx.Client(timeout=300)
        body = {"prompt": PROMPT, "max_tokens": args.tokens, "stream": True, "ignore_eos": True}
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                pass
        return http

    for name, one in (("zmq", zmq_one), ("http", http_one)):
        rate = throughput(one, args.clients, args.per_client)
        figures[f"requests_per_s_{name}"] = round(rate, 2)
        print(f"{args.clients} concurrent streaming clients over {name}: {rate:.1f} requests/s "
              f"({args.tokens} tokens each)")  # fmt: skip
    return figures


if __name__ == "__main__":
    main()
