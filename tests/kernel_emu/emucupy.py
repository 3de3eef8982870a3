"""An emulated CuPy, so the GPU backend runs end to end on a machine without a GPU.

`install(lib)` puts modules named `cupy` and `cupyx` in `sys.modules`; the code under
test imports them as it would the real ones. Device arrays are host NumPy arrays
behind a wrapper of CuPy's interface (`ndarray`), and every RawKernel launch runs the
kernel's own `.cu` source, compiled by g++ against the host emulation of CUDA
(tests/kernel_emu/driver.cpp: `emu_launch`). So CupyBackend, the launchers, the CUDA
graph decode and the host tier's copies run as written, on the real kernels' logic.

It is stricter than a GPU where a GPU would silently go wrong, and as strict as CuPy
where CuPy raises:
- each launch's arguments are checked against the kernel's parameters: kind (array or
  value) and size (np.int64 for an `int`, an fp32 array for a BF16 pointer fail);
  Python ints and floats are refused (CuPy would pick their width, not the kernel);
- a NumPy array mixed into device arithmetic, or a device array handed to NumPy
  (`np.asarray`), raises TypeError, as in CuPy;
- dynamic shared memory over 48 KiB needs the kernel's opt-in attribute;
- a stream capture (CUDA graph) records kernel launches without running them and
  replays them on `Graph.launch`; anything else that touches device data while
  capturing (CuPy's own elementwise ops, copies, host reads, synchronizing) and any
  allocation outside a private pool raise CaptureError, so a captured step must be
  our kernels on static buffers, and a replay sees only what was uploaded into them;
- copies issued on a stream other than the current one (the host tier's copy stream)
  are held back until something waits for them (an event waited on or synchronized,
  the stream or the device synchronized), the latest a GPU may run them: a reader
  that forgets to wait reads stale bytes here;
- streams are ordered as CUDA orders them (vector clocks: an op follows the ops of
  its own stream, those of a recorded event it waited on, and those the host waited
  for by a synchronize or a blocking read), and a kernel launch or graph replay, a
  copy or an indexed write that touches device memory (or a copy the host memory)
  which an op of another stream, not ordered before it, also touched raises
  RaceError: the two may run in either order, or at once, on a GPU. (Kernels are taken to use all of every array
  they are passed; CuPy's own elementwise ops are not tracked.)

Another host thread may wait for an event (the disk tier's writer does): each host
thread keeps its own clock (a wait orders only what its own thread issues later, as
on a GPU), and draining held-back copies is guarded by a lock, so each runs once.

What it does not do: device arithmetic (host expf, no tensor cores), the memory
model within a stream, concurrency between kernels, or speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # NumPy < 2
    byte_bounds = np.byte_bounds

MAX_STATIC_SMEM = 48 * 1024
MAX_DYNAMIC_SMEM = 227 * 1024  # an H100's opt-in limit per block
ALIGN = 256  # CuPy's allocations start on (at least) this boundary


class CaptureError(RuntimeError):
    """What a stream capture cannot hold."""


class RaceError(RuntimeError):
    """Two streams touch the same device memory with nothing ordering one after the other."""


class _State:
    lib: ctypes.CDLL | None = None
    capture: tuple[Stream, list[_Launch]] | None = None
    allocator_depth = 0  # nested `using_allocator` blocks with a private pool
    streams: ClassVar[list[Stream]] = []
    launches = 0  # kernels run, replays included
    pdl_launches = 0  # of which launched as programmatic dependents (pdl.py)
    replays = 0  # graphs launched
    skip_kernels = False  # count launches but run none (host-side timing)
    # Early reads (watch_early_reads): the bytes the last kernel run changed, [start, end)
    # runs, which a kernel launched next as a programmatic dependent may not read before its
    # pdl_enter; and the last kernel's name
    track_writes = False
    written: ClassVar[list[Span]] = []
    written_by = ""
    # per host thread, the ops of each stream it has waited for
    host: ClassVar[dict[int, dict[Stream, int]]] = {}
    lock = threading.RLock()  # held-back copies and `host`, for waits from other threads


def _no_capture(what: str) -> None:
    if _State.capture is not None:
        raise CaptureError(f"{what} while a stream is capturing: a CUDA graph holds kernels only")


# ---- arrays ------------------------------------------------------------------------------


class MemoryPointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _unwrap(x: Any) -> Any:
    """An operand of device arithmetic: device arrays and scalars; not host arrays."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray) and x.ndim > 0:
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _wrap(x: Any) -> Any:
    if isinstance(x, (np.ndarray, np.generic)):
        return ndarray(np.asarray(x))  # CuPy's reductions give 0-d arrays, not scalars
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def _alloc(shape: Any, dtype: Any, fill: int) -> ndarray:
    """New device memory, 256-byte aligned as CuPy's pool hands it out, every byte `fill`."""
    if _State.capture is not None and _State.allocator_depth == 0:
        raise CaptureError(
            "allocation from the default pool while capturing: a replay would write memory "
            "the pool has since handed to someone else"
        )
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.full(nbytes + ALIGN, fill, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return ndarray(raw[start : start + nbytes].view(dtype).reshape(shape))


class ndarray(NDArrayOperatorsMixin):
    """A device array: a host NumPy array behind CuPy's interface."""

    __array_priority__ = 100

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._a.ctypes.data)

    def __repr__(self) -> str:
        return f"emucupy.ndarray({self._a!r})"

    def __len__(self) -> int:
        return len(self._a)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _no_capture(f"CuPy op {ufunc.__name__}")
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(o) for o in kwargs["out"])
        return _wrap(getattr(ufunc, method)(*(_unwrap(x) for x in inputs), **kwargs))

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        _no_capture(f"CuPy op {func.__name__}")
        return _wrap(func(*_unwrap(list(args)), **{k: _unwrap(v) for k, v in kwargs.items()}))

    @staticmethod
    def _index(key: Any) -> tuple[Any, bool]:
        """The NumPy index of `key`, and whether it gathers (advanced indexing)."""
        parts = key if isinstance(key, tuple) else (key,)
        gathers = any(isinstance(p, (ndarray, np.ndarray, list)) for p in parts)
        parts = tuple(p._a if isinstance(p, ndarray) else p for p in parts)
        return (parts if isinstance(key, tuple) else parts[0]), gathers

    def __getitem__(self, key: Any) -> ndarray:
        index, gathers = self._index(key)
        if gathers:
            _no_capture("a gather (advanced indexing)")
        return ndarray(np.asarray(self._a[index]))

    def __setitem__(self, key: Any, value: Any) -> None:
        _no_capture("an indexed write")
        index, gathers = self._index(key)
        spans = [_span(self._a if gathers else self._a[index])]
        if isinstance(value, ndarray):
            spans.append(_span(value._a))
        _use(get_current_stream(), spans, "an indexed write")
        self._a[index] = value._a if isinstance(value, ndarray) else value

    def __iter__(self) -> Iterator[ndarray]:
        _no_capture("iterating")
        return (ndarray(np.asarray(row)) for row in self._a)

    def __int__(self) -> int:
        _no_capture("a host read")
        get_current_stream().synchronize()
        return int(self._a)

    def __float__(self) -> float:
        _no_capture("a host read")
        get_current_stream().synchronize()
        return float(self._a)

    def __bool__(self) -> bool:
        _no_capture("a host read")
        get_current_stream().synchronize()
        return bool(self._a)

    # views: no data moves
    def view(self, dtype: Any) -> ndarray:
        return ndarray(self._a.view(dtype))

    def reshape(self, *shape: Any) -> ndarray:
        out = self._a.reshape(*shape)
        if not np.may_share_memory(out, self._a):
            _no_capture("a reshape that copies")
        return ndarray(out)

    def ravel(self) -> ndarray:
        return self.reshape(-1)

    # work: a CuPy kernel each, not ours
    def astype(self, dtype: Any, *, copy: bool = True) -> ndarray:
        _no_capture("astype")
        return ndarray(self._a.astype(dtype, copy=copy))

    def copy(self) -> ndarray:
        _no_capture("copy")
        return ndarray(self._a.copy())

    def fill(self, value: Any) -> None:
        _no_capture("fill")
        self._a.fill(value)

    def sort(self, axis: int = -1) -> None:
        _no_capture("sort")
        self._a.sort(axis=axis)

    def __getattr__(self, name: str) -> Any:  # reductions and the like
        attr = getattr(np.ndarray, name, None)
        if not callable(attr) or name.startswith("_"):
            raise AttributeError(f"emucupy.ndarray has no attribute {name!r}")

        def method(*args: Any, **kwargs: Any) -> Any:
            _no_capture(f"CuPy op {name}")
            return _wrap(getattr(self._a, name)(*_unwrap(list(args)), **kwargs))

        return method

    # host <-> device
    def get(self, stream: Stream | None = None, order: str = "C", out: np.ndarray | None = None,
            blocking: bool = True) -> np.ndarray:  # fmt: skip
        return asnumpy(self, stream=stream, order=order, out=out, blocking=blocking)

    def set(self, arr: np.ndarray, stream: Stream | None = None) -> None:
        _no_capture("a host-to-device copy")
        if not isinstance(arr, np.ndarray) or arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set needs a host array of {self.shape} {self.dtype}")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        dst = self._a
        _use(stream or get_current_stream(), [_span(dst), _span(arr)], "a host-to-device copy")
        _on(stream, lambda: np.copyto(dst, arr))


