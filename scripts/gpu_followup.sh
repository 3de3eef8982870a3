#!/usr/bin/env bash
# After a change to the Hopper GEMM, decode attention or the disk tier's read path, on a
# lent GPU as one call of about 8-9 minutes (timeout_s=600; what is done is packed after
# each part, so a cut run keeps its first parts), most important first: every GPU
# test (the kernels against their twins and across batch shapes, the Hopper GEMM's
# included, the engine's invariance suite: 0 logits may differ) and the disk staging
# tests; the Hopper GEMM against gemm.cu and cuBLAS (its tiles and stage layouts side by
# side); the engine end to end (decode, prefill, first tokens cached, from the host tier
# and from disk after a restart, against cuBLAS) and on the default model's shapes (decode
# batch 1, the cached first token: issue 18's two targets for it; PDL as default, then off;
# then its projections unsplit), each
# with where the device's time goes kernel by kernel (a decode step, the cached first
# token); the GEMM (M = 1: issue 18's 85 % of the copy bandwidth) and attention kernels
# against their floors; one decode step's first kernels under
# Nsight Compute (why warps stall); the disk tier's read speed with 16 reader threads;
# last, the Hopper GEMM's tiles and epilogue not yet a default, forced (the wide FOLD,
# which hung in its first version; the decode tile and the 64 x 128 tile against WS; the
# gated SwiGLU epilogue; the cluster entry points; the cluster split): their GPU tests,
# the engine with the gated epilogue on (8B and the default model), with the clusters on
# (8B prefill) and with the cluster split on (8B and the default model's decode), beside
# the default; the row epilogues' GPU tests (the add_rmsnorm in the o and down launches,
# the rope_kv_write in the qkv launch), and the default model with them on, then with
# every default-model fusion on together, then every decode fusion on together at 8B
# (issue 18's 1.3x the weights-read floor); last, the engine with the shared page in
# attention (8B and the default model). (2026-11-28's end-to-end comparison of the
# decode tiles with WS is left out.)
# Since 2026-12-02 also: the tall FOLD's bit test, its column in the sm90 part and the 8B
# prefill with it on (tall_test, tall_e2e), and the decode GEMMs with a part of the launch
# left out (sm90_ablate; attention's two ablations are rows of the attention part).
# Everything lands in ${OUT:-gpu-results}/results-followup.tgz.
#   bash scripts/gpu_followup.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=results-followup.tgz
source scripts/gpu_parts.sh
source scripts/gpu_env.sh  # reprise importable for the benchmarks; the device in $OUT
py=$python
# part NAME LIMIT with FLAGS (one, or several joined by commas: gemm_sm90_plan's by name,
# another reprise.cuda module's as MODULE.NAME) set True in the process (False where the
# name starts with "!"), running bench_gpu_e2e with the arguments that follow (a path not
# yet a default, or a default taken away, beside the default's rows)
flag_part() {
  local name=$1 limit=$2 flags=$3
  shift 3
  local args sets="" flag
  args=$(printf "'%s', " "$@")
  for flag in ${flags//,/ }; do
    local value=True
    [[ $flag == '!'* ]] && value=False && flag=${flag#!}
    case $flag in
      *.*) sets+="import reprise.cuda.${flag%%.*} as m; m.${flag#*.} = $value; " ;;
      *) sets+="plan.$flag = $value; " ;;
    esac
  done
  part "$name" "$limit" env PYTHONUNBUFFERED=1 "$py" -c "
import sys
from reprise.cuda import gemm_sm90_plan as plan
$sets
from reprise.bench.bench_gpu_e2e import main
sys.exit(main([$args]))"
}
part check 330 bash scripts/gpu_check.sh -m gpu "${pytest_extra[@]}" tests/test_gemm_sm90_gpu.py \
  tests/test_disk_staging.py tests/test_qwen3.py tests/test_embeddings.py tests/test_granite.py \
  tests/test_smollm3.py tests/test_sliding_window_models.py tests/test_rope_scaling.py \
  tests/test_seed_oss_helium.py tests/test_padded_heads.py tests/test_gemma3.py \
  tests/test_gemma2.py tests/test_gemma_ops.py tests/test_moe.py tests/test_moe_kernels.py \
  tests/test_olmo.py tests/test_olmo_ops.py tests/test_async_scheduling.py
