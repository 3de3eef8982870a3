"""A real `reprise serve --http 127.0.0.1:0` (NumPy backend) for the HTTP tests, a test
module's daemon (`served`, for its fixture), and a /metrics scraper (test_http.py,
test_router.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class HttpDaemon:
    """`reprise serve --http 127.0.0.1:0`; the port is read from its log. With
    `wait=False` the caller calls `wait_ready()` (to start several at once)."""

    def __init__(self, tmp: Path, model_dir: Path, *extra: str, env: dict | None = None,
                 wait: bool = True, verify: ssl.SSLContext | bool = True) -> None:  # fmt: skip
        tmp.chmod(0o700)
        self.address = f"ipc://{tmp}/d.sock"
        self.log_path = tmp / "serve.log"
        self.log = self.log_path.open("w+")
        self.url = ""
        self.verify = verify  # for HTTPS: the certificate the daemon serves
        env = {**os.environ, **(env or {})}
        env.pop("REPRISE_SOCKET", None)
        cmd = [
            sys.executable, "-m", "reprise.cli.main", "serve",
            "--model", str(model_dir), "--backend", "numpy", "--socket", self.address,
            "--block-size", "16", "--num-device-blocks", "96", "--max-model-len", "256",
            "--max-tokens-cap", "64", "--http", "127.0.0.1:0", *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 120) -> str:
        try:
            self.url = self._wait_ready(timeout_s)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        return self.url

    def _wait_ready(self, timeout_s: float) -> str:
        deadline, url = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline and self.proc.poll() is None:
            if url is None:
                found = re.search(r"HTTP on (https?://\S+:\d+)", self.log_path.read_text())
                url = found.group(1) if found else None
            else:
                with contextlib.suppress(httpx.TransportError):
                    health = httpx.get(f"{url}/health", timeout=5, verify=self.verify)
                    if health.status_code == 200:
                        return url
            time.sleep(0.05)
        raise AssertionError(f"the daemon never became ready; log:\n{self.read_log()[-3000:]}")

    def read_log(self) -> str:
        return self.log_path.read_text()

    def openai(self, api_key: str = "none"):  # -> openai.OpenAI (an optional package)
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.log.close()


@contextlib.contextmanager
def served(tmp: Path, model_dir: Path, *extra: str) -> Iterator[HttpDaemon]:
    """An HttpDaemon (`extra`: more `serve` options) for a test module's fixture: stopped
    after, and then checked to have exited cleanly (its log's tail if not)."""
    d = HttpDaemon(tmp, model_dir, *extra)
    try:
        yield d
    finally:
        d.stop()
    assert d.proc.returncode == 0, d.read_log()[-2000:]


def scrape(url: str) -> Samples:
    """Every sample of `url`/metrics, parsed by prometheus_client's own parser."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples}  # fmt: skip