def asarray(x: Any, dtype: Any = None) -> ndarray:
    if isinstance(x, ndarray):
        return x if dtype is None or x.dtype == dtype else x.astype(dtype)
    _no_capture("a host-to-device copy")
    host = np.asarray(x, dtype=dtype)
    out = _alloc(host.shape, host.dtype, 0)
    out._a[...] = host
    return out


array = asarray


def asnumpy(x: Any, stream: Stream | None = None, order: str = "C", out: np.ndarray | None = None,
            *, blocking: bool = True) -> np.ndarray:  # fmt: skip
    if order != "C":
        raise NotImplementedError("the emulation copies to the host in C order only")
    if not isinstance(x, ndarray):
        return np.asarray(x)
    _no_capture("a device-to-host copy")
    if out is None:
        out = np.empty(x.shape, x.dtype)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous host array of {x.shape} {x.dtype}")
    src = x._a
    on = stream or get_current_stream()
    _use(on, [_span(src), _span(out)], "a device-to-host copy")
    _on(stream, lambda: np.copyto(out, src))
    if blocking:
        on.synchronize()
    return out


def empty(shape: Any, dtype: Any = np.float64) -> ndarray:
    # device memory is not zero: neither is this (but when kernels are skipped, whatever
    # reads their outputs gets zeros, so token ids stay in range)
    return _alloc(shape, dtype, 0 if _State.skip_kernels else 0xA5)


