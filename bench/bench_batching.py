"""Continuous batching with prefix reuse, reuse on vs off, in one run. A benchmark, not a test.

    python bench/bench_batching.py [--model DIR] [--users 16] [--system-tokens 1024]
                                   [--suffix-tokens 32] [--turns 8] [--backend numpy]

Two scenarios, each run on a fresh engine with reuse on and then with reuse off:

- burst: `--users` requests that share a `--system-tokens` system prompt, each
  with its own `--suffix-tokens` question, all submitted at once (one token each).
  With reuse on, the first computes the shared prefix and the others wait for it
  and reuse it; prints the prefill tokens computed and the time to first token
  (mean and worst over the users, from the moment the burst was submitted).
- chat: one conversation of `--turns` turns through the chat template, each turn
  adding a user message to the history with the model's previous answers
  (16 greedy tokens each); prints, per turn and in total, the prompt tokens,
  the prefill tokens computed and the time to first token.

Writes the figures as JSON (default: bench/results/batching.json).
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

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
TOPICS = ["rivers", "bread", "comets", "violins", "glaciers", "owls", "bridges", "tea"]


def run_until_done(engine: Engine, request_ids: list) -> dict:
    """Step until every request is done; the seconds from now to each one's first token."""
    start = time.perf_counter()
    first_token: dict = {}
    done: set = set()
    while not done.issuperset(request_ids):
        for out in engine.step():
            first_token.setdefault(out.request_id, time.perf_counter() - start)
            if out.finish_reason:
                done.add(out.request_id)
    return {r: first_token[r] for r in request_ids}


def burst(make_engine, args: argparse.Namespace, *, reuse: bool) -> dict:
    engine: Engine = make_engine(reuse)
    rng = np.random.default_rng(0)
    system = rng.integers(100, 49000, size=args.system_tokens).tolist()
    prompts = [
        system + rng.integers(100, 49000, size=args.suffix_tokens).tolist()
        for _ in range(args.users)
    ]
    before = engine.stats()["prefill_tokens_computed"]
    ids = [engine.add_request(p, FIRST_TOKEN) for p in prompts]
    ttft = run_until_done(engine, ids)
    completions = [engine.take_completion(r) for r in ids]
    return {
        "prefill_tokens_computed": engine.stats()["prefill_tokens_computed"] - before,
        "prompt_tokens": sum(len(p) for p in prompts),
        "cached_tokens": sum(c.cached_tokens for c in completions),
        "ttft_mean_ms": 1e3 * float(np.mean(list(ttft.values()))),
        "ttft_max_ms": 1e3 * max(ttft.values()),
    }


def chat(make_engine, args: argparse.Namespace, *, reuse: bool) -> dict:
    engine: Engine = make_engine(reuse)
    messages = [{"role": "system", "content": "You are a patient teacher. " * 8}]
    turns = []
    for turn in range(args.turns):
        topic = TOPICS[turn % len(TOPICS)]
        messages.append({"role": "user", "content": f"Tell me one fact about {topic}."})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        before = engine.stats()["prefill_tokens_computed"]
        request_id = engine.add_request(prompt, ANSWER)
        ttft = run_until_done(engine, [request_id])[request_id]
        out = engine.take_completion(request_id)
        messages.append({"role": "assistant", "content": out.text})
        turns.append(
            {
                "prompt_tokens": len(prompt),
                "cached_tokens": out.cached_tokens,
                "prefill_tokens_computed": engine.stats()["prefill_tokens_computed"] - before,
                "ttft_ms": 1e3 * ttft,
            }
        )
    return {
        "turns": turns,
        "prefill_tokens_computed": sum(t["prefill_tokens_computed"] for t in turns),
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "ttft_total_ms": sum(t["ttft_ms"] for t in turns),
        "ttft_last_ms": turns[-1]["ttft_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("bench/results/batching.json"))
    args = parser.parse_args()
    path = args.model or prepare_default_model(progress=True).path
    loaded = Engine.from_pretrained(path, backend=args.backend, num_device_blocks=1)

    def make_engine(reuse: bool) -> Engine:
        """A fresh pool around the one loaded model."""
        return Engine(
            loaded.config,
            loaded.tokenizer,
            loaded.runner.model,
            model_fingerprint=b"bench",
            block_size=args.block_size,
            num_device_blocks=args.users
            * (-(-(args.system_tokens + args.suffix_tokens) // args.block_size) + 2),
            enable_reuse=reuse,
            max_num_batched_tokens=args.max_batched_tokens,
        )

    results: dict = {}
    for name, scenario in (("burst", burst), ("chat", chat)):
        results[name] = {}
        for reuse in (True, False):
            label = "reuse_on" if reuse else "reuse_off"
            results[name][label] = scenario(make_engine, args, reuse=reuse)
            print(f"{name} {label}: done", flush=True)

    b_on, b_off = results["burst"]["reuse_on"], results["burst"]["reuse_off"]
    c_on, c_off = results["chat"]["reuse_on"], results["chat"]["reuse_off"]
    print(
        f"\nmodel {path.name}, backend {args.backend}, block {args.block_size}, "
        f"budget {args.max_batched_tokens} tokens/step"
    )
    print(
        f"\nburst: {args.users} users, {args.system_tokens}-token shared system prompt, "
        f"{args.suffix_tokens}-token questions"
    )
    print(f"{'':28}{'reuse on':>12}{'reuse off':>12}{'on/off':>9}")
    for key, label in (
        ("prefill_tokens_computed", "prefill tokens computed"),
        ("ttft_mean_ms", "TTFT mean (ms)"),
        ("ttft_max_ms", "TTFT worst (ms)"),
    ):
        print(f"{label:28}{b_on[key]:12.0f}{b_off[key]:12.0f}{b_on[key] / b_off[key]:9.3f}")
    print(f"\nchat: {args.turns} turns")
    print(f"{'turn':>4}{'prompt':>8}{'computed on':>13}{'off':>7}{'TTFT on ms':>12}{'off':>9}")
    for idx, (on, off) in enumerate(zip(c_on["turns"], c_off["turns"], strict=True)):
        print(
            f"{idx + 1:4}{on['prompt_tokens']:8}{on['prefill_tokens_computed']:13}"
            f"{off['prefill_tokens_computed']:7}{on['ttft_ms']:12.0f}{off['ttft_ms']:9.0f}"
        )
    for key, label in (
        ("prefill_tokens_computed", "prefill tokens computed"),
        ("ttft_total_ms", "TTFT summed (ms)"),
        ("ttft_last_ms", "TTFT last turn (ms)"),
    ):
        print(f"{label:28}{c_on[key]:12.0f}{c_off[key]:12.0f}{c_on[key] / c_off[key]:9.3f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = (
        f"python bench/bench_batching.py --backend {args.backend} --users {args.users} "
        f"--system-tokens {args.system_tokens} --suffix-tokens {args.suffix_tokens} "
        f"--turns {args.turns} --block-size {args.block_size} "
        f"--max-batched-tokens {args.max_batched_tokens}"
    )
    meta = {
        "command": command,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.write_text(json.dumps({**meta, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
