"""bench/bench_ncu_step.py's reading of Nsight Compute's CSV (its details page: one row per
kernel, section and metric), on a CSV made here in that layout."""

from __future__ import annotations

import csv
import io

from reprise.bench.bench_ncu_step import main, parse, summary

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
          "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name",
          "Metric Unit", "Metric Value"]  # fmt: skip


def ncu_csv(kernels: list[tuple[str, str, dict[str, tuple[str, str]]]]) -> str:
    out = io.StringIO()
    out.write("==PROF== Connected to process 1234 (python3)\n")  # ncu's own lines come first
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(HEADER)
    for kid, (name, grid, metrics) in enumerate(kernels):
        for metric, (unit, value) in metrics.items():
            writer.writerow([kid, 1234, "python3", "host", name, 1, 7, "(128, 1, 1)", grid, 0,
                             "9.0", "Section", metric, unit, value])  # fmt: skip
    return out.getvalue()


def test_a_line_per_kernel_in_launch_order_with_durations_in_us(tmp_path) -> None:
    kernels = [
        ("gemm_sm90_ws_bf16_split", "(96, 1, 1)", {
            "Duration": ("usecond", "25.86"), "DRAM Throughput": ("%", "45.1"),
            "Registers Per Thread": ("register/thread", "168"), "Waves Per SM": ("", "0.73"),
        }),
        ("rmsnorm_bf16", "(1, 1, 1)", {"Duration": ("nsecond", "3,520"), "DRAM Throughput": ("%", "0.4")}),
        ("paged_attention_tc_d128_b32_deep", "(1, 256, 1)", {"Duration": ("msecond", "0.02390")}),
    ]  # fmt: skip
    text = ncu_csv(kernels)
    got = parse(text)
    assert [k["id"] for k in got] == ["0", "1", "2"]
    assert [k["name"] for k in got] == [name for name, _, _ in kernels]
    assert [k["Duration"] for k in got] == ["25.86", "3.52", "23.90"]
    assert got[0]["grid"] == "(96, 1, 1)" and got[0]["Registers Per Thread"] == "168"
    lines = summary(got)
    assert len(lines) == 1 + 3 + 1
    assert "paged_attention_tc_d128_b32_deep" in lines[3] and "23.90" in lines[3]
    assert lines[2].split()[-9:] == ["3.52", "0.4", "-", "-", "-", "-", "-", "-", "-"]
    assert lines[-1] == "3 kernels, 53.3 us in all (each alone, under ncu)"
    path = tmp_path / "step.csv"
    path.write_text(text)
    assert main(["summary", str(path)]) == 0


def test_a_log_without_kernel_rows_says_so(tmp_path, capsys) -> None:
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== Disconnected\n")
    assert parse(path.read_text()) == []
    assert main(["summary", str(path)]) == 1
    assert "no kernel rows" in capsys.readouterr().err


def test_stall_reasons_print_under_their_kernel_largest_first() -> None:
    """Where the CSV holds the stall metrics (`--metrics` STALL_METRICS), a line under the
    kernel names its largest TOP_STALLS reasons, largest first; a kernel without them has
    no such line."""
    from reprise.bench.bench_ncu_step import STALL_METRICS, STALL_REASONS, TOP_STALLS

    values = {reason: float(i) / 4 for i, reason in enumerate(STALL_REASONS)}
    values["barrier"] = 9.5
    stalls = {metric: ("", f"{values[reason]:,.2f}")
              for reason, metric in zip(STALL_REASONS, STALL_METRICS, strict=True)}  # fmt: skip
    kernels = [
        ("paged_attention_tc_d128_b32", "(128, 8, 1)", {"Duration": ("usecond", "349.41"), **stalls}),
        ("rmsnorm_bf16", "(1, 1, 1)", {"Duration": ("usecond", "3.52")}),
    ]  # fmt: skip
    lines = summary(parse(ncu_csv(kernels)))
    assert lines[1].split()[1] == "paged_attention_tc_d128_b32"
    want = sorted(values.items(), key=lambda rv: -rv[1])[:TOP_STALLS]
    assert want[0] == ("barrier", 9.5)
    assert lines[2] == "     stalls: " + ", ".join(f"{r} {v:.2f}" for r, v in want)
    assert lines[3].split()[1] == "rmsnorm_bf16" and len(lines) == 1 + 3 + 1