def zeros(shape: Any, dtype: Any = np.float64) -> ndarray:
    return _alloc(shape, dtype, 0)


def ones(shape: Any, dtype: Any = np.float64) -> ndarray:
    out = _alloc(shape, dtype, 0)
    out._a.fill(1)
    return out


def empty_like(x: ndarray, dtype: Any = None) -> ndarray:
    return empty(x.shape, x.dtype if dtype is None else dtype)


def zeros_like(x: ndarray, dtype: Any = None) -> ndarray:
    return zeros(x.shape, x.dtype if dtype is None else dtype)


# ---- kernels -----------------------------------------------------------------------------


class _Launch:
    """One kernel launch, its arguments packed as the driver takes them."""

    def __init__(self, name: str, grid: tuple[int, ...], block: tuple[int, ...],
                 args: tuple[Any, ...], smem: int, pdl: bool = False) -> None:  # fmt: skip
        self.name, self.smem, self.pdl = name, smem, pdl
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.keep: list[Any] = []  # the arrays and values the pointers point at
        self.arrays: list[np.ndarray] = []  # the array arguments (as host arrays)
        self.spans: list[Span] = []  # the device memory of its array arguments
        count = len(args)
        self.pointers = (ctypes.c_void_p * max(count, 1))()
        self.sizes = (ctypes.c_int * max(count, 1))()
        self.is_array = (ctypes.c_int * max(count, 1))()
        self.count = count
        for i, arg in enumerate(args):
            if isinstance(arg, ndarray):
                value = ctypes.c_void_p(arg._a.ctypes.data)
                self.keep += [arg._a, value]
                self.arrays.append(arg._a)
                self.spans.append(_span(arg._a))
                self.pointers[i] = ctypes.addressof(value)
                self.sizes[i], self.is_array[i] = arg.itemsize, 1
            elif isinstance(arg, np.generic):
                value = np.array(arg)
                self.keep.append(value)
                self.pointers[i] = value.ctypes.data
                self.sizes[i], self.is_array[i] = value.itemsize, 0
            elif isinstance(arg, np.ndarray):
                raise TypeError(f"{name} argument {i}: Unsupported type {type(arg)} (a host array)")
            else:
                raise TypeError(
                    f"{name} argument {i}: pass a NumPy scalar, not {type(arg).__name__}: "
                    "CuPy picks a Python number's width, not the kernel"
                )

    def run(self) -> None:
        if _State.skip_kernels:
            _State.launches += 1
            return
        assert _State.lib is not None, "emucupy.install(lib) first"
        _State.lib.emu_pdl_entered()  # from zero
        lib = _State.lib
        watched = _State.track_writes and self.pdl and bool(_State.written)
        if watched:  # what the kernel before wrote: unready until this one's threads wait
            for start, end in _State.written:
                lib.set_unready(ctypes.c_void_p(start), ctypes.c_ulonglong(end - start))
        before = [a.copy() for a in self.arrays] if _State.track_writes else []
        error = ctypes.create_string_buffer(512)
        try:
            rc = lib.emu_launch(
                self.name.encode(), *map(ctypes.c_uint, self.grid + self.block),
                ctypes.c_int(self.smem), self.pointers, self.sizes, self.is_array,
                ctypes.c_int(self.count), error, ctypes.c_int(len(error)),
            )  # fmt: skip
        finally:
            counts = np.zeros(2, np.uint64)
            if watched:
                lib.emu_unready_reads(counts.ctypes.data_as(ctypes.c_void_p))
                lib.set_unready(None, ctypes.c_ulonglong(0))
        if counts[0]:
            raise RuntimeError(
                f"{self.name}, launched as a programmatic dependent, read before its wait "
                f"{int(counts[0])} times bytes that {_State.written_by}, the kernel before it, "
                "wrote"
            )
        if _State.track_writes:
            _State.written = _changed_runs(self.arrays, before)
            _State.written_by = self.name
        if rc:
            reasons = {2: "more dynamic shared memory than the emulator holds",
                       3: "cp.async copies left in flight"}  # fmt: skip
            raise RuntimeError(f"launch of {self.name} failed ({rc}): "
                               f"{error.value.decode() or reasons.get(rc, '')}")  # fmt: skip
        entered = _State.lib.emu_pdl_entered()
        if self.pdl:  # launched as a programmatic dependent: every thread waits first
            threads = int(np.prod(self.grid)) * int(np.prod(self.block))
            if entered != threads:
                raise RuntimeError(
                    f"{self.name} launched as a dependent: {entered} of its {threads} threads "
                    "called pdl_enter"
                )
            _State.pdl_launches += 1
        _State.launches += 1


