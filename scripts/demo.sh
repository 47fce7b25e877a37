#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the end-to-end demo (scripts/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/demo.py "$@"
