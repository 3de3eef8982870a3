#!/usr/bin/env bash
# A lent GPU's whole session in one command, each part under its own time limit so a
# hung or slow part cannot cost the others: the GPU tests (scripts/gpu_check.sh, GPU
# tests only), the Hopper GEMM against gemm.cu and cuBLAS, every kernel against its
# floor, and the engine end to end on Llama-3.1-8B shapes. Everything lands in
# ${OUT:-gpu-results}/results.tgz (the parts' files, packed: a lent machine sends back
# only a few files).
#   bash scripts/gpu_session.sh            (about 6 minutes at most)
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=results.tgz
source scripts/gpu_parts.sh
# most important first: the proof, then the engine's figures, then the kernels'. The tests
# run with gpu_parts.sh's $pytest_extra (four processes, a time limit each).
part check 150 bash scripts/gpu_check.sh -m gpu "${pytest_extra[@]}" tests/test_gemm_sm90_gpu.py \
  tests/test_qwen2.py tests/test_disk_staging.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/check.out" | tail -25
part e2e 110 bash scripts/gpu_bench.sh e2e
grep -E "^(measurement|decode|prefill|ttft|invariant|tensor|transformers|target|profile)|failed" \
  "$OUT/e2e.out" | cut -c1-110
part e2e_default 30 bash scripts/gpu_bench.sh e2e_default
grep -E "^(decode|ttft|target|profile)" "$OUT/e2e_default.out" | cut -c1-120
part kernels 30 bash scripts/gpu_bench.sh kernels
grep -E "^llama-3.1-8b (qkv|o |gate|down|lm_head|paged attn tc)" "$OUT/kernels.out" | cut -c1-104
part sm90 60 bash scripts/gpu_bench.sh sm90
cut -c1-160 "$OUT/sm90.out" | tail -32