class RawKernel:
    """A kernel of ours by name; `RawKernel(code, name)` also builds (as CuPy's does), but
    only a kernel driver.cpp knows can launch."""

    def __init__(self, *code_and_name: str, **options: Any) -> None:
        self.name = code_and_name[-1]
        self.max_dynamic_shared_size_bytes = 0

    def __setattr__(self, key: str, value: Any) -> None:
        if key == "max_dynamic_shared_size_bytes" and not 0 <= value <= MAX_DYNAMIC_SMEM:
            raise ValueError(f"max_dynamic_shared_size_bytes must be in [0, {MAX_DYNAMIC_SMEM}]")
        object.__setattr__(self, key, value)

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 *, shared_mem: int = 0, stream: Stream | None = None,
                 pdl: bool = False) -> None:  # fmt: skip
        """As CuPy's; `pdl` (not CuPy's) is a launch as a programmatic dependent
        (PdlDriver below), which every thread of the kernel must enter by pdl_enter."""
        if not isinstance(args, tuple):
            raise TypeError(f"{self.name}: args must be a tuple; got {type(args).__name__}")
        limit = max(MAX_STATIC_SMEM, self.max_dynamic_shared_size_bytes)
        if shared_mem > limit:
            raise RuntimeError(
                f"{self.name}: {shared_mem} bytes of dynamic shared memory over the kernel's "
                f"limit of {limit} (set max_dynamic_shared_size_bytes)"
            )
        launch = _Launch(self.name, grid, block, args, shared_mem, pdl)
        current = get_current_stream()
        if _State.capture is not None:
            capturing, recorded = _State.capture
            if current is not capturing:
                raise CaptureError(f"{self.name} launched on another stream than the capturing one")
            recorded.append(launch)
            return
        current._drain(len(current._queue))
        _use(current, launch.spans, f"kernel {self.name}")
        launch.run()


