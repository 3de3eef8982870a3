"""Compile our CUDA sources with NVRTC on any machine: no GPU, driver or toolkit needed.

CuPy compiles a RawModule for the device it finds, so it cannot check a source on
a machine without one. This module calls NVRTC itself, through ctypes, with the
library from the `nvidia-cuda-nvrtc` wheel and the headers (`cuda_bf16.h`) from
`nvidia-cuda-runtime`, for a named architecture. CI compiles every kernel file for
sm_80 and sm_90 this way (tests/test_kernels_compile.py), and the CuPy backend
passes the same options (`compile_options`; compile_source adds what CuPy adds), so
what CI checked is what runs. CI also compiles every kernel through CuPy's own NVRTC
call, the device's architecture named instead of asked for.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .families import FAMILIES, KERNEL_DIR

log = logging.getLogger(__name__)

ARCHS = ("sm_80", "sm_90")
# NOTE: no --use_fast_math: exp, rsqrt and division keep their IEEE-accurate forms, so
# the kernels stay within BF16 tolerance of their NumPy twins.
BASE_OPTIONS = ("--std=c++17", "-default-device")
# What CuPy adds when it compiles a RawModule (CuPy 14: _compile_with_cache_cuda); the
# options that change code, so compile_source builds what runs. -ftz=true flushes fp32
# denormals to zero; no twin comparison meets one on the tests' inputs, and bit identity
# across paths does not depend on it (every path runs the same code).
CUPY_ADDS = ("-ftz=true",)


class NvrtcUnavailable(RuntimeError):
    """NVRTC or the CUDA headers are not installed."""


class CompileError(RuntimeError):
    """NVRTC refused a source; the message holds its log."""


@dataclass(frozen=True, slots=True)
class Compiled:
    cubin: bytes
    log: str


@dataclass(frozen=True, slots=True)
class Resources:
    """What one compiled kernel takes per thread and per CTA (ptxas -v's figures)."""

    registers: int  # per thread
    local_bytes: int  # per thread: the stack frame, where spills go (0: no spills)
    shared_bytes: int  # per CTA, static (dynamic shared memory comes at launch)


def kernel_resources(cubin: bytes) -> dict[str, Resources]:
    """Each kernel's registers, local (stack frame, spills included) and static shared
    bytes, read from the cubin's ELF without a GPU or toolkit.

    NOTE: the figures sit where cuobjdump --dump-resource-usage reads them: the
    `.nv.info` section's EIATTR_REGCOUNT (0x2f) records and each kernel's EIATTR_FRAME_SIZE
    (0x11) record, both (symbol index, value) pairs in the 4-byte-headed attribute
    stream (format byte 4 = a u16 size and that many bytes; the others 2 bytes of value),
    and the size of the `.nv.shared.<kernel>` section.
    """
    assert cubin[:5] == b"\x7fELF\x02", "a 64-bit ELF cubin"
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    # (name offset, type, flags, address, offset, size, link, info, align, entry size)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]

    def cstr(at: int) -> str:
        return cubin[at : cubin.index(b"\0", at)].decode()

    names = [cstr(sections[names_index][4] + sec[0]) for sec in sections]
    symtab = sections[names.index(".symtab")]
    strtab_at = sections[symtab[6]][4]
    symbols = [
        cstr(strtab_at + struct.unpack_from("<I", cubin, symtab[4] + i * 24)[0])
        for i in range(symtab[5] // 24)
    ]
    found: dict[str, dict[str, int]] = {}
    for name, sec in zip(names, sections, strict=True):
        if name.startswith(".nv.info"):
            at, end = sec[4], sec[4] + sec[5]
            while at < end:
                fmt, attr, size = (
                    cubin[at],
                    cubin[at + 1],
                    struct.unpack_from("<H", cubin, at + 2)[0],
                )
                if fmt == 4 and attr in (0x2F, 0x11):
                    symbol, value = struct.unpack_from("<II", cubin, at + 4)
                    key = "registers" if attr == 0x2F else "local_bytes"
                    found.setdefault(symbols[symbol], {})[key] = value
                at += 4 + (size if fmt == 4 else 0)
        elif name.startswith(".nv.shared.") and name[11:] in symbols:
            found.setdefault(name[11:], {})["shared_bytes"] = sec[5]
    return {
        kernel: Resources(v["registers"], v.get("local_bytes", 0), v.get("shared_bytes", 0))
        for kernel, v in found.items()
        if "registers" in v
    }


def kernel_sources() -> list[Path]:
    """Every kernel family's source, one `.cu` file each (families.FAMILIES)."""
    return [family.source for family in FAMILIES]


# `#include "common.cuh"`: a header of this folder, by name (no path).
_LOCAL_INCLUDE = re.compile(r'[ \t]*#[ \t]*include[ \t]+"([\w.-]+\.cuh)"[^\n]*\n?')


def kernel_source(path: Path) -> str:
    """The text NVRTC compiles for `path`: each `#include "x.cuh"` of a header in this
    folder replaced by the header's text (itself expanded; a header already expanded
    leaves an empty line), between #line markers so that the compiler's messages name
    the header's and the source's own lines.

    NOTE: the headers travel inside the source text, not through an include path,
    because CuPy keys its on-disk kernel cache by the source text and the options:
    with an include path, an edited header would leave CuPy loading a stale cubin.
    """
    return _expand(path, set())


def _expand(path: Path, expanded: set[str]) -> str:
    parts = []
    for number, line in enumerate(path.read_text().splitlines(keepends=True), start=1):
        match = _LOCAL_INCLUDE.fullmatch(line)
        if match is None:
            parts.append(line)
            continue
        name = match[1]
        if not (KERNEL_DIR / name).is_file():
            raise FileNotFoundError(
                f"{path.name}:{number} includes {name}, which is not in {KERNEL_DIR}"
            )
        if name in expanded:
            parts.append("\n")
            continue
        expanded.add(name)
        header = _expand(KERNEL_DIR / name, expanded)
        newline = "" if header.endswith("\n") else "\n"
        parts += [f'#line 1 "{name}"\n', header, newline, f'#line {number + 1} "{path.name}"\n']
    return "".join(parts)


def kernel_names(source: str) -> list[str]:
    """The `extern "C" __global__` entry points a source declares (after `void`, launch
    bounds and attribute macros such as gemm_sm90.cu's GEMM_SM90_CLUSTER_OF_2 may stand)."""
    bounds = r"(?:(?:__launch_bounds__\([^)]*\)|[A-Z][A-Z0-9_]+)\s*)*"
    return re.findall(rf'extern\s+"C"\s+__global__\s+{bounds}void\s+{bounds}(\w+)\s*\(', source)


def _nvidia_dirs() -> list[Path]:
    """Roots of the pip `nvidia` namespace packages (cu13 wheels: nvidia/cu13/...;
    cu12 wheels: nvidia/cuda_nvrtc/..., nvidia/cuda_runtime/...)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _first(patterns: list[str]) -> Path | None:
    for root in _nvidia_dirs():
        for pattern in patterns:
            hits = sorted(root.glob(pattern), reverse=True)  # the newest major version first
            if hits:
                return hits[0]
    return None


@functools.cache
def include_dir() -> Path | None:
    """The folder holding cuda_bf16.h: from the nvidia-cuda-runtime wheel, else a CUDA
    toolkit ($CUDA_PATH, $CUDA_HOME, /usr/local/cuda), else where cuda-pathfinder
    (CuPy's own finder) puts the runtime headers; None when there is none."""
    header = _first(["cu*/include/cuda_bf16.h", "cuda_runtime/include/cuda_bf16.h"])
    if header is not None:
        return header.parent
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_bf16.h").is_file():
            return Path(root) / "include"
    try:
        from cuda.pathfinder import (  # type: ignore[import-not-found, unused-ignore]
            find_nvidia_header_directory,
        )

        found = find_nvidia_header_directory("cudart")
    except Exception:  # not installed, or an older API: no more places to look
        return None
    return Path(found) if found and (Path(found) / "cuda_bf16.h").is_file() else None


@functools.cache
def _library() -> ctypes.CDLL:
    """libnvrtc: from the nvidia-cuda-nvrtc wheel, else a CUDA toolkit, else where
    cuda-pathfinder (CuPy's own finder) finds it."""
    path = _first(["cu*/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*"])
    if path is None:
        roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
        for root in filter(None, roots):
            hits = sorted((Path(root) / "lib64").glob("libnvrtc.so*"), reverse=True)
            if hits:
                path = hits[0]
                break
    if path is None:
        try:
            from cuda.pathfinder import (  # type: ignore[import-not-found, unused-ignore]
                load_nvidia_dynamic_lib,
            )

            path = Path(load_nvidia_dynamic_lib("nvrtc").abs_path)
        except Exception:  # not installed, or nothing found
            path = None
    if path is None:
        raise NvrtcUnavailable(
            "NVRTC not found: install the nvidia-cuda-nvrtc and nvidia-cuda-runtime wheels "
            "(pip install 'reprise[kernels]')"
        )
    lib = ctypes.CDLL(str(path))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def compile_options(arch: str | None = None) -> list[str]:
    """NVRTC options for our sources; `arch` like "sm_90" (CuPy adds its own)."""
    include = include_dir()
    if include is None:
        raise NvrtcUnavailable(
            "cuda_bf16.h not found: install the nvidia-cuda-runtime wheel (pip install 'reprise[kernels]')"
        )
    options = [*BASE_OPTIONS, f"--include-path={include}"]
    if arch is not None:
        if not re.fullmatch(r"sm_\d{2,3}a?", arch):
            raise ValueError(f"arch must look like sm_90; got {arch!r}")
        options.insert(0, f"--gpu-architecture={arch}")
    return options


def compile_source(source: str, name: str, arch: str) -> Compiled:
    """Compile CUDA C++ `source` to a cubin for `arch`; raises CompileError with the log."""
    lib = _library()
    options = [o.encode() for o in (*compile_options(arch), *CUPY_ADDS)]
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
    )
    try:
        status = lib.nvrtcCompileProgram(
            prog, len(options), (ctypes.c_char_p * len(options))(*options)
        )
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)))
        log_buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetProgramLog(prog, log_buf))
        log = log_buf.value.decode(errors="replace")
        if status != 0:
            raise CompileError(f"{name} for {arch}: {_error(lib, status)}\n{log}")
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin))
        return Compiled(cubin.raw, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _error(lib: ctypes.CDLL, status: int) -> str:
    return lib.nvrtcGetErrorString(status).decode()


def _check(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        raise CompileError(f"NVRTC call failed: {_error(lib, status)}")


def nvrtc_version() -> str:
    """The loaded NVRTC: its major.minor, and its library file's path and size (which
    tell builds of one minor version apart)."""
    lib = _library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
    file = Path(lib._name).resolve()
    return f"{major.value}.{minor.value} {file} {file.stat().st_size}"


def cache_dir() -> Path:
    """Where compiled cubins are kept between processes: $REPRISE_KERNEL_CACHE, else the
    `kernels` folder of reprise's cache (daemon/model/prepare.py's cache_dir, the same rule:
    $REPRISE_CACHE_DIR, which the systemd unit points at its writable state directory,
    else $XDG_CACHE_HOME/reprise, else ~/.cache/reprise)."""
    if os.environ.get("REPRISE_KERNEL_CACHE"):
        return Path(os.environ["REPRISE_KERNEL_CACHE"]).expanduser()
    if os.environ.get("REPRISE_CACHE_DIR"):
        return Path(os.environ["REPRISE_CACHE_DIR"]).expanduser() / "kernels"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "reprise" / "kernels"
    return Path.home() / ".cache" / "reprise" / "kernels"


_ELF = b"\x7fELF"


def cubin_file(source: str, name: str, arch: str) -> Path:
    """A file holding `source` compiled for `arch` (compile_source's cubin), for CuPy's
    RawModule(path=...): from the cache (`cache_dir`) when an earlier process compiled
    the same text with the same options, NVRTC and arch, else compiled now and kept
    there (written to a temporary name, then renamed: a reader never sees half a file).
    A cache that cannot be written (read-only, full) only costs the compile: the cubin
    goes to a temporary folder, with one warning.

    NOTE: CuPy keeps its own RawModule(code=...) compiles on disk alike; this is for the
    sources it cannot compile (gemm_sm90.cu for sm_90a: about 25 s each process).
    """
    parts = (source, name, arch, *compile_options(arch), *CUPY_ADDS, nvrtc_version())
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    folder = cache_dir()
    path = folder / f"{Path(name).stem}-{arch}-{key[:32]}.cubin"
    try:
        with open(path, "rb") as kept:
            if kept.read(len(_ELF)) == _ELF:  # else damaged: compiled and replaced below
                return path
    except OSError:
        pass  # not there (or unreadable): compiled below
    cubin = compile_source(source, name, arch).cubin
    part = None
    try:
        # the daemon loads what is here: a folder of its user's alone
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".part-", delete=False) as part:
            part.write(cubin)
        os.replace(part.name, path)
        return path
    except OSError as exc:
        log.warning("kernel cache %s not writable (%s): compiling each process", folder, exc)
        if part is not None:
            with contextlib.suppress(OSError):
                os.unlink(part.name)
    path = Path(tempfile.mkdtemp(prefix="reprise-cubin-")) / f"{Path(name).stem}.cubin"
    path.write_bytes(cubin)
    return path
