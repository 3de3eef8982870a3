"""One engine step under Nsight Compute, and the table of what it read (issue 18).

    ncu --profile-from-start off --clock-control none --csv --log-file step.csv \\
        --section SpeedOfLight --section LaunchStats --section Occupancy \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python bench/bench_ncu_step.py run [--like llama-3.1-8b] [--case decode|cached|prefill]
    python bench/bench_ncu_step.py summary step.csv

(add `--metrics` with STALL_METRICS, comma-joined, for the summary's stall lines; and
`--kernel-name regex:paged_attention --launch-count 1` to profile one kernel of a call)

`run` builds the engine as bench_gpu_e2e does (random weights of `--like`'s shapes),
warms it (graphs captured, kernels loaded) and brackets exactly one call with the CUDA
profiler API (cudaProfilerStart / Stop), so `--profile-from-start off` profiles that
call's kernels and no other: a batch-1 decode step at `--context` (graphs: each of the
graph's kernel nodes is profiled on its own), a fully cached prompt's first token, or a
fresh prompt's prefill (`--prompt-tokens` computed in one step).
`--launch-count N` on ncu keeps the first N of them (one layer's are enough).

`summary` reads ncu's CSV (one row per kernel and metric) and prints a line per kernel:
duration, DRAM and SM throughput (% of peak), registers, waves, achieved occupancy, warp
cycles per issued instruction and the L2 hit rate. Kernels bound by memory show DRAM
near its peak; one far under it with little SM throughput either is waiting (latency, a
tail, too few CTAs): many cycles per issued instruction say its warps stall, and where
the CSV holds STALL_METRICS, a line under the kernel says on what (the largest reasons,
in warps stalled a cycle an instruction issues: they sum to the cycles per issue).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

# (what the summary calls it, ncu's metric name in its sections' CSV rows)
COLUMNS = (
    ("us", "Duration"),
    ("dram%", "DRAM Throughput"),
    ("mem%", "Memory Throughput"),
    ("sm%", "Compute (SM) Throughput"),
    ("regs", "Registers Per Thread"),
    ("waves", "Waves Per SM"),
    ("occ%", "Achieved Occupancy"),
    ("cyc/iss", "Warp Cycles Per Issued Instruction"),
    ("L2hit%", "L2 Hit Rate"),
)
# Why warps stall (ncu's raw metrics, `--metrics`): on average, warps stalled for the
# reason per cycle an instruction issued. A kernel's values sum to about its warp cycles
# per issued instruction.
STALL_REASONS = (
    "long_scoreboard", "short_scoreboard", "barrier", "wait", "mio_throttle",
    "math_pipe_throttle", "not_selected", "selected", "lg_throttle", "tex_throttle",
    "dispatch_stall", "no_instruction", "branch_resolving", "membar", "sleeping", "drain",
    "misc", "imc_miss",
)  # fmt: skip
STALL_METRICS = tuple(
    f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio" for reason in STALL_REASONS
)
TOP_STALLS = 5


def parse(text: str) -> list[dict[str, str]]:
    """ncu's CSV (details page: a row per kernel, section and metric) -> a dict per
    kernel, in launch order: its ID, name, grid and block, and every metric's value
    converted to the summary's unit where it has one (Duration in µs)."""
    start = text.find('"ID"')
    if start < 0:
        return []
    kernels: dict[str, dict[str, str]] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        kid = row.get("ID")
        if not kid or not kid.isdigit():
            continue
        kernel = kernels.setdefault(kid, {
            "id": kid, "name": row.get("Kernel Name", "?"), "grid": row.get("Grid Size", ""),
            "block": row.get("Block Size", ""),
        })  # fmt: skip
        name, unit, value = (
            row.get("Metric Name"),
            row.get("Metric Unit", ""),
            row.get("Metric Value", ""),
        )
        if name:
            kernel[name] = _to_us(value, unit) if name == "Duration" else value
    return [kernels[k] for k in sorted(kernels, key=int)]


