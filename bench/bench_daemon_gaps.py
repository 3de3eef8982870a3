"""The worst gap between two tokens of a normal stream while huge prompts arrive (issue 19).

    python bench/bench_daemon_gaps.py [--model DIR] [--prompts 20] [--out FILE]

Starts `reprise serve` (NumPy backend), streams one ordinary request, and while it
streams sends `--prompts` prompts from another client, in two rounds:
- 1 MiB of text each: refused from its length alone, before any tokenizer work;
- just under the length bound (max_model_len x the longest token's bytes), which must
  be tokenized to learn it is too long: done on the daemon's tokenizing thread, which
  releases the GIL while it encodes.
Prints the stream's worst inter-token gap in each round beside the same stream alone
(the baseline, in the same run). The target: <= 2 s on the default model.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from reprise.daemon.model.prepare import prepare_default_model
from reprise.daemon.model.tokenizer import Tokenizer
from reprise.ipc import Client, RequestError

TARGET_GAP_S = 2.0
MAX_MODEL_LEN = 8192


def worst_gap(client: Client, flood: list[str] | None, address: str) -> float:
    """The stream's largest gap between replies, with `flood` sent meanwhile."""
    stamps: list[float] = []
    sender = None
    if flood:

        def send() -> None:
            with Client(address, timeout_s=600) as other:
                for prompt in flood:
                    with contextlib.suppress(RequestError):  # prompt_too_long, as expected
                        other.generate(prompt, max_tokens=1)

        sender = threading.Thread(target=send)
    started = False
    for _ in client.stream(
        "Count from one to fifty:", max_tokens=48, temperature=0, ignore_eos=True
    ):
        stamps.append(time.perf_counter())
        if sender is not None and not started:
            sender.start()
            started = True
    if sender is not None:
        sender.join()
    return max(b - a for a, b in itertools.pairwise(stamps))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results/daemon_gaps.json"))
    args = parser.parse_args()
    path = args.model or prepare_default_model(progress=True).path
    bound = MAX_MODEL_LEN * (Tokenizer.from_dir(path).max_token_bytes() or 4)
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/gaps.sock"
        proc = subprocess.Popen(
            [sys.executable, "-m", "reprise.cli.main", "serve", "--model", str(path),
             "--backend", "numpy", "--socket", address, "--max-model-len", str(MAX_MODEL_LEN),
             "--max-message-bytes", str(2 << 20), "--log-level", "warning"],
            env={**os.environ, "REPRISE_SOCKET": ""},
        )  # fmt: skip
        try:
            with Client(address, timeout_s=600) as client:
                for _ in range(600):
                    try:
                        client.health(timeout_s=1)
                        break
                    except Exception:
                        time.sleep(0.5)
                rounds = {
                    "alone": None,
                    "1 MiB prompts": ["a " * (1 << 19)] * args.prompts,
                    "prompts just under the length bound": ["a " * (bound // 2 - 8)] * args.prompts,
                }
                gaps = {name: worst_gap(client, flood, address) for name, flood in rounds.items()}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    for name, gap in gaps.items():
        print(f"worst inter-token gap, {name}: {gap * 1000:.0f} ms "
              f"({gap / gaps['alone']:.1f}x alone)")  # fmt: skip
    worst = max(gaps.values())
    print(f"target <= {TARGET_GAP_S} s: {'met' if worst <= TARGET_GAP_S else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompts": args.prompts, "length_bound_bytes": bound,
                                    "worst_gap_s": gaps, "target_s": TARGET_GAP_S},
                                   indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
