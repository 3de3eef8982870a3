"""The Hopper GEMM (cuda/gemm_sm90.cu) against gemm.cu and cuBLAS (torch.mm) on
Llama-3.1-8B's projections, on one sm_90 GPU. A benchmark, not a test.

    python bench/bench_gemm_sm90.py [--rows 1,16,64,512,2048] [--iters 50] [--out x.json]

Each time is the median over 5 repeats of the mean of back-to-back calls between two
CUDA events, after warm-up, with the inputs rotated among enough copies that they do
not sit in L2 (50 MB) from the previous call; at M = 1 the host's launch cost
(~10-20 us a call) may still show. Each row first checks the results agree (max |diff|
relative to the largest |cuBLAS| element), so a wrong kernel cannot post a time.

Columns: `sm90` the cp.async kernels on the plain weight and `ws` the warp-specialized
kernel on the packed one (what CupyBackend(gemm="wgmma") runs; the wide 128 x 256 tile
where launch_plan picks it), both split as gemm_kernel.split_k says; `ws S=1` the packed
kernel forced unsplit (what the split buys at small M); `ws nosw` the same launch as `ws`
on the no-swizzle stage layout (prepare_weight(swizzle=False)); `ws 128` the 128 x 128
WS tile (WHOLE or FOLD) where `ws` runs the wide one (else the same as `ws`); `ws pad`
(M <= 256) the same launch as `ws` on the kernels built as before 2026-11-27, the rows
past M zero-filled every k-tile and every consumer computing (gemm_sm90_kernel.PAD_ONCE
off: what writing them once and idling a consumer with no row buys at decode); with
`--wide-fold`, `wfold` the wide FOLD forced on split weights past one m tile (route
"wide_fold", not yet a default: gemm_sm90_plan.WIDE_FOLD_BY_DEFAULT; else `ws`); with
`--decode-tile`, `dec` what `ws` runs with DECODE_TILE_BY_DEFAULT on (the decode tile at
M <= 64 where WS's grid is under a wave; else the same as `ws`); with `--m64-tile`, `m64`
what `ws` runs with M64_TILE_BY_DEFAULT on (the 64 x 128 tile, 2 CTAs an SM, at M <= 64;
else the same as `ws`); with `--cluster`, `c2` what `ws` runs on its cluster entry point
(two CTAs along M sharing each weight tile by multicast: gemm_sm90_plan.CLUSTER_BY_DEFAULT,
not yet a default; NaN where launch_plan pairs no m tiles) and `c2/cuBLAS` its ratio;
with `--csplit`, `csplit` what `ws` runs with CSPLIT_BY_DEFAULT on (the cluster split: a
tile's splits one cluster, folded through its shared memory; NaN where `ws` runs no
PARTIAL route); with `--tall`, `tall` the tall FOLD forced (route "tall_fold": three
consumers of 64 x 128 folding in registers, gemm_sm90_plan.TALL_FOLD_BY_DEFAULT, not yet
a default; NaN where `ws` runs no FOLD) and `tall/cuBLAS` its ratio, and `128 S=1` the
128 x 128 tile unsplit where `ws` folds (other bits: the fold's cost against the tile's);
with `--ablate`, two timings of `ws`'s launch with a part left out (gemm_sm90_kernel.ABLATE:
wrong output, so not in the error check): `notail` PARTIAL's fence, count and fold (NaN
where `ws` runs no PARTIAL), `nomma` every MMA (the weight stream alone: against the copy
floor, what the ring delivers).
The decode and 64 x 128 tile flags are on by default since 2026-11-28, so at M <= 64 `ws`
is already one of these two and the columns repeat it; `bash scripts/gpu_followup.sh`
times WS alone end to end (`ws_only_e2e`); `mma` gemm.cu (the default off sm_90) and `mma pad` (M <= 256)
the same on gemm.cu built as before 2026-11-27 (gemm_kernel.PAD_ONCE off: its x rows
past M zero-filled every k-tile); cuBLAS. Ratios are times measured in this run: ws/mma
below 1 means the Hopper kernel is faster than gemm.cu.

The verdict (last lines) is the strict, per-kernel form of the dispatch question: the
Hopper kernel wins an (N, K) outright when ws/mma <= 1 at every M measured (a weight
takes one family for every M) and ws/cuBLAS <= 1.25 at M >= 512 (issue 18's target).
lm_head first passed it on 2026-11-27 (H200, bench/results/2026-11-27-h200), no other
shape yet; the default on sm_90 (gemm_sm90_kernel.WGMMA_BY_DEFAULT) was decided end to
end instead (bench/bench_gpu_e2e.py's gemm_family section).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from reprise.bench.bench_gpu_kernels import as_torch, patched, random_bf16
from reprise.cuda import gemm_kernel, gemm_sm90_kernel, gemm_sm90_plan
from reprise.cuda.gemm_kernel import gemm, split_k
from reprise.cuda.gemm_sm90_kernel import gemm_sm90, prepare_weight
from reprise.cuda.gemm_sm90_plan import WS, Sm90Launch, launch_plan
from reprise.cuda.kernels import launch_kernel

# (N, K, fp32 out)
SHAPES = {
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (28672, 4096, False),
    "down": (4096, 14336, False),
    "lm_head": (128256, 4096, True),
}
L2_BYTES = 50 * 2**20
ABLATIONS = ("ws_notail", "ws_nomma")  # timed only: their output is wrong by construction
CUBLAS_TARGET = 1.25  # issue 18: ws / cuBLAS at M >= 512


def median_us(fn: Callable[[Any], Any], inputs: list[Any], iters: int) -> float:
    """The median over 5 repeats of the mean time of `iters` back-to-back calls (queued
    faster than they run at these sizes, so the host's launch cost hides)."""
    import cupy

    for i in range(3):
        fn(inputs[i % len(inputs)])
    means = []
    for _ in range(5):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for i in range(iters):
            fn(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        means.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters)
    return statistics.median(means)


def ws_narrow(x: Any, packed: Any, out: Any, out_f32: bool) -> Any:
    """The 128 x 128 WS tile where launch_plan would take the wide one (WHOLE, or FOLD
    through its workspace, past one m tile): the same bits; otherwise gemm_sm90 as it is."""
    m, n, k = x.shape[0], packed.num_cols, packed.k
    plan = launch_plan(m, n, k, out_f32=out_f32, packed=True)
    if "_wide" not in plan.kernel:
        return gemm_sm90(x, packed, out_f32=out_f32, out=out)
    if plan.splits > 1:  # the narrow FOLD is a route of its own
        return gemm_sm90(x, packed, out_f32=out_f32, out=out, route="ws_fold")
    return ws_whole_128(x, packed, out, out_f32)


def ws_whole_128(x: Any, packed: Any, out: Any, out_f32: bool) -> Any:
    """The 128 x 128 WS tile unsplit (WHOLE) at any M, a split weight too (other bits than
    its FOLD's): beside `ws` (WS's FOLD) and `ws S=1` (the wide WHOLE) it tells whether a
    split weight's large-M cost is the fold or the tile (`--tall`'s `128 S=1` column)."""
    m, n, k = x.shape[0], packed.num_cols, packed.k
    # WHOLE on WS: no route names it past one m tile, so launched here
    args = (x, packed.data, out, np.int32(m), np.int32(n), np.int32(k))
    grid = gemm_sm90_plan.grid(WS, m, n)
    plan = Sm90Launch(WS.kernel_name(out_f32), grid, WS.num_threads, WS.smem_bytes, 1, 0, False)
    device = gemm_sm90_kernel._device_id()
    fn = gemm_sm90_kernel._kernel(plan.kernel, plan.smem_bytes, device, packed.swizzled)
    launch_kernel(fn, plan.grid, (plan.threads,), args, shared_mem=plan.smem_bytes)
    return out


def ws_wide_fold(x: Any, packed: Any, out: Any, out_f32: bool) -> Any:
    """The wide FOLD forced where a split weight's product passes one m tile; otherwise
    gemm_sm90 as it is."""
    m, n, k = x.shape[0], packed.num_cols, packed.k
    route = "wide_fold" if split_k(n, k) > 1 and m > WS.block_m else None
    return gemm_sm90(x, packed, out_f32=out_f32, out=out, route=route)


def with_setting(module: Any, setting: str, value: bool, call: Callable[[], Any]) -> Any:
    """call() with `module.setting` = value meanwhile: a tile not yet a default forced on
    (gemm_sm90_plan's DECODE_TILE_BY_DEFAULT, M64_TILE_BY_DEFAULT), or the kernels built
    as before 2026-11-27 (gemm_sm90_kernel.PAD_ONCE, gemm_kernel.PAD_ONCE off: the x
    rows past M zero-filled every k-tile, and every ws consumer computing). The same bits
    either way."""
    with patched(module, setting, value):
        return call()


def timings(
    m: int, n: int, k: int, out_f32: bool, iters: int, wide_fold: bool = False,
    decode_tile: bool = False, m64_tile: bool = False, cluster: bool = False,
    csplit: bool = False, tall: bool = False, ablate: bool = False,
) -> tuple[dict[str, float], float]:  # fmt: skip
    """Each path's time (us) for one shape, and the largest relative error among them."""
    import cupy
    import torch

    pair_bytes = 2 * (m * k + n * k)
    copies = max(2, -(-2 * L2_BYTES // pair_bytes))
    pairs = [
        (random_bf16((m, k), 1.0, s), random_bf16((n, k), 0.02, 100 + s)) for s in range(copies)
    ]
    # and the packed weight, in both stage layouts
    pairs = [(x, w, prepare_weight(w), prepare_weight(w, swizzle=False)) for x, w in pairs]
    out = cupy.empty((m, n), np.float32 if out_f32 else np.uint16)
    torch_out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def forced(module: Any, setting: str, value: Any, fn: Callable[..., Any], weight: int):
        """fn on the pair's x and weight (index 1 plain, 2 packed) with module.setting =
        value meanwhile (with_setting)."""
        return lambda p: with_setting(
            module, setting, value, partial(fn, p[0], p[weight], out_f32=out_f32, out=out)
        )

    fns: dict[str, Callable[[Any], Any]] = {
        "sm90": lambda p: gemm_sm90(p[0], p[1], out_f32=out_f32, out=out),
        "ws": lambda p: gemm_sm90(p[0], p[2], out_f32=out_f32, out=out),
        "ws_unsplit": lambda p: gemm_sm90(p[0], p[2], out_f32=out_f32, out=out, splits=1),
        "ws_noswizzle": lambda p: gemm_sm90(p[0], p[3], out_f32=out_f32, out=out),
        "ws_128": lambda p: ws_narrow(p[0], p[2], out, out_f32),
        "ws_pad": forced(gemm_sm90_kernel, "PAD_ONCE", False, gemm_sm90, 2),
        "ws_wide_fold": lambda p: ws_wide_fold(p[0], p[2], out, out_f32),
        "ws_decode_tile": forced(gemm_sm90_plan, "DECODE_TILE_BY_DEFAULT", True, gemm_sm90, 2),
        "ws_m64_tile": forced(gemm_sm90_plan, "M64_TILE_BY_DEFAULT", True, gemm_sm90, 2),
        "ws_cluster": lambda p: gemm_sm90(p[0], p[2], out_f32=out_f32, out=out, cluster=True),
        "ws_csplit": forced(gemm_sm90_plan, "CSPLIT_BY_DEFAULT", True, gemm_sm90, 2),
        "ws_tall_fold": lambda p: gemm_sm90(p[0], p[2], out_f32=out_f32, out=out, route="tall_fold"),
        "ws_128_unsplit": lambda p: ws_whole_128(p[0], p[2], out, out_f32),
        "ws_notail": forced(gemm_sm90_kernel, "ABLATE", 1, gemm_sm90, 2),
        "ws_nomma": forced(gemm_sm90_kernel, "ABLATE", 2, gemm_sm90, 2),
        "mma": lambda p: gemm(p[0], p[1], out_f32=out_f32, out=out),
        "mma_pad": forced(gemm_kernel, "PAD_ONCE", False, gemm, 1),
        "cublas": lambda p: torch.mm(as_torch(p[0]), as_torch(p[1]).t(), out=torch_out),
    }
    if m > 2 * WS.block_m:  # past two m tiles only the last one's padding differs
        del fns["ws_pad"], fns["mma_pad"]
    if not wide_fold:
        del fns["ws_wide_fold"]
    if not decode_tile:
        del fns["ws_decode_tile"]
    if not m64_tile:
        del fns["ws_m64_tile"]
    if not cluster or launch_plan(m, n, k, out_f32=out_f32, packed=True, cluster=True).cluster == 1:
        del fns["ws_cluster"]
    plan = launch_plan(m, n, k, out_f32=out_f32, packed=True)  # what `ws` runs
    if not csplit or not plan.workspace:
        del fns["ws_csplit"]
    if not tall or not plan.kernel.endswith("_fold"):
        del fns["ws_tall_fold"], fns["ws_128_unsplit"]
    if not ablate or not plan.workspace:
        del fns["ws_notail"]  # the tail's ablation: PARTIAL's alone
    if not ablate:
        del fns["ws_nomma"]
    ref = fns["cublas"](pairs[0]).float()
    errs = []
    for key in [key for key in fns if key != "cublas" and key not in ABLATIONS]:
        got = fns[key](pairs[0])
        got = torch.as_tensor(got, device="cuda") if out_f32 else as_torch(got)
        errs.append(float((got.float() - ref).abs().max() / ref.abs().max()))
    t = {key: median_us(fn, pairs, iters) for key, fn in fns.items()}
    del pairs
    cupy.get_default_memory_pool().free_all_blocks()
    return t, max(errs)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,512,2048")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--wide-fold", action="store_true", help="time the wide FOLD too")
    parser.add_argument("--decode-tile", action="store_true", help="time the decode tile too")
    parser.add_argument("--m64-tile", action="store_true", help="time the 64 x 128 tile too")
    parser.add_argument("--cluster", action="store_true", help="time the cluster entry points too")
    parser.add_argument("--csplit", action="store_true", help="time the cluster split too")
    parser.add_argument("--tall", action="store_true", help="time the tall FOLD too")
    parser.add_argument("--ablate", action="store_true",
                        help="time the ws kernel without its split tail and without its MMAs too")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{'shape':8} {'M':>5} {'S':>2} {'ws route':16} {'sm90':>8} {'ws':>8} {'ws S=1':>8} "
          f"{'ws nosw':>8} {'ws 128':>8} {'ws pad':>8} {'wfold':>8} {'dec':>8} {'m64':>8} {'c2':>8} {'csplit':>8} {'tall':>8} {'128 S=1':>8} {'notail':>8} {'nomma':>8} {'mma':>8} {'mma pad':>8} {'cuBLAS':>8} {'ws/mma':>7} {'ws/cuBLAS':>9} "
          f"{'c2/cuBLAS':>9} {'tall/cuBLAS':>11} {'S gain':>7} {'err':>7}")  # fmt: skip
    verdict: dict[str, bool] = {}
    for name in args.shapes.split(","):
        n, k, out_f32 = SHAPES[name]
        flip = True
        for m in rows:
            t, err = timings(m, n, k, out_f32, args.iters, args.wide_fold, args.decode_tile,
                             args.m64_tile, args.cluster, args.csplit, args.tall,
                             args.ablate)  # fmt: skip
            route = launch_plan(m, n, k, out_f32=out_f32, packed=True).kernel
            route = route.removeprefix("gemm_sm90_")
            ws_mma, ws_cublas = t["ws"] / t["mma"], t["ws"] / t["cublas"]
            gain = t["ws_unsplit"] / t["ws"]
            flip &= ws_mma <= 1 and (m < 512 or ws_cublas <= CUBLAS_TARGET)
            print(f"{name:8} {m:5d} {split_k(n, k):2d} {route:16} {t['sm90']:8.1f} {t['ws']:8.1f} "
                  f"{t['ws_unsplit']:8.1f} {t['ws_noswizzle']:8.1f} {t['ws_128']:8.1f} "
                  f"{t.get('ws_pad', float('nan')):8.1f} "
                  f"{t.get('ws_wide_fold', float('nan')):8.1f} "
                  f"{t.get('ws_decode_tile', float('nan')):8.1f} "
                  f"{t.get('ws_m64_tile', float('nan')):8.1f} "
                  f"{t.get('ws_cluster', float('nan')):8.1f} "
                  f"{t.get('ws_csplit', float('nan')):8.1f} "
                  f"{t.get('ws_tall_fold', float('nan')):8.1f} "
                  f"{t.get('ws_128_unsplit', float('nan')):8.1f} "
                  f"{t.get('ws_notail', float('nan')):8.1f} "
                  f"{t.get('ws_nomma', float('nan')):8.1f} "
                  f"{t['mma']:8.1f} {t.get('mma_pad', float('nan')):8.1f} {t['cublas']:8.1f} {ws_mma:7.2f} {ws_cublas:9.2f} "
                  f"{t.get('ws_cluster', float('nan')) / t['cublas']:9.2f} "
                  f"{t.get('ws_tall_fold', float('nan')) / t['cublas']:11.2f} {gain:7.2f} {err:7.1e}")  # fmt: skip
            results.append({"shape": name, "m": m, "n": n, "k": k, "splits": split_k(n, k),
                            "ws_route": route, "us": t, "ws_over_mma": ws_mma,
                            "ws_over_cublas": ws_cublas, "split_gain": gain,
                            "max_rel_err": err})  # fmt: skip
        verdict[name] = flip
    for name, flip in verdict.items():
        print(f"verdict {name}: {'wgmma may be the sm_90 default' if flip else 'keep mma.sync'}")
    if args.out:
        device = torch.cuda.get_device_name()
        payload = {"device": device, "rows": results, "verdict": verdict}
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
