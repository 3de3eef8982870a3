"""The systemd unit: the directives DESIGN §6 and issue 19 ask for, a stop timeout the
drain fits in, and `systemd-analyze verify` where systemd is installed; the wheel: every
module and kernel source in it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from reprise.daemon.serve.server import CLOSE_LINGER_S, ServerConfig

UNIT = Path(__file__).resolve().parents[1] / "packaging/systemd/reprise.service"
# the source folders setup.cfg's package_dir installs as reprise.<folder>
PACKAGE_FOLDERS = ("daemon", "cuda", "blockpool", "ipc", "cli", "bench")


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



def test_the_wheel_holds_every_module_and_kernel_source(tmp_path: Path) -> None:
    """A built wheel (what `pip install` of a release gives, unlike the editable install
    the tests run from) holds every module and CUDA source of the source folders, each
    folder as the `reprise` subpackage of its name (setup.cfg's package_dir): a
    subpackage missing from `packages` imports here and fails there."""
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # a copy: the build writes its build/ folder beside the sources
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(root / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path / "dist"), str(src)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("reprise-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        held = set(zf.namelist())
    wanted = {
        f"reprise/{path.relative_to(src).as_posix()}"
        for folder in PACKAGE_FOLDERS
        for path in (src / folder).rglob("*")
        if path.suffix in (".py", ".cu", ".cuh")
    }
    assert len(wanted) > 100, len(wanted)
    assert wanted <= held, f"missing from the wheel: {sorted(wanted - held)[:10]}"
