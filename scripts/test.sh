#!/usr/bin/env bash
# Install everything the tests need, lint, type-check, and run the test suite (CPU; GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
bash scripts/typecheck.sh
# the slowest tests, printed at the end: the suite must stay well inside CI's 90 minutes
.venv/bin/python -m pytest --durations=20 "$@"
