"""Every kernel source compiles for sm_80 and sm_90 through NVRTC, on this machine,
without a GPU (DESIGN §5), and declares the entry points its launcher uses."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path

import pytest
from test_cupy_api import real_cupy

from reprise.cuda import nvrtc

pytestmark = pytest.mark.kernels

# NVRTC's cubin of each (source, name, arch), compiled once a run: several tests read the
# same one (the entry points here; registers and spills in test_attention_split,
# test_decode_block_emulated and test_moe_kernels), and decode_block.cu alone takes
# about a minute an architecture. A compile that fails is not kept.
compiled = functools.cache(nvrtc.compile_source)


def nvrtc_or_skip(arch: str = "sm_90") -> None:
    """The test skipped where NVRTC (or its options for `arch`) is missing; failed on CI,
    which installs it (missing there is a failure, not a skip)."""
    try:
        nvrtc.compile_options(arch)
        nvrtc._library()
    except nvrtc.NvrtcUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="module", autouse=True)
def needs_nvrtc() -> None:
    nvrtc_or_skip()


@pytest.mark.parametrize("arch", nvrtc.ARCHS)
@pytest.mark.parametrize("path", nvrtc.kernel_sources(), ids=lambda p: p.name)
def test_kernel_compiles(path: Path, arch: str) -> None:
    source = nvrtc.kernel_source(path)
    entry_points = nvrtc.kernel_names(source)
    assert entry_points, f'{path.name} declares no extern "C" __global__ kernel'
    result = compiled(source, path.name, arch)
    assert result.cubin[:4] == b"\x7fELF"
    for name in entry_points:  # the cubin's symbol table names every entry point
        assert name.encode() + b"\x00" in result.cubin, name
    assert "warning" not in result.log.lower(), result.log


@pytest.mark.parametrize("arch", nvrtc.ARCHS)
@pytest.mark.parametrize("path", nvrtc.kernel_sources(), ids=lambda p: p.name)
def test_kernel_compiles_the_way_cupy_compiles_it(
    path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CuPy's own NVRTC call with its own options, as a RawModule makes it on a device:
    CuPy 14's _compile_with_cache_cuda adds -ftz=true, then compile_using_nvrtc adds
    -arch=sm_XX, --device-as-default-execution-space (which our -default-device repeats)
    and --pch. The one step replaced is where CuPy asks the device for its architecture."""
    real_cupy()
    from cupy.cuda import compiler

    assert "options += ('-ftz=true',)" in inspect.getsource(compiler._compile_with_cache_cuda)
    assert nvrtc.CUPY_ADDS == ("-ftz=true",)
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc",
                        lambda arch=None: (f"-arch=sm_{arch}", "cubin"))  # fmt: skip
    source = nvrtc.kernel_source(path)
    options = (*nvrtc.compile_options(), *nvrtc.CUPY_ADDS)
    cubin, _ = compiler.compile_using_nvrtc(source, options, arch=arch[3:], cache_in_memory=True)
    assert cubin[:4] == b"\x7fELF"
    for name in nvrtc.kernel_names(source):
        assert name.encode() + b"\x00" in cubin, name


def test_a_broken_source_reports_the_compiler_log() -> None:
    source = 'extern "C" __global__ void broken(float* y) { y[0] = undefined_name; }\n'
    with pytest.raises(nvrtc.CompileError, match="undefined_name"):
        nvrtc.compile_source(source, "broken.cu", "sm_90")
    with pytest.raises(ValueError, match="arch must look like sm_90"):
        nvrtc.compile_source(source, "broken.cu", "hopper")


def test_an_error_in_a_header_names_the_header_and_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nvrtc, "KERNEL_DIR", tmp_path)
    (tmp_path / "bad.cuh").write_text(
        "__device__ int ok();\n__device__ int bad() { return undefined_name; }\n"
    )
    (tmp_path / "k.cu").write_text(
        '#include "bad.cuh"\nextern "C" __global__ void k(int* y) { y[0] = also_undefined; }\n'
    )
    with pytest.raises(nvrtc.CompileError) as error:
        nvrtc.compile_source(nvrtc.kernel_source(tmp_path / "k.cu"), "k.cu", "sm_90")
    assert 'bad.cuh(2): error: identifier "undefined_name" is undefined' in str(error.value)
    assert 'k.cu(2): error: identifier "also_undefined" is undefined' in str(error.value)


