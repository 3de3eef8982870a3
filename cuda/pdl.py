"""Programmatic dependent launch (PDL, sm_90+; issue 18): our kernels launched so that
each may start while the one before it in the stream finishes.

`REPRISE_PDL` in the environment chooses, for a process on a device of compute
capability 9.0 or more:
- `graphs` (the default): the launches captured into a CUDA graph (the decode steps'
  graphs, `CupyBackend.capture`) are programmatic dependents; eager launches are CuPy's;
- `1`: every launch of ours, eager ones too;
- `0`: none, every kernel launched by CuPy.
A dependent launch goes through the driver's `cuLaunchKernelEx` (ctypes over libcuda:
CuPy cannot set launch attributes, and `cuda.bindings` is not one of our dependencies)
with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION; a captured launch keeps its
programmatic edge in the graph.

Why `graphs` is the default (H200, 2026-11-28, `bench/results/2026-11-28-h200/`): on the
default model's shapes a batch-1 decode step replayed as a graph took 1.65 ms with every
launch dependent against 2.03 ms without (the step's kernels busy 1,469 against 1,726 µs;
likely the Hopper GEMM streaming its first weight tiles before its wait, while the kernel
before it finishes, though no run has separated that from the launch overlap), while eager launches through ctypes cost about twice CuPy's (an eager
decode step 28.6 against 18.4 ms, a fresh 4,096-token prompt 37.2 against 25.5 ms). On
the H100 at 8B shapes (2026-11-27) graphs gained 0 % at batch 1 and 5 % at batch 64.

Why this is safe: every kernel of ours calls `pdl_enter()` (common.cuh) before it
writes global memory or reads anything a grid still running may write:
`griddepcontrol.wait` holds it until the previous grid has completed and its writes are
visible, then `griddepcontrol.launch_dependents` lets the next grid launch. Most call it
first; the Hopper GEMM starts its constant weight's copies before it, and attention_tc.cu
and rope_kv_write read the step's uploaded metadata (attention also the KV pages wholly
before the step's positions) before it: a dependent grid starts only once the grid before
it has passed its own wait, so every grid but that one has completed, and that one
writes none of these. tests/test_pdl.py checks each entry point at the source, and the
kernel emulator that every thread of every kernel launched this way waits and that none
reads, before its wait, a byte the kernel before it changed
(`tests/kernel_emu/emucupy.py`'s `watch_early_reads`). CuPy's own kernels (elementwise, copies) and cuBLAS's are
launched as before and wait for all work before them. The whole GPU suite passed with
every launch dependent (H100, 2026-11-27: 0 logits differ).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ENV = "REPRISE_PDL"
MIN_COMPUTE_CAPABILITY = 90
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID: the value's first 12 bytes are x, y, z (uint32)
_COOPERATIVE = 2  # CUlaunchAttributeID: every CTA of the grid resident at once, or no launch


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


MODES = ("0", "1", "graphs")
DEFAULT_MODE = "graphs"


def requested(environ: dict[str, str] | None = None) -> str:
    """The mode `REPRISE_PDL` asks for (`graphs` when unset); ValueError naming it and
    what is allowed for any other value."""
    value = (os.environ if environ is None else environ).get(ENV, DEFAULT_MODE)
    if value not in MODES:
        raise ValueError(
            f"{ENV} must be graphs (launches captured in CUDA graphs, the default), 1 (every "
            f"launch) or 0 (off); got {value!r}"
        )
    return value


@functools.cache
def active() -> str:
    """The mode in effect: the requested one where the current device takes PDL, else
    `0` (checked once per process)."""
    mode = requested()
    if mode == "0":
        return mode
    import cupy

    return mode if int(cupy.cuda.Device().compute_capability) >= MIN_COMPUTE_CAPABILITY else "0"


_capturing = False  # inside `capturing()`: the launches go into a CUDA graph


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Marks the launches made inside as captured into a CUDA graph (`dependent`)."""
    global _capturing
    before, _capturing = _capturing, True
    try:
        yield
    finally:
        _capturing = before


