#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, and run the whole test suite, slow smoke runs included;
# extra arguments go to pytest. For the edit loop, plain `.venv/bin/pytest` skips the slow and
# integration ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -n 0 -m "slow or not slow" --durations=25 "$@"
