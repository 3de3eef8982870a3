"""NumPy backend ops: the batch-invariant GEMM and attention twins against the plain
fp32 matmul versions they replaced (which are not invariant). A benchmark, not a test.

    .venv/bin/python bench/bench_numpy_ops.py [--quick] [--only gemm|attention] [--repeat-seconds S]

Prints milliseconds per call (best of repeated calls, old and new interleaved so
machine load hits both alike) and new / old. On a shared machine, threaded BLAS
stalls whenever another process holds a core; OPENBLAS_NUM_THREADS=1 gives
steadier numbers.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from reprise.cuda.attention import paged_attention_ref
from reprise.cuda.dtypes import BF16, F32, to_bf16, to_f32
from reprise.cuda.gemm import gemm_ref, prepare_weight
from reprise.cuda.kvcache import kv_cache_shape

# (K, N, what): SmolLM2-135M's projections, then Llama-3-8B's K with N scaled down for CPU time
GEMM_SHAPES = [
    (576, 960, "qkv"),
    (576, 3072, "gate_up"),
    (1536, 576, "down"),
    (576, 49152, "lm_head"),
    (4096, 1536, "8B qkv, N/4"),
    (14336, 512, "8B down, N/8"),
]
GEMM_ROWS = [1, 8, 64, 512, 2048]
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M, Llama-3-8B
ATTENTION_SHAPES = [(9, 3, 64), (32, 8, 128)]
BLOCK_SIZE = 32


def old_gemm(x: np.ndarray, w32: np.ndarray, *, out_f32: bool = False) -> np.ndarray:
    y = to_f32(x) @ w32.T
    return y if out_f32 else to_bf16(y)


def old_attention(
    q: np.ndarray,
    cache: np.ndarray,
    layer: int,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    scale: float,
) -> np.ndarray:
    """The per-tile batched fp32 matmul version this package shipped before."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[3], cache.shape[4]
    group = num_heads // num_kv_heads
    out = np.empty((num_tokens, num_heads, head_dim), dtype=F32)
    scale32 = F32.type(scale)
    for b in range(len(seq_lens)):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, seq_len = end - start, int(seq_lens[b])
        if q_len == 0:
            continue
        rows = to_f32(q[start:end]).reshape(q_len, num_kv_heads, group, head_dim)
        rows = rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, q_len * group, head_dim)
        row_pos = np.repeat(np.arange(seq_len - q_len, seq_len), group)
        m = np.full((num_kv_heads, q_len * group), -np.inf, dtype=F32)
        denom = np.zeros((num_kv_heads, q_len * group), dtype=F32)
        acc = np.zeros((num_kv_heads, q_len * group, head_dim), dtype=F32)
        for t in range(-(-seq_len // block_size)):
            page = cache[int(block_tables[b, t]), layer]
            k, v = to_f32(page[0]), to_f32(page[1])
            visible = (t * block_size + np.arange(block_size))[None, :] <= row_pos[:, None]
            s = np.where(visible[None], np.matmul(rows, k.transpose(0, 2, 1)) * scale32, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1))
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new[..., None])
            denom = denom * alpha + p.sum(axis=-1, dtype=F32)
            acc = acc * alpha[..., None] + np.matmul(to_f32(to_bf16(p)), v)
            m = m_new
        out[start:end] = (
            (acc / denom[..., None])
            .reshape(num_kv_heads, q_len, group, head_dim)
            .transpose(1, 0, 2, 3)
            .reshape(q_len, num_heads, head_dim)
        )
    return to_bf16(out)


def best_ms(fns: list[Callable[[], object]], seconds: float) -> list[float]:
    """Best time of each function, calling them in turn until `seconds` have passed."""
    for fn in fns:
        fn()  # warm up
    best = [float("inf")] * len(fns)
    deadline, rounds = time.perf_counter() + seconds, 0
    while rounds < 3 or time.perf_counter() < deadline:
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
        rounds += 1
    return [b * 1e3 for b in best]


def bench_gemm(rng: np.random.Generator, rows: list[int], seconds: float) -> None:
    print(f"{'GEMM K x N':>22} {'M':>5} {'old ms':>10} {'new ms':>10} {'new/old':>8}")
    for k, n, what in GEMM_SHAPES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(BF16)
        w_old, w_new = np.ascontiguousarray(w.astype(F32)), prepare_weight(w)
        for m in rows:
            if m * n > 2048 * 3072 * 4:  # the lm_head only ever sees the rows that sample
                continue
            x = rng.standard_normal((m, k)).astype(BF16)
            old, new = best_ms([partial(old_gemm, x, w_old), partial(gemm_ref, x, w_new)], seconds)
            print(f"{k:>6} x {n:<6} {what:>8} {m:>5} {old:>10.3f} {new:>10.3f} {new / old:>8.2f}")


def attention_inputs(
    rng: np.random.Generator,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    spans: list[tuple[int, int]],
) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray, np.ndarray, float]:
    """Random cache and queries for (seq_len, q_len) spans, pages shuffled in the pool."""
    num_blocks = sum(-(-s // BLOCK_SIZE) for s, _ in spans)
    cache = rng.standard_normal(kv_cache_shape(num_blocks, 1, num_kv_heads, BLOCK_SIZE, head_dim))
    cache = cache.astype(BF16)
    pages = rng.permutation(num_blocks)
    width = max(-(-s // BLOCK_SIZE) for s, _ in spans)
    tables, used = np.zeros((len(spans), width), np.int32), 0
    for b, (seq_len, _) in enumerate(spans):
        count = -(-seq_len // BLOCK_SIZE)
        tables[b, :count], used = pages[used : used + count], used + count
    q = rng.standard_normal((sum(ql for _, ql in spans), num_heads, head_dim)).astype(BF16)
    seq_lens = np.array([s for s, _ in spans], np.int32)
    starts = np.cumsum([0] + [ql for _, ql in spans]).astype(np.int32)
    return q, cache, 0, tables, seq_lens, starts, float(1 / np.sqrt(head_dim))


def bench_attention(rng: np.random.Generator, seconds: float) -> None:
    cases = [
        ("prefill 512", [(512, 512)]),
        ("prefill 128 after 384", [(512, 128)]),
        ("decode ctx 512", [(512, 1)]),
        ("decode ctx 2048", [(2048, 1)]),
        ("decode 8 seqs ctx 512", [(512, 1)] * 8),
    ]
    print(
        f"\n{'attention heads/kv/dim':>24} {'case':>22} {'old ms':>10} {'new ms':>10} {'new/old':>8}"
    )
    for heads, kv_heads, dim in ATTENTION_SHAPES:
        for name, spans in cases:
            args = attention_inputs(rng, heads, kv_heads, dim, spans)
            old, new = best_ms(
                [partial(old_attention, *args), partial(paged_attention_ref, *args)], seconds
            )
            print(
                f"{f'{heads}/{kv_heads}/{dim}':>24} {name:>22} {old:>10.3f} {new:>10.3f} {new / old:>8.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M = 1, 64, 512 only, shorter runs")
    parser.add_argument("--repeat-seconds", type=float, default=1.0)
    parser.add_argument("--only", choices=["gemm", "attention"], help="run one of the two tables")
    args = parser.parse_args()
    seconds = args.repeat_seconds / (4 if args.quick else 1)
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"cpus {os.cpu_count()}, OPENBLAS_NUM_THREADS={threads}, load {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    if args.only != "attention":
        bench_gemm(rng, [1, 64, 512] if args.quick else GEMM_ROWS, seconds)
    if args.only != "gemm":
        bench_attention(rng, seconds)


if __name__ == "__main__":
    main()
