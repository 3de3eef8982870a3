"""gemm.cu's split count against its speed, on one GPU: every count `split_length` cuts
K into exactly, for Llama-3.1-8B's projections at small and large M. A benchmark, not
a test: it says which S each shape should get, and whether the large-M FOLD route
still costs anything over the unsplit kernel.

    python bench/bench_split_sweep.py [--rows 1,16,64,2048] [--max-splits 12] [--out x.json]

Times as bench/bench_gemm_sm90.py takes them (the median of 5 repeats of the mean of
back-to-back calls, the inputs rotated past L2). Bandwidth is the weight's and the
activations' bytes over the time, against a device copy's (read + write) measured in
this run; `*` marks the count `split_k` picks today, `best` the fastest. Rows of
different S are different bits (DESIGN §4: S is fixed per weight), so this chooses the
rule, it never switches a loaded weight.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from reprise.bench.bench_gemm_sm90 import L2_BYTES, SHAPES, median_us
from reprise.bench.bench_gpu_kernels import random_bf16
from reprise.cuda.gemm_kernel import gemm, num_splits, split_k, split_length, tile_config


def copy_bytes_per_s() -> float:
    import cupy

    src = cupy.ones(1 << 30, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    us = median_us(lambda _: dst.__setitem__(Ellipsis, src), [None], 10)
    return 2 * src.nbytes / (us * 1e-6)


def exact_counts(k: int, most: int) -> list[int]:
    return [s for s in range(1, most + 1) if num_splits(k, split_length(k, s)) == s]


def main() -> None:
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,2048")
    parser.add_argument("--max-splits", type=int, default=12)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    copy = copy_bytes_per_s()
    print(f"device copy {copy / 1e9:.0f} GB/s (read + write)")
    results = []
    for name in args.shapes.split(","):
        n, k, out_f32 = SHAPES[name]
        chosen = split_k(n, k)
        copies = max(2, -(-2 * L2_BYTES // (2 * n * k)))
        weights = [random_bf16((n, k), 0.02, 100 + s) for s in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            xs = [random_bf16((m, k), 1.0, s) for s in range(copies)]
            out = cupy.empty((m, n), cupy.float32 if out_f32 else cupy.uint16)
            pairs = list(zip(xs, weights, strict=True))
            line = []
            times = {}
            for s in exact_counts(k, args.max_splits):
                call = partial(gemm, out_f32=out_f32, out=out, splits=s)
                times[s] = median_us(lambda p, call=call: call(p[0], p[1]), pairs, args.iters)
                line.append(f"S={s}{'*' if s == chosen else ''} {times[s]:.1f}")
            best = min(times, key=times.get)
            moved = 2 * (n * k + m * k) + out.nbytes
            share = {s: moved / (t * 1e-6) / copy for s, t in times.items()}
            print(
                f"{name:8} M={m:<5} {tile_config(m).name:6} "
                + "  ".join(line)
                + f"  | best S={best}: {share[best]:.0%} of copy; chosen {share[chosen]:.0%}"
            )
            results.append({"shape": name, "m": m, "n": n, "k": k, "chosen": chosen,
                            "us": times, "share_of_copy": share, "best": best})  # fmt: skip
        del weights
        cupy.get_default_memory_pool().free_all_blocks()
    if args.out:
        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        payload = {"device": device, "copy_bytes_per_s": copy, "rows": results}
        args.out.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