def _to_us(value: str, unit: str) -> str:
    """A duration in ncu's unit (ns, us, ms, s; also "nsecond", "usecond", ...) in µs."""
    scale = {"n": 1e-3, "u": 1.0, "m": 1e3, "s": 1e6}.get(unit.strip()[:1])
    try:
        number = float(value.replace(",", ""))
    except ValueError:
        return value
    return value if scale is None else f"{number * scale:.2f}"


def summary(kernels: list[dict[str, str]]) -> list[str]:
    header = f"{'id':>4} {'kernel':44} {'grid':>16} " + " ".join(f"{c:>8}" for c, _ in COLUMNS)
    lines = [header]
    for k in kernels:
        name = k["name"] if len(k["name"]) <= 44 else k["name"][:41] + "..."
        values = " ".join(f"{k.get(metric, '-'):>8}" for _, metric in COLUMNS)
        lines.append(f"{k['id']:>4} {name:44} {k['grid']:>16} {values}")
        stalls = stall_reasons(k)
        if stalls:
            lines.append("     stalls: " + ", ".join(f"{r} {v:.2f}" for r, v in stalls))
    total = sum(float(k["Duration"]) for k in kernels if _is_number(k.get("Duration", "")))
    lines.append(f"{len(kernels)} kernels, {total:.1f} us in all (each alone, under ncu)")
    return lines


def stall_reasons(kernel: dict[str, str]) -> list[tuple[str, float]]:
    """The kernel's TOP_STALLS largest stall reasons with their values, largest first
    (none where the CSV has no STALL_METRICS)."""
    found = [
        (reason, float(kernel[metric].replace(",", "")))
        for reason, metric in zip(STALL_REASONS, STALL_METRICS, strict=True)
        if _is_number(kernel.get(metric, "").replace(",", ""))
    ]
    return sorted(found, key=lambda rv: -rv[1])[:TOP_STALLS]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def run(args: argparse.Namespace) -> None:
    import cupy
    import cupyx.profiler

    from reprise.bench.bench_gpu_e2e import GREEDY, Bench

    bench = Bench(argparse.Namespace(
        like=args.like, block_size=32, context=args.context, batches=(1,), prefill_tokens=0,
        ttft_tokens=args.prompt_tokens, disk_dir=None, backend="cupy",
    ))  # fmt: skip
    if args.case == "decode":
        engine = bench.decoding_engine(1, args.context, graphs=True, steps=8)
        call = engine.step
    elif args.case == "prefill":  # a new prompt each call: computed whole, in one step
        n = args.prompt_tokens
        engine = bench.engine(num_device_blocks=4 * (bench.blocks(n + 1) + 1),
                              max_num_batched_tokens=n, logits_cache_mb=0)  # fmt: skip

        def call() -> None:
            engine.generate(bench.prompt(n), GREEDY)
    else:
        n = args.prompt_tokens
        engine = bench.engine(num_device_blocks=bench.blocks(n + 1) + 3, max_num_batched_tokens=n,
                              logits_cache_mb=0)  # fmt: skip
        prompt = bench.prompt(n)

        def call() -> None:
            engine.generate(prompt, GREEDY)

    for _ in range(
        3
    ):  # warm: kernels loaded, graphs captured (the cached case: computed, then cached)
        call()
    cupy.cuda.Device().synchronize()
    with cupyx.profiler.profile():  # cudaProfilerStart ... cudaProfilerStop
        call()
        cupy.cuda.Device().synchronize()
    print(f"bench_ncu_step: profiled one {args.case} call", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="one warm call between profiler start and stop")
    p_run.add_argument("--like", default="llama-3.1-8b")
    p_run.add_argument("--case", choices=("decode", "cached", "prefill"), default="decode")
    p_run.add_argument("--context", type=int, default=512)
    p_run.add_argument("--prompt-tokens", type=int, default=4096)
    p_sum = sub.add_parser("summary", help="a line per kernel of ncu's CSV")
    p_sum.add_argument("csv", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
        return 0
    kernels = parse(args.csv.read_text(errors="replace"))
    if not kernels:
        print(f"bench_ncu_step: no kernel rows in {args.csv}", file=sys.stderr)
        return 1
    print("\n".join(summary(kernels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
