#!/usr/bin/env bash
# The main job on a fresh machine: install, prepare the default model, answer a prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/reprise model prepare
.venv/bin/reprise model info
.venv/bin/reprise run "${1:-What is the capital of France?}"