def watch_early_reads(monkeypatch: Any) -> None:
    """From now on (until `monkeypatch` undoes it) every kernel run is diffed for the bytes
    it changes, and a kernel launched next as a programmatic dependent fails its launch if
    a thread of it reads any of them before its pdl_enter (a cp.async source or an __ldg:
    cuda_emu.h's "Reads before a grid's wait"). Conservative: a copy between the two
    kernels (which on a GPU would end the programmatic overlap) does not clear them."""
    monkeypatch.setattr(_State, "track_writes", True)
    monkeypatch.setattr(_State, "written", [])


class PdlDriver:
    """cuda/pdl.py's Driver for the emulation (`pdl._driver`): the arguments packed as
    the real driver's would be (pdl.pack_args), then the kernel launched as a dependent,
    so every thread of it must call pdl_enter (checked when it runs, replays included)."""

    def launch(self, fn: RawKernel, grid: tuple[int, ...], block: tuple[int, ...],
               args: tuple[Any, ...], shared_mem: int, *, programmatic: bool = True,
               cluster: int = 1, cooperative: bool = False) -> None:  # fmt: skip
        from reprise.cuda import pdl

        if cluster != 1:
            raise NotImplementedError("the emulation launches no cluster (it runs gemm.cu)")
        if not (programmatic or cooperative):
            raise ValueError("a driver launch is programmatic or cooperative (else CuPy's)")
        # (a cooperative launch's grid runs together here anyway: driver.cpp's persistent
        # kernels run as one cluster)
        pdl.launch_config(
            grid, block, shared_mem, 0, programmatic=programmatic, cooperative=cooperative
        )
        pdl.pack_args(args)
        fn(grid, block, tuple(args), shared_mem=shared_mem, pdl=programmatic)

    def occupancy(self, fn: RawKernel, threads: int, shared_mem: int) -> int:
        """One CTA an SM (the emulation has one SM; what a grid runs at once is driver.cpp's
        to say), within the limits the emulation checks."""
        limit = max(MAX_STATIC_SMEM, fn.max_dynamic_shared_size_bytes)
        return 1 if 0 < threads <= 1024 and shared_mem <= limit else 0


def pdl_launches() -> int:
    """Kernels run as programmatic dependents so far (replays included)."""
    return _State.pdl_launches


class RawModule:
    def __init__(self, code: str | None = None, *, options: tuple[str, ...] = (),
                 backend: str = "nvrtc") -> None:  # fmt: skip
        if code is None:
            raise NotImplementedError("the emulation builds a RawModule from code only")
        self.code = code
        self.options = options

    def get_function(self, name: str) -> RawKernel:
        if f" {name}(" not in self.code and f"\n{name}(" not in self.code:
            raise RuntimeError(f"no kernel named {name} in the module")
        return RawKernel(name)


# ---- streams, events, graphs -------------------------------------------------------------


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:  # fmt: skip
        self.stream: Stream | None = None
        self.position = 0  # of the stream's held-back copies, those before the event
        self.clock: dict[Stream, int] = {}  # the ops of each stream the event follows
        self.time = time.perf_counter()

    def record(self, stream: Stream | None = None) -> None:
        _no_capture("an event record")
        self.stream = stream or get_current_stream()
        self.position = len(self.stream._queue)
        self.clock = {**self.stream.after, self.stream: self.stream.position}
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        _no_capture("an event synchronize")
        if self.stream is not None:
            self.stream._drain(self.position)
        _host_waits(self.clock)


def get_elapsed_time(start: Event, end: Event) -> float:
    return 1e3 * (end.time - start.time)


class Graph:
    def __init__(self, launches: list[_Launch]) -> None:
        self.launches = launches
        self.spans = sorted({span for launch in launches for span in launch.spans})

    def launch(self, stream: Stream | None = None) -> None:
        _no_capture("a graph launch")
        _State.replays += 1
        stream = stream or get_current_stream()
        stream._drain(len(stream._queue))
        _use(stream, self.spans, "a graph replay")
        for launch in self.launches:
            launch.run()


