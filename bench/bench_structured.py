"""What a structured output costs the host per token, beside the engine's own decode step.

    python bench/bench_structured.py [--model DIR] [--repeats 20] [--out FILE]

On the default model's vocabulary (49,152 tokens), with llguidance:
- compiling: the first spec (which builds llguidance's view of the vocabulary, once an
  engine), then a new JSON schema, then one already compiled (the engine's cache);
- per token of a JSON answer to a schema, tokenized as the model would write it: the
  next token's mask (`Grammar.mask`) and taking the token in (`Grammar.accept`), the
  median, 90th percentile and worst of `--repeats` passes;
- the same run's host time of a plain batch-1 decode step (bench_host_step's null
  backend: the engine's work with no math), the baseline the mask adds to. On a GPU the
  mask is computed after the step's forward is launched, so it overlaps the device's
  work; on the host it adds to the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from reprise.daemon.engine.sampling.structured import Grammars, StructuredOutput
from reprise.daemon.model.prepare import prepare_default_model
from reprise.daemon.model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
ANSWER = {
    "name": "Alice Smith",
    "age": 30,
    "email": "alice@example.com",
    "tags": ["engineer", "runner", "reader of long books"],
    "address": {"city": "Lyon", "zip": "69001"},
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured.json"))
    args = parser.parse_args()
    path = args.model or prepare_default_model(progress=True).path
    from reprise.bench.bench_host_step import decode_step_ms, null_engine

    tokenizer = Tokenizer.from_dir(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tokenizer.backend.to_str, vocab, tokenizer.eos_token_ids)
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    grammars.compile(StructuredOutput("regex", "[a-z]+"))
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    grammars.compile(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    grammars.compile(spec)
    cached_ms = (time.perf_counter() - t0) * 1e3
    ids = tokenizer.encode(json.dumps(ANSWER, indent=2), add_special_tokens=False)
    per_token: list[float] = []
    for _ in range(args.repeats):
        grammar = grammars.start(spec)
        for token in ids:
            t0 = time.perf_counter()
            grammar.mask()
            grammar.accept(token)
            per_token.append(time.perf_counter() - t0)
        assert grammar.ended, "the answer is a whole object of the schema"
    us = np.asarray(per_token) * 1e6
    engine = null_engine(path, num_device_blocks=64, max_num_batched_tokens=2048)
    plain = decode_step_ms(engine, 1, 512, args.repeats, detokenize=False)["step_ms"]
    result = {
        "model": str(path),
        "vocab": vocab,
        "answer_tokens": len(ids),
        "first_compile_ms": first_ms,
        "compile_ms": compile_ms,
        "cached_compile_ms": cached_ms,
        "mask_accept_us": {
            "median": float(np.median(us)),
            "p90": float(np.percentile(us, 90)),
            "max": float(us.max()),
        },
        "plain_decode_step_host_ms": plain,
        "median_over_plain_step": float(np.median(us)) / 1e3 / plain,
    }
    print(f"compile: first {first_ms:.1f} ms (the vocabulary), a schema {compile_ms:.2f} ms, "
          f"cached {cached_ms:.3f} ms")  # fmt: skip
    print(f"mask + accept per token ({len(ids)} tokens x {args.repeats}): median "
          f"{statistics.median(us):.1f} us, p90 {np.percentile(us, 90):.1f} us, max {us.max():.0f} us")  # fmt: skip
    print(f"plain decode step b=1, host: {plain:.3f} ms; the median mask adds "
          f"{result['median_over_plain_step']:.1%} of it")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