def dependent() -> bool:
    """Whether the launch made now is a programmatic dependent: every launch in mode
    `1`, a captured one in mode `graphs`."""
    mode = active()
    return mode == "1" or (mode == "graphs" and _capturing)


def dim3(dims: Sequence[int]) -> tuple[int, int, int]:
    """A grid or block of 1 to 3 dimensions as (x, y, z)."""
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"a grid or block has 1 to 3 positive dimensions; got {tuple(dims)}")
    x, y, z = (*map(int, dims), 1, 1)[:3]
    return x, y, z


def pack_args(args: Sequence[Any]) -> tuple[ctypes.Array, list[Any]]:
    """The `void**` a driver launch takes: entry i points at argument i's value (a
    device array's pointer, or a NumPy scalar's bytes), and what must stay alive until
    the launch call returns. Python numbers are refused: their width is the kernel's
    to fix (np.int32, np.float32, ...), not ours to guess."""
    pointers = (ctypes.c_void_p * max(len(args), 1))()
    keep: list[Any] = []
    for i, arg in enumerate(args):
        data: Any = getattr(arg, "data", None)
        if hasattr(data, "ptr"):  # a CuPy array
            value: Any = ctypes.c_void_p(int(data.ptr))
            pointers[i] = ctypes.addressof(value)
        elif isinstance(arg, np.generic):
            value = np.array(arg)
            pointers[i] = value.ctypes.data
        else:
            raise TypeError(
                f"kernel argument {i}: pass a device array or a NumPy scalar; got "
                f"{type(arg).__name__}"
            )
        keep.append(value)
    return pointers, keep


def launch_config(
    grid: Sequence[int], block: Sequence[int], shared_mem: int, stream: int, *,
    programmatic: bool = True, cluster: int = 1, cooperative: bool = False,
) -> tuple[LaunchConfig, ctypes.Array]:  # fmt: skip
    """The launch configuration and its attributes (which must outlive the launch call):
    programmatic serialization (`programmatic`), clusters of `cluster` CTAs along x
    where `cluster` > 1 (grid.x a multiple of it: gemm_sm90.cu's cluster split), and a
    cooperative launch (`cooperative`: decode_block.cu's grid barriers need every CTA
    resident at once; the driver refuses a grid that cannot be, rather than let it hang)."""
    if cluster < 1 or dim3(grid)[0] % cluster:
        raise ValueError(f"grid.x must be whole clusters of {cluster}; got a grid of {tuple(grid)}")
    attrs = (LaunchAttribute * 3)()
    count = 0
    if cooperative:  # cooperative = 1
        _set_attribute(attrs[count], _COOPERATIVE, (1,))
        count += 1
    if programmatic:  # programmaticStreamSerializationAllowed = 1
        _set_attribute(attrs[count], _PROGRAMMATIC_STREAM_SERIALIZATION, (1,))
        count += 1
    if cluster > 1:  # clusterDim = (cluster, 1, 1)
        _set_attribute(attrs[count], _CLUSTER_DIMENSION, (cluster, 1, 1))
        count += 1
    gx, gy, gz = dim3(grid)
    bx, by, bz = dim3(block)
    config = LaunchConfig(gx, gy, gz, bx, by, bz, int(shared_mem), ctypes.c_void_p(stream or None),
                          ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute)), count)  # fmt: skip
    return config, attrs


def _set_attribute(attr: LaunchAttribute, attr_id: int, words: Sequence[int]) -> None:
    """`attr` set to `attr_id` with its value's first words (uint32) `words`. NOTE: written
    through memmove: assigning bytes to the c_char array would stop at their first zero."""
    attr.id = attr_id
    data = b"".join(int(w).to_bytes(4, "little") for w in words)
    ctypes.memmove(ctypes.addressof(attr) + LaunchAttribute.value.offset, data, len(data))