grep -sE "^(FAILED|ERROR)|passed|failed" "$OUT/check.out" | tail -25
# the tall FOLD's bit test alone (three consumers and setmaxnreg 56 / 152, not yet run on a
# GPU: a register budget over the CTA's pool would hang, as the wide FOLD's first did), ahead
# of the sm90 and tall_e2e parts that time it
part tall_test 60 env PYTHONUNBUFFERED=1 "$py" -m pytest -m gpu -p no:cacheprovider -ra \
  tests/test_gemm_sm90_pending_gpu.py -k tall
grep -sE "^(FAILED|ERROR)|passed|failed" "$OUT/tall_test.out" | tail -5
# the tall FOLD is timed below unless its test ran here and did not pass (a hang or a wrong
# bit would cost the sm90 and tall_e2e parts their limits, or time a wrong kernel)
tall_ok() {
  [ ! -f "$OUT/tall_test.out" ] || { grep -qE "[0-9]+ passed" "$OUT/tall_test.out" &&
    ! grep -qE "[0-9]+ (failed|error)" "$OUT/tall_test.out"; }
}
tall=()
tall_ok && tall=(--tall)
# (M = 512 and 2,048, issue 18's rows against cuBLAS; M = 1 and 64 are sm90_ablate's. The
# cluster and cluster-split columns are left out: 2026-11-30 and 2026-12-01 settled them, and
# the part took 97 s of its 100 with them and the small rows)
part sm90 100 env PYTHONUNBUFFERED=1 "$py" bench/bench_gemm_sm90.py --rows 512,2048 \
  "${tall[@]}" --out "$OUT/gemm_sm90.json"
cut -c1-215 "$OUT/sm90.out" | tail -16
# the engine with the tall FOLD on (TALL_FOLD_BY_DEFAULT in the process: three consumers of
# 64 x 128 folding in registers, for the split projections of M = 2,048: qkv, o and down),
# beside the e2e part's rows: 8B prefill and against the cuBLAS engine (issue 18's
# invariant / cuBLAS prefill <= 1.25; the sm90 part's `tall` column for the GEMMs alone)
if tall_ok; then
  flag_part tall_e2e 60 TALL_FOLD_BY_DEFAULT --sections floors,prefill,cublas --batches 1 --out "$OUT/gpu_e2e_tall.json"
else
  echo "== tall_e2e: skipped (tall_test did not pass)"
fi
grep -sE "^(prefill|invariant|target: (prefill|invariant))|failed|Error" \
  "$OUT/tall_e2e.out" | cut -c1-150 | head -24
# 8B decode b=1 and b=64 with asynchronous scheduling (async_default below: the default
# model's), beside the e2e part's rows (issue 18's 1.3x the floor)
part async_e2e 60 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py \
  --sections floors,decode --async-scheduling --out "$OUT/gpu_e2e_async.json"
grep -sE "^(decode|target: decode)|failed|Error" "$OUT/async_e2e.out" | cut -c1-150
part e2e 90 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py \
  --sections floors,decode,prefill,ttft,kernels,disk,cublas --out "$OUT/gpu_e2e.json"
grep -sE "^(decode|prefill|ttft|invariant|target|profile)|failed|Error" "$OUT/e2e.out" | cut -c1-120
grep -sE "^kernels" "$OUT/e2e.out" | cut -c1-160
part e2e_default 30 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py --like smollm2-135m \
  --sections decode,ttft,kernels --batches 1 --out "$OUT/gpu_e2e_default.json"
grep -sE "^(decode|ttft|target|profile)|failed|Error" "$OUT/e2e_default.out" | cut -c1-120
grep -sE "^kernels .*(span|idle)" "$OUT/e2e_default.out" | cut -c1-160
# asynchronous scheduling (EngineConfig.async_scheduling: the next decode step launched
# before this one's tokens are read back, so the host's part of a step runs while the
# device works), beside e2e_default: the default model's decode b=1 (issue 18's 1,500
# tok/s; the host was 13 % of its step) and b=64
part async_default 30 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py --like smollm2-135m \
  --sections decode --batches 1,64 --async-scheduling --out "$OUT/gpu_e2e_async_default.json"
