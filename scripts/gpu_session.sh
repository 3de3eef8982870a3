#!/usr/bin/env bash
# A lent GPU's whole session in one command, each part under its own time limit so a
# hung or slow part cannot cost the others: the GPU tests (scripts/gpu_check.sh, GPU
# tests only), the Hopper GEMM against gemm.cu and cuBLAS, every kernel against its
# floor, and the engine end to end on Llama-3.1-8B shapes. Everything lands in
# ${OUT:-gpu-results}/results.tgz (the parts' files, packed: a lent machine sends back
# only a few files).
#   bash scripts/gpu_session.sh            (about 9 minutes at most)
set -uo pipefail
cd "$(dirname "$0")/.."
top=${OUT:-gpu-results}
mkdir -p "$top"
export OUT=$(mktemp -d)
part() {  # part NAME SECONDS COMMAND...: run it under a limit, say how it ended
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.out" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s (limit $limit s)"
}
part check 210 bash scripts/gpu_check.sh -m gpu --timeout=100 tests/test_gemm_sm90_gpu.py \
  tests/test_qwen2.py tests/test_disk_staging.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/check.out" | tail -25
part sm90 80 bash scripts/gpu_bench.sh sm90
cut -c1-120 "$OUT/sm90.out" | tail -32
part kernels 120 bash scripts/gpu_bench.sh kernels
part e2e 150 bash scripts/gpu_bench.sh e2e
grep -E "^(measurement|decode|prefill|ttft|invariant|wgmma|transformers|target)" \
  "$OUT/e2e.out" | cut -c1-110
tar -czf "$top/results.tgz" -C "$OUT" .