class Driver:
    """cuLaunchKernelEx through ctypes, over the CUDA driver CuPy already loaded."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]  # fmt: skip
        self._launch.restype = ctypes.c_int
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._occupancy = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor
        self._occupancy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_size_t]  # fmt: skip
        self._occupancy.restype = ctypes.c_int

    def occupancy(self, fn: Any, threads: int, shared_mem: int) -> int:
        """CTAs of CuPy kernel `fn` (`threads` threads, `shared_mem` bytes of dynamic
        shared memory) that one SM holds at once, by the driver's occupancy calculator."""
        blocks = ctypes.c_int()
        rc = self._occupancy(
            ctypes.byref(blocks), ctypes.c_void_p(fn.kernel.ptr), threads, shared_mem
        )
        self._check(rc, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return blocks.value

    def _check(self, rc: int, call: str) -> None:
        """RuntimeError naming the driver's error, if `rc` is one."""
        if rc:
            name = ctypes.c_char_p()
            self._error_name(rc, ctypes.byref(name))
            raise RuntimeError(f"{call} failed: {(name.value or b'?').decode()} ({rc})")

    def launch(
        self, fn: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
        shared_mem: int, *, programmatic: bool = True, cluster: int = 1, cooperative: bool = False,
    ) -> None:  # fmt: skip
        """Launch CuPy kernel `fn` (a RawKernel, its shared-memory opt-in already set)
        on the current stream: as a programmatic dependent of the grid before it
        (`programmatic`), in clusters of `cluster` CTAs along x, cooperatively."""
        import cupy

        config, attr = launch_config(grid, block, shared_mem, cupy.cuda.get_current_stream().ptr,
                                     programmatic=programmatic, cluster=cluster,
                                     cooperative=cooperative)  # fmt: skip
        pointers, keep = pack_args(args)
        rc = self._launch(ctypes.byref(config), ctypes.c_void_p(fn.kernel.ptr), pointers, None)
        del keep, attr  # alive until here: the driver has copied the arguments
        self._check(rc, "cuLaunchKernelEx")


_driver: Driver | None = None  # made at the first PDL launch; tests put the emulator's here


def driver() -> Driver:
    """The process's driver, made at its first use."""
    global _driver
    if _driver is None:
        _driver = Driver()
    return _driver


def occupancy(fn: Any, threads: int, shared_mem: int) -> int:
    return driver().occupancy(fn, threads, shared_mem)


# Whether the driver takes a cooperative launch that is also a programmatic dependent
# (decode_block.cu's, in a graph under PDL): None until the first such launch says.
# CUDA's documents do not say it may be refused; if it is, the launch is retried
# cooperative alone, and every one after it so (a dependent's early start is lost, its
# grid barriers kept), with one warning.
cooperative_programmatic: bool | None = None


def launch(fn: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
           shared_mem: int, *, programmatic: bool = True, cluster: int = 1,
           cooperative: bool = False) -> None:  # fmt: skip
    global cooperative_programmatic
    both = cooperative and programmatic
    if both and cooperative_programmatic is False:
        programmatic = both = False
    try:
        driver().launch(fn, grid, block, args, shared_mem, programmatic=programmatic,
                        cluster=cluster, cooperative=cooperative)  # fmt: skip
    except RuntimeError as refused:
        if not both or cooperative_programmatic is not None:
            raise
        driver().launch(fn, grid, block, args, shared_mem, programmatic=False, cluster=cluster,
                        cooperative=True)  # fmt: skip
        cooperative_programmatic = False  # only once cooperative alone has launched
        log.warning("a cooperative launch as a programmatic dependent was refused (%s); "
                    "cooperative launches wait for the grid before them from now on", refused)  # fmt: skip
        return
    if both:
        cooperative_programmatic = True
