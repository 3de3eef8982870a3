"""Issue 22's before/after engine timing on the NumPy backend (bench/results/arch_before_after.md):
a 512-token prefill and a batch-1 decode step of the default model, median of 3.

    python bench/bench_engine_numpy.py LABEL
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from reprise.daemon import Engine, SamplingParams


def timed(engine: Engine, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.generate(prompt, params)
    return time.perf_counter() - start


def main(label: str) -> None:
    engine = Engine.from_pretrained(backend="numpy", max_num_batched_tokens=2048,
                                    enable_reuse=False)  # fmt: skip
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, temperature=0)
    many = SamplingParams(max_tokens=41, temperature=0, ignore_eos=True)
    timed(engine, rng.integers(100, 40000, 64).tolist(), many)  # warm-up
    prefill, decode = [], []
    for _ in range(3):
        prefill.append(timed(engine, rng.integers(100, 40000, 512).tolist(), one))
        short = rng.integers(100, 40000, 8).tolist()
        first = timed(engine, short, one)
        decode.append((timed(engine, short, many) - first) / 40)
    print(f"{label}: prefill 512 {statistics.median(prefill) * 1e3:.0f} ms, "
          f"decode step (batch 1) {statistics.median(decode) * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
