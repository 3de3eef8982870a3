"""head_dim 256 (Gemma's) through both attention launchers, on the emulated CuPy
(tests/kernel_emu/emucupy.py): attention_kernel.paged_attention (the CUDA-core kernel) and
attention_tc_kernel.paged_attention_tc (its 16- and 32-key pages, the normal ring alone)
take it (entry point, workspace sized by head_dim), match the twin and give a position
the same bits in a prefill, as a decode step and batched; the tensor-core launcher
refuses 64-key pages, and the backend takes it there only with D256_BY_DEFAULT.

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
from reprise.cuda.attention import KV_CHUNK, paged_attention_ref

pytestmark = pytest.mark.kernels


def launch_with(
    paged: Paged, spans: list[tuple[int, int, int]], launcher: Callable[..., Any] | None = None,
    window: int = 0, softcap: float = 0.0,
) -> np.ndarray:  # fmt: skip
    """`launcher` (attention_kernel.paged_attention) on the spans batched in one launch, its
    output poisoned first."""
    import cupy

    from reprise.cuda.kernels import to_device, to_host

    q, tables, seq_lens, starts = paged.inputs(spans)
    out = cupy.asarray(np.full(q.shape, 0xFFFF, np.uint16))
    run = launcher or attention_kernel.paged_attention
    args = [to_device(x) for x in (q, paged.cache, tables, seq_lens, starts)]
    run(args[0], args[1], 1, *args[2:], 1 / np.sqrt(paged.head_dim), window, softcap, out=out)
    return to_host(out)


LAUNCHERS = {"cuda-cores": (attention_kernel.paged_attention, attention_kernel.ROWS_PER_CTA),
             "tensor-cores": (attention_tc_kernel.paged_attention_tc, attention_tc_kernel.ROWS_PER_CTA)}  # fmt: skip


@pytest.mark.parametrize(("kernel", "block_size"), [("cuda-cores", 32), ("tensor-cores", 32),
                                                    ("tensor-cores", 16)])  # fmt: skip
def test_the_launcher_runs_head_dim_256_as_the_twin(
    emulated: None,  # noqa: F811
    rng: np.random.Generator,
    kernel: str,
    block_size: int,
) -> None:
    """A prefill over a KV chunk boundary, decode steps of its positions, and those
    steps batched after another sequence's prefill chunk, each on split_grid's geometry
    (split: chunk states through the launcher's workspace): within BF16 rounding of the
    twin, each decode step the bits of its position in the prefill, and the same bits
    in the batch."""
    assert 256 in attention_kernel.HEAD_DIMS and 256 in attention_tc_kernel.TC_HEAD_DIMS
    run, rows = LAUNCHERS[kernel]

    def launch(paged: Paged, spans: list[tuple[int, int, int]]) -> np.ndarray:
        return launch_with(paged, spans, run)

    n = KV_CHUNK + 9
    paged = Paged(rng, (4, 2, 256), block_size, [n, 40])
    assert attention_kernel.split_grid(n, 1, 2, 2, len(paged.tables[0]), block_size, rows).splits
    prefill = launch(paged, [(0, 0, n)])
    assert max_row_ulps(prefill, paged.twin([(0, 0, n)])) <= 2
    steps = [(0, pos, pos + 1) for pos in (0, KV_CHUNK - 1, KV_CHUNK, n - 1)]
    q, tables, *_ = paged.inputs(steps)
    grid = attention_kernel.split_grid(
        q.shape[0], len(steps), 2, 2, tables.shape[1], block_size, rows
    )
    assert grid.splits
    decoded = launch(paged, steps)
    assert max_row_ulps(decoded, paged.twin(steps)) <= 2
    for i, (_, pos, _) in enumerate(steps):
        assert np.array_equal(decoded[i].view(np.uint16), prefill[pos].view(np.uint16)), pos
    batched = launch(paged, [(1, 30, 40), *steps])
    assert np.array_equal(batched[10:].view(np.uint16), decoded.view(np.uint16))


@pytest.mark.parametrize(("window", "softcap"), [(40, 0.0), (KV_CHUNK + 1, 2.0)])
def test_head_dim_256_on_the_tensor_cores_under_a_window_and_a_cap(
    emulated: None,  # noqa: F811
    rng: np.random.Generator,
    window: int,
    softcap: float,
) -> None:
    """Gemma's window (and Gemma 2's soft cap) on the tensor-core kernel at head_dim 256,
    Gemma 3 1B's group of 4 query heads a KV head: within BF16 rounding of the twin, and a
    prefill's rows the bits of their decode steps (split launches) and of a batch."""
    n = 2 * KV_CHUNK + 5
    paged = Paged(rng, (4, 1, 256), 16, [n, 30])
    q, tables, seq_lens, starts = paged.inputs([(0, 0, n)])
    twin = paged_attention_ref(q, paged.cache, 1, tables, seq_lens, starts,
                               1 / np.sqrt(256), window, softcap)  # fmt: skip
    run = attention_tc_kernel.paged_attention_tc
    prefill = launch_with(paged, [(0, 0, n)], run, window, softcap)
    assert max_row_ulps(prefill, twin) <= 2
    steps = [(0, pos, pos + 1) for pos in (0, window - 1, window, KV_CHUNK, n - 1)]
    decoded = launch_with(paged, steps, run, window, softcap)
    for i, (_, pos, _) in enumerate(steps):
        assert np.array_equal(decoded[i].view(np.uint16), prefill[pos].view(np.uint16)), pos
    batched = launch_with(paged, [(1, 0, 30), *steps], run, window, softcap)
    assert np.array_equal(batched[30:].view(np.uint16), decoded.view(np.uint16))


