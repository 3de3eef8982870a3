#!/usr/bin/env bash
# The main job on a fresh machine: install, prepare the default model, start the daemon,
# answer one prompt twice, and show that the second answer reused the first one's KV blocks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
reprise=.venv/bin/reprise
"$reprise" model prepare
sock="ipc://$(mktemp -d)/reprise.sock"
"$reprise" serve --socket "$sock" &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 300); do  # wait until the daemon answers (it loads and warms up first)
  "$reprise" stats --socket "$sock" --timeout 1 --json >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { echo "reprise serve exited" >&2; exit 1; }
done
prompt=${1:-What is the capital of France?}
for run in first second; do
  echo "== $run time: $prompt"
  "$reprise" generate --socket "$sock" --chat "$prompt" --json | .venv/bin/python -c '
import json, sys
r = json.load(sys.stdin)
print(r["text"].strip())
print("  prompt tokens {prompt_tokens}, cached {cached_tokens}, "
      "time to first token {ttft_ms:.0f} ms".format(**r))'
done
"$reprise" stats --socket "$sock"
