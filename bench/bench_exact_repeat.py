"""Time to first token of an exact repeat (the same prompt again, its last logits row
stored and its every token's KV cached) next to the same prompt computed fresh and
cached without a stored row (the last token computed), in process, all in one run.

    .venv/bin/python bench/bench_exact_repeat.py [--model DIR] [--backend numpy]
        [--prompt-tokens 512] [--repeats 5] [--embed]

With `--embed` every request asks for its prompt's embedding too (SamplingParams.embed):
the exact repeat then takes its stored embedding beside the stored row, and the bench
checks its bits against the fresh one's (default out: exact_repeat_embed.json).

The prompt is token ids (no tokenizer in the timing); each time is one
`engine.generate(prompt, max_tokens=1)` call, best of `--repeats`, each on a prompt
of its own. Prints the times in ms and their ratios to the fresh prefill and to the
cached prompt without a stored row, and writes them as JSON (default:
bench/results/exact_repeat.json). The target: an exact repeat's first token in at
most 1 ms on the default model (llama.cpp returns its stored logits in 0.64 ms).
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
EMBEDDING = SamplingParams(max_tokens=1, temperature=0, embed=True)


def timed(engine: Engine, prompt: list[int], params: SamplingParams = FIRST_TOKEN):
    start = time.perf_counter()
    result = engine.generate(prompt, params)
    return time.perf_counter() - start, result


def same_embedding(a, b) -> bool:
    """Both None (no embedding asked), or the same bits."""
    if a.embedding is None or b.embedding is None:
        return a.embedding is None and b.embedding is None
    return bool(np.array_equal(a.embedding.view(np.uint32), b.embedding.view(np.uint32)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--embed", action="store_true", help="ask for embeddings too")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    name = "exact_repeat_embed.json" if args.embed else "exact_repeat.json"
    out_path = args.out or Path("bench/results") / name
    asked = EMBEDDING if args.embed else FIRST_TOKEN
    path = args.model or prepare_default_model(progress=True).path
    n, bs = args.prompt_tokens, args.block_size
    blocks = (args.repeats + 1) * (-(-n // bs) + 1)
    settings = dict(
        backend=args.backend, block_size=bs, num_device_blocks=blocks, max_num_batched_tokens=n
    )
    # The same model twice: with the logits cache (the default) and without it.
    with_rows = Engine.from_pretrained(path, **settings)
    without_rows = Engine.from_pretrained(path, **settings, logits_cache_mb=0)
    vocab = with_rows.config.vocab_size

    def prompt(seed: int) -> list[int]:
        return np.random.default_rng(seed).integers(100, vocab, size=n).tolist()

    fill = SamplingParams(max_tokens=bs, temperature=0, ignore_eos=True)
    fresh, cached, repeat = [], [], []
    for rep in range(args.repeats):
        p = prompt(1000 + rep)
        t, first = timed(with_rows, p, asked)
        fresh.append(t)
        assert first.cached_tokens == 0
        # the prompt's tail block fills (and is found again) only once it is full: a
        # prompt of a multiple of the block size needs no more than this first token
        if n % bs:
            with_rows.generate(p, fill)
        before = with_rows.stats()["exact_repeats"]
        t, out = timed(with_rows, p, asked)
        repeat.append(t)
        assert with_rows.stats()["exact_repeats"] == before + 1 and out.cached_tokens == n
        assert out.token_ids == first.token_ids and same_embedding(out, first)
        without_rows.generate(p, fill if n % bs else FIRST_TOKEN)
        t, out = timed(without_rows, p, asked)
        cached.append(t)
        assert out.cached_tokens == n - 1 and out.token_ids == first.token_ids
        assert same_embedding(out, first)
    best = {
        name: min(v)
        for name, v in (("fresh", fresh), ("cached_no_row", cached), ("exact_repeat", repeat))
    }
    print(
        f"model {path}, backend {args.backend}, prompt {n} tokens, block {bs}, "
        f"best of {args.repeats}"
        + (", with embeddings (the same bits each way)" if args.embed else "")
    )
    print(f"{'':16}{'ms':>10}{'x fresh':>10}{'x cached':>10}")
    for name, t in best.items():
        print(f"{name:16}{t * 1e3:10.3f}{t / best['fresh']:10.4f}{t / best['cached_no_row']:10.4f}")
    target = "met" if best["exact_repeat"] <= 1e-3 else "NOT met"
    print(f"target: exact repeat's first token <= 1 ms: {target}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps(
            {
                "command": f"python bench/bench_exact_repeat.py --backend {args.backend} "
                f"--prompt-tokens {n} --block-size {bs} --repeats {args.repeats}"
                + (" --embed" if args.embed else ""),
                "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                "date": time.strftime("%Y-%m-%d"),
                "ms": {k: round(v * 1e3, 3) for k, v in best.items()},
                "ratio_to_fresh": {k: round(v / best["fresh"], 5) for k, v in best.items()},
                "ratio_to_cached_no_row": {
                    k: round(v / best["cached_no_row"], 4) for k, v in best.items()
                },
                "stats": with_rows.stats(),
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
