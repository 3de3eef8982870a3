"""The HTTP server's browser and transport settings: CORS only for --allowed-origins (none
by default), HTTPS with --ssl-certfile and --ssl-keyfile, each checked before the model
loads."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from http_support import HttpDaemon
from starlette.testclient import TestClient

from reprise.daemon.serve.http import create_app
from reprise.daemon.serve.http_config import HttpConfig

APP = "http://app.example:3000"
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip


def _client(**config: object) -> TestClient:
    return TestClient(create_app(HttpConfig(**config), "ipc:///nowhere"))  # type: ignore[arg-type]


def test_no_origin_may_call_by_default() -> None:
    """A web page's preflight gets no CORS grant, and a simple request no allow header, so
    a browser keeps the answer from the page (a loopback server stays the user's)."""
    client = _client()
    answer = client.options("/v1/completions", headers={"Origin": APP, **PREFLIGHT})
    assert "access-control-allow-origin" not in answer.headers
    answer = client.get("/version", headers={"Origin": APP})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_allowed_origins_get_cors_and_others_do_not() -> None:
    client = _client(allowed_origins=(APP,))
    answer = client.options("/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == APP
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    assert client.get("/version", headers={"Origin": APP}).headers[
        "access-control-allow-origin"] == APP  # fmt: skip
    other = client.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                       **PREFLIGHT})  # fmt: skip
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    anyone = _client(allowed_origins=("*",))
    assert anyone.get("/version", headers={"Origin": "http://x.example"}).headers[
        "access-control-allow-origin"] == "*"  # fmt: skip


def test_the_api_key_still_guards_an_allowed_origin() -> None:
    client = _client(allowed_origins=(APP,), api_key="k")
    assert client.get("/v1/models", headers={"Origin": APP}).status_code == 401


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"allowed_origins": ("app.example",)}, "allowed origin must be '*' or scheme://host"),
        ({"allowed_origins": ("http://a.example/path",)}, "(no path)"),
        ({"ssl_keyfile": "k.pem"}, "TLS needs both --ssl-keyfile and --ssl-certfile"),
        ({"ssl_keyfile": "/nope/k.pem", "ssl_certfile": "/nope/c.pem"}, "--ssl-certfile /nope"),
    ],
)
def test_bad_settings_are_refused_in_one_line(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        HttpConfig(**config)
    assert "\n" not in str(refused.value)


def test_the_command_line_refuses_them_before_loading(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "reprise.cli.main", "serve", "--model", str(tmp_path / "none"),
           "--socket", f"ipc://{tmp_path}/s"]  # fmt: skip
    for extra, message in [
        (["--http", ":0", "--allowed-origins", '["a"'], "--allowed-origins is not a JSON list"),
        (["--http", ":0", "--allowed-origins", "ftp://x"], "allowed origin must be"),
        (["--http", ":0", "--ssl-certfile", "c.pem"], "TLS needs both"),
        (["--allowed-origins", "*"], "--allowed-origins is an HTTP setting: it needs --http"),
    ]:
        done = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (extra, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, (extra, done.stderr)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl's command line)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    tmp = tmp_path_factory.mktemp("tls")
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def https_daemon(
    tmp_path_factory: pytest.TempPathFactory, certificate: tuple[Path, Path]
) -> Iterator[HttpDaemon]:
    from reprise.daemon.model.synth import synth_model

    key, cert = certificate
    tiny = synth_model("tiny", tmp_path_factory.mktemp("synth") / "tiny", seed=4)
    d = HttpDaemon(tmp_path_factory.mktemp("https"), tiny, "--ssl-keyfile", str(key),
                   "--ssl-certfile", str(cert),
                   verify=ssl.create_default_context(cafile=cert))  # fmt: skip
    yield d
    d.stop()


def test_https_serves_with_the_certificate_and_plain_http_is_refused(
    https_daemon: HttpDaemon, certificate: tuple[Path, Path]
) -> None:
    url = https_daemon.url
    assert url.startswith("https://127.0.0.1:")
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    trusted = ssl.create_default_context(cafile=certificate[1])
    answer = httpx.post(f"{url}/v1/completions", json=body, verify=trusted)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/health", verify=ssl.create_default_context())  # not trusted
    with pytest.raises(httpx.HTTPError):  # no plain HTTP on the TLS port
        httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
