"""Our CUDA kernels against the hardware floors and the vendor libraries, measured in
one run on one GPU. A benchmark, not a test.

    python bench/bench_gpu_kernels.py --out results.json [--sections all|none|floors,gemm,...]
        [--models llama-3.1-8b,smollm2-135m] [--iters 20] [--warmup 3] [--no-flush]

Sections (each runs in its own try/except: a failure is recorded under `errors` in
the JSON, with the rows measured so far, and the run goes on with the next):

- floors: device copy bandwidth (a 1 GiB device-to-device memcpy, read + write bytes
  counted), the BF16 matrix rate (torch.mm, 8192^3) and pinned host <-> device
  bandwidth both ways (256 MiB). Every other section's floors divide by these.
- gemm: each GEMM of a layer (fused qkv, o, fused gate_up, down) at M = 1, 16, 64
  (decode) and 512, 2048 (prefill), and the fp32-output lm_head at the decode sizes
  only (the model runs it on the sampled rows alone). Each row also gives the weight's
  split count (gemm_kernel.split_k), the achieved GB/s (the floor's bytes over the
  time) and its fraction of the device copy bandwidth measured by `floors` in the same
  run (`of_copy_bw`; the note says it at M = 1, where the weight stream is the work).
  On sm_90 it also times the Hopper GEMM (gemm_sm90.cu on the packed weight, split-K as
  gemm.cu's) on the same operands: `wgmma_us` and `wgmma_over_mma` (below 1: faster
  than gemm.cu) in the row's JSON. The reference is cuBLAS through
  torch.mm on the same buffers: the project holds BF16 as uint16 bits, which
  cupy.matmul cannot multiply as BF16 (CuPy had no bfloat16 before v14, and v14's
  is minimal).
- attention: paged attention at decode (1, 16, 64 sequences of context 512 and 4096)
  and prefill (one causal 2048-token sequence), block size 32, against torch's
  scaled_dot_product_attention on contiguous BF16 tensors of the same shapes, run
  with enable_gqa and with K/V repeated to every head; the faster is the reference.
  Each row records the KV split's geometry (head_parts, kv_lanes, busy_ctas: CTAs
  with work at that context); a split launch gets its workspace preallocated. Same-run
  baselines of the tensor-core kernel: `tc ring2` held to its normal page ring (split
  launches take the deep one); `tc expf`, its page step before base 2 (the accurate
  expf, a rescale and the masks on every page); `tc sel`, that with the select around
  each key's expf it had before 2026-11-27; `tc coop`, the shared page (a decode CTA's
  pages on all four warps; BUILDS), and `tc coop plan4k` / `plan8k` with the head split
  below; `tc notail` and `tc nomath`, ablations timed only (wrong output: the split's
  tail, the page step's math left out); `tc plan4k` / `tc plan8k`, the head
  split planned for a 4,096- or 8,192-token context instead of 2,048 (fewer pages a CTA
  at long contexts); and `tc chunk64` / `tc chunk128`, built with KV chunks of 64 or 128
  keys instead of 256 (CHUNKS: fewer pages a CTA walks in a row; other bits).
- small: embed, rmsnorm, add_rmsnorm, rope (q and k), kv_write, silu_mul, argmax.
- hosttier: CupyBackend offloading and onboarding 64 and 256 blocks of the
  Llama-3.1-8B cache (4 MiB a block) against the pinned bandwidth, a call a block and
  as one run (`offload run`, `onboard run`: `tier_copies`, as the runner issues a
  match's copies; `issue_us` is the host's time to issue them), and how far the copies
  overlap GEMMs issued with them.

A kernel's floor is max(bytes it must move / copy bandwidth, flops / matrix rate);
the table gives its time, floor, time / floor, the reference's time and time /
reference. A time is the median of CUDA event pairs around single calls. A spin
kernel holds the stream while Python issues the timed calls, so they run back to
back and launch overhead is not what is timed; L2 is flushed before each call, so
weights come from DRAM as in a model far larger than L2. Models are the shapes of
daemon/model/synth.py. The JSON (command, device, floors, rows, errors) is rewritten after
every section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from reprise.cuda import launchers
from reprise.cuda.attention_kernel import (
    ROWS_PER_CTA,
    kv_chunks,
    paged_attention,
    split_grid,
    workspace_floats,
)
from reprise.cuda.attention_tc_kernel import ROWS_PER_CTA as TC_ROWS_PER_CTA
from reprise.cuda.backend import cuda_device_available
from reprise.cuda.gemm_kernel import gemm, split_k
from reprise.cuda.kvcache import kv_cache_shape
from reprise.daemon.model.synth import SHAPES

Row = dict[str, Any]
Floors = dict[str, float | None]  # COPY_BW, H2D_BW, D2H_BW in bytes/s; MATMUL_RATE in flop/s
Timed = tuple[Any, str | None]  # (a result or None, the error text or None)

COPY_BW = "copy_bytes_per_s"  # device memory, read + write bytes
H2D_BW = "h2d_bytes_per_s"  # pinned host -> device
D2H_BW = "d2h_bytes_per_s"
MATMUL_RATE = "matmul_flop_per_s"  # BF16 tensor cores, through cuBLAS
SECTION_NAMES = ("floors", "gemm", "attention", "small", "hosttier")
DEFAULT_MODELS = ("llama-3.1-8b", "smollm2-135m")
DECODE_ROWS = (1, 16, 64)
PREFILL_ROWS = (512, 2048)
ATTENTION_BATCHES = (1, 16, 64)
ATTENTION_CONTEXTS = (512, 4096)
PREFILL_TOKENS = 2048
BLOCK_SIZE = 32
SMALL_TOKENS = (1, 64, 2048)
ROPE_POSITIONS = 4096
HOST_TIER_MODEL = "llama-3.1-8b"
HOST_TIER_BLOCKS = 512  # in the device cache
HOST_TIER_COPIES = (64, 256)
HOST_TIER_REPEATS = 3
COPY_BYTES = 1 << 30
PINNED_BYTES = 256 << 20
MATMUL_SIZE = 8192
FLUSH_BYTES = 256 << 20  # over L2 (50 MiB on H100 and H200)
MAX_SPIN_S = 0.25
# Spins for `ns` nanoseconds of the device's global timer; the loop count bounds it should
# the timer not advance (each pass takes well over a nanosecond).
SPIN_SOURCE = r"""
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (unsigned long long i = 0; i < ns; ++i) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= ns) break;
    }
}
"""

# ---- shapes and floors: arithmetic only, no device ------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, name: str) -> ModelShape:
        """The shape of a model in daemon/model/synth.py's SHAPES (Hugging Face config names)."""
        if name not in SHAPES:
            raise ValueError(f"model must be one of {', '.join(SHAPES)}; got {name!r}")
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")  # fmt: skip
        return cls(name, *(SHAPES[name][k] for k in keys))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class GemmShape(NamedTuple):
    name: str
    n: int  # out_features: w is [N, K]
    k: int
    out_f32: bool = False


