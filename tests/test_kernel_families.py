"""The table of kernel families (families.FAMILIES) against the folder, and the kernel
sources as NVRTC gets them: each `.cu` with its `#include "x.cuh"` headers expanded in
its text (nvrtc.kernel_source), the text CI compiles and CuPy's RawModule gets. No
NVRTC or GPU needed."""

from __future__ import annotations

import inspect
import sys
import types
from pathlib import Path

import pytest

from reprise.cuda import families, kernels, nvrtc
from reprise.cuda.families import FAMILIES

COMMON = nvrtc.KERNEL_DIR / "common.cuh"
EMULATOR = Path(__file__).parent / "kernel_emu"


def test_the_table_names_every_source_once() -> None:
    names = [f.name for f in FAMILIES]
    assert len(set(names)) == len(names), names
    assert {f.source for f in FAMILIES} == set(families.KERNEL_DIR.glob("*.cu"))
    assert nvrtc.kernel_sources() == [f.source for f in FAMILIES]
    assert families.family("gemm").source.name == "gemm.cu"
    with pytest.raises(
        ValueError, match=r"no kernel family .gemm\.cu.; the families are activation"
    ):
        families.family("gemm.cu")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_launcher_and_twin_exists(family: families.Family) -> None:
    assert family.launchers and family.twins
    for ref in (*family.launchers, *family.twins):
        assert callable(families.resolve(ref)), ref
    # Each launcher loads this family's source by name: in its own code where its module
    # holds other families' launchers too (launchers.py), else anywhere in its module.
    shared = {r.partition(":")[0] for f in FAMILIES if f != family for r in f.launchers}
    for ref in family.launchers:
        fn = families.resolve(ref)
        where = fn if ref.partition(":")[0] in shared else inspect.getmodule(fn)
        assert f'"{family.name}"' in inspect.getsource(where), ref


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_the_emulator_builds_every_family(family: families.Family) -> None:
    drivers = [(EMULATOR / name).read_text() for name in ("driver.cpp", "driver_sm90.cpp")]
    assert any(f'#include "../../cuda/{family.source.name}"' in d for d in drivers), family.name


@pytest.mark.parametrize("path", nvrtc.kernel_sources(), ids=lambda p: p.name)
def test_the_source_nvrtc_gets_holds_its_headers(path: Path) -> None:
    raw = path.read_text().splitlines()
    source = nvrtc.kernel_source(path)
    assert '#include "' not in source  # every local include expanded: no include path needed
    includes = [i for i, line in enumerate(raw, start=1) if line.startswith('#include "')]
    if not includes:  # attention.cu, attention_tc.cu: their own copies (for now)
        assert source == path.read_text()
        return
    assert raw[includes[0] - 1].startswith('#include "common.cuh"')
    assert source.count(COMMON.read_text()) == 1  # once, though rmsnorm.cuh includes it too
    # the source's own lines keep their numbers in the compiler's messages: after each
    # header, and from the last on, the rest of the source as it is
    for at in includes:
        assert f'#line {at + 1} "{path.name}"\n' in source
    lines = source.splitlines()
    after = lines.index(f'#line {includes[-1] + 1} "{path.name}"')
    assert lines[after + 1 :] == raw[includes[-1] :]


def test_a_header_is_expanded_once_and_a_missing_one_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nvrtc, "KERNEL_DIR", tmp_path)
    (tmp_path / "b.cuh").write_text("int b;")  # no final newline
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\nint a;\n')
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"  // again\nint k;\n')
    assert nvrtc.kernel_source(tmp_path / "k.cu") == (
        '#line 1 "a.cuh"\n#line 1 "b.cuh"\nint b;\n#line 2 "a.cuh"\nint a;\n'
        '#line 2 "k.cu"\n\nint k;\n'
    )
    (tmp_path / "bad.cu").write_text('int x;\n#include "missing.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r"bad.cu:2 includes missing.cuh"):
        nvrtc.kernel_source(tmp_path / "bad.cu")


def test_cupy_gets_the_expanded_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy keys its kernel cache by the source text and the options: the header must be
    in the text, or an edited header would load a stale cubin."""
    made: list[str] = []
    cupy = types.ModuleType("cupy")
    cupy.RawModule = lambda *, code, options, backend: made.append(code)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(nvrtc, "compile_options", lambda arch=None: ["--std=c++17"])
    monkeypatch.setattr(kernels, "compile_options", nvrtc.compile_options)
    kernels.module.cache_clear()
    try:
        kernels.module("rmsnorm")
    finally:
        kernels.module.cache_clear()
    assert made == [nvrtc.kernel_source(nvrtc.KERNEL_DIR / "rmsnorm.cu")]
    assert COMMON.read_text() in made[0]
