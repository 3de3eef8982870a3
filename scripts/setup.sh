#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install reprise into it.
#   scripts/setup.sh            the runtime only
#   scripts/setup.sh test       plus pytest, hypothesis, ruff, the reference stack
#                               (CPU PyTorch, transformers) the tests compare against, and
#                               NVRTC with the CUDA headers, to compile the kernels (no GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if [ "${1:-}" = test ]; then
  # CPU build of PyTorch, pinned so pip does not pull a multi-GB CUDA build.
  pip install "${REPRISE_TORCH:-torch==2.13.0}"
  pip install -e '.[test,reference,kernels]'
else
  pip install -e .
fi