class Stream:
    """A stream: kernels run at once; copies issued on it while it is not current wait
    in `_queue` until something waits for them."""

    _current: ClassVar[list[Stream]] = []

    def __init__(self, null: bool = False, non_blocking: bool = False) -> None:
        self.ptr = 0 if null else id(self)
        self._queue: list[Callable[[], None] | None] = []  # run entries become None
        self.position = 0  # ops issued on it
        self.after: dict[Stream, int] = {}  # ops of other streams its next op follows
        self.log: list[tuple[int, list[Span], str]] = []  # its ops' positions and spans
        self.name = "the null stream" if null else f"stream {len(_State.streams)}"
        _State.streams.append(self)

    def __repr__(self) -> str:
        return self.name

    def __enter__(self) -> Stream:
        Stream._current.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        Stream._current.pop()

    def _drain(self, position: int) -> None:
        with _State.lock:
            for i in range(position):
                op = self._queue[i]
                if op is not None:
                    self._queue[i] = None
                    op()

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        _no_capture("a wait on an event")
        if event.stream is not self:
            if event.stream is not None:
                event.stream._drain(event.position)
            _merge(self.after, event.clock)

    def synchronize(self) -> None:
        _no_capture("a stream synchronize")
        self._drain(len(self._queue))
        _host_waits({**self.after, self: self.position})

    def begin_capture(self) -> None:
        if _State.capture is not None:
            raise CaptureError("a capture is already under way")
        if self.ptr == 0:
            raise CaptureError("the legacy default stream cannot capture")
        _State.capture = (self, [])

    def end_capture(self) -> Graph:
        if _State.capture is None or _State.capture[0] is not self:
            raise CaptureError("end_capture on a stream that is not capturing")
        _, launches = _State.capture
        _State.capture = None
        return Graph(launches)


_NULL = Stream(null=True)
Stream.null = _NULL  # type: ignore[attr-defined]


def get_current_stream() -> Stream:
    return Stream._current[-1] if Stream._current else _NULL


def _on(stream: Stream | None, op: Callable[[], None]) -> None:
    """Run a copy on `stream`: now if it is the current stream, else when waited for."""
    if stream is None or stream is get_current_stream():
        op()
    else:
        stream._queue.append(op)


def _synchronize_all() -> None:
    _no_capture("a device synchronize")
    for stream in _State.streams:
        stream._drain(len(stream._queue))
    _host_waits({stream: stream.position for stream in _State.streams})


Span = tuple[int, int]  # [start, end) bytes of device memory


def _changed_runs(arrays: list[np.ndarray], before: list[np.ndarray]) -> list[Span]:
    """The byte runs of `arrays` whose bits differ from `before` (their copies), merged."""
    runs: list[Span] = []
    for a, b in zip(arrays, before, strict=True):
        if a.itemsize not in (1, 2, 4, 8) or a.size == 0:
            continue
        bits = f"u{a.itemsize}"
        idx = np.nonzero(a.view(bits) != b.view(bits))
        if not idx[0].size:
            continue
        offsets = np.zeros(idx[0].size, np.int64)
        for i, stride in zip(idx, a.strides, strict=True):
            offsets += i.astype(np.int64) * stride
        starts = np.sort(a.ctypes.data + offsets)
        breaks = np.flatnonzero(np.diff(starts) != a.itemsize) + 1  # a gap: a new run
        firsts = starts[np.r_[0, breaks]]
        lasts = starts[np.r_[breaks - 1, starts.size - 1]] + a.itemsize
        runs += zip(firsts.tolist(), lasts.tolist(), strict=True)
    merged: list[Span] = []
    for first, last in sorted(runs):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def _span(a: np.ndarray) -> Span:
    low, high = byte_bounds(a)
    return int(low), int(high)


def _merge(clock: dict[Stream, int], other: dict[Stream, int]) -> None:
    for stream, position in other.items():
        if clock.get(stream, 0) < position:
            clock[stream] = position


def _use(stream: Stream, spans: list[Span], what: str) -> None:
    """Issue an op on `stream` that touches `spans`. RaceError if an op of another stream
    that is not ordered before this one touched any of them."""
    after = stream.after
    with _State.lock:
        _merge(after, _host_clock())  # what this thread waited for precedes what it issues
    spans = [(low, high) for low, high in spans if high > low]
    for other in _State.streams:
        if other is stream:
            continue
        seen = after.get(other, 0)
        for position, other_spans, other_what in reversed(other.log):
            if position <= seen:
                break
            if any(a < d and c < b for a, b in spans for c, d in other_spans):
                raise RaceError(
                    f"{what} on {stream} and {other_what} on {other} touch the same device "
                    f"memory, and nothing orders one after the other: record an event "
                    "after the first and make the second's stream wait for it"
                )
    stream.position += 1
    stream.log.append((stream.position, spans, what))
    if len(stream.log) > 1024:  # forget what every stream and the host are past
        with _State.lock:
            host = max((h.get(stream, 0) for h in _State.host.values()), default=0)
        floor = min(
            (max(s.after.get(stream, 0), host) for s in _State.streams if s is not stream),
            default=stream.position,
        )
        stream.log = [entry for entry in stream.log if entry[0] > floor]


