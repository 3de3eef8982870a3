"""The scenarios of `reprise bench`, each run against a Target with reuse on and off
side by side (off: every request in a namespace of its own), on random token-id
prompts. Each returns a JSON-ready dict: its settings, its figures, and the
ratios of reuse on over off measured in the same run.

- repeat:   one prompt, first call vs repeats (vs repeats with reuse off)
- prefix:   time to first token vs the length of an already cached prefix
- shared:   a burst of users sharing one system prompt
- chat:     a multi-turn conversation, each turn resending the history
- sweep:    generation throughput vs the number of concurrent requests
- hosttier: a working set larger than the device pool, host tier on vs off
            (two in-process engines; the CLI builds them)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .targets import Request, Result, Target

Progress = Callable[[Iterable[Any], str], Iterable[Any]]


@dataclass(frozen=True, slots=True)
class Sizes:
    prompt_tokens: int = 1024
    prefix_lengths: tuple[int, ...] = (0, 256, 512, 768, 1024)
    suffix_tokens: int = 32
    users: int = 16
    system_tokens: int = 1024
    turns: int = 8
    answer_tokens: int = 16
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_tokens: int = 32
    repeats: int = 3
    vocab: int = 32000  # prompt ids are drawn from [100, vocab)


def _no_progress(items: Iterable[Any], _label: str) -> Iterable[Any]:
    return items


class Prompts:
    """Random token-id prompts, reproducible from the seed."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.high = max(vocab, 101)

    def __call__(self, n: int) -> list[int]:
        return self.rng.integers(100, self.high, size=n).tolist()


def repeat(target: Target, sizes: Sizes, progress: Progress = _no_progress) -> dict[str, Any]:
    prompts = Prompts(sizes.vocab, seed=1)
    prompt = prompts(sizes.prompt_tokens)
    first = target.run([Request(prompt, 1)])[0]
    on = [target.run([Request(prompt, 1)])[0] for _ in progress(range(sizes.repeats), "repeat on")]
    off = [
        target.run([Request(prompt, 1, reuse=False)])[0]
        for _ in progress(range(sizes.repeats), "repeat off")
    ]
    ttft_on, ttft_off = _median(on, "ttft_s"), _median(off, "ttft_s")
    return {
        "prompt_tokens": sizes.prompt_tokens,
        "ttft_first_s": first.ttft_s,
        "ttft_repeat_s": ttft_on,
        "ttft_reuse_off_s": ttft_off,
        "cached_tokens_repeat": on[-1].cached_tokens,
        "repeat_over_first": ttft_on / first.ttft_s,
        "repeat_over_reuse_off": ttft_on / ttft_off,
    }


def prefix(target: Target, sizes: Sizes, progress: Progress = _no_progress) -> dict[str, Any]:
    prompts = Prompts(sizes.vocab, seed=2)
    shared = prompts(max(sizes.prefix_lengths))
    points = []
    for length in progress(sizes.prefix_lengths, "prefix"):
        if length:  # cache the prefix through another request that shares only it
            target.run([Request(shared[:length] + prompts(sizes.suffix_tokens), 1)])
        prompt = shared[:length] + prompts(sizes.suffix_tokens)
        on = target.run([Request(prompt, 1)])[0]
        off = target.run([Request(prompt, 1, reuse=False)])[0]
        points.append(
            {
                "prefix_tokens": length,
                "prompt_tokens": len(prompt),
                "cached_tokens": on.cached_tokens,
                "ttft_on_s": on.ttft_s,
                "ttft_off_s": off.ttft_s,
                "on_over_off": on.ttft_s / off.ttft_s,
            }
        )
    return {"suffix_tokens": sizes.suffix_tokens, "points": points}


def shared(target: Target, sizes: Sizes, progress: Progress = _no_progress) -> dict[str, Any]:
    prompts = Prompts(sizes.vocab, seed=3)
    result: dict[str, Any] = {"users": sizes.users, "system_tokens": sizes.system_tokens}
    for label in progress(("on", "off"), "shared"):
        system = prompts(sizes.system_tokens)  # a fresh one each time: nothing cached before
        batch = [
            Request(system + prompts(sizes.suffix_tokens), 1, reuse=label == "on")
            for _ in range(sizes.users)
        ]
        results = target.run(batch)
        result[label] = {
            "prefill_tokens_computed": sum(r.prompt_tokens - r.cached_tokens for r in results),
            "ttft_mean_s": statistics.fmean(r.ttft_s for r in results),
            "ttft_max_s": max(r.ttft_s for r in results),
        }
    result["on_over_off"] = _ratios(result["on"], result["off"])
    return result


