"""scripts/setup.sh picks the CuPy extra from the NVIDIA driver's CUDA version."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = """Mon Nov 23 10:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""


def cuda_extra(
    tmp_path: Path, smi_output: str | None, rc: int = 0, **env: str
) -> subprocess.CompletedProcess:
    """Run `setup.sh cuda-extra` with a fake nvidia-smi printing `smi_output` and exiting
    with `rc` (None: no nvidia-smi on PATH at all)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if smi_output is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat <<'END'\n{smi_output}END\nexit {rc}\n")
        smi.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    environ = {k: v for k, v in os.environ.items() if k != "REPRISE_CUDA"}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "cuda-extra"],
        env={**environ, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )


@pytest.mark.parametrize(
    ("cuda", "extra"),
    [("13.0", "cuda13"), ("13.2", "cuda13"), ("14.1", "cuda13"), ("12.4", "cuda12")],
)
def test_extra_follows_the_driver(tmp_path: Path, cuda: str, extra: str) -> None:
    run = cuda_extra(tmp_path, HEADER.format(driver="580.65.06", cuda=cuda))
    assert run.stdout.strip() == extra


def test_no_driver_no_extra(tmp_path: Path) -> None:
    assert cuda_extra(tmp_path, None).stdout.strip() == ""


def test_driver_that_fails_means_no_extra(tmp_path: Path) -> None:
    # nvidia-smi installed but no device or driver loaded: it prints an error, no header
    failed = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    run = cuda_extra(tmp_path, failed, rc=9)
    assert run.stdout.strip() == ""


def test_old_driver_is_named(tmp_path: Path) -> None:
    run = cuda_extra(tmp_path, HEADER.format(driver="470.256.02", cuda="11.4"))
    assert run.stdout.strip() == ""
    assert "CUDA 11 is older" in run.stderr


@pytest.mark.parametrize(("choice", "extra"), [("none", ""), ("12", "cuda12"), ("13", "cuda13")])
def test_override(tmp_path: Path, choice: str, extra: str) -> None:
    run = cuda_extra(tmp_path, HEADER.format(driver="580.65.06", cuda="13.0"), REPRISE_CUDA=choice)
    assert run.stdout.strip() == extra


def test_a_bad_override_is_refused(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as e:
        cuda_extra(tmp_path, None, REPRISE_CUDA="cuda13")
    assert "REPRISE_CUDA must be 12, 13 or none; got 'cuda13'" in e.value.stderr