grep -sE "^(decode|target)|failed|Error" "$OUT/async_default.out" | cut -c1-150
# the same with PDL off (REPRISE_PDL=0), beside the default above (`graphs`: the kernels
# captured in the decode graphs launched as programmatic dependents): a 135M model's step
# is ~270 small kernels, where launch gaps weigh most
part e2e_default_nopdl 30 env PYTHONUNBUFFERED=1 REPRISE_PDL=0 "$py" bench/bench_gpu_e2e.py \
  --like smollm2-135m --sections decode,ttft,kernels --batches 1 \
  --out "$OUT/gpu_e2e_default_nopdl.json"
grep -sE "^(decode|ttft|target)|^kernels .*(span|idle)|failed|Error" "$OUT/e2e_default_nopdl.out" \
  | cut -c1-160
# the default model's projections unsplit (--max-splits 1), beside e2e_default (same call):
# its K of 576 splits 3 ways and 1,536 six, and each of its 120 GEMMs a step took ~9 us at
# M = 1 on 1-3.5 MB weights, latency rather than bandwidth, where a split adds a
# partials round trip; a rule to compare (other split counts are other bits), not to serve
part e2e_default_s1 30 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py --like smollm2-135m \
  --sections decode,kernels --batches 1 --max-splits 1 --out "$OUT/gpu_e2e_default_s1.json"
grep -sE "^(decode|split)|^kernels .*(span|idle|gemm)|failed|Error" "$OUT/e2e_default_s1.out" \
  | cut -c1-160
# the attention part also compiles attention_tc.cu twice more: its page step before base 2
# (`paged attn tc expf`: natural-unit expf, a rescale and the masks on every page), and
# that with a select around each expf too (`tc sel`: as the H200 timed it on 2026-11-27)
# (and the host tier's copies a call a block and as one run, `tier_copies`: the host's
# issue time of each, the hosttier section)
part attention 100 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_kernels.py \
  --sections floors,gemm,attention,hosttier --models llama-3.1-8b --out "$OUT/gpu_kernels.json"
grep -sE "^llama-3.1-8b (qkv|o|gate_up|down|lm_head) +M=1 |paged attn|hosttier|^llama-3.1-8b +(offload|onboard|overlap)|Error" \
  "$OUT/attention.out" | cut -c1-170
part disk_read_16 30 env PYTHONUNBUFFERED=1 "$py" bench/bench_disk_tier.py \
  --shape 8b --blocks 128 --repeat 3 --read-threads 16
grep -sE "blocks of|^(read|ahead|into|ring) " "$OUT/disk_read_16.out"
# last, since the wide FOLD's first version hung: the forced-tile tests (the wide FOLD; the
# decode and 64 x 128 tiles against WS) and the gated (SwiGLU) epilogue's, kernel and engine
# (the engine test's model: the synthetic stand-in gpu_check.sh makes where the default
# model cannot be fetched; that script's export does not reach this one)
model=${REPRISE_TEST_MODEL_DIR:-/tmp/reprise-smollm2-135m-synth}
[ -f "$model/config.json" ] || "$py" -c "from reprise.daemon.model.synth import synth_model
synth_model('smollm2-135m', '$model')"
# the engine's own host time per step on this machine's CPU, with a backend that does no
# math (the cached 4k prompt's step was 0.35 ms of host time on the CPU machines here;
# the GPU's cached first token spends 1.2 ms beside its graph): how much of that gap is
# the engine's Python on a slower host and how much the CuPy side
part host_step 60 env PYTHONUNBUFFERED=1 "$py" bench/bench_host_step.py --model "$model" \
  --out "$OUT/host_step.json"
grep -sE "ms of host time|on the engine loop" "$OUT/host_step.out"
# the decode GEMMs (M = 1 and 64) with a part of the launch left out (timing only, wrong
# output: gemm_sm90_kernel.ABLATE, two more builds of gemm_sm90.cu, ~30 s each to compile):
# PARTIAL's tail, and every MMA (the weight stream alone): where qkv, o and down lose the
# 8B decode step's ~0.65 ms over their copy floors
part sm90_ablate 150 env PYTHONUNBUFFERED=1 "$py" bench/bench_gemm_sm90.py --rows 1,64 \
  --shapes qkv,o,down,gate_up --ablate --out "$OUT/gemm_sm90_ablate.json"
