"""Time to first token of a long prompt: computed fresh, fully cached in the device
pool, and served from the host tier, next to one decode step, all in one run.

    python bench/bench_reuse_ttft.py [--model DIR] [--prompt-tokens 2048] [--backend numpy]

Prints the times and their ratios to the fresh prefill and to one decode step,
and writes them as JSON (default: bench/results/reuse_ttft.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.prepare import prepare_default_model

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def timed(engine: Engine, prompt: list[int], params: SamplingParams = FIRST_TOKEN):
    start = time.perf_counter()
    result = engine.generate(prompt, params)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/reuse_ttft.json"))
    args = parser.parse_args()
    path = args.model or prepare_default_model(progress=True).path
    n, bs = args.prompt_tokens, args.block_size
    vocab = 49152

    def prompt(seed: int) -> list[int]:
        return np.random.default_rng(seed).integers(100, vocab, size=n).tolist()

    blocks_per_prompt = -(-n // bs) + 1
    # The device pool holds two prompts; the host tier holds many.
    engine = Engine.from_pretrained(
        path,
        backend=args.backend,
        block_size=bs,
        num_device_blocks=2 * blocks_per_prompt,
        num_host_blocks=8 * blocks_per_prompt,
        max_num_batched_tokens=n,
        # a cached prompt computes its last token here (bench_exact_repeat.py times the
        # repeat that computes none)
        logits_cache_mb=0,
    )
    fresh, cached, host, decode = [], [], [], []
    for rep in range(args.repeats):
        p = prompt(1000 + rep)
        t, out = timed(engine, p)
        fresh.append(t)
        assert out.cached_tokens == 0
        t, out = timed(engine, p)
        cached.append(t)
        assert out.cached_tokens == n - 1 and out.host_cached_tokens == 0, out.cached_tokens
        # one decode step at this context: 2 tokens minus 1 token, both fully cached
        t2, _ = timed(engine, p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        t1, _ = timed(engine, p)
        decode.append(max(t2 - t1, 1e-9))
        for flood in range(2):  # two other prompts push this one out to the host tier
            engine.generate(prompt(2000 + 10 * rep + flood), FIRST_TOKEN)
        t, out = timed(engine, p)
        host.append(t)
        assert out.host_cached_tokens > 0, out
    best = {
        name: min(v)
        for name, v in (
            ("fresh", fresh),
            ("device_cached", cached),
            ("host_cached", host),
            ("decode_step", decode),
        )
    }
    print(
        f"model {path}, backend {args.backend}, prompt {n} tokens, block {bs}, best of {args.repeats}"
    )
    print(f"{'':16}{'ms':>10}{'x fresh':>10}{'x decode':>10}")
    for name, t in best.items():
        print(f"{name:16}{t * 1e3:10.1f}{t / best['fresh']:10.3f}{t / best['decode_step']:10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": f"python bench/bench_reuse_ttft.py --backend {args.backend} --prompt-tokens {n} "
                f"--block-size {bs} --repeats {args.repeats}",
                "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                "date": time.strftime("%Y-%m-%d"),
                "ms": {k: round(v * 1e3, 2) for k, v in best.items()},
                "ratio_to_fresh": {k: round(v / best["fresh"], 4) for k, v in best.items()},
                "ratio_to_decode_step": {
                    k: round(v / best["decode_step"], 3) for k, v in best.items()
                },
                "stats": engine.stats(),
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