def _host_clock() -> dict[Stream, int]:
    return _State.host.setdefault(threading.get_ident(), {})


def _host_waits(clock: dict[Stream, int]) -> None:
    with _State.lock:
        _merge(_host_clock(), clock)


def _stream_of(ptr: int) -> Stream:
    for stream in _State.streams:
        if stream.ptr == ptr:
            return stream
    raise ValueError(f"no stream with handle {ptr}")


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else device
        # an sm_80 as far as dispatch goes: this emulation runs gemm.cu, not the Hopper
        # GEMM (tests/test_gemm_sm90.py emulates that one through its own driver), so a
        # default CupyBackend here keeps every weight on mma.sync
        self.compute_capability = "80"

    def synchronize(self) -> None:
        _synchronize_all()


class MemoryPool:
    """Allocations here are ordinary ones; what a pool changes is that allocating while
    capturing is allowed within `using_allocator(pool.malloc)`."""

    def malloc(self, size: int) -> MemoryPointer:  # pragma: no cover - never called
        raise NotImplementedError

    def free_all_blocks(self) -> None:
        pass


_POOL = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _POOL


get_default_pinned_memory_pool = get_default_memory_pool


@contextlib.contextmanager
def using_allocator(allocator: Any = None) -> Iterator[None]:
    _State.allocator_depth += 1
    try:
        yield
    finally:
        _State.allocator_depth -= 1


def _device_spans(dst: int, src: int, sizes: tuple[int, int], kind: int) -> list[Span]:
    """The device side(s) of a copy that spans `sizes` bytes at `dst` and at `src`."""
    sides = {1: [0], 2: [1], 3: [0, 1]}[kind]
    ptrs = (dst, src)
    return [(ptrs[i], ptrs[i] + sizes[i]) for i in sides]


class _Runtime:
    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2
    memcpyDeviceToDevice = 3

    @staticmethod
    def getDevice() -> int:
        return 0

    @staticmethod
    def getDeviceCount() -> int:
        return 1

    @staticmethod
    def memGetInfo() -> tuple[int, int]:
        return 8 << 30, 16 << 30

    @staticmethod
    def getDeviceProperties(device: int) -> dict[str, Any]:
        return {"name": b"emulated GPU (emucupy)", "totalGlobalMem": 16 << 30,
                "multiProcessorCount": 1, "major": 9, "minor": 0}  # fmt: skip

    @staticmethod
    def runtimeGetVersion() -> int:
        return 13000

    @staticmethod
    def driverGetVersion() -> int:
        return 13000

    @staticmethod
    def deviceSynchronize() -> None:
        _synchronize_all()

    @staticmethod
    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        """As a copy by `set` or `asnumpy`: both ends' bytes count for the race check (host
        memory too: the tier copies' pinned slots), and on a stream that is not current
        the copy waits until something waits for it."""
        _no_capture("memcpyAsync")
        on = _stream_of(stream)
        what = {1: "a host-to-device copy", 2: "a device-to-host copy"}.get(kind, "a device copy")
        _use(on, [(dst, dst + size), (src, src + size)], f"{what} (memcpyAsync)")
        _on(on, lambda: ctypes.memmove(dst, src, size))

    @staticmethod
    def memcpy2DAsync(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                      kind: int, stream: int) -> None:  # fmt: skip
        _no_capture("memcpy2DAsync")
        if width > dpitch or width > spitch:
            raise ValueError(f"memcpy2DAsync: width {width} over a pitch ({dpitch}, {spitch})")
        ends = (height - 1) * dpitch + width, (height - 1) * spitch + width
        _use(_stream_of(stream), _device_spans(dst, src, ends, kind), "memcpy2DAsync")
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    @staticmethod
    def memsetAsync(ptr: int, value: int, size: int, stream: int) -> None:
        _no_capture("memsetAsync")
        _use(_stream_of(stream), [(ptr, ptr + size)], "memsetAsync")
        ctypes.memset(ptr, value, size)


# ---- the modules -------------------------------------------------------------------------


