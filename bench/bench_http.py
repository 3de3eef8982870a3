"""The HTTP front end against ZeroMQ on the same daemon (issue 20).

    python bench/bench_http.py [--model DIR] [--requests 200] [--clients 32] [--out FILE]
                               [--baseline-src DIR ...]

Starts `reprise serve --http 127.0.0.1:0` (NumPy backend, one BLAS thread; by default
on a `tiny` random-weight model, so the engine's own time is small and the front
end's shows), then measures, on that one daemon:
- time to first token of one request at a time, ZeroMQ (`Client.stream`) and HTTP
  (`POST /v1/completions`, `stream: true`, over a kept-alive connection), interleaved;
  the extra time HTTP costs is the difference of the two at p50 and at p99
  (target: <= 1 ms at p50 on loopback);
- the daemon's CPU time per request over each (from /proc: hardly moved by other work
  on a shared machine, unlike wall time);
- requests/s with `--clients` concurrent streaming clients, each sending requests of
  `--tokens` tokens back to back, over each front end.
With `--baseline-src DIR` (repeatable), a daemon run from another source tree (DIR
holding `reprise/`, e.g. unpacked from `git archive REV`) is measured in the same run,
its sequential requests interleaved with the current one's: before/after under the
same load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
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


def start_daemon(
    model: Path, tmp: Path, src: Path | None = None
) -> tuple[subprocess.Popen, str, str, Path]:
    """A daemon with --http; `src`: a folder holding another `reprise` package to run."""
    address = f"ipc://{tmp}/d.sock"
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_SOCKET"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    # One BLAS thread: on a small shared machine, BLAS threads spinning beside the
    # front end's would measure the machine, not the front end.
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
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


class RawHttp:
    """A minimal HTTP/1.1 client on one kept-alive socket, for the time to first token
    without an HTTP library's own cost (httpx spends about 1 ms of the client's CPU on
    a streamed request); it reads until the first event, then to the last chunk."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ttft(self, max_tokens: int) -> float:
        body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()  # fmt: skip
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        t0 = time.perf_counter()
        self.sock.sendall(head.encode() + body)
        data, first = b"", None
        while not data.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of the stream
            piece = self.sock.recv(1 << 16)
            assert piece, "the server closed the connection"
            data += piece
            if first is None and b"data: {" in data:
                first = time.perf_counter() - t0
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert first is not None
        return first

    def close(self) -> None:
        self.sock.close()


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
    parser.add_argument("--baseline-src", type=Path, action="append", default=[],
                        help="also measure, in the same run, a daemon run from this folder "
                        "(named after it), which holds another version as `reprise/` (e.g. "
                        "from `git archive REV`); may be repeated")  # fmt: skip
    parser.add_argument("--note", default=None, help="a line kept with the figures")
    args = parser.parse_args()
    load_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tmp.chmod(0o700)
        model = args.model
        if model is None:
            from reprise.daemon.model.synth import synth_model

            model = synth_model("tiny", tmp / "tiny", seed=3)
        sides: dict[str, Path | None] = {src.name: src.resolve() for src in args.baseline_src}
        sides["current"] = None
        daemons = {}
        try:
            for name, src in sides.items():
                (tmp / name).mkdir(mode=0o700)
                proc, address, url, _ = start_daemon(model, tmp / name, src)
                daemons[name] = (proc, address, url)
            figures = measure(args, {n: (a, u, p.pid) for n, (p, a, u) in daemons.items()})
        finally:
            for proc, _, _ in daemons.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    figures["model"] = str(args.model or "synth tiny")
    if args.note:
        figures["note"] = args.note
    figures["cpus"] = os.cpu_count()
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)  # other work on the machine
    figures["load_average_1m_before"] = load_before
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