def gemm_shapes(model: ModelShape) -> list[GemmShape]:
    """A layer's GEMMs as the model runs them (q, k, v fused; gate, up fused), then the lm_head."""
    return [
        GemmShape("qkv", model.q_size + 2 * model.kv_size, model.hidden),
        GemmShape("o", model.hidden, model.q_size),
        GemmShape("gate_up", 2 * model.intermediate, model.hidden),
        GemmShape("down", model.hidden, model.intermediate),
        GemmShape("lm_head", model.vocab, model.hidden, out_f32=True),
    ]


def gemm_rows(shape: GemmShape) -> tuple[int, ...]:
    """The M values a GEMM is timed at: the lm_head only sees the rows that sample."""
    return DECODE_ROWS if shape.name == "lm_head" else DECODE_ROWS + PREFILL_ROWS


def gemm_bytes(m: int, n: int, k: int, *, out_f32: bool = False) -> int:
    """BF16 x [M, K] and w [N, K] read once, y [M, N] written once."""
    return 2 * (m * k + n * k) + (4 if out_f32 else 2) * m * n


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def attention_bytes(model: ModelShape, num_seqs: int, q_len: int, kv_len: int) -> int:
    """Each sequence's K and V read once, q read and out written once, all BF16."""
    kv = num_seqs * kv_len * 2 * model.kv_size
    return 2 * (kv + 2 * num_seqs * q_len * model.q_size)


def attention_flops(model: ModelShape, num_seqs: int, q_len: int, kv_len: int) -> int:
    """QK^T and PV at 2 flops a multiply-add; a causal prefill (q_len > 1) halves them."""
    flops = 4 * num_seqs * q_len * kv_len * model.q_size
    return flops // 2 if q_len > 1 else flops


def small_kernel_bytes(model: ModelShape, num_tokens: int) -> dict[str, int]:
    """Bytes each small kernel must move for `num_tokens` rows (argmax: logit rows)."""
    t, h, d, inter = num_tokens, model.hidden, model.head_dim, model.intermediate

    def rope(heads: int) -> int:  # x in and out, the positions, a cos and a sin row a token
        return 4 * t * heads * d + 4 * t + 4 * t * d

    return {
        "embed": 4 * t + 2 * t * h + 4 * t * h,  # ids, table rows, fp32 out
        "rmsnorm": 4 * t * h + 2 * h + 2 * t * h,  # fp32 in, weight, BF16 out
        "add_rmsnorm": (4 + 2) * t * h + 2 * h + (4 + 2) * t * h,  # + fp32 sum, BF16 norm
        "rope q+k": rope(model.num_heads) + rope(model.num_kv_heads),
        "kv_write": 2 * 2 * 2 * t * model.kv_size + 8 * t,  # k, v read and written; slots
        # the model's one launch for the three above: q, k, v in once, q out, k and v to the cache
        "rope_kv_write": 2 * 2 * t * (model.q_size + 2 * model.kv_size) + 8 * t + 4 * t + 4 * t * d,
        "silu_mul": 2 * 2 * t * inter + 2 * t * inter,
        "argmax": 4 * t * model.vocab + 4 * t,
    }


def kv_block_bytes(model: ModelShape, block_size: int) -> int:
    """One KV-cache block: every layer's K and V for `block_size` tokens, BF16."""
    return model.num_layers * 2 * model.kv_size * block_size * 2


def floor_us(
    num_bytes: int, num_flops: int, floors: Floors, bandwidth: str = COPY_BW
) -> tuple[float | None, str | None]:
    """(the larger of the bytes and flop floors in µs, "bytes" or "flops"); (None, None)
    when neither applies or was measured."""
    bw, rate = floors.get(bandwidth), floors.get(MATMUL_RATE)
    candidates = [(1e6 * num_bytes / bw, "bytes")] if num_bytes and bw else []
    candidates += [(1e6 * num_flops / rate, "flops")] if num_flops and rate else []
    return max(candidates) if candidates else (None, None)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def overlap_fraction(compute_us: float, copy_us: float, both_us: float) -> float:
    """How much of the shorter job hid under the longer: 1 fully, 0 not at all."""
    return (compute_us + copy_us - both_us) / min(compute_us, copy_us)


def bf16_bits(x32: Any, xp: Any = np) -> Any:
    """float32 -> uint16 BF16 bits, rounded to nearest even like `__float2bfloat16_rn`
    (finite values); `xp` is numpy or cupy, so big weights are made on the device."""
    bits = x32.view(xp.uint32)
    rounded = bits + ((bits >> 16) & 1)
    rounded += 0x7FFF
    rounded >>= 16
    return rounded.astype(xp.uint16)


def parse_sections(text: str) -> tuple[str, ...]:
    """'all', 'none' or a comma list of SECTION_NAMES; the floors come with any other."""
    if text == "none":
        return ()
    names = set(SECTION_NAMES if text == "all" else (s.strip() for s in text.split(",")))
    if unknown := names - set(SECTION_NAMES):
        raise argparse.ArgumentTypeError(
            f"unknown section {', '.join(sorted(unknown))}; "
            f"choose all, none or from {', '.join(SECTION_NAMES)}"
        )
    return tuple(s for s in SECTION_NAMES if s in names or s == "floors")


# ---- rows and the table ---------------------------------------------------------------


def make_row(
    where: tuple[str, str, str, str],
    timed: Timed,
    floors: Floors,
    *,
    cost: tuple[int, int] = (0, 0),
    bandwidth: str = COPY_BW,
    ref: tuple[str | None, float | None, str | None] = (None, None, None),
    **extra: Any,
) -> Row:
    """One table row. where: (section, model, op, shape); timed: our (µs, error); cost:
    (bytes, flops) for the floor; ref: the reference's (name, µs, error)."""
    (section, model, op, shape), (time_us, error), (ref_name, ref_us, ref_error) = where, timed, ref
    floor, bound = floor_us(*cost, floors, bandwidth)
    row = {"section": section, "model": model, "op": op, "shape": shape,
           "time_us": _round(time_us), "floor_us": _round(floor), "bound": bound,
           "x_floor": ratio(time_us, floor), "reference": ref_name, "ref_us": _round(ref_us),
           "x_ref": ratio(time_us, ref_us), "bytes": cost[0], "flops": cost[1],
           "error": error, "ref_error": ref_error}  # fmt: skip
    return row | extra


