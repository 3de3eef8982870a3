"""Where a call's device time goes, kernel by kernel: CUDA's own activity trace, read
back as each call's span on the device and the kernels that fill it (issue 18).

CUDA events around a graph replay give its total only. CUPTI, the driver's activity
trace, records every kernel, copy and set the process runs, whoever launched it (CuPy's
RawKernels, each node of a replayed CUDA graph, cuBLAS) with its start and duration on
the device clock; torch.profiler (Kineto) is the maintained way to read it from Python,
and the GPU image has torch. `profile_calls` runs a call a few times under it, each
after the device is idle and followed by a pause of `gap_s`, so the calls come apart on
the device's timeline wherever the pauses are (`split_calls`), and `breakdown` says, a
call's worth each:

- `span_us`: first operation's start to the last one's end;
- `busy_us`: the time some operation ran (the union of their intervals), and
  `idle_us` = span - busy: the device waiting inside the call (launch gaps, the host);
- `top`: the operations by their total time, one entry per (name, grid): a GEMM's
  kernel appears once per weight shape, since its grid differs by shape.

The reading (`device_ops`, `split_calls`, `breakdown`) is plain code over the trace's
JSON (Chrome's trace format, which `export_chrome_trace` writes), tested on the CPU.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The trace's categories of device work, and what this module calls them.
DEVICE_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
GAP_S = 0.02  # the host's pause after each profiled call
SPLIT_GAP_US = 10_000.0  # a gap this long on the device separates two calls (half the pause)


@dataclass(frozen=True, slots=True)
class DeviceOp:
    """One operation the device ran: a kernel (with its grid), a copy or a set."""

    kind: str
    name: str
    grid: tuple[int, ...] | None
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us

    @property
    def key(self) -> str:
        if self.grid is None:
            return self.name if self.kind == "kernel" else f"[{self.kind}] {self.name}"
        return f"{self.name} grid={'x'.join(str(g) for g in self.grid)}"


def device_ops(trace: dict[str, Any]) -> list[DeviceOp]:
    """The device's operations in a Chrome-format trace, by start time."""
    ops = []
    for event in trace.get("traceEvents", []):
        kind = DEVICE_CATEGORIES.get(event.get("cat", ""))
        if kind is None or event.get("ph") != "X":
            continue
        grid = (event.get("args") or {}).get("grid")
        ops.append(DeviceOp(kind, str(event.get("name", "?")),
                            tuple(int(g) for g in grid) if grid else None,
                            float(event["ts"]), float(event.get("dur", 0.0))))  # fmt: skip
    return sorted(ops, key=lambda op: op.start_us)


def split_calls(ops: list[DeviceOp], gap_us: float = SPLIT_GAP_US) -> list[list[DeviceOp]]:
    """Cut ops (by start) into calls wherever the device was idle at least `gap_us`."""
    calls: list[list[DeviceOp]] = []
    end = float("-inf")
    for op in ops:
        if op.start_us - end >= gap_us:
            calls.append([])
        calls[-1].append(op)
        end = max(end, op.end_us)
    return calls


def busy_us(ops: list[DeviceOp]) -> float:
    """How long at least one of `ops` ran: the union of their intervals."""
    total, end = 0.0, float("-inf")
    for op in sorted(ops, key=lambda o: o.start_us):
        if op.end_us > end:
            total += op.end_us - max(op.start_us, end)
            end = op.end_us
    return total


def breakdown(ops: list[DeviceOp], calls: int, *, gap_us: float = SPLIT_GAP_US,
              top: int = 16) -> dict[str, Any]:  # fmt: skip
    """Per call (medians over the calls found): span, busy and idle µs, and operations;
    the `top` operations by their total µs a call (total over every call / the calls
    found). `calls` is how many were profiled: `calls_found` differs when the trace
    missed or merged some, which the caller should report rather than trust."""
    found = split_calls(ops, gap_us)
    result: dict[str, Any] = {"calls": calls, "calls_found": len(found)}
    if not found:
        return result
    spans = [max(op.end_us for op in c) - c[0].start_us for c in found]
    busy = [busy_us(c) for c in found]
    totals: dict[str, list[float]] = {}
    for call in found:
        for op in call:
            entry = totals.setdefault(op.key, [0.0, 0.0])
            entry[0] += op.dur_us
            entry[1] += 1
    n = len(found)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    result |= {
        "span_us": statistics.median(spans),
        "busy_us": statistics.median(busy),
        "idle_us": statistics.median(s - b for s, b in zip(spans, busy, strict=True)),
        "ops_per_call": statistics.median(len(c) for c in found),
        "top": [
            {"op": key, "us": total / n, "count": count / n} for key, (total, count) in ranked[:top]
        ],
        "other_us": sum(total for _, (total, _) in ranked[top:]) / n,
    }
    return result


def profile_calls(call: Callable[[], Any], calls: int = 3, *, gap_s: float = GAP_S,
                  top: int = 16) -> dict[str, Any]:  # fmt: skip
    """`breakdown` of `calls` runs of `call` (each after the device is idle, each
    followed by a pause of gap_s) under torch.profiler's CUDA activity trace. Needs
    torch with CUDA and a device; raises what torch raises otherwise."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()  # the primary context CuPy's work runs in is the one traced
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
            cupy.cuda.Device().synchronize()
            time.sleep(gap_s)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return breakdown(device_ops(trace), calls, gap_us=gap_s * 1e6 / 2, top=top)


def summary_lines(label: str, result: dict[str, Any], top: int = 12) -> list[str]:
    """What a run prints of one breakdown: its span, busy and idle µs, then its top ops."""
    if "span_us" not in result:
        return [f"kernels {label}: no device operations traced ({result})"]
    found = result["calls_found"]
    note = "" if found == result["calls"] else f" (calls found {found} of {result['calls']})"
    lines = [f"kernels {label}: span {result['span_us']:9.1f} us, busy {result['busy_us']:9.1f}, "
             f"idle {result['idle_us']:8.1f}, {result['ops_per_call']:.0f} ops a call{note}"]  # fmt: skip
    for row in result["top"][:top]:
        lines.append(f"kernels {label}: {row['us']:9.1f} us {row['count']:6.1f}x  {row['op']}")
    return lines