cut -c1-215 "$OUT/sm90_ablate.out" | tail -10
# Nsight Compute over one batch-1 decode step's first 12 kernels (the embedding and the
# first layer: every kernel a layer runs, the RMSNorm in registers among them), each alone:
# DRAM and SM throughput, waves, occupancy, why warps stall (bench/bench_ncu_step.py; where
# the machine lets ncu read its counters). (The prefill attention kernel's profile of
# 2026-11-28 stands: no change since reaches it; its part is left out for time.)
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
if [ -n "$ncu_bin" ]; then
  stalls=$("$py" -c "from reprise.bench.bench_ncu_step import STALL_METRICS as m; print(','.join(m))")
  ncu_sections=(--section SpeedOfLight --section LaunchStats --section Occupancy
    --section WarpStateStats --section MemoryWorkloadAnalysis --metrics "$stalls")
  part ncu_decode 90 env PYTHONUNBUFFERED=1 "$ncu_bin" --profile-from-start off \
    --clock-control none --launch-count 12 --csv --log-file "$OUT/ncu_decode.csv" \
    "${ncu_sections[@]}" "$py" bench/bench_ncu_step.py run --case decode
  if [ -f "$OUT/ncu_decode.csv" ]; then
    "$py" bench/bench_ncu_step.py summary "$OUT/ncu_decode.csv" >"$OUT/ncu_decode.txt" 2>&1
    cut -c1-190 "$OUT/ncu_decode.txt"
  fi
fi
part pending_test 150 env PYTHONUNBUFFERED=1 REPRISE_TEST_MODEL_DIR="$model" "$py" -m pytest \
  -m gpu -p no:cacheprovider -ra tests/test_gemm_sm90_pending_gpu.py
grep -sE "^(FAILED|ERROR)|passed|failed" "$OUT/pending_test.out" | tail -5
# the engine with its MLPs' silu_mul as a kernel of its own (GATED_BY_DEFAULT off in the
# process; the gated epilogue is the default since 2026-12-01), beside the e2e part's
# default rows: 8B decode and prefill, and against the cuBLAS engine
flag_part ungated_e2e 90 '!GATED_BY_DEFAULT' --sections floors,decode,prefill,kernels,cublas --batches 1,64 --out "$OUT/gpu_e2e_ungated.json"
grep -sE "^(decode|prefill|invariant|target: (decode|prefill|invariant))|failed|Error" \
  "$OUT/ungated_e2e.out" | cut -c1-150 | head -24
# the engine with the cluster entry points on (CLUSTER_BY_DEFAULT in the process: two CTAs
# along M multicasting each weight tile, for every prefill product of an even count of m
# tiles), beside the e2e part's rows: 8B prefill and against the cuBLAS engine (issue 18's
# invariant / cuBLAS prefill, and the sm90 part's c2 column for the GEMMs alone)
flag_part cluster_e2e 60 CLUSTER_BY_DEFAULT --sections floors,prefill,cublas --batches 1 --out "$OUT/gpu_e2e_cluster.json"
grep -sE "^(prefill|invariant|target: (prefill|invariant))|failed|Error" \
  "$OUT/cluster_e2e.out" | cut -c1-150 | head -24
# the default model with each of 2026-12-01's two new defaults taken away (the cluster
# split: CSPLIT_BY_DEFAULT off, each split projection of a decode step PARTIAL's workspace,
# fence and counter again; the gated epilogue: GATED_BY_DEFAULT off), beside e2e_default,
# which has both: the two were measured alone (+34 % and +9 % over neither), not together
flag_part nocsplit_default 30 '!CSPLIT_BY_DEFAULT' --like smollm2-135m --sections decode,kernels --batches 1 --out "$OUT/gpu_e2e_nocsplit_default.json"
grep -sE "^decode|^kernels .*(span|idle)|failed|Error" "$OUT/nocsplit_default.out" | cut -c1-150
flag_part ungated_default 30 '!GATED_BY_DEFAULT' --like smollm2-135m --sections decode,kernels --batches 1 --out "$OUT/gpu_e2e_ungated_default.json"
grep -sE "^decode|^kernels .*(span|idle)|failed|Error" "$OUT/ungated_default.out" | cut -c1-150
# the default model with the row epilogues on (NORM_EPILOGUE_BY_DEFAULT and
# ROPE_EPILOGUE_BY_DEFAULT: each layer's o and down launches run the add_rmsnorm after them
# and its qkv launch the rope_kv_write, 90 launches a decode step fewer; they take those
# launches off the cluster split, onto their tile's PARTIAL), beside e2e_default: issue
# 18's 1,500 tokens/s (fused_default: the same with the cached first token)
flag_part epilogues_default 30 NORM_EPILOGUE_BY_DEFAULT,ROPE_EPILOGUE_BY_DEFAULT --like smollm2-135m --sections decode,kernels --batches 1 --out "$OUT/gpu_e2e_epilogues_default.json"
grep -sE "^decode|^kernels .*(span|idle|_norm_|_rope_)|failed|Error" "$OUT/epilogues_default.out" | cut -c1-150
flag_part fused_default 30 NORM_EPILOGUE_BY_DEFAULT,ROPE_EPILOGUE_BY_DEFAULT --like smollm2-135m --sections decode,ttft,kernels --batches 1 --out "$OUT/gpu_e2e_fused_default.json"
grep -sE "^(decode|ttft|target)|^kernels .*(span|idle)|failed|Error" "$OUT/fused_default.out" | cut -c1-150
# the row epilogues on at 8B shapes (with the defaults: the gated MLP; the cluster split
# keeps to small weights), beside the e2e part's rows: issue 18's decode b=1 at 1.3x the
# weights-read floor
flag_part fused_e2e 60 NORM_EPILOGUE_BY_DEFAULT,ROPE_EPILOGUE_BY_DEFAULT --sections floors,decode,kernels --batches 1 --out "$OUT/gpu_e2e_fused.json"
grep -sE "^(decode|target: decode)|^kernels decode b=1 ctx=512 graphs|failed|Error" \
  "$OUT/fused_e2e.out" | cut -c1-150 | head -24