@pytest.mark.parametrize("arch", nvrtc.ARCHS)
def test_gemm_resources(arch: str) -> None:
    """gemm.cu's registers and spills per kernel, read from the cubin CI builds: no
    kernel spills; the FOLD kernels' only stack frame is their running total (one fp32
    slot per accumulator element, kept out of registers on purpose), and they fit as
    many CTAs per SM as the unsplit kernel of their tile (the H100 run of 2026-11-26
    measured 1.8x the time when the total took registers and halved that count); and
    the skinny kernels fit the CTAs per SM that split_k assumes (SKINNY_CTAS_PER_SM on
    sm_90), so that the 8B projections' split grids at M = 1 fill one wave of the
    reference device (more than half of it, never spilling into a second)."""
    from reprise.cuda.gemm_kernel import (
        CONFIGS,
        REFERENCE_SMS,
        SKINNY,
        SKINNY_CTAS_PER_SM,
        ctas_per_sm,
        launch_plan,
        split_k,
    )

    source = nvrtc.kernel_source(nvrtc.KERNEL_DIR / "gemm.cu")
    resources = nvrtc.kernel_resources(compiled(source, "gemm.cu", arch).cubin)
    assert set(resources) == set(nvrtc.kernel_names(source))
    configs = {config.name: config for config in CONFIGS}
    for name, used in sorted(resources.items()):
        print(f"{arch} {name}: {used.registers} registers, {used.local_bytes} B local, "
              f"{used.shared_bytes} B static shared")  # fmt: skip
        assert 0 < used.registers <= 255, (name, used)
        if not name.endswith("_fold"):
            assert used.local_bytes == 0, (name, used)
            continue
        config = configs[name.split("_")[2]]
        accumulators = config.block_m * config.block_n // config.num_threads
        assert used.local_bytes == 4 * accumulators, (name, used)
        whole = resources[name.removesuffix("_fold")]
        shared = config.smem_bytes + used.shared_bytes
        assert ctas_per_sm(config.num_threads, used.registers, shared, arch) == ctas_per_sm(
            config.num_threads, whole.registers, shared, arch
        ), (name, used.registers, whole.registers)
    skinny = (
        "gemm_bf16_skinny",
        "gemm_f32_skinny",
        "gemm_bf16_skinny_split",
        "gemm_f32_skinny_split",
    )
    fits = {}
    for name in skinny:
        shared = resources[name].shared_bytes + SKINNY.smem_bytes
        fits[name] = ctas_per_sm(SKINNY.num_threads, resources[name].registers, shared, arch)
    if arch == "sm_90":
        assert set(fits.values()) == {SKINNY_CTAS_PER_SM}, fits
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
            plan = launch_plan(1, n, k, split_k(n, k), out_f32=False)
            cta_count = plan.grid[0] * plan.grid[1]
            wave = REFERENCE_SMS * fits[plan.kernel]
            assert wave // 2 < cta_count and (
                cta_count <= wave or plan.kernel.endswith("skinny")
            ), (
                n,
                k,
            )
    else:
        assert min(fits.values()) >= 1, fits


def test_kernel_resources_reads_what_ptxas_reports() -> None:
    """A kernel forced to spill (a large local array indexed at run time) shows a stack
    frame; a plain one none; its __shared__ array shows as static shared bytes."""
    source = (
        'extern "C" __global__ void __launch_bounds__(64) plain(float* y) {\n'
        "  __shared__ float tile[512];\n"
        "  tile[threadIdx.x] = y[threadIdx.x]; __syncthreads(); y[threadIdx.x] = tile[63 - threadIdx.x];\n"
        "}\n"
        'extern "C" __global__ void spilling(float* y, int i) {\n'
        "  float a[256];\n"
        "  for (int j = 0; j < 256; ++j) a[j] = y[j] * j;\n"
        "  y[0] = a[i & 255];\n"
        "}\n"
    )
    found = nvrtc.kernel_resources(nvrtc.compile_source(source, "probe.cu", "sm_90").cubin)
    assert set(found) == {"plain", "spilling"}
    assert found["plain"].local_bytes == 0 and found["plain"].registers > 0
    assert found["plain"].shared_bytes >= 512 * 4
    assert found["spilling"].local_bytes >= 256 * 4
