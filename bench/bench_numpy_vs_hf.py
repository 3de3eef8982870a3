"""Prefill and decode speed of reprise's NumPy backend next to Hugging Face
transformers (PyTorch, CPU, fp32) on the same model folder, in one run.

    python bench/bench_numpy_vs_hf.py [--model DIR] [--prompt-tokens 512] [--decode-tokens 64]

Prints a table and the ratio reprise / transformers for each phase, and
writes the figures as JSON (default: bench/results/numpy_vs_hf.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/numpy_vs_hf.json"))
    args = parser.parse_args()

    import torch
    import transformers

    from reprise.daemon import Engine, SamplingParams
    from reprise.daemon.model.prepare import prepare_default_model

    path = args.model or prepare_default_model(progress=True).path
    # reuse off: every repeat computes the whole prompt, as transformers does
    engine = Engine.from_pretrained(
        path, backend="numpy", max_num_batched_tokens=args.prompt_tokens, enable_reuse=False
    )
    vocab = engine.config.vocab_size
    prompt = np.random.default_rng(0).integers(100, vocab, size=args.prompt_tokens).tolist()
    n, d = args.prompt_tokens, args.decode_tokens

    prefill_params = SamplingParams(max_tokens=1, temperature=0)
    decode_params = SamplingParams(max_tokens=d + 1, temperature=0, ignore_eos=True)
    ours_prefill = best_of(args.repeats, lambda: engine.generate(prompt, prefill_params))
    ours_total = best_of(args.repeats, lambda: engine.generate(prompt, decode_params))

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def hf_generate(new_tokens: int) -> None:
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    hf_prefill = best_of(args.repeats, lambda: hf_generate(1))
    hf_total = best_of(args.repeats, lambda: hf_generate(d + 1))

    rows = {
        "prefill_tok_s": (n / ours_prefill, n / hf_prefill),
        "decode_tok_s": (d / (ours_total - ours_prefill), d / (hf_total - hf_prefill)),
    }
    print(f"model {path}  prompt {n} tokens, decode {d} tokens, best of {args.repeats}")
    print(
        f"torch {torch.__version__} threads {torch.get_num_threads()}, numpy {np.__version__}, cpus {os.cpu_count()}"
    )
    print(f"{'':16}{'reprise numpy':>16}{'transformers':>16}{'ratio':>10}")
    for name, (ours, theirs) in rows.items():
        print(f"{name:16}{ours:16.1f}{theirs:16.1f}{ours / theirs:10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python bench/bench_numpy_vs_hf.py "
                + " ".join(
                    f"--{k.replace('_', '-')} {v}"
                    for k, v in vars(args).items()
                    if k not in ("model", "out")
                ),
                "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "numpy": np.__version__,
                **{
                    name: {
                        "reprise_numpy": round(o, 2),
                        "transformers": round(t, 2),
                        "ratio": round(o / t, 3),
                    }
                    for name, (o, t) in rows.items()
                },
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