# (row key, heading, width); the first three left-aligned
COLUMNS = (("model", "model", 13), ("op", "op", 22), ("shape", "shape", 25),
           ("time_us", "time µs", 11), ("floor_us", "floor µs", 10), ("bound", "bound", 6),
           ("x_floor", "×floor", 8), ("ref_us", "ref µs", 10), ("x_ref", "×ref", 7))  # fmt: skip


def format_header() -> str:
    return _line([heading for _, heading, _ in COLUMNS])


def format_row(row: Row) -> str:
    """The table line of a row, then its note and errors, if any."""
    cells = [_cell(row.get(key)) for key, _, _ in COLUMNS]
    notes = [f"{k}: {row[k]}" if k != "note" else row[k] for k in ("note", "error", "ref_error")
             if row.get(k)]  # fmt: skip
    return _line(cells) + ("  " + "; ".join(notes) if notes else "")


def _line(cells: list[str]) -> str:
    return "".join(
        f"{cell:<{w}}" if i < 3 else f"{cell:>{w}}"
        for i, (cell, (_, _, w)) in enumerate(zip(cells, COLUMNS, strict=True))
    )


def _cell(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


# ---- timing and device helpers --------------------------------------------------------


@functools.cache
def _spin_kernel() -> Any:
    import cupy

    return cupy.RawKernel(SPIN_SOURCE, "spin_ns")


@dataclass(slots=True)
class Timer:
    """Median device time in µs of a callable on CuPy's current stream: one CUDA event
    pair around each of `iters` calls, after a first call (compiles, picks cuBLAS
    algorithms) and `warmup` more.

    The timed calls start behind a spin kernel that holds the stream for twice the
    host time the warm-up calls took to issue, so they run back to back on the device
    and the events see the kernels, not Python's launch overhead. With `flush`, a
    memset of FLUSH_BYTES before each call evicts L2. Torch must run on the same stream
    (main makes it so)."""

    iters: int = 20
    warmup: int = 3
    flush: bool = True
    spin: bool = True
    _flush_buf: Any = field(default=None, repr=False)

    def median_us(self, fn: Callable[[], Any], *, flush: bool | None = None) -> float:
        import cupy

        flush = self.flush if flush is None else flush
        stream = cupy.cuda.get_current_stream()
        fn()
        stream.synchronize()
        start = time.perf_counter()
        self._calls(fn, self.warmup, flush, stream)
        issue_s = (time.perf_counter() - start) / self.warmup
        stream.synchronize()
        if self.spin:
            spin_s = min(2 * self.iters * issue_s + 50e-6, MAX_SPIN_S)
            _spin_kernel()((1,), (1,), (np.uint64(spin_s * 1e9),))
        pairs = self._calls(fn, self.iters, flush, stream)
        stream.synchronize()
        return statistics.median(1e3 * cupy.cuda.get_elapsed_time(a, b) for a, b in pairs)

    def _calls(self, fn: Callable[[], Any], count: int, flush: bool, stream: Any) -> list:
        import cupy

        if flush and self._flush_buf is None:
            self._flush_buf = cupy.empty(FLUSH_BYTES, dtype=cupy.uint8)
        pairs = []
        for _ in range(count):
            if flush:
                cupy.cuda.runtime.memsetAsync(self._flush_buf.data.ptr, 0, FLUSH_BYTES, stream.ptr)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            fn()
            end.record(stream)
            pairs.append((start, end))
        return pairs


@dataclass(slots=True)
class Context:
    """What the sections share: the timer, the models, the measured floors, the errors."""

    timer: Timer
    models: tuple[ModelShape, ...]
    floors: Floors = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)

    def attempt(self, where: str, fn: Callable[[], Any]) -> Timed:
        """(fn(), None), or (None, the error's text) with the error logged: one failed
        measurement must not cost the rest of a rare GPU run."""
        try:
            return fn(), None
        except Exception as exc:
            self.log(where, exc)
            return None, f"{type(exc).__name__}: {exc}"

    def timed(self, where: str, fn: Callable[[], Any]) -> Timed:
        """(median µs of fn, None), or (None, the error's text)."""
        return self.attempt(where, partial(self.timer.median_us, fn))

    def log(self, where: str, exc: BaseException) -> None:
        self.errors.append({"where": where, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc(limit=-4)})  # fmt: skip


def random_bf16(shape: tuple[int, ...], scale: float, seed: int) -> Any:
    """A device array of N(0, scale^2) values as BF16 uint16 bits, made on the device."""
    import cupy

    x32 = cupy.random.RandomState(seed).standard_normal(shape, dtype=cupy.float32)
    x32 *= np.float32(scale)
    return bf16_bits(x32, cupy)


