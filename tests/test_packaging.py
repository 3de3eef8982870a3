"""The systemd unit: the directives DESIGN §6 and issue 19 ask for, a stop timeout the
drain fits in, and `systemd-analyze verify` where systemd is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reprise.daemon.serve.server import CLOSE_LINGER_S, ServerConfig

UNIT = Path(__file__).resolve().parents[1] / "packaging/systemd/reprise.service"


def directives() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def test_the_unit_carries_the_limits_and_sandboxing() -> None:
    unit = directives()
    assert unit["Type"] == "notify" and unit["RuntimeDirectory"] == "reprise"
    assert int(unit["LimitNOFILE"]) >= 4096
    assert unit["NoNewPrivileges"] == "yes" and unit["PrivateTmp"] == "yes"
    assert unit["ProtectSystem"] == "strict" and unit["ProtectHome"] == "read-only"
    assert unit["Environment"] == f"REPRISE_CACHE_DIR={unit['ReadWritePaths']}"
    # A SIGTERM is answered within the drain, one step (a few seconds on the NumPy
    # backend, tests/test_trust.py F8) and the final replies' linger.
    drain_s = ServerConfig(address="ipc:///x/y.sock").drain_timeout_s
    assert int(unit["TimeoutStopSec"]) >= 2 * (drain_s + CLOSE_LINGER_S + 5)


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    # ExecStart must name an executable that exists here: this checkout's `reprise`.
    here = Path(sys.executable).parent / "reprise"
    text = UNIT.read_text().replace("/opt/reprise/.venv/bin/reprise", str(here))
    (tmp_path / "reprise.service").write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "reprise.service")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # Unknown or misspelt keys are only warnings: any line about the unit fails the test.
    complaints = [line for line in done.stderr.splitlines() if "reprise.service" in line]
    assert done.returncode == 0 and not complaints, done.stderr
