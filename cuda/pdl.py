"""Programmatic dependent launch (PDL, sm_90+; issue 18): our kernels launched so that
each may start while the one before it in the stream finishes, behind a flag.

`REPRISE_PDL=1` in the environment turns it on for a process, on devices of compute
capability 9.0 or more; off (unset or `0`), the default, every kernel is launched by
CuPy as before. On, `kernels.launch_kernel` launches each of our kernels through the
driver's `cuLaunchKernelEx` (ctypes over libcuda: CuPy cannot set launch attributes,
and `cuda.bindings` is not one of our dependencies) with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, inside CUDA graph capture too
(a captured launch keeps its programmatic edge).

Why this is safe: every kernel of ours calls `pdl_enter()` (common.cuh) first, before
it reads or writes global memory: `griddepcontrol.wait` holds it until the previous
grid has completed and its writes are visible, then `griddepcontrol.launch_dependents`
lets the next grid launch. So what starts early is only the launch itself and each
CTA's setup, never an access; tests/test_pdl.py checks that every `__global__` entry
point calls it first, and (in the kernel emulator) that every thread of every kernel
launched this way does. CuPy's own kernels (elementwise, copies) and cuBLAS's are
launched as before and wait for all work before them.

NOTE: not measured yet. A session with a GPU runs `REPRISE_PDL=1` beside the default in
`scripts/gpu_session.sh` (the invariance suite and the end-to-end decode).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

ENV = "REPRISE_PDL"
MIN_COMPUTE_CAPABILITY = 90
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


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


def requested(environ: dict[str, str] | None = None) -> bool:
    """Whether `REPRISE_PDL` asks for PDL; ValueError naming it and what is allowed
    when it is neither unset, `0` nor `1`."""
    value = (os.environ if environ is None else environ).get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 (off, the default) or 1 (on); got {value!r}")
    return value == "1"


@functools.cache
def active() -> bool:
    """PDL requested and the current device takes it (checked once per process)."""
    if not requested():
        return False
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= MIN_COMPUTE_CAPABILITY


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
        data = getattr(arg, "data", None)
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
    grid: Sequence[int], block: Sequence[int], shared_mem: int, stream: int
) -> tuple[LaunchConfig, LaunchAttribute]:
    """The launch configuration with the programmatic-serialization attribute set."""
    attr = LaunchAttribute()
    attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed
    gx, gy, gz = dim3(grid)
    bx, by, bz = dim3(block)
    config = LaunchConfig(gx, gy, gz, bx, by, bz, int(shared_mem), ctypes.c_void_p(stream or None),
                          ctypes.pointer(attr), 1)  # fmt: skip
    return config, attr


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

    def launch(
        self, fn: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
        shared_mem: int,
    ) -> None:  # fmt: skip
        """Launch CuPy kernel `fn` (a RawKernel, its shared-memory opt-in already set)
        on the current stream as a programmatic dependent of the grid before it."""
        import cupy

        config, attr = launch_config(grid, block, shared_mem, cupy.cuda.get_current_stream().ptr)
        pointers, keep = pack_args(args)
        rc = self._launch(ctypes.byref(config), ctypes.c_void_p(fn.kernel.ptr), pointers, None)
        del keep, attr  # alive until here: the driver has copied the arguments
        if rc:
            name = ctypes.c_char_p()
            self._error_name(rc, ctypes.byref(name))
            raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({rc})")


_driver: Driver | None = None  # made at the first PDL launch; tests put the emulator's here


def launch(fn: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
           shared_mem: int) -> None:  # fmt: skip
    global _driver
    if _driver is None:
        _driver = Driver()
    _driver.launch(fn, grid, block, args, shared_mem)
