"""gemm_sm90.cu builds for sm_90a through NVRTC, without a GPU, as the launcher builds it
(test_kernels_compile.py builds every source for sm_80 and sm_90, where this file's entry
points trap): every entry point in the cubin, no warning, every one (the split-K routes
included) within its launch bounds' registers with no local memory (spills), and, where
a cuobjdump is on PATH, warpgroup MMA (HGMMA.64x128x16) in each entry point's SASS."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from reprise.cuda import nvrtc
from reprise.cuda.gemm_kernel import ctas_per_sm
from reprise.cuda.gemm_sm90_kernel import ARCH, SOURCE
from reprise.cuda.gemm_sm90_plan import (
    CONFIGS,
    EPILOGUE_TILES,
    ROW_EPILOGUES,
    SPLIT_ROUTES,
    WS,
    WS_DECODE,
    WS_M64,
    WS_TALL,
    WS_WIDE,
    Sm90WsConfig,
)

# Every entry point: the WHOLE kernels, then the split-K routes (gemm_sm90_kernel.launch_plan).
ENTRY_POINTS = [
    *(
        c.kernel_name(f32)
        for c in (*CONFIGS, WS, WS_WIDE, WS_DECODE, WS_M64)
        for f32 in (False, True)
    ),
    *(f"{c.kernel_name(f32)}_{kind}" for c, kind in SPLIT_ROUTES.values() for f32 in (False, True)),
]
# The gated (SwiGLU) epilogue's: WHOLE on each ws tile and every ws split route but the
# wide FOLD, by tile.
GATED = {
    **{c.kernel_name(False, gated=True): c for c in (WS, WS_WIDE, WS_DECODE, WS_M64)},
    **{
        f"{c.kernel_name(False, gated=True)}_{kind}": c
        for route, (c, kind) in SPLIT_ROUTES.items()
        if isinstance(c, Sm90WsConfig) and route != "wide_fold"
    },
}
ENTRY_POINTS += list(GATED)
# The cluster entry points (two CTAs along M sharing each weight tile): WHOLE on WS and the
# wide tile, FOLD on WS, with BF16, fp32 and gated output.
CLUSTER = {
    f"{name}_c2": c
    for c in (WS, WS_WIDE)
    for name in (c.kernel_name(False), c.kernel_name(True), c.kernel_name(False, gated=True))
} | {
    f"{name}_fold_c2": WS
    for name in (WS.kernel_name(False), WS.kernel_name(True), WS.kernel_name(False, gated=True))
}
# The row epilogues' (the add_rmsnorm, or the rope_kv_write, after the product): WHOLE and
# PARTIAL on the two 256-thread tiles, each named after the plain entry point it extends.
ROW_EPILOGUE = {
    plain.replace("_bf16", f"_{epilogue}"): WS_DECODE if "_decode" in plain else WS_M64
    for plain in EPILOGUE_TILES
    for epilogue in ROW_EPILOGUES
}
ENTRY_POINTS += list(CLUSTER)
ENTRY_POINTS += list(ROW_EPILOGUE)

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
    assert sorted(names) == sorted(ENTRY_POINTS)
    for name in names:
        assert name.encode() + b"\x00" in cubin, name


def test_every_entry_point_fits_one_cta_an_sm_without_spills(cubin: bytes) -> None:
    """No stack frame (nothing spilled: the FOLD routes' second accumulator set fits), and
    one CTA of each (its launch bounds' threads, its tile's shared memory) resident an SM."""
    resources = nvrtc.kernel_resources(cubin)
    configs = {
        c.kernel_name(f32): c
        for c in (*CONFIGS, WS, WS_WIDE, WS_DECODE, WS_M64)
        for f32 in (False, True)
    }
    configs.update(
        {
            f"{c.kernel_name(f32)}_{kind}": c
            for c, kind in SPLIT_ROUTES.values()
            for f32 in (False, True)
        }
    )
    configs.update(GATED)
    configs.update(CLUSTER)
    configs.update(ROW_EPILOGUE)
    assert sorted(resources) == sorted(ENTRY_POINTS)
    for name, used in resources.items():
        config = configs[name]
        print(f"{name}: {used.registers} registers, {used.local_bytes} B local")
        assert used.local_bytes == 0, (name, used)
        assert used.registers <= 65536 // config.num_threads, (name, used)
        shared = used.shared_bytes + config.smem_bytes
        least = 2 if config in (WS_DECODE, WS_M64) else 1  # the decode tiles' point: 2 an SM
        assert ctas_per_sm(config.num_threads, used.registers, shared) >= least, (name, used)


def test_the_register_movers_are_allocated_their_whole_entry_cap(cubin: bytes) -> None:
    """The entry points whose producer gives registers to its consumers (setmaxnreg: the
    wide FOLD, every tall-tile one) are allocated exactly their launch bounds' cap (65,536
    over the threads, to a multiple of 8): setmaxnreg.inc waits until the CTA's pool, the
    registers it was launched with, holds the consumers' budget, which the kernel sizes
    from that cap (gemm_sm90.cu's Sm90WsTile); fewer would hang every launch."""
    resources = nvrtc.kernel_resources(cubin)
    movers = {name: c for name, c in (
        *((f"{WS_WIDE.kernel_name(f32)}_fold", WS_WIDE) for f32 in (False, True)),
        *((f"{WS_TALL.kernel_name(f32)}_fold", WS_TALL) for f32 in (False, True)),
        (f"{WS_TALL.kernel_name(False, gated=True)}_fold", WS_TALL),
    )}  # fmt: skip
    assert len(movers) == 5
    for name, config in movers.items():
        cap = 65536 // config.num_threads // 8 * 8
        assert resources[name].registers == cap, (name, resources[name].registers, cap)


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
    assert len(functions) == len(ENTRY_POINTS)
    for text in functions:
        name = text.split()[0]
        assert "HGMMA.64x128x16.F32.BF16" in text, name
        assert "LDGSTS" in text, name  # cp.async
        assert "LDL" not in text and "STL" not in text, name  # nothing spilled to local memory
        if name.startswith("gemm_sm90_ws_"):
            assert "UBLKCP" in text, name  # the bulk copies of the packed weight
            assert "SYNCS.PHASECHK" in text and "ARRIVES.LDGSTSBAR" in text, name  # mbarriers
        # the cluster entry points multicast their weight panels and wait at cluster
        # barriers; no other does either
        clustered = "UBLKCP.S.G.MULTICAST" in text and "UCGABAR_WAIT" in text
        assert clustered == (name in CLUSTER), name


def test_the_no_swizzle_layout_builds_too() -> None:
    """The ws kernels on the no-swizzle stage layout (REPRISE_WS_SWIZZLE 0, which a weight
    packed with swizzle=False runs on; the launcher builds it on demand) build without a
    warning or a spill."""
    try:
        nvrtc._library()
    except nvrtc.NvrtcUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    source = "#define REPRISE_WS_SWIZZLE 0\n" + nvrtc.kernel_source(SOURCE)
    compiled = nvrtc.compile_source(source, SOURCE.name, ARCH)
    assert "warning" not in compiled.log.lower(), compiled.log
    resources = nvrtc.kernel_resources(compiled.cubin)
    assert sorted(resources) == sorted(ENTRY_POINTS)
    assert all(used.local_bytes == 0 for used in resources.values()), resources


def test_ptxas_keeps_every_wgmma_pipelined(tmp_path: Path) -> None:
    """ptxas (nvcc -Xptxas -v, where nvcc is on PATH) serializes a function's wgmma when
    non-wgmma code defines their accumulators inside the pipeline (C7515), e.g. a wgmma
    loop that carries them through memory: a silent slowdown. None of ours may."""
    nvcc = cuda_tool("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    source = tmp_path / "gemm_sm90.cu"
    source.write_text(nvrtc.kernel_source(SOURCE))
    cmd = [str(nvcc), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           "-ftz=true", "-o", str(tmp_path / "gemm_sm90.cubin"), str(source)]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    assert "C7515" not in built.stderr and "C7517" not in built.stderr, built.stderr
    assert "spill stores" in built.stderr and " 0 bytes spill stores" in built.stderr
    spills = [line for line in built.stderr.splitlines() if "spill stores" in line]
    assert all(line.strip().startswith("0 bytes stack frame, 0 bytes spill") for line in spills)