def chat(target: Target, sizes: Sizes, progress: Progress = _no_progress) -> dict[str, Any]:
    """Token-level turns: each prompt is the history (earlier prompts and the model's
    answers, as generated) plus a new question."""
    prompts = Prompts(sizes.vocab, seed=4)
    questions = [prompts(sizes.suffix_tokens) for _ in range(sizes.turns)]
    system = prompts(sizes.system_tokens // 4)
    result: dict[str, Any] = {"turns": sizes.turns}
    for label in progress(("on", "off"), "chat"):
        history, turns = list(system), []
        for question in questions:
            request = Request(history + question, sizes.answer_tokens, reuse=label == "on")
            done = target.run([request])[0]
            turns.append(
                {
                    "prompt_tokens": done.prompt_tokens,
                    "prefill_tokens_computed": done.prompt_tokens - done.cached_tokens,
                    "ttft_s": done.ttft_s,
                }
            )
            history = request.token_ids + list(done.token_ids)  # the answer, as generated
        result[label] = {
            "turns": turns,
            "prefill_tokens_computed": sum(t["prefill_tokens_computed"] for t in turns),
            "ttft_total_s": sum(t["ttft_s"] for t in turns),
            "ttft_last_s": turns[-1]["ttft_s"],
        }
    summary = ("prefill_tokens_computed", "ttft_total_s", "ttft_last_s")
    result["on_over_off"] = _ratios(
        {k: result["on"][k] for k in summary}, {k: result["off"][k] for k in summary}
    )
    return result


def sweep(target: Target, sizes: Sizes, progress: Progress = _no_progress) -> dict[str, Any]:
    prompts = Prompts(sizes.vocab, seed=5)
    points = []
    for batch_size in progress(sizes.batch_sizes, "sweep"):
        batch = [
            Request(prompts(sizes.suffix_tokens), sizes.decode_tokens, reuse=False)
            for _ in range(batch_size)
        ]
        results = target.run(batch)
        wall = max(r.total_s for r in results)
        decode = max(r.total_s for r in results) - max(r.ttft_s for r in results)
        generated = sum(r.num_tokens for r in results)
        points.append(
            {
                "batch_size": batch_size,
                "tokens_per_s": generated / wall,
                "decode_tokens_per_s": batch_size * (sizes.decode_tokens - 1) / decode
                if decode > 0
                else None,
            }
        )
    return {
        "prompt_tokens": sizes.suffix_tokens,
        "decode_tokens": sizes.decode_tokens,
        "points": points,
    }


def hosttier(
    with_host: Target, without_host: Target, sizes: Sizes, progress: Progress = _no_progress
) -> dict[str, Any]:
    """Prompts that together overflow the device pool, sent twice: the second round
    finds them in the host tier, or recomputes them without one."""
    result: dict[str, Any] = {"prompts": sizes.users, "prompt_tokens": sizes.prompt_tokens}
    for label, target in progress((("on", with_host), ("off", without_host)), "hosttier"):
        prompts = Prompts(sizes.vocab, seed=6)
        working_set = [prompts(sizes.prompt_tokens) for _ in range(sizes.users)]
        for prompt in working_set:
            target.run([Request(prompt, 1)])
        second = [target.run([Request(prompt, 1)])[0] for prompt in working_set]
        result[label] = {
            "cached_tokens": sum(r.cached_tokens for r in second),
            "host_cached_tokens": sum(r.host_cached_tokens for r in second),
            "ttft_mean_s": statistics.fmean(r.ttft_s for r in second),
        }
    result["on_over_off"] = _ratios(result["on"], result["off"])
    return result


def _median(results: list[Result], field: str) -> float:
    return statistics.median(getattr(r, field) for r in results)


def _ratios(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    return {k: (on[k] / off[k] if off[k] else None) for k in on if isinstance(on[k], int | float)}
