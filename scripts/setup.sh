#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install reprise into it.
#   scripts/setup.sh            the runtime only
#   scripts/setup.sh test       plus pytest, hypothesis, ruff, mypy, the reference stack
#                               (CPU PyTorch, transformers) the tests compare against,
#                               NVRTC with the CUDA headers, to compile the kernels (no GPU),
#                               and CuPy, whose API the tests check without a device
# On a machine with an NVIDIA driver it also installs CuPy for the driver's CUDA major
# version (the cuda13 or cuda12 extra), so `backend=auto` runs on the GPU.
# REPRISE_CUDA=12|13 picks the extra; REPRISE_CUDA=none installs none (NumPy only).
#   scripts/setup.sh cuda-extra prints the extra it would install here (empty: none), and
#                               installs nothing
set -euo pipefail
cd "$(dirname "$0")/.."

# The CUDA major version the driver supports ("CUDA Version: 13.0" in nvidia-smi's
# header), or nothing without a driver or when nvidia-smi fails (no device).
driver_cuda() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  { nvidia-smi 2>/dev/null || true; } | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1
}

cuda=${REPRISE_CUDA-$(driver_cuda)}
case "$cuda" in
  "" | none) extra= ;;
  12) extra=cuda12 ;;
  *[!0-9]*)
    echo "setup: REPRISE_CUDA must be 12, 13 or none; got '$cuda'" >&2
    exit 2
    ;;
  *)
    if [ "$cuda" -ge 13 ]; then
      extra=cuda13
    else
      echo "setup: CUDA $cuda is older than CuPy's 12.x builds need; running on NumPy" >&2
      extra=
    fi
    ;;
esac
if [ "${1:-}" = cuda-extra ]; then
  echo "$extra"
  exit 0
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

if [ "${1:-}" = test ]; then
  # CPU build of PyTorch, pinned so pip does not pull a multi-GB CUDA build.
  pip install "${REPRISE_TORCH:-torch==2.13.0}"
  pip install -e '.[test,reference,kernels]'
  # CuPy's API for tests/test_cupy_api.py (a CUDA extra brings CuPy itself; none, none)
  [ -n "$extra" ] || [ "$cuda" = none ] || pip install -e '.[cupy-api]'
else
  pip install -e .
fi
if [ -n "$extra" ]; then
  if pip install -e ".[$extra]"; then
    echo "setup: installed CuPy for CUDA $cuda (reprise[$extra]): backend=auto uses the GPU" >&2
  else
    echo "setup: could not install reprise[$extra] for the GPU (see pip's error above);" \
      "reprise runs on NumPy until it is installed" >&2
  fi
fi
