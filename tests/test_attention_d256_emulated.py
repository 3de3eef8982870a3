"""head_dim 256 (Gemma's) through the CUDA-core attention's launcher, on the emulated CuPy
(tests/kernel_emu/emucupy.py): attention_kernel.paged_attention takes it (entry point,
workspace sized by head_dim), matches the twin and gives a position the same bits in a
prefill, as a decode step and batched; the tensor-core launcher refuses it.

The kernel's own invariance at head_dim 256 (batch, chunking, grids, windows) is tested
beside 64 and 128 in test_kernels_emulated.py and test_sliding_window_emulated.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_cupy_emulated import emulated  # noqa: F401 (a fixture: the emulated CuPy)
from test_kernels_emulated import Paged, max_row_ulps

from reprise.cuda import attention_kernel, attention_tc_kernel
from reprise.cuda.attention import KV_CHUNK

pytestmark = pytest.mark.kernels


def launch(
    paged: Paged, spans: list[tuple[int, int, int]], launcher: Callable[..., Any] | None = None
) -> np.ndarray:
    """`launcher` (attention_kernel.paged_attention) on the spans batched in one launch, its
    output poisoned first."""
    import cupy

    from reprise.cuda.kernels import to_device, to_host

    q, tables, seq_lens, starts = paged.inputs(spans)
    out = cupy.asarray(np.full(q.shape, 0xFFFF, np.uint16))
    run = launcher or attention_kernel.paged_attention
    args = [to_device(x) for x in (q, paged.cache, tables, seq_lens, starts)]
    run(args[0], args[1], 1, *args[2:], 1 / np.sqrt(paged.head_dim), out=out)
    return to_host(out)


def test_the_launcher_runs_head_dim_256_as_the_twin(
    emulated: None,  # noqa: F811
    rng: np.random.Generator,
) -> None:
    """A prefill over a KV chunk boundary, decode steps of its positions, and those
    steps batched after another sequence's prefill chunk, each on split_grid's geometry
    (split: chunk states through the launcher's workspace): within BF16 rounding of the
    twin, each decode step the bits of its position in the prefill, and the same bits
    in the batch."""
    assert 256 in attention_kernel.HEAD_DIMS
    n = KV_CHUNK + 9
    paged = Paged(rng, (4, 2, 256), 32, [n, 40])
    assert attention_kernel.split_grid(n, 1, 2, 2, len(paged.tables[0]), 32).splits
    prefill = launch(paged, [(0, 0, n)])
    assert max_row_ulps(prefill, paged.twin([(0, 0, n)])) <= 2
    steps = [(0, pos, pos + 1) for pos in (0, KV_CHUNK - 1, KV_CHUNK, n - 1)]
    q, tables, *_ = paged.inputs(steps)
    grid = attention_kernel.split_grid(q.shape[0], len(steps), 2, 2, tables.shape[1], 32)
    assert grid.splits
    decoded = launch(paged, steps)
    assert max_row_ulps(decoded, paged.twin(steps)) <= 2
    for i, (_, pos, _) in enumerate(steps):
        assert np.array_equal(decoded[i].view(np.uint16), prefill[pos].view(np.uint16)), pos
    batched = launch(paged, [(1, 30, 40), *steps])
    assert np.array_equal(batched[10:].view(np.uint16), decoded.view(np.uint16))


def test_the_tensor_core_launcher_refuses_head_dim_256(
    emulated: None,  # noqa: F811
    rng: np.random.Generator,
) -> None:
    assert attention_tc_kernel.TC_HEAD_DIMS == (64, 128)
    paged = Paged(rng, (4, 2, 256), 32, [5])
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 128\); got 256"):
        launch(paged, [(0, 0, 5)], attention_tc_kernel.paged_attention_tc)


def test_the_split_workspace_scales_with_head_dim() -> None:
    assert attention_kernel.workspace_floats(3, 8, 256, 4) == 3 * 8 * 4 * (256 + 2)
