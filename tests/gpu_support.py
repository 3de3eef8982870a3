"""Helpers the GPU test modules share: host <-> device transfers (BF16 as uint16 bits)
and poisoned output buffers. CuPy is imported on use, so this imports anywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reprise.cuda.backend import cuda_unavailable_reason
from reprise.cuda.kernels import to_device as dev
from reprise.cuda.kernels import to_host as host

__all__ = ["dev", "host", "is_synthetic", "needs_gpu", "poisoned"]

NO_GPU = cuda_unavailable_reason()
# The skip says why, so a GPU machine whose CuPy is broken does not pass by skipping.
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA device: {NO_GPU}")


def is_synthetic(model_dir: Path) -> bool:
    """Random weights (`reprise model synth`): numbers compare, answers make no sense."""
    return "reprise_synthetic" in json.loads((model_dir / "config.json").read_text())


def poisoned(shape: tuple[int, ...], dtype: Any) -> Any:
    """A device buffer of all-ones bytes (NaN for BF16 and fp32, -1 for ints):
    anything a kernel leaves unwritten shows."""
    import cupy

    out = cupy.empty(shape, dtype=np.dtype(dtype))
    out.view(np.uint8).fill(0xFF)
    return out
