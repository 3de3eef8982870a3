#!/usr/bin/env bash
# After a change to decode attention or the disk tier's read path, on a lent GPU as one
# call of about 4 minutes (6.5 at most), most important first: every GPU test (the
# attention kernels against their twins and across batch shapes, the engine's invariance
# suite: 0 logits may differ) and the disk staging tests; the engine end to end (decode,
# first tokens cached, from the host tier and from disk after a restart); the attention
# kernels against their floors; the disk tier's read speed with 8 and with 16 reader
# threads. Everything lands in ${OUT:-gpu-results}/results-followup.tgz.
#   bash scripts/gpu_followup.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=results-followup.tgz
source scripts/gpu_parts.sh
source scripts/gpu_env.sh  # reprise importable for the benchmarks; the device in $OUT
py=$python
part check 150 bash scripts/gpu_check.sh -m gpu "${pytest_extra[@]}" tests/test_disk_staging.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/check.out" | tail -25
part e2e 120 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py \
  --sections floors,decode,ttft,disk --out "$OUT/gpu_e2e.json"
grep -E "^(decode|ttft|target)|failed|Error" "$OUT/e2e.out" | cut -c1-120
part attention 40 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_kernels.py \
  --sections floors,attention --models llama-3.1-8b --out "$OUT/gpu_kernels.json"
grep -E "paged attn|Error" "$OUT/attention.out" | cut -c1-110
for threads in 8 16; do
  part "disk_read_$threads" 40 env PYTHONUNBUFFERED=1 "$py" bench/bench_disk_tier.py \
    --shape 8b --blocks 128 --repeat 3 --read-threads "$threads"
  grep -E "blocks of|^(read|ahead|into) " "$OUT/disk_read_$threads.out"
done
