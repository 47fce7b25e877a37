#!/usr/bin/env bash
# Create .venv (if needed) and install fastdata with its test, benchmark and trainer (integrations) extras.
# torch is pinned through constraints.txt to the local CPU build (no CUDA download).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# editable_mode=compat: a path entry that type checkers follow (the default import hook hides fastdata from mypy).
.venv/bin/python -m pip install --quiet -c constraints.txt --config-settings editable_mode=compat \
    -e '.[test,bench,jpeg,tokenizers,integrations]'
# LitData, a peer the benchmarks time (shards, lm), without its requirements: it asks for torchvision, whose PyPI
# build does not load against this CPU torch, and for tifffile; what the benchmarks use of it needs neither.
.venv/bin/python -m pip install --quiet -c constraints.txt --no-deps litdata==0.2.76 obstore==0.12.1
