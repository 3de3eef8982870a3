#!/usr/bin/env bash
# Programmatic dependent launch (cuda/pdl.py, off by default) on a lent GPU, as a second
# call after scripts/gpu_session.sh: the whole GPU suite with REPRISE_PDL=1 (the
# invariance suite included: 0 logits may differ), then the engine's decode, prefill and
# first-token figures with it on and off in the same run, for the ratio. Everything lands
# in ${OUT:-gpu-results}/results-pdl.tgz.
#   bash scripts/gpu_pdl.sh            (about 5 minutes at most)
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=results-pdl.tgz
source scripts/gpu_parts.sh
source scripts/gpu_env.sh  # reprise importable for the benchmarks; the device in $OUT
py=$python
sections=floors,decode,prefill,ttft
part check 160 env REPRISE_PDL=1 bash scripts/gpu_check.sh -m gpu "${pytest_extra[@]}"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/check.out" | tail -25
part e2e_pdl 70 env REPRISE_PDL=1 PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py \
  --sections "$sections" --out "$OUT/gpu_e2e_pdl.json"
part e2e_off 70 env REPRISE_PDL=0 PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py \
  --sections "$sections" --out "$OUT/gpu_e2e_off.json"
for f in e2e_pdl e2e_off; do
  echo "-- $f"
  grep -E "^(decode|prefill|ttft|target)|failed|Error" "$OUT/$f.out" | cut -c1-110
done
