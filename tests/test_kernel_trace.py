"""The kernel trace's reading (bench/kernel_trace.py) on Chrome-format traces made here:
calls cut at the host's pauses, spans, busy time as a union, per-(name, grid) totals."""

from __future__ import annotations

import numpy as np
import pytest

from reprise.bench.kernel_trace import (
    DeviceOp,
    breakdown,
    busy_us,
    device_ops,
    split_calls,
    summary_lines,
)


def event(cat: str, name: str, ts: float, dur: float, grid: list[int] | None = None) -> dict:
    args = {"grid": grid, "block": [128, 1, 1]} if grid else {}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_device_ops_keeps_the_devices_work_by_start() -> None:
    trace = {"traceEvents": [
        event("kernel", "gemm", 50.0, 5.0, [96, 2, 1]),
        event("cuda_runtime", "cudaGraphLaunch", 1.0, 9.0),  # the host's call: not device work
        event("gpu_memcpy", "Memcpy DtoD", 10.0, 2.0),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3.0},  # no duration: skipped
        event("gpu_memset", "Memset", 20.0, 1.0),
    ]}  # fmt: skip
    ops = device_ops(trace)
    assert [(op.kind, op.name, op.start_us) for op in ops] == [
        ("memcpy", "Memcpy DtoD", 10.0), ("memset", "Memset", 20.0), ("kernel", "gemm", 50.0),
    ]  # fmt: skip
    assert ops[2].grid == (96, 2, 1) and ops[2].key == "gemm grid=96x2x1"
    assert ops[0].key == "[memcpy] Memcpy DtoD"
    assert device_ops({}) == []


def test_busy_time_is_the_union_of_the_intervals() -> None:
    ops = [DeviceOp("kernel", "a", None, 0.0, 10.0), DeviceOp("kernel", "b", None, 5.0, 10.0),
           DeviceOp("kernel", "c", None, 3.0, 2.0), DeviceOp("kernel", "d", None, 30.0, 1.0)]  # fmt: skip
    assert busy_us(ops) == 16.0  # [0, 15) and [30, 31)
    rng = np.random.default_rng(7)
    for _ in range(20):  # against a dense timeline on a fine grid
        starts = rng.integers(0, 200, size=12)
        durs = rng.integers(1, 40, size=12)
        timeline = np.zeros(260, dtype=bool)
        for s, d in zip(starts, durs, strict=True):
            timeline[s : s + d] = True
        got = busy_us([DeviceOp("kernel", "k", None, float(s), float(d))
                       for s, d in zip(starts, durs, strict=True)])  # fmt: skip
        assert got == timeline.sum()


def test_calls_come_apart_at_the_pauses_and_are_summed_per_call() -> None:
    rng = np.random.default_rng(11)
    calls, pause = 3, 20_000.0
    events, t = [], 1000.0
    expected_span, expected_gemm = [], 0.0
    for _ in range(calls):
        start = t
        for _ in range(4):  # four GEMMs of two shapes, with launch gaps between them
            for grid in ([96, 2, 1], [32, 4, 1]):
                dur = float(rng.integers(10, 30))
                events.append(event("kernel", "gemm_ws", t, dur, grid))
                expected_gemm += dur
                t += dur + 2.0
        events.append(event("kernel", "argmax", t, 3.0, [1, 1, 1]))
        t += 3.0
        expected_span.append(t - start)
        t += pause
    result = breakdown(device_ops({"traceEvents": events}), calls, gap_us=pause / 2, top=2)
    assert result["calls_found"] == calls
    assert result["ops_per_call"] == 9
    assert result["span_us"] == pytest.approx(sorted(expected_span)[1])
    assert result["idle_us"] == pytest.approx(8 * 2.0)  # the eight launch gaps
    assert result["busy_us"] == pytest.approx(result["span_us"] - 16.0)
    top = result["top"]
    assert [row["count"] for row in top] == [4.0, 4.0]
    assert {row["op"] for row in top} == {"gemm_ws grid=96x2x1", "gemm_ws grid=32x4x1"}
    assert top[0]["us"] >= top[1]["us"]
    assert sum(row["us"] for row in top) == pytest.approx(expected_gemm / calls)
    assert result["other_us"] == pytest.approx(3.0)  # argmax, past the top 2
    lines = summary_lines("decode", result)
    assert lines[0].startswith("kernels decode: span") and "calls found" not in lines[0]
    assert len(lines) == 3


def test_a_trace_that_merged_calls_says_so() -> None:
    ops = [DeviceOp("kernel", "k", None, float(t), 1.0) for t in (0, 5, 100, 105)]
    assert [len(c) for c in split_calls(ops, gap_us=50.0)] == [2, 2]
    result = breakdown(ops, calls=3, gap_us=50.0)
    assert result["calls_found"] == 2
    assert "(calls found 2 of 3)" in summary_lines("x", result)[0]
    assert summary_lines("x", breakdown([], calls=3))[0].startswith("kernels x: no device")
