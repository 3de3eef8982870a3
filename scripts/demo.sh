#!/usr/bin/env bash
# The main job on a fresh machine: install, prepare the default model, start the daemon,
# answer one prompt twice, and show that the second call reused the first one's KV blocks.
#   bash scripts/demo.sh ["your question"]
# The prompt is a short note (scripts/demo_system.txt) as the system message and the
# question: 163 tokens with the default question, five whole blocks of 32 and 3 more, so
# the second call reuses 160 and computes only the last 3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
reprise=.venv/bin/reprise
"$reprise" model prepare
dir=$(mktemp -d)
sock="ipc://$dir/reprise.sock"
"$reprise" serve --socket "$sock" &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 300); do  # wait until the daemon answers (it loads and warms up first)
  "$reprise" stats --socket "$sock" --timeout 1 --json >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { echo "reprise serve exited" >&2; exit 1; }
  sleep 0.2
done
question=${1:-What is the capital of France?}
system=$(cat scripts/demo_system.txt)
for run in first second; do
  echo "== $run call: $question"
  "$reprise" generate --socket "$sock" --system "$system" "$question" --json >"$dir/$run.json"
  .venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1]))["text"].strip())' "$dir/$run.json"
done
.venv/bin/python - "$dir/first.json" "$dir/second.json" <<'PY'
import json, sys
first, second = (json.load(open(p)) for p in sys.argv[1:])
print(f"\n{second['cached_tokens']} of {second['prompt_tokens']} prompt tokens reused "
      f"on the second call ({first['cached_tokens']} on the first)")
ratio = first["ttft_ms"] / max(second["ttft_ms"], 1e-3)
print(f"time to first token: {first['ttft_ms']:.0f} ms, then {second['ttft_ms']:.0f} ms "
      f"({ratio:.1f}x faster); the answers are {'identical' if first['text'] == second['text'] else 'DIFFERENT'}")
PY
"$reprise" stats --socket "$sock"
