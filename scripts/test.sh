#!/usr/bin/env bash
# Install everything the tests need, lint, and run the test suite (CPU; GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
