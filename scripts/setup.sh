#!/usr/bin/env bash
# Create .venv (if needed) and install fastdata with its test and benchmark extras.
# torch is pinned through constraints.txt to the local CPU build (no CUDA download).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet -c constraints.txt -e '.[test,bench,jpeg,tokenizers]'