def as_torch(a: Any) -> Any:
    """A torch view of a CuPy array (no copy); uint16 BF16 bits come back as bfloat16."""
    import cupy
    import torch

    if a.dtype == np.uint16:
        return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def release() -> None:
    """Hand cached memory back between sections (CuPy's pools and torch's)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()


# ---- sections: each yields its rows as it measures them -------------------------------


def measure_floors(ctx: Context) -> Iterator[Row]:
    import cupy
    import cupyx

    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream()

    def memcpy_us(num_bytes: int, kind: int) -> float:
        dev = cupy.ones(num_bytes, cupy.uint8)
        if kind == rt.memcpyDeviceToDevice:
            other = cupy.empty_like(dev)
            src, dst = dev.data.ptr, other.data.ptr
        else:
            other = cupyx.empty_pinned(num_bytes, np.uint8)
            src, dst = dev.data.ptr, other.ctypes.data
            if kind == rt.memcpyHostToDevice:
                src, dst = dst, src
        copy = partial(rt.memcpyAsync, dst, src, num_bytes, kind, stream.ptr)
        return ctx.timer.median_us(copy, flush=False)  # `other` lives until here

    def matmul_us() -> float:
        import torch

        shape = (MATMUL_SIZE, MATMUL_SIZE)
        a, b = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return ctx.timer.median_us(partial(torch.mm, a, b, out=torch.empty_like(a)), flush=False)

    pinned = f"{PINNED_BYTES >> 20} MiB pinned"
    cases = [
        (COPY_BW, "device copy", f"{COPY_BYTES >> 20} MiB D2D, r+w", 2 * COPY_BYTES, "GB/s",
         partial(memcpy_us, COPY_BYTES, rt.memcpyDeviceToDevice)),
        (H2D_BW, "host->device", pinned, PINNED_BYTES, "GB/s",
         partial(memcpy_us, PINNED_BYTES, rt.memcpyHostToDevice)),
        (D2H_BW, "device->host", pinned, PINNED_BYTES, "GB/s",
         partial(memcpy_us, PINNED_BYTES, rt.memcpyDeviceToHost)),
        (MATMUL_RATE, "bf16 matmul", f"torch.mm {MATMUL_SIZE}^3",
         gemm_flops(MATMUL_SIZE, MATMUL_SIZE, MATMUL_SIZE), "TFLOP/s", matmul_us),
    ]  # fmt: skip
    for key, op, shape, amount, unit, fn in cases:
        time_us, error = ctx.attempt(f"floors {op}", fn)
        ctx.floors[key] = amount / (time_us * 1e-6) if time_us else None
        rate = ctx.floors[key] and round(ctx.floors[key] / (1e12 if unit == "TFLOP/s" else 1e9), 1)
        note = rate and f"{rate} {unit}"
        cost = (0, amount) if key == MATMUL_RATE else (amount, 0)
        where = ("floors", "-", op, shape)
        yield make_row(where, (time_us, error), {}, cost=cost, rate=rate, note=note)
        release()


def stream_rates(num_bytes: int, time_us: float | None, floors: Floors) -> dict[str, Any]:
    """GB/s moved and its fraction of the copy bandwidth (None where either is missing),
    and a note saying both."""
    if not time_us:
        return {"gb_per_s": None, "of_copy_bw": None}
    rate = num_bytes / (time_us * 1e-6)
    fraction = ratio(rate, floors.get(COPY_BW))
    note = f"{rate / 1e9:.0f} GB/s" + (f" = {100 * fraction:.1f} % of copy" if fraction else "")
    return {"gb_per_s": round(rate / 1e9, 1), "of_copy_bw": _round(fraction), "note": note}


def cublas_gemm(x: Any, w: Any, out_f32: bool) -> tuple[Callable[[], Any], str]:
    """torch.mm on the same buffers, and a name for it: fp32 output like ours where
    this torch has mm's out_dtype, else BF16 (half our lm_head's output bytes)."""
    import torch

    xt, wt = as_torch(x), as_torch(w).t()
    if out_f32:
        with contextlib.suppress(TypeError, RuntimeError, NotImplementedError):
            torch.mm(xt, wt, out_dtype=torch.float32)
            return partial(torch.mm, xt, wt, out_dtype=torch.float32), "cuBLAS fp32 out"
    out = torch.empty(xt.shape[0], wt.shape[1], device=xt.device, dtype=torch.bfloat16)
    return partial(torch.mm, xt, wt, out=out), "cuBLAS bf16 out"


def packed_for_wgmma(w: Any) -> Any:
    """The weight packed for the Hopper GEMM (gemm_sm90.cu) where this device and its
    shape take it, else None."""
    from reprise.cuda.gemm_sm90_kernel import device_arch, prepare_weight, supported

    return prepare_weight(w) if supported(device_arch(), 0, *w.shape) else None


def wgmma_timing(
    ctx: Context, where: str, x: Any, packed: Any, out_f32: bool, out: Any, mma_us: float | None
) -> dict[str, Any]:
    """The Hopper GEMM on the packed weight (split as gemm_kernel.split_k says, what
    CupyBackend(gemm="wgmma") runs) on the same operands: its µs and its time over
    gemm.cu's (below 1: faster) as extra row fields; none where the device lacks it."""
    if packed is None:
        return {}
    from reprise.cuda.gemm_sm90_kernel import gemm_sm90

    wgmma_us, error = ctx.timed(
        f"{where} wgmma", partial(gemm_sm90, x, packed, out_f32=out_f32, out=out)
    )
    return {"wgmma_us": _round(wgmma_us), "wgmma_over_mma": ratio(wgmma_us, mma_us),
            "wgmma_error": error}  # fmt: skip


def measure_gemm(ctx: Context) -> Iterator[Row]:
    import cupy

    for model in ctx.models:
        for seed, shape in enumerate(gemm_shapes(model)):
            n, k = shape.n, shape.k
            w = random_bf16((n, k), 0.02, seed)  # [N, K]
            packed = packed_for_wgmma(w)
            for m in gemm_rows(shape):
                x = random_bf16((m, k), 1.0, seed + 100)  # [M, K]
                out = cupy.empty((m, n), np.float32 if shape.out_f32 else np.uint16)
                where = f"gemm {model.name} {shape.name} M={m}"
                ours = ctx.timed(where, partial(gemm, x, w, out_f32=shape.out_f32, out=out))
                made, ref_error = ctx.attempt(where, partial(cublas_gemm, x, w, shape.out_f32))
                ref_fn, ref_name = made if made else (None, None)
                ref_us = None
                if ref_fn is not None:
                    ref_us, ref_error = ctx.timed(f"{where} cuBLAS", ref_fn)
                cost = (gemm_bytes(m, n, k, out_f32=shape.out_f32), gemm_flops(m, n, k))
                where_row = ("gemm", model.name, shape.name, f"M={m} N={n} K={k}")
                ref = (ref_name, ref_us, ref_error)
                achieved = stream_rates(cost[0], ours[0], ctx.floors)
                hopper = wgmma_timing(ctx, where, x, packed, shape.out_f32, out, ours[0])
                yield make_row(where_row, ours, ctx.floors, cost=cost, ref=ref,
                               splits=split_k(n, k), **achieved, **hopper)  # fmt: skip
            del w, packed
            release()


def attention_cases() -> list[tuple[str, int, int, int]]:
    """(label, num_seqs, q_len, kv_len): decode steps, then one causal prefill."""
    decode = [
        (f"decode B={b} ctx={c}", b, 1, c) for c in ATTENTION_CONTEXTS for b in ATTENTION_BATCHES
    ]
    return [*decode, (f"prefill {PREFILL_TOKENS} causal", 1, PREFILL_TOKENS, PREFILL_TOKENS)]