# the engine with the shared page on (attention_tc_kernel.COOP: a decode's split attention
# CTA runs each page on all four warps, not warp 0 alone; the same bits), beside the e2e and
# e2e_default parts' rows: 8B decode b=1 and the cached 4,096-token first token (issue 18's
# 1.3x the floor and 1.1 decode steps), then the default model's decode b=1
flag_part coop_e2e 60 attention_tc_kernel.COOP --sections floors,decode,ttft,kernels --batches 1 --out "$OUT/gpu_e2e_coop.json"
grep -sE "^(decode|ttft|target)|^kernels (decode b=1 ctx=512 graphs|ttft 4096 cached).*(span|attention)|failed|Error" \
  "$OUT/coop_e2e.out" | cut -c1-150 | head -24
flag_part coop_default 30 attention_tc_kernel.COOP --like smollm2-135m --sections decode,kernels --batches 1 --out "$OUT/gpu_e2e_coop_default.json"
grep -sE "^decode|^kernels .*(span|idle|attention)|failed|Error" "$OUT/coop_default.out" | cut -c1-150
# last of all, the persistent layer tail (decode_block_kernel.BY_DEFAULT: a decode's o_proj,
# add_rmsnorm, gate_up, silu * up, down_proj and add_rmsnorm as one launch whose CTAs meet
# at grid barriers; the same bits): its GPU tests first (a grid barrier whose CTAs are not
# all resident hangs, here, within its limit, after everything else), then the default
# model's decode with it on beside e2e_default (issue 18's 1,500 tok/s), alone and with the
# other default-model fusions and the shared page, then 8B's decode beside e2e
part tail_test 240 env PYTHONUNBUFFERED=1 REPRISE_TEST_MODEL_DIR="$model" "$py" -m pytest \
  -m gpu -p no:cacheprovider -ra tests/test_decode_block_gpu.py
