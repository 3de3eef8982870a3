"""Loading our CUDA kernels into CuPy, once per kernel family, and the launch checks
every launcher shares.

Each family is one `.cu` file in this folder, its headers expanded in its text
(nvrtc.kernel_source), compiled by CuPy's NVRTC with the options CI compiles it with
(nvrtc.compile_options), behind `functools.cache`.
BF16 arrays live on the device as `uint16` CuPy arrays holding the bit patterns
(CuPy has no bfloat16 dtype); `to_device` / `to_host` convert at the boundary.
CuPy is imported lazily: this module imports on any machine.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from . import pdl
from .dtypes import BF16
from .families import family as family_of
from .nvrtc import compile_options, kernel_source

if TYPE_CHECKING:  # pragma: no cover
    import cupy

BF16_BITS = np.dtype(np.uint16)  # how a BF16 array is held on the device


@functools.cache
def module(family: str, defines: tuple[str, ...] = ()) -> cupy.RawModule:
    """The compiled module of `cuda/<family>.cu` (a family of families.FAMILIES), with
    `defines` ("NAME=VALUE", as -D options) where a benchmark builds a variant."""
    import cupy

    source = kernel_source(family_of(family).source)
    options = (*compile_options(), *(f"-D{d}" for d in defines))
    return cupy.RawModule(code=source, options=options, backend="nvrtc")


def kernel(family: str, name: str, defines: tuple[str, ...] = ()) -> cupy.RawKernel:
    return module(family, defines).get_function(name)


def launch_kernel(
    fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], *,
    shared_mem: int = 0, cluster: int = 1, cooperative: bool = False,
) -> None:  # fmt: skip
    """Launch one of our kernels on the current stream: as a programmatic dependent of
    the kernel before it where PDL takes it (pdl.py: on sm_90+, a launch captured in a
    CUDA graph by default, every launch with REPRISE_PDL=1), else as CuPy launches it;
    in clusters of `cluster` CTAs along x, or cooperatively (every CTA resident at once:
    decode_block.cu's grid barriers), each a launch attribute, so through the driver's
    launch whether or not PDL takes it. Every launch of ours goes through here."""
    if cluster > 1 or cooperative:
        pdl.launch(fn, grid, block, args, shared_mem, programmatic=pdl.dependent(), cluster=cluster,
                   cooperative=cooperative)  # fmt: skip
    elif pdl.dependent():
        pdl.launch(fn, grid, block, args, shared_mem)
    else:
        fn(grid, block, args, shared_mem=shared_mem)


def stream_counters(launches: str, size: int, device_id: int) -> cupy.ndarray:
    """`size` uint32 zeros for one kind of split launch (`launches`: "gemm tiles", "sm90
    tiles", "attention splits", "argmax rows") on device `device_id` (the current one,
    which the caller has at hand) and the current stream, which every such launch leaves
    zero: a tile's or a row's CTAs count themselves in, and the last one folds the
    partials and resets its counter.

    NOTE: one array per (kind, size, device, stream), never freed, so that launches that
    may overlap (other streams) never share one, and a CUDA graph captured with it keeps
    it valid. A launch cut short (a trapped kernel) leaves counts behind; the context is
    lost then."""
    import cupy

    return _stream_counters(launches, size, device_id, cupy.cuda.get_current_stream().ptr)


@functools.cache
def _stream_counters(launches: str, size: int, device_id: int, stream_ptr: int) -> cupy.ndarray:
    import cupy

    return cupy.zeros(size, dtype=np.uint32)


def to_device(x: np.ndarray) -> cupy.ndarray:
    """A host array on the device; BF16 travels as its uint16 bit patterns."""
    import cupy

    if x.dtype == BF16:
        return cupy.asarray(np.ascontiguousarray(x).view(BF16_BITS))
    return cupy.asarray(np.ascontiguousarray(x))


def to_host(x: Any, *, bf16: bool | None = None) -> np.ndarray:
    """A device array on the host; uint16 comes back as BF16 unless `bf16=False`."""
    import cupy

    host = cupy.asnumpy(x)
    if host.dtype == BF16_BITS and bf16 is not False:
        return host.view(BF16)
    return host


def check(name: str, x: Any, dtype: np.dtype | type, ndim: int) -> None:
    """A launcher's input check: a C-contiguous device array of this dtype and rank."""
    shape = getattr(x, "shape", None)
    if getattr(x, "dtype", None) != np.dtype(dtype) or len(shape or ()) != ndim:
        raise ValueError(
            f"{name} must be a {ndim}-d {np.dtype(dtype)} device array; "
            f"got {getattr(x, 'dtype', type(x).__name__)} {shape}"
        )
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; got strides {x.strides}")
