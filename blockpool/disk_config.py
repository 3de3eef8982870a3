"""The disk tier's settings (where it lives, how large it may grow, the layout of its
blocks) and the shapes of the callables it takes (a copy into a staging buffer, and
what makes one). Each setting is checked when the config is built, with a message
naming the field and the bad value."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import ml_dtypes
import numpy as np


class CopyDone(Protocol):
    """A copy into a staging buffer, maybe still under way: `synchronize()` returns once
    the buffer holds the bytes (the GPU backend's event, recorded after the copy)."""

    def synchronize(self) -> None: ...


# Issues a copy of one block into the staging buffer it is given (`block_shape`,
# `dtype`), and returns what the writer waits on before reading the buffer.
ReadBlock = Callable[[np.ndarray], CopyDone]
# Makes a staging buffer: (shape, dtype) -> host array (pinned memory on the GPU).
Allocate = Callable[[tuple[int, ...], Any], np.ndarray]


def _resolve_dtype(name: str) -> np.dtype | None:
    try:
        return np.dtype(getattr(ml_dtypes, name, name))
    except TypeError:
        return None


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """Where the disk tier lives, how large it may grow, and the layout of its blocks."""

    directory: str | os.PathLike[str]
    max_bytes: int
    block_shape: tuple[
        int, ...
    ]  # one block, e.g. [num_layers, 2, num_kv_heads, block_size, head_dim]
    block_size: int
    model_fingerprint: bytes
    # What computed the KV bytes: backend, device and code version (e.g.
    # "cupy/sm_90/reprise 0.1.0"). Bit-identity holds per backend and device
    # (DESIGN §4), so KV of another producer never matches.
    producer: str
    dtype: str = "bfloat16"
    write_queue_blocks: int = 64  # writes queued at most; staging buffers: one more
    fsync: bool = False
    # reads into host memory are bound by its bandwidth on the GPU hosts measured: 16
    # threads read 9-10 % faster than 8 there (bench/results/2026-11-27-h100/ab)
    read_threads: int = field(default_factory=lambda: min(16, os.cpu_count() or 1))

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str | os.PathLike) or not os.fspath(self.directory):
            raise ValueError(f"directory must be a non-empty path; got {self.directory!r}")
        shape = tuple(self.block_shape) if isinstance(self.block_shape, list | tuple) else None
        if not shape or not all(_is_count(d) for d in shape):
            raise ValueError(
                f"block_shape must be a non-empty tuple of positive integers; got {self.block_shape!r}"
            )
        object.__setattr__(self, "block_shape", tuple(int(d) for d in shape))
        if not _is_count(self.block_size) or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1; got {self.block_size!r}")
        if not isinstance(self.model_fingerprint, bytes) or not self.model_fingerprint:
            raise ValueError(
                f"model_fingerprint must be non-empty bytes; got {self.model_fingerprint!r}"
            )
        if not isinstance(self.producer, str) or not self.producer:
            raise ValueError(f"producer must be a non-empty string; got {self.producer!r}")
        if not _is_count(self.read_threads):
            raise ValueError(f"read_threads must be an integer >= 1; got {self.read_threads!r}")
        if not isinstance(self.dtype, str) or _resolve_dtype(self.dtype) is None:
            raise ValueError(f"dtype must name a NumPy or ml_dtypes dtype; got {self.dtype!r}")
        if not _is_count(self.write_queue_blocks):
            raise ValueError(
                f"write_queue_blocks must be an integer >= 1; got {self.write_queue_blocks!r}"
            )
        if not _is_count(self.max_bytes) or self.max_bytes < self.payload_nbytes:
            raise ValueError(
                f"max_bytes must be an integer >= one block ({self.payload_nbytes} bytes); "
                f"got {self.max_bytes!r}"
            )
        if not isinstance(self.fsync, bool):
            raise ValueError(f"fsync must be a bool; got {self.fsync!r}")

    @property
    def np_dtype(self) -> np.dtype:
        dtype = _resolve_dtype(self.dtype)
        assert dtype is not None
        return dtype

    @property
    def payload_nbytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.np_dtype.itemsize


def _is_count(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and int(value) >= 1