def cpu_s(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ms_per_request(pid: int, send_one, num_requests: int) -> float:
    """The daemon's CPU per request, one request at a time: unlike wall time, hardly
    moved by other work on the machine."""
    before = cpu_s(pid)
    for _ in range(num_requests):
        send_one()
    return (cpu_s(pid) - before) / num_requests * 1e3


def measure(args: argparse.Namespace, sides: dict[str, tuple[str, str, int]]) -> dict:
    """Per side (a daemon: its socket address, HTTP URL and pid), ZeroMQ against HTTP;
    the sides' sequential requests are interleaved, so they share the machine's moments."""
    samples = {name: {"zmq": [], "http": [], "http_raw": []} for name in sides}
    clients = {name: Client(address) for name, (address, _, _) in sides.items()}
    raws = {name: RawHttp(url) for name, (_, url, _) in sides.items()}
    with httpx.Client(timeout=300) as http:
        for i in range(10 + args.requests):  # the first 10 warm both paths up
            for name, (_, url, _) in sides.items():
                got = {"zmq": ttft_zmq(clients[name], 1), "http": ttft_http(http, url, 1),
                       "http_raw": raws[name].ttft(1)}  # fmt: skip
                if i >= 10:
                    for front, value in got.items():
                        samples[name][front].append(value)
        cpu = {name: {"zmq": cpu_ms_per_request(pid, lambda c=clients[name]: ttft_zmq(c, 1),
                                                 args.requests),
                      "http": cpu_ms_per_request(pid, lambda u=url: ttft_http(http, u, 1),
                                                 args.requests)}
               for name, (_, url, pid) in sides.items()}  # fmt: skip
    for client in clients.values():
        client.close()
    for raw in raws.values():
        raw.close()
    figures: dict = {"requests": args.requests}
    for name, (address, url, _) in sides.items():
        figures[name] = side = {}
        side["daemon_cpu_ms_per_request"] = {k: round(v, 3) for k, v in cpu[name].items()}
        print(f"{name}: daemon CPU per request (1 token): ZeroMQ {cpu[name]['zmq']:.3f} ms, "
              f"HTTP {cpu[name]['http']:.3f} ms")  # fmt: skip
        for q in (50, 99):
            z, h, r = (float(np.percentile(np.array(samples[name][front]) * 1e3, q))
                       for front in ("zmq", "http", "http_raw"))  # fmt: skip
            side[f"ttft_ms_p{q}"] = {"zmq": round(z, 3), "http": round(h, 3),
                                     "extra": round(h - z, 3), "http_raw": round(r, 3),
                                     "extra_raw": round(r - z, 3)}  # fmt: skip
        for q in (50, 99):
            t = side[f"ttft_ms_p{q}"]
            met = (
                ""
                if q == 99
                else (
                    " (target <= 1 ms: "
                    + ("met)" if t["extra_raw"] <= TARGET_EXTRA_TTFT_MS else "MISSED)")
                )
            )
            print(f"{name}: time to first token, p{q}: ZeroMQ {t['zmq']:.3f} ms, HTTP "
                  f"{t['http']:.3f} ms (httpx): +{t['extra']:.3f} ms, "
                  f"{t['http_raw']:.3f} ms (minimal client): +{t['extra_raw']:.3f} ms{met}")  # fmt: skip
        senders = {"zmq": zmq_sender(address, args), "http": http_sender(url, args),
                   "http_raw": raw_sender(url, args)}  # fmt: skip
        for front, one in senders.items():
            rate = throughput(one, args.clients, args.per_client)
            side[f"requests_per_s_{front}"] = round(rate, 2)
            print(f"{name}: {args.clients} concurrent streaming clients over {front}: "
                  f"{rate:.1f} requests/s ({args.tokens} tokens each)")  # fmt: skip
    return figures


def zmq_sender(address: str, args: argparse.Namespace):
    def one(client: Client | None) -> Client:
        client = client or Client(address)
        for _ in client.stream(PROMPT, max_tokens=args.tokens, ignore_eos=True):
            pass
        return client

    return one


def raw_sender(url: str, args: argparse.Namespace):
    def one(raw: RawHttp | None) -> RawHttp:
        raw = raw or RawHttp(url)
        raw.ttft(args.tokens)
        return raw

    return one


def http_sender(url: str, args: argparse.Namespace):
    def one(http: httpx.Client | None) -> httpx.Client:
        http = http or httpx.Client(timeout=300)
        body = {"prompt": PROMPT, "max_tokens": args.tokens, "stream": True, "ignore_eos": True}
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                pass
        return http

    return one


if __name__ == "__main__":
    main()