def test_the_tensor_core_launcher_refuses_64_key_pages_of_head_dim_256(
    emulated: None,  # noqa: F811
    rng: np.random.Generator,
) -> None:
    paged = Paged(rng, (4, 2, 256), 64, [5])
    with pytest.raises(ValueError, match=r"block_size must be one of \(16, 32\) for head_dim 256"):
        launch_with(paged, [(0, 0, 5)], attention_tc_kernel.paged_attention_tc)
    assert not attention_tc_kernel.takes(256, 64) and attention_tc_kernel.takes(256, 32)
    assert not attention_tc_kernel.takes(96, 32)


def test_the_backend_takes_the_tensor_cores_for_head_dim_256_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CupyBackend.paged_attention: head_dim 256 runs on the CUDA cores unless
    D256_BY_DEFAULT is on, then on the tensor cores where they have its pages; 128 on the
    tensor cores either way; and kernel_choice says which."""
    pytest.importorskip("cupy")
    from reprise.cuda import cupy_backend

    calls: list[str] = []
    monkeypatch.setattr(attention_kernel, "paged_attention", lambda *a: calls.append("cuda-cores"))
    monkeypatch.setattr(
        attention_tc_kernel, "paged_attention_tc", lambda *a: calls.append("tensor-cores")
    )
    backend = object.__new__(cupy_backend.CupyBackend)
    backend.attention = "tensor-cores"
    cases = [(False, 256, 32, "cuda-cores"), (True, 256, 32, "tensor-cores"), (True, 256, 16, "tensor-cores"),
             (True, 256, 64, "cuda-cores"), (False, 128, 64, "tensor-cores"), (True, 128, 32, "tensor-cores")]  # fmt: skip
    for flag, head_dim, block_size, want in cases:
        monkeypatch.setattr(attention_tc_kernel, "D256_BY_DEFAULT", flag)
        q = np.zeros((1, 4, head_dim), np.uint16)
        cache = np.zeros((2, 1, 2, 2, block_size, head_dim), np.uint16)
        calls.clear()
        backend.paged_attention(q, cache, 0, None, None, None, 0.1)
        assert calls == [want], (flag, head_dim, block_size)
    from reprise.cuda import gemm_sm90_kernel

    monkeypatch.setattr(gemm_sm90_kernel, "device_arch", lambda: "90")
    backend.gemm_family = None
    for flag, choice in ((False, "tensor-cores/wgmma"), (True, "tensor-cores+d256/wgmma")):
        monkeypatch.setattr(attention_tc_kernel, "D256_BY_DEFAULT", flag)
        assert backend.kernel_choice == choice  # the disk tier's files are keyed by it
    backend.attention = "cuda-cores"
    assert backend.kernel_choice == "cuda-cores/wgmma"
    calls.clear()
    backend.paged_attention(np.zeros((1, 4, 256), np.uint16), cache, 0, None, None, None, 0.1)
    assert calls == ["cuda-cores"]


def test_the_split_workspace_scales_with_head_dim() -> None:
    assert attention_kernel.workspace_floats(3, 8, 256, 4) == 3 * 8 * 4 * (256 + 2)
