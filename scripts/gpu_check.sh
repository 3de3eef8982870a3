#!/usr/bin/env bash
# The GPU verification in one command, for a machine with a CUDA device and CuPy but
# perhaps no network (such as the lent H100): makes reprise importable without
# installing anything, uses the default model if it is prepared here and else writes
# its shape with random weights (`reprise model synth --like smollm2-135m`), then runs
# the kernel compile checks and every GPU test. The log and JUnit XML go to
# ${OUT:-gpu-results}.
#   bash scripts/gpu_check.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
if [ -z "${REPRISE_TEST_MODEL_DIR:-}" ]; then
  model=$("$python" -c 'try:  # the gguf package the converter needs may be missing here
    from reprise.daemon.model.prepare import default_model_dir, is_prepared
    d = default_model_dir(); print(d if is_prepared(d) else "")
except ImportError:
    print("")')
  if [ -z "$model" ]; then
    model=/tmp/reprise-smollm2-135m-synth
    [ -f "$model/config.json" ] || "$python" -c "from reprise.daemon.model.synth import synth_model
synth_model('smollm2-135m', '$model')"
  fi
  export REPRISE_TEST_MODEL_DIR=$model
fi
echo "model: $REPRISE_TEST_MODEL_DIR" | tee -a "$out/device.txt"
# only the modules that hold GPU or kernel tests: the others import the daemon's ZeroMQ
PYTHONUNBUFFERED=1 "$python" -m pytest -m "gpu or kernels" -p no:cacheprovider -ra \
  --durations=20 --junitxml="$out/gpu.xml" tests/test_kernels_compile.py tests/test_gpu_*.py \
  tests/test_graphs.py \
  tests/test_invariance.py "$@" 2>&1 | tee "$out/gpu.log"
exit "${PIPESTATUS[0]}"