def _numpy_function(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        _no_capture(f"CuPy op {name}")
        return _wrap(fn(*_unwrap(list(args)), **{k: _unwrap(v) for k, v in kwargs.items()}))

    return call


def _module_getattr(name: str) -> Any:
    """The rest of CuPy's namespace: NumPy's types as they are, its functions on device
    arrays (where, arange, take_along_axis, ...)."""
    attr = getattr(np, name, None)
    if attr is None or name.startswith("_"):
        raise AttributeError(f"emulated cupy has no attribute {name!r}")
    if isinstance(attr, type) or not callable(attr):
        return attr
    return _numpy_function(name, attr)


class RandomState:
    """cupy.random.RandomState: NumPy's draws, with CuPy's `dtype` arguments."""

    def __init__(self, seed: int | None = None) -> None:
        self._rs = np.random.RandomState(seed)

    def standard_normal(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        return asarray(self._rs.standard_normal(size).astype(dtype))

    def random_sample(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        return asarray(self._rs.random_sample(size).astype(dtype))

    def uniform(self, low: float = 0.0, high: float = 1.0, size: Any = None,
                dtype: Any = np.float64) -> ndarray:  # fmt: skip
        return asarray(self._rs.uniform(low, high, size).astype(dtype))

    def randint(self, low: int, high: int | None = None, size: Any = None,
                dtype: Any = np.int64) -> ndarray:  # fmt: skip
        return asarray(self._rs.randint(low, high, size, dtype=dtype))


def modules() -> dict[str, types.ModuleType]:
    """`cupy`, `cupy.cuda`, `cupy.cuda.runtime` and `cupyx`, emulated."""
    cupy = types.ModuleType("cupy", "emulated CuPy (tests/kernel_emu/emucupy.py)")
    cuda = types.ModuleType("cupy.cuda")
    for name in ["ndarray", "asarray", "array", "asnumpy", "empty", "zeros", "ones", "empty_like",
                 "zeros_like", "RawKernel", "RawModule", "get_default_memory_pool",
                 "get_default_pinned_memory_pool"]:  # fmt: skip
        setattr(cupy, name, globals()[name])
    cupy.__version__ = "emulated"  # type: ignore[attr-defined]
    random = types.ModuleType("cupy.random")
    random.RandomState = RandomState  # type: ignore[attr-defined]
    random.permutation = lambda n: asarray(np.random.permutation(n))  # type: ignore[attr-defined]
    cupy.random = random  # type: ignore[attr-defined]
    cupy.__getattr__ = _module_getattr  # type: ignore[attr-defined]
    for name in ["Stream", "Event", "Device", "MemoryPool", "using_allocator", "Graph",
                 "get_current_stream", "get_elapsed_time", "MemoryPointer"]:  # fmt: skip
        setattr(cuda, name, globals()[name])
    cuda.runtime = _Runtime  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    cupyx = types.ModuleType("cupyx", "emulated cupyx: pinned memory is host memory")
    cupyx.zeros_pinned = lambda shape, dtype=np.float64: np.zeros(shape, dtype)  # type: ignore[attr-defined]
    cupyx.empty_pinned = lambda shape, dtype=np.float64: np.empty(shape, dtype)  # type: ignore[attr-defined]
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.random": random, "cupyx": cupyx}


def install(lib: ctypes.CDLL, setitem: Callable[[Any, str, Any], None]) -> None:
    """Make `import cupy` the emulation, launching kernels through `lib` (driver.cpp
    built as a shared library). `setitem` is monkeypatch.setitem, so the modules go
    when the test does."""
    _State.lib = lib
    lib.emu_pdl_entered.restype = ctypes.c_ulonglong  # threads that called pdl_enter
    _State.capture = None
    _State.allocator_depth = 0
    _host_waits({stream: stream.position for stream in _State.streams})  # a clean start
    for name, module in modules().items():
        setitem(sys.modules, name, module)
    from reprise.cuda import pdl  # the driver launches (clusters, cooperative) run here too

    setitem(vars(pdl), "_driver", PdlDriver())


def skip_kernels(skip: bool = True) -> None:
    """Run no kernel from now on (with `skip`): launches and replays are counted, memory
    that kernels would write stays as allocated, and `empty` allocates zeros, so token
    ids read back stay in range. What is left of a step is its CPU side."""
    _State.skip_kernels = skip


def launches() -> int:
    """Kernels run so far (replays included)."""
    return _State.launches


def replays() -> int:
    """CUDA graphs launched so far."""
    return _State.replays
