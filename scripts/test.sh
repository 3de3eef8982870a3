#!/usr/bin/env bash
# Install everything the tests need, lint, type-check, and run the test suite (CPU; GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
bash scripts/typecheck.sh
# The suite's files spread over up to 4 workers, one a core (CI's 2 cores: about 20 minutes
# where one process took 40-80). Each worker does its own BLAS and torch work on one
# thread, so two workers never fight over a core; results do not depend on it (the NumPy
# twins' sums are exact whatever the BLAS threading, cuda/gemm.py). A test file's tests
# stay on one worker, in order, sharing its module fixtures. `-n 0` runs in one process.
# The slowest tests are printed at the end: the suite must stay well inside CI's 90 minutes.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile --durations=20 "$@"