grep -sE "^(FAILED|ERROR)|passed|failed" "$OUT/tail_test.out" | tail -5
flag_part tail_default 30 decode_block_kernel.BY_DEFAULT --like smollm2-135m --sections decode,ttft,kernels --batches 1,4 --out "$OUT/gpu_e2e_tail_default.json"
grep -sE "^(decode|ttft)|^kernels decode b=1 ctx=512 graphs|failed|Error" "$OUT/tail_default.out" | cut -c1-150 | head -24
# the same with one layer a launch (decode_layer's launches, not one decode_layers a step)
flag_part tail_layer_default 30 decode_block_kernel.BY_DEFAULT --like smollm2-135m --sections decode,kernels --batches 1 --layers-a-launch 1 --out "$OUT/gpu_e2e_tail_layer_default.json"
grep -sE "^decode|^kernels decode b=1 ctx=512 graphs|failed|Error" "$OUT/tail_layer_default.out" | cut -c1-150 | head -20
flag_part tail_fused_default 30 decode_block_kernel.BY_DEFAULT,ROPE_EPILOGUE_BY_DEFAULT,attention_tc_kernel.COOP --like smollm2-135m --sections decode,kernels --batches 1 --out "$OUT/gpu_e2e_tail_fused_default.json"
grep -sE "^decode|^kernels decode b=1 ctx=512 graphs|failed|Error" "$OUT/tail_fused_default.out" | cut -c1-150 | head -20
flag_part tail_e2e 60 decode_block_kernel.BY_DEFAULT --sections floors,decode,kernels --batches 1 --out "$OUT/gpu_e2e_tail.json"
grep -sE "^(decode|target)|^kernels decode b=1 ctx=512 graphs.*(span|decode_tail|decode_layer)|failed|Error" "$OUT/tail_e2e.out" | cut -c1-150 | head -20
# the same as tail_default with the weights read under L2's normal policy (decode_block.cu
# built with REPRISE_WEIGHTS_EVICT_FIRST=0, a compile of its own: about 30-60 s): does
# evict-first keep the KV pages in L2?
flag_part tail_l2normal_default 120 decode_block_kernel.BY_DEFAULT,decode_block_kernel.WEIGHTS_EVICT_NORMAL --like smollm2-135m --sections decode,kernels --batches 1 --out "$OUT/gpu_e2e_tail_l2normal_default.json"
grep -sE "^decode|^kernels decode b=1 ctx=512 graphs|failed|Error" "$OUT/tail_l2normal_default.out" | cut -c1-150 | head -20
# Gemma-3-1B's shapes (head_dim 256 on the CUDA-core attention kernel, 26 layers, a
# window on 5 of 6): 7.8x the weights-read floor at decode b=1 on 2026-12-01, unexplained;
# here with where each step's time goes
part gemma 90 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py --like gemma-3-1b \
  --sections floors,decode,prefill,kernels --batches 1,64 --out "$OUT/gpu_e2e_gemma.json"
grep -sE "^(decode|prefill|kernels (decode b=1 ctx=512 graphs|prefill))|failed|Error" "$OUT/gemma.out" | cut -c1-150 | head -40
# the same with head_dim 256 on the tensor-core kernel (attention_tc_kernel.D256_BY_DEFAULT:
# its normal ring at one CTA an SM, 255 registers), beside `gemma`'s CUDA-core rows
flag_part gemma_tc 90 attention_tc_kernel.D256_BY_DEFAULT --like gemma-3-1b \
  --sections floors,decode,prefill,kernels --batches 1,64 --out "$OUT/gpu_e2e_gemma_tc.json"
grep -sE "^(decode|prefill|kernels (decode b=1 ctx=512 graphs|prefill))|failed|Error" "$OUT/gemma_tc.out" | cut -c1-150 | head -40
# a mixture of experts (2026-11-30, session 38): Qwen3-30B-A3B's shapes (random weights,
# 61 GB), the grouped GEMMs on gemm.cu's unsplit tile, decode against the active
# parameters' read floor (run by hand: PARTS=moe_e2e)
part moe_e2e 240 env PYTHONUNBUFFERED=1 "$py" bench/bench_gpu_e2e.py --like qwen3-30b-a3b \
  --sections floors,decode,prefill,kernels --batches 1,64 --out "$OUT/gpu_e2e_moe.json"
grep -sE "^(decode|prefill|kernels decode b=1)|failed|Error" "$OUT/moe_e2e.out" | cut -c1-150 | head -40
# prompt lookup speculation on the GPU (2026-11-29, session 31; drafted steps in graphs
# of their own since session 32): a drafted step (1 + 4 rows a request, the drafted
# bucket's graph) against plain decode (graphs), drafts planted all right (the most
# drafts gain) and all wrong (what they cost when none is kept), on the default model's
# shapes ($model: the default model, or its random-weight stand-in); each checks the
# answers bit-identical
part spec_right_default 120 env PYTHONUNBUFFERED=1 "$py" bench/bench_speculative.py \
  --backend cupy --model "$model" --planted right --out "$OUT/speculative_right_default.json"
grep -sE "tok/s|differs|Error" "$OUT/spec_right_default.out" | cut -c1-150
part spec_wrong_default 120 env PYTHONUNBUFFERED=1 "$py" bench/bench_speculative.py \
  --backend cupy --model "$model" --planted wrong --out "$OUT/speculative_wrong_default.json"
grep -sE "tok/s|differs|Error" "$OUT/spec_wrong_default.out" | cut -c1-150
