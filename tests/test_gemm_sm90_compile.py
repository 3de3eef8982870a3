"""gemm_sm90.cu builds for sm_90a through NVRTC, without a GPU, as the launcher builds it
(test_kernels_compile.py builds every source for sm_80 and sm_90, where this file's entry
points trap): every entry point in the cubin, no warning, and, where a cuobjdump is on
PATH, warpgroup MMA (HGMMA.64x128x16) in each entry point's SASS and no local memory."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from reprise.cuda import nvrtc
from reprise.cuda.gemm_sm90_kernel import ARCH, CONFIGS, SOURCE, WS

pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def cubin() -> bytes:
    try:
        nvrtc.compile_options(ARCH)
        nvrtc._library()
    except nvrtc.NvrtcUnavailable as e:
        if os.environ.get("CI"):  # CI installs it: missing there is a failure, not a skip
            raise
        pytest.skip(str(e))
    compiled = nvrtc.compile_source(nvrtc.kernel_source(SOURCE), SOURCE.name, ARCH)
    assert "warning" not in compiled.log.lower(), compiled.log
    return compiled.cubin


def test_every_entry_point_builds_for_sm90a(cubin: bytes) -> None:
    assert cubin[:4] == b"\x7fELF"
    names = nvrtc.kernel_names(nvrtc.kernel_source(SOURCE))
    assert names == [c.kernel_name(f32) for c in (*CONFIGS, WS) for f32 in (False, True)]
    for name in names:
        assert name.encode() + b"\x00" in cubin, name


def cuda_tool(name: str) -> Path | None:
    """A CUDA binary on PATH, else in the pip wheels' nvidia/cu*/bin (nvidia-cuda-cuobjdump,
    nvidia-cuda-nvdisasm)."""
    found = shutil.which(name)
    if found:
        return Path(found)
    hits = [p for root in nvrtc._nvidia_dirs() for p in sorted(root.glob(f"cu*/bin/{name}"))]
    return hits[-1] if hits else None


def test_the_sass_runs_on_warpgroup_mma(cubin: bytes, tmp_path: Path) -> None:
    tool, disasm = cuda_tool("cuobjdump"), cuda_tool("nvdisasm")
    if tool is None or disasm is None:
        pytest.skip("needs cuobjdump and nvdisasm (the nvidia-cuda-cuobjdump and -nvdisasm wheels)")
    path = tmp_path / "gemm_sm90.cubin"
    path.write_bytes(cubin)
    env = {**os.environ, "NVDISASM_PATH": str(disasm.parent)}
    sass = subprocess.run(
        [str(tool), "-sass", str(path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert sass.returncode == 0, sass.stderr
    functions = sass.stdout.split("Function : ")[1:]
    assert len(functions) == 2 * (len(CONFIGS) + 1)
    for text in functions:
        name = text.split()[0]
        assert "HGMMA.64x128x16.F32.BF16" in text, name
        assert "LDGSTS" in text, name  # cp.async
        assert "LDL" not in text and "STL" not in text, name  # nothing spilled to local memory
        if name.startswith("gemm_sm90_ws_"):
            assert "UBLKCP" in text, name  # the bulk copies of the packed weight
            assert "SYNCS.PHASECHK" in text and "ARRIVES.LDGSTSBAR" in text, name  # mbarriers