def paged_inputs(model: ModelShape, num_seqs: int, q_len: int, kv_len: int) -> dict[str, Any]:
    """paged_attention's arguments: each sequence's pages shuffled through a one-layer
    cache, its queries the last q_len of its kv_len positions."""
    import cupy

    pages = -(-kv_len // BLOCK_SIZE)
    shape = kv_cache_shape(num_seqs * pages, 1, model.num_kv_heads, BLOCK_SIZE, model.head_dim)
    q = random_bf16((num_seqs * q_len, model.num_heads, model.head_dim), 1.0, 2)
    # the KV split's workspace, allocated once as a captured graph holds it (unused
    # when the launch does not split)
    floats = workspace_floats(num_seqs * q_len, model.num_heads, model.head_dim,
                              kv_chunks(pages, BLOCK_SIZE))  # fmt: skip
    tables = cupy.random.permutation(num_seqs * pages).astype(cupy.int32)
    return {
        "q": q,  # [T, heads, head_dim]
        "cache": random_bf16(shape, 1.0, 1),  # [blocks, 1, 2, kv_heads, block_size, head_dim]
        "layer": 0,
        "block_tables": tables.reshape(num_seqs, pages),
        "seq_lens": cupy.full((num_seqs,), kv_len, dtype=cupy.int32),
        "query_start_loc": cupy.arange(num_seqs + 1, dtype=cupy.int32) * np.int32(q_len),
        "scale": model.head_dim**-0.5,
        "out": cupy.empty_like(q),
        "workspace": cupy.empty(floats, dtype=cupy.float32),
    }


def sdpa_calls(model: ModelShape, num_seqs: int, q_len: int, kv_len: int) -> dict[str, Callable]:
    """torch SDPA on contiguous [B, heads, len, head_dim] BF16, with enable_gqa and with
    K/V repeated to every query head beforehand (the repeat is not timed)."""
    import torch
    import torch.nn.functional as F

    def rand(heads: int, length: int) -> Any:
        shape = (num_seqs, heads, length, model.head_dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    q = rand(model.num_heads, q_len)
    k, v = rand(model.num_kv_heads, kv_len), rand(model.num_kv_heads, kv_len)
    group = model.num_heads // model.num_kv_heads
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    kw = {"is_causal": q_len > 1, "scale": model.head_dim**-0.5}
    return {
        "SDPA gqa": partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True, **kw),
        "SDPA repeat": partial(F.scaled_dot_product_attention, q, kr, vr, **kw),
    }


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """owner.name = value meanwhile, put back even when the block raises: a benchmark's
    variant of a module's setting or function (a same-run baseline, a geometry to try)."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def paged_attention_tc_normal_ring(**inputs: Any) -> Any:
    """The tensor-core kernel held to its normal page ring, split launches too (whose
    launcher takes the deep ring): the deep ring's gain, measured in the same run."""
    from reprise.cuda import attention_tc_kernel as tc

    def normal(head_dim: int, block_size: int, grid: Any) -> tuple[str, int]:
        return tc.kernel_name(head_dim, block_size), tc.smem_bytes(head_dim, block_size)

    with patched(tc, "launch_variant", normal):
        return tc.paged_attention_tc(**inputs)


# Other builds of the tensor-core kernel (attention_tc_kernel.BUILD), timed beside it:
# `tc expf` its page step before base 2 (the accurate expf of natural-unit scores, acc
# rescaled and every page masked: what those three gained); `tc sel` that with a select
# around each expf too, as the H200 timed it on 2026-11-27 (but for the chunk's reset kept
# a branch and the copies' addressing, which both builds share with the default); `tc
# coop` the shared page, not yet the default (attention_tc_kernel.COOP: a split launch's
# CTA of one m16 tile of rows runs each page on all four warps; the same bits).
# And two ablations, timing only (their output is wrong: attention_tc.cu's
# REPRISE_ATTN_ABLATE): `tc notail` a split CTA returning once its chunks' states are
# stored (no fence, count or merge: the default's time less this is the split's tail), `tc
# nomath` no page's math (the pages still loaded: the default's time less this is the page
# step). Which of the two a batch-1 decode's 14-17 µs is, at 2 and 16 chunks, says which
# change comes next: a tail through a cluster's shared memory, or two pages in flight.
BUILDS = {
    "expf": ("REPRISE_ATTN_EXPF=1",),
    "sel": ("REPRISE_ATTN_EXPF=1", "REPRISE_ATTN_EXP_SELECT=1"),
    "coop": ("REPRISE_ATTN_COOP=1",),
    "notail": ("REPRISE_ATTN_ABLATE=1",),
    "nomath": ("REPRISE_ATTN_ABLATE=2",),
}


def paged_attention_tc_built(build: tuple[str, ...], **inputs: Any) -> Any:
    """The tensor-core kernel compiled with the defines `build`, in the same run."""
    from reprise.cuda import attention_tc_kernel as tc

    with patched(tc, "BUILD", build):
        return tc.paged_attention_tc(**inputs)


def planned_context(keys: int | None) -> contextlib.AbstractContextManager[None]:
    """attention_kernel.PLANNED_CONTEXT = keys meanwhile (None: as it is): the context
    split_grid plans its head split for, so how many lanes share a sequence's chunks."""
    from reprise.cuda import attention_kernel

    return patched(attention_kernel, "PLANNED_CONTEXT", keys or attention_kernel.PLANNED_CONTEXT)


# `paged attn tc plan4k` / `plan8k`: the head split planned for 4,096 or 8,192 keys, not
# 2,048 (speed only: no geometry reaches a bit). At batch 1 on 8 KV heads of 4: 2 head
# parts and 16 lanes, or 1 and 33, instead of 4 and 8; so at 4,096 keys one chunk (8
# pages) a CTA instead of two (16), each KV page read by 2 or 1 CTAs instead of 4; at 512
# keys 32 or 16 busy CTAs instead of 64.
PLANS = {"plan4k": 4096, "plan8k": 8192}


def paged_attention_tc_planned(keys: int, **inputs: Any) -> Any:
    from reprise.cuda.attention_tc_kernel import paged_attention_tc

    with planned_context(keys):
        return paged_attention_tc(**inputs)


def paged_attention_tc_coop_planned(keys: int, **inputs: Any) -> Any:
    """`tc coop plan4k` / `plan8k`: the shared page (BUILDS' coop) with the head split
    planned for longer contexts: a CTA's four warps then share each page among more query
    heads (at batch 1 on 8 KV heads of 4: 2 or 4 rows a CTA, each page read by fewer CTAs)."""
    from reprise.cuda import attention_tc_kernel as tc

    with patched(tc, "BUILD", BUILDS["coop"]):
        return paged_attention_tc_planned(keys, **inputs)


# `paged attn tc chunk64` / `chunk128`: the tensor-core kernel built with KV chunks of 64 or
# 128 keys (REPRISE_KV_CHUNK), its launch planned for them (attention_kernel.KV_CHUNK): at
# 256, a batch-1 decode at 512 keys has 2 busy chunks a head, each a CTA walking 8 pages
# one after another (one warp's rows, at 17.7 % occupancy with wait and barrier stalls
# leading: 2026-11-28-h200); at 64, 8 chunks of 2 pages each and 8 states merged. Other
# bits than the default's (speed only here; tests/test_attention_tc_emulated.py checks the
# build against its twin cut alike, and DESIGN §4 within it).
CHUNKS = {"chunk64": 64, "chunk128": 128}


@contextlib.contextmanager
def kv_chunk(keys: int | None) -> Iterator[None]:
    """The tensor-core kernel built with KV chunks of `keys` and its launches planned for
    them, meanwhile (None: as it is)."""
    from reprise.cuda import attention_kernel
    from reprise.cuda import attention_tc_kernel as tc

    if keys is None:
        yield
        return
    with (
        patched(tc, "BUILD", (*tc.BUILD, f"REPRISE_KV_CHUNK={keys}")),
        patched(attention_kernel, "KV_CHUNK", keys),
    ):
        yield


def paged_attention_tc_chunked(keys: int, **inputs: Any) -> Any:
    """The preallocated workspace holds 256-key chunks' states: shorter chunks take one
    of their own from CuPy's pool (host work, outside the timed stream's events)."""
    from reprise.cuda.attention_tc_kernel import paged_attention_tc

    with kv_chunk(keys):
        return paged_attention_tc(**{**inputs, "workspace": None})


def measure_attention(ctx: Context) -> Iterator[Row]:
    """Both paged-attention kernels (CUDA cores, tensor cores; the latter also held to
    its normal page ring, built with its page step before base 2 and with the select it
    had before (BUILDS), with its head split planned for longer contexts, and built with
    shorter KV chunks) against the faster SDPA."""
    from reprise.cuda.attention_tc_kernel import paged_attention_tc

    kernels = {
        "paged attn": paged_attention,
        "paged attn tc": paged_attention_tc,
        "paged attn tc ring2": paged_attention_tc_normal_ring,
        **{
            f"paged attn tc {name}": partial(paged_attention_tc_built, build)
            for name, build in BUILDS.items()
        },
        **{
            f"paged attn tc {name}": partial(paged_attention_tc_planned, keys)
            for name, keys in PLANS.items()
        },
        **{
            f"paged attn tc coop {name}": partial(paged_attention_tc_coop_planned, keys)
            for name, keys in PLANS.items()
        },
        **{
            f"paged attn tc {name}": partial(paged_attention_tc_chunked, keys)
            for name, keys in CHUNKS.items()
        },
    }
    for model in ctx.models:
        for label, *case in attention_cases():
            where = f"attention {model.name} {label}"
            inputs, error = ctx.attempt(where, partial(paged_inputs, model, *case))
            ours = {
                op: ctx.timed(f"{where} {op}", partial(fn, **inputs)) if inputs else (None, error)
                for op, fn in kernels.items()
            }
            del inputs
            calls, ref_error = ctx.attempt(f"{where} SDPA", partial(sdpa_calls, model, *case))
            refs: dict[str, float] = {}
            for name, fn in (calls or {}).items():
                ref_us, err = ctx.timed(f"{where} {name}", fn)
                ref_error = ref_error or err
                if ref_us is not None:
                    refs[name] = ref_us
            del calls
            best = min(refs, key=refs.__getitem__) if refs else None
            cost = (attention_bytes(model, *case), attention_flops(model, *case))
            for op, timed in ours.items():
                num_seqs, q_len, kv_len = case
                rows = ROWS_PER_CTA if op == "paged attn" else TC_ROWS_PER_CTA
                variant = op.rsplit(" ", 1)[-1]
                with planned_context(PLANS.get(variant)), kv_chunk(CHUNKS.get(variant)):
                    grid = split_grid(num_seqs * q_len, num_seqs, model.num_kv_heads,
                                      model.num_heads // model.num_kv_heads,
                                      -(-kv_len // BLOCK_SIZE), BLOCK_SIZE, rows)  # fmt: skip
                yield make_row(
                    ("attention", model.name, op, label),
                    timed,
                    ctx.floors,
                    cost=cost,
                    ref=(best, refs.get(best or ""), ref_error),
                    head_parts=grid.head_parts,
                    kv_lanes=grid.kv_lanes,
                    busy_ctas=grid.busy_ctas(kv_len),
                    **{f"{name.replace(' ', '_')}_us": _round(t) for name, t in refs.items()},
                )
            release()


def small_kernel_calls(
    model: ModelShape, num_tokens: int, table: Any, weight: Any, cos: Any, sin: Any
) -> dict[str, Callable[[], Any]]:
    """A call of each small kernel on inputs as the model feeds them (q, k, v strided
    views of the fused qkv output), into preallocated outputs where the launcher takes
    one; argmax only up to DECODE_ROWS[-1] rows, as it runs on sampled rows."""
    import cupy

    t, hidden, kv_heads, head_dim = num_tokens, model.hidden, model.num_kv_heads, model.head_dim
    rs = cupy.random.RandomState(3)
    token_ids = rs.randint(0, model.vocab, size=t).astype(cupy.int32)
    positions = rs.randint(0, ROPE_POSITIONS, size=t).astype(cupy.int32)
    residual = rs.standard_normal((t, hidden), dtype=cupy.float32)
    delta = random_bf16((t, hidden), 1.0, 4)
    qkv = random_bf16((t, model.q_size + 2 * model.kv_size), 1.0, 5)  # [T, q + 2 kv]
    q_end, k_end = model.q_size, model.q_size + model.kv_size
    q = qkv[:, :q_end].reshape(t, model.num_heads, head_dim)
    k = qkv[:, q_end:k_end].reshape(t, kv_heads, head_dim)
    v = qkv[:, k_end:].reshape(t, kv_heads, head_dim)
    cache_shape = kv_cache_shape(-(-t // BLOCK_SIZE), 1, kv_heads, BLOCK_SIZE, head_dim)
    cache = cupy.zeros(cache_shape, cupy.uint16)
    slots = cupy.arange(t, dtype=cupy.int64)
    gate_up = random_bf16((t, 2 * model.intermediate), 1.0, 6)
    q_out, k_out = cupy.empty(q.shape, cupy.uint16), cupy.empty(k.shape, cupy.uint16)
    embedded, normed = cupy.empty((t, hidden), cupy.float32), cupy.empty((t, hidden), cupy.uint16)
    act = cupy.empty((t, model.intermediate), cupy.uint16)

    def rope_qk() -> None:
        launchers.rope(q, positions, cos, sin, out=q_out)
        launchers.rope(k, positions, cos, sin, out=k_out)

    calls: dict[str, Callable[[], Any]] = {
        "embed": partial(launchers.embed, table, token_ids, out=embedded),
        "rmsnorm": partial(launchers.rmsnorm, residual, weight, 1e-5, out=normed),
        "add_rmsnorm": partial(launchers.add_rmsnorm, residual, delta, weight, 1e-5),
        "rope q+k": rope_qk,
        "kv_write": partial(launchers.kv_write, cache, 0, k, v, slots),
        "rope_kv_write": partial(
            launchers.rope_kv_write,
            qkv.reshape(t, model.num_heads + 2 * kv_heads, head_dim),
            positions,
            cos,
            sin,
            cache,
            0,
            slots,
            model.num_heads,
        ),
        "silu_mul": partial(launchers.silu_mul, gate_up, out=act),
    }
    if t <= DECODE_ROWS[-1]:
        logits = rs.standard_normal((t, model.vocab), dtype=cupy.float32)
        calls["argmax"] = partial(launchers.argmax, logits, out=cupy.empty((t,), cupy.int32))
    return calls


def measure_small(ctx: Context) -> Iterator[Row]:
    import cupy

    for model in ctx.models:
        table = random_bf16((model.vocab, model.hidden), 0.02, 7)  # [vocab, hidden]
        weight = random_bf16((model.hidden,), 1.0, 8)
        rs = cupy.random.RandomState(9)
        angles = rs.uniform(0, 6.3, (ROPE_POSITIONS, model.head_dim // 2)).astype(cupy.float32)
        tables = (table, weight, cupy.cos(angles), cupy.sin(angles))
        for t in SMALL_TOKENS:
            where = f"small {model.name} T={t}"
            calls, _ = ctx.attempt(where, partial(small_kernel_calls, model, t, *tables))
            num_bytes = small_kernel_bytes(model, t)
            for op, fn in (calls or {}).items():
                timed, cost = ctx.timed(f"{where} {op}", fn), (num_bytes[op], 0)
                yield make_row(("small", model.name, op, f"T={t}"), timed, ctx.floors, cost=cost)
            del calls
        del table, tables
        release()


def issue_copies(backend: Any, offload: bool, cache: Any, host: Any, block_ids: Any) -> None:
    """Offload device blocks `block_ids` into host slots 0, 1, ..., or onboard them back,
    a call a block."""
    for slot, block_id in enumerate(block_ids):
        if offload:
            backend.offload_block(cache, int(block_id), host, slot)
        else:
            backend.onboard_block(host, slot, cache, int(block_id))


def issue_run(backend: Any, offload: bool, cache: Any, host: Any, block_ids: Any) -> None:
    """The same copies as one run (`tier_copies`), as the runner hands a match's copies."""
    if offload:
        copies = [("offload", int(b), slot) for slot, b in enumerate(block_ids)]
    else:
        copies = [("onboard", slot, int(b)) for slot, b in enumerate(block_ids)]
    backend.tier_copies(cache, host, copies)


def time_issue(backend: Any, issue: Callable[[], Any]) -> tuple[float, float, float]:
    """Medians over HOST_TIER_REPEATS runs (after one more) of the µs from calling `issue`
    on an idle device to its work done (the copies waited for, the device synchronized)
    by events and by the host clock, and of the host µs `issue` itself took."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    runs = []
    for _ in range(HOST_TIER_REPEATS + 1):
        cupy.cuda.Device().synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        t0 = time.perf_counter()
        start.record(stream)
        issue()
        t1 = time.perf_counter()
        backend.wait_copies()
        end.record(stream)
        cupy.cuda.Device().synchronize()
        t2 = time.perf_counter()
        runs.append(
            (1e3 * cupy.cuda.get_elapsed_time(start, end), 1e6 * (t2 - t0), 1e6 * (t1 - t0))
        )
    device_us, host_us, issue_us = (statistics.median(r) for r in zip(*runs[1:], strict=True))
    return device_us, host_us, issue_us


def measure_host_tier(ctx: Context) -> Iterator[Row]:
    import cupy

    from reprise.cuda.cupy_backend import CupyBackend

    model = ModelShape.of(HOST_TIER_MODEL)
    backend = CupyBackend()
    shape = kv_cache_shape(
        HOST_TIER_BLOCKS, model.num_layers, model.num_kv_heads, BLOCK_SIZE, model.head_dim
    )
    cache = backend.kv_cache(shape)  # [blocks, layers, 2, kv_heads, block_size, head_dim]
    host = backend.host_kv_cache((max(HOST_TIER_COPIES), *shape[1:]))  # pinned, as the engine's
    rng = np.random.default_rng(0)
    copy_us: float | None = None  # the largest offload, timed by events
    for n in HOST_TIER_COPIES:
        block_ids = rng.choice(HOST_TIER_BLOCKS, size=n, replace=False)
        num_bytes = n * kv_block_bytes(model, BLOCK_SIZE)
        for offload, run in ((True, False), (False, False), (True, True), (False, True)):
            op = ("offload" if offload else "onboard") + (" run" if run else "")
            issue = partial(issue_run if run else issue_copies, backend, offload, cache, host,
                            block_ids)  # fmt: skip
            timed, error = ctx.attempt(f"hosttier {op} {n}", partial(time_issue, backend, issue))
            device_us, host_us, issue_us = timed or (None, None, None)
            copy_us = device_us if offload and not run else copy_us
            gb_s = device_us and round(num_bytes / device_us / 1e3, 2)
            row = make_row(
                ("hosttier", model.name, op, f"{n} blocks ({num_bytes >> 20} MiB)"),
                (device_us, error),
                ctx.floors,
                cost=(num_bytes, 0),
                bandwidth=D2H_BW if offload else H2D_BW,
                host_us=_round(host_us),
                issue_us=_round(issue_us),
                gb_s=gb_s,
                note=gb_s and f"{gb_s} GB/s, issued in {issue_us:.0f} µs",
            )
            row["fraction_of_pinned"] = ratio(row["floor_us"], device_us)
            yield row

    # Overlap: GEMMs (the 8B gate_up at decode size) about as long as the largest offload.
    gate_up = next(s for s in gemm_shapes(model) if s.name == "gate_up")
    w = random_bf16((gate_up.n, gate_up.k), 0.02, 10)
    x = random_bf16((DECODE_ROWS[-1], gate_up.k), 1.0, 11)
    one_gemm = partial(gemm, x, w, out=cupy.empty((DECODE_ROWS[-1], gate_up.n), cupy.uint16))
    gemm_us, _ = ctx.timed("hosttier overlap gemm", one_gemm)
    if gemm_us is None or copy_us is None:
        return
    reps = int(min(max(round(copy_us / gemm_us), 20), 5000))
    n = max(HOST_TIER_COPIES)
    block_ids = rng.choice(HOST_TIER_BLOCKS, size=n, replace=False)
    copies = partial(issue_copies, backend, True, cache, host, block_ids)

    def compute() -> None:
        for _ in range(reps):
            one_gemm()

    def both() -> None:  # copies first: each copy waits for the compute queued before it
        copies()
        compute()

    runs: dict[str, tuple[float, float, float]] = {}
    for name, fn in (("compute", compute), ("copy", copies), ("both", both)):
        runs[name], _ = ctx.attempt(f"hosttier overlap {name}", partial(time_issue, backend, fn))
        if runs[name] is None:
            return
    times = {name: device_us for name, (device_us, _, _) in runs.items()}
    fraction = overlap_fraction(times["compute"], times["copy"], times["both"])
    perfect = max(times["compute"], times["copy"])  # the floor: the shorter wholly hidden
    row = make_row(
        ("hosttier", model.name, "overlap", f"{reps} gate_up + {n} offloads"),
        (times["both"], None),
        {},
        overlap_fraction=round(fraction, 3),
        reps=reps,
        copy_issue_us=_round(runs["copy"][2]),  # it delays the compute issued after the copies
        **{f"{name}_us": _round(us) for name, us in times.items()},
        note=f"overlap {fraction:.2f} (compute {times['compute']:.0f} µs, "
        f"copy {times['copy']:.0f} µs, M={DECODE_ROWS[-1]})",
    )
    row.update(floor_us=_round(perfect), bound="max", x_floor=ratio(times["both"], perfect))
    yield row


SECTIONS: dict[str, Callable[[Context], Iterator[Row]]] = {
    "floors": measure_floors,
    "gemm": measure_gemm,
    "attention": measure_attention,
    "small": measure_small,
    "hosttier": measure_host_tier,
}


# ---- driver ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_kernels.json"))
    parser.add_argument(
        "--sections",
        type=parse_sections,
        default=SECTION_NAMES,
        help=f"all (default), none, or a comma list of {', '.join(SECTION_NAMES)}",
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"a comma list of daemon/model/synth.py shapes: {', '.join(SHAPES)}",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls a measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    parser.add_argument("--no-flush", action="store_true", help="leave L2 warm between calls")
    args = parser.parse_args(argv)
    try:
        args.models = tuple(ModelShape.of(m.strip()) for m in args.models.split(","))
    except ValueError as e:
        parser.error(str(e))
    if args.iters < 1 or args.warmup < 1:
        parser.error(f"--iters and --warmup must be at least 1; got {args.iters}, {args.warmup}")
    return args


def device_info() -> dict[str, Any]:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    info = {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
    }
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
    return info


def shared_stream(ctx: Context) -> tuple[Any, contextlib.AbstractContextManager]:
    """A CuPy stream and a context that makes it torch's current stream too, so that one
    Timer times both libraries. Where torch cannot take it, both use the legacy default
    stream (torch's default), and the error is logged."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        import torch

        return stream, torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr))
    except Exception as exc:
        ctx.log("torch on CuPy's stream (both now on the default stream)", exc)
        return cupy.cuda.Stream.null, contextlib.nullcontext()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    ctx = Context(Timer(args.iters, args.warmup, flush=not args.no_flush), args.models)
    rows: list[Row] = []
    payload: dict[str, Any] = {
        "device": None, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python", "bench/bench_gpu_kernels.py", *argv]),
        "settings": {"sections": list(args.sections), "models": [m.name for m in args.models],
                     "iters": args.iters, "warmup": args.warmup, "flush_l2": not args.no_flush},
        "floors": ctx.floors, "rows": rows, "errors": ctx.errors,
    }  # fmt: skip

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")

    if not args.sections:
        if cuda_device_available():
            payload.update(device_info())
        write()
        print(f"nothing measured (--sections none); wrote {args.out}")
        return 0
    if not cuda_device_available():
        raise SystemExit(
            "bench_gpu_kernels: no CUDA device found; this benchmark needs CuPy and an NVIDIA "
            "GPU (pip install 'reprise[cuda13]'). Nothing was measured."
        )
    import cupy

    payload.update(device_info())
    print(f"{payload['device']}, cupy {payload['cupy']}, torch {payload.get('torch', '-')}")
    try:  # compile and launch it once now: a failure costs the spin, not the run
        _spin_kernel()((1,), (1,), (np.uint64(0),))
        cupy.cuda.Device().synchronize()
    except Exception as exc:  # then launch overhead shows in the shortest kernels' times
        ctx.timer.spin = False
        ctx.log("spin kernel", exc)
    stream, torch_stream = shared_stream(ctx)
    with stream, torch_stream:
        for name in args.sections:
            print(f"\n[{name}]\n{format_header()}", flush=True)
            try:
                for row in SECTIONS[name](ctx):
                    rows.append(row)
                    print(format_row(row), flush=True)
            except Exception as exc:  # the rows it measured stay
                ctx.log(name, exc)
                print(f"section {name} failed: {type(exc).__name__}: {exc}", flush=True)
            finally:
                with contextlib.suppress(Exception):
                    release()
                write()
    floors = ", ".join(f"{k} {v:.4g}" for k, v in ctx.floors.items() if v)
    print(f"\nfloors: {floors or 'none measured'}\n{len(ctx.errors)} errors; wrote {args.out}")
    for e in ctx.errors:
        print(f"  {e['where']}: {e['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
