"""What prompt lookup speculation gains and costs, on the default model, with the answer
checked bit-identical to decoding one token a step.

    python bench/bench_speculative.py [--backend auto] [--model DIR] [--tokens 4]
                                      [--max-tokens 96] [--planted right|wrong] [--out FILE]

Three chat requests, greedy, each run twice in one process on one loaded model: once
without drafts (the baseline), once with `--tokens` draft tokens a step:
- `repeat`: the answer copies a paragraph of the prompt (the case drafts are for: edits,
  quotes, code changes, retrieval answers);
- `list`: a list the model continues, partly like its prompt;
- `free`: an open question (drafts seldom right: what they cost when they miss);
- `json`: an answer held to a JSON schema (compact), whose keys and punctuation the
  grammar forces: those are the draft.

For each: decode tokens per second without and with drafts and their ratio (the time
after the first token, so the prompt's step is left out), decode steps, draft tokens
checked and kept, and whether the tokens and logits are bit-identical (they must be;
the run stops if not). `--planted right` makes every draft the plain answer's next
tokens (the most drafts can gain: every step keeps K + 1 tokens), `--planted wrong`
every draft token wrong (what K rows a step cost when none is kept), each answer
`--max-tokens` long (eos ignored): these two measure
the backend, not the model, so a random-weight stand-in (`reprise model synth`) serves
where the default model cannot be fetched. On the NumPy backend a step of 1 + k rows costs the CPU's
matrix product about twice a one-row step's (OpenBLAS's small-M path), so drafts gain
only where most are kept; on a GPU at small batch a step's rows cost little more than
one row's, and a drafted step of up to 16 requests replays a CUDA graph as a decode
step does (graphs.py's drafted buckets).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from reprise.daemon import Engine, SamplingParams, StructuredOutput
from reprise.daemon.engine.sequence import Sequence
from reprise.daemon.engine.speculative import Speculator

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "small brass lamp and a notebook in which he recorded the wind, the colour of the sea "
    "and the names of the ships that passed the point before midnight."
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "occupation", "hobbies"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
REQUESTS: dict[str, tuple[str, StructuredOutput | None]] = {
    "repeat": (f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}", None),
    "list": (
        "Continue this list up to twenty items, one per line:\n"
        "1. apples\n2. bananas\n3. cherries\n4. dates\n5. elderberries\n6.",
        None,
    ),
    "free": ("Why is the sky blue? Answer in a few sentences.", None),
    "json": (
        "Describe Alice, a 30-year-old baker from Lyon who likes cycling, as JSON.",
        StructuredOutput("json", json.dumps(SCHEMA)),
    ),
}


class PlantedSpeculator(Speculator):
    """Drafts taken from known answers: right, or each token shifted (wrong)."""

    answers: dict[tuple[int, ...], list[int]]
    wrong: bool

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        done = len(seq.output_token_ids)
        truth = self.answers.get(tuple(seq.prompt_token_ids), [])[done : done + limit]
        return [(t + 1) % self.vocab_size for t in truth] if self.wrong else truth


def run(
    engine: Engine,
    prompt_ids: list[int],
    max_tokens: int,
    whole: bool = False,
    structured: StructuredOutput | None = None,
) -> dict:
    """One greedy answer, timed; `whole`: `max_tokens` of it (eos ignored)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        return_logits=True,
        ignore_eos=whole,
        structured=structured,
    )
    before = engine.stats()
    request_id = engine.add_request(prompt_ids, params)
    steps, first, start = 0, None, time.perf_counter()
    while engine.has_work():
        outputs = engine.step()
        steps += 1
        if first is None and any(o.token_ids for o in outputs):
            first = time.perf_counter()
    end = time.perf_counter()
    out = engine.take_completion(request_id)
    after = engine.stats()
    decoded = len(out.token_ids) - 1
    assert first is not None
    return {
        "tokens": out.token_ids,
        "logits": out.logits,
        "decode_tokens_per_s": decoded / (end - first) if decoded else 0.0,
        "first_token_s": first - start,
        "decode_steps": steps - 1,
        "draft_tokens": after["spec_draft_tokens"] - before["spec_draft_tokens"],
        "accepted_tokens": after["spec_accepted_tokens"] - before["spec_accepted_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--tokens", type=int, default=4, help="draft tokens a step")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--planted", choices=["right", "wrong"], default=None,
                        help="drafts from the plain answer, all right or all wrong")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/speculative.json"))
    args = parser.parse_args()

    base = Engine.from_pretrained(args.model, backend=args.backend, enable_reuse=False)
    # the same loaded model, with drafts
    spec = Engine(
        base.config, base.tokenizer, base.runner.model, base.settings,
        speculative_tokens=args.tokens,
    )  # fmt: skip
    planted = None
    if args.planted is not None:
        planted = PlantedSpeculator(
            args.tokens, 1, 1, vocab_size=base.config.vocab_size, max_model_len=spec.max_model_len
        )
        planted.answers, planted.wrong = {}, args.planted == "wrong"
        spec.speculator = spec.scheduler.speculator = planted
    for engine in (base, spec):  # a batch of one's graphs (on the GPU), as the daemon's warm-up
        engine.capture_decode_graphs(max_seqs=1)
    rows = {}
    for name, (text, structured) in REQUESTS.items():
        if structured is not None and planted is not None:
            continue  # planted drafts measure the backend: the plain requests do
        chat = base.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        ids = base.tokenizer.encode(chat, add_special_tokens=False)
        run(base, ids, 4, structured=structured)  # warm both (first-call allocations)
        run(spec, ids, 4, structured=structured)
        whole = planted is not None  # the backend's figures: every answer max_tokens long
        plain = run(base, ids, args.max_tokens, whole, structured)
        if planted is not None:
            planted.answers[tuple(ids)] = plain["tokens"]
        drafted = run(spec, ids, args.max_tokens, whole, structured)
        same = plain["tokens"] == drafted["tokens"] and np.array_equal(
            plain["logits"].view(np.uint32), drafted["logits"].view(np.uint32)
        )
        if not same:
            raise SystemExit(f"{name}: the drafted answer differs from the plain one")
        rows[name] = {
            "answer_tokens": len(plain["tokens"]),
            "plain_tokens_per_s": round(plain["decode_tokens_per_s"], 2),
            "drafted_tokens_per_s": round(drafted["decode_tokens_per_s"], 2),
            "speedup": round(drafted["decode_tokens_per_s"] / plain["decode_tokens_per_s"], 3),
            "plain_decode_steps": plain["decode_steps"],
            "drafted_decode_steps": drafted["decode_steps"],
            "draft_tokens": drafted["draft_tokens"],
            "accepted_tokens": drafted["accepted_tokens"],
            "bit_identical": same,
            "answer": base.tokenizer.decode(plain["tokens"])[:160],
        }
        row = rows[name]
        print(
            f"{name:7} {row['answer_tokens']:4d} tokens: {row['plain_tokens_per_s']:7.2f} -> "
            f"{row['drafted_tokens_per_s']:7.2f} tok/s (x{row['speedup']:.2f}), steps "
            f"{row['plain_decode_steps']} -> {row['drafted_decode_steps']}, drafts kept "
            f"{row['accepted_tokens']} / {row['draft_tokens']}, bit-identical"
        )
    result = {
        "machine": platform.machine(),
        "backend": base.runner.model.ops.name,
        "draft_tokens_per_step": args.tokens,
        "planted": args.planted,
        "prompt_lookup": [spec.settings.prompt_lookup_min, spec.settings.prompt_lookup_max],
        "max_tokens": args.max_tokens,
        "command": "python bench/bench_speculative.py "
        f"--backend {args.backend} --tokens {args.tokens} --max-tokens {args.max_tokens}"
        + (f" --planted {args.planted}" if args.planted else ""),
        "requests": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
