#!/usr/bin/env bash
# Issue 7's GPU benchmarks in one command, for a machine with a CUDA device, CuPy and
# torch but perhaps no network (such as the lent H100): every kernel against its floor
# and cuBLAS / SDPA (bench/bench_gpu_kernels.py), then the engine end to end on
# Llama-3.1-8B shapes with random weights (bench/bench_gpu_e2e.py) and on the default
# model's (decode batch 1 and the cached first token), then the opt-in Hopper
# GEMM against gemm.cu and cuBLAS (bench/bench_gemm_sm90.py). JSON and logs go to
# ${OUT:-gpu-results}.
#   bash scripts/gpu_bench.sh [kernels] [e2e] [e2e_default] [sm90]     (default: all four)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
parts=${*:-kernels e2e e2e_default sm90}
status=0
for part in $parts; do
  case $part in
    kernels) PYTHONUNBUFFERED=1 "$python" bench/bench_gpu_kernels.py --out "$out/gpu_kernels.json" \
               2>&1 | tee "$out/gpu_kernels.log" ;;
    e2e) PYTHONUNBUFFERED=1 "$python" bench/bench_gpu_e2e.py --out "$out/gpu_e2e.json" \
           2>&1 | tee "$out/gpu_e2e.log" ;;
    e2e_default) PYTHONUNBUFFERED=1 "$python" bench/bench_gpu_e2e.py --like smollm2-135m \
                   --sections decode,ttft --batches 1 --out "$out/gpu_e2e_default.json" \
                   2>&1 | tee "$out/gpu_e2e_default.log" ;;
    sm90) PYTHONUNBUFFERED=1 "$python" bench/bench_gemm_sm90.py --out "$out/gemm_sm90.json" \
            2>&1 | tee "$out/gemm_sm90.log" ;;
    *) echo "unknown part $part: kernels, e2e, e2e_default or sm90" >&2; exit 2 ;;
  esac
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit $status
