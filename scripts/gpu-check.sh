#!/usr/bin/env bash
# The GPU check (issue 28) in one command, for a session lent a machine with an NVIDIA GPU: the CUDA tests,
# make_loader(device="cuda")'s bytes/s against plain pinned and pageable copies, and ResNet-18/50 training steps
# from packed raw and jpeg files. Writes benchmarks/results/gpu/results.{json,md} and prints the table; extra
# arguments go to benchmarks/gpucheck.py. Stopped after GPU_CHECK_SECONDS (default 560).
# Exit status: 0 ran (read the targets), 1 a test or a measurement failed, 3 no CUDA device, 4 no torch built
# with CUDA, 5 a package it needs is missing and could not be installed, 124 stopped at the time limit.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no CUDA device: no /dev/nvidia0 and no working nvidia-smi on this machine; run this where an NVIDIA GPU is" >&2
    exit 3
fi

# The Python: .venv as scripts/setup.sh makes it, where its torch is a CUDA build, else python3 (a GPU image's own
# torch), or $PYTHON. torch is never installed here: setup.sh pins the CPU build, and the machine may be offline.
cuda_torch() { "$1" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; }
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    for candidate in .venv/bin/python python3; do
        command -v "$candidate" >/dev/null || continue
        if cuda_torch "$candidate"; then PYTHON=$candidate; break; fi
        torch=$("$candidate" -c 'import torch; print(f"torch {torch.__version__}, a CPU-only build")' 2>/dev/null)
        echo "$candidate: ${torch:-no torch}" >&2
    done
fi
if [ -z "$PYTHON" ]; then
    echo "no torch built with CUDA in .venv or python3 (a CPU-only build cannot use the GPU); set PYTHON to one" >&2
    exit 4
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's fastdata, installed or not
export PYTHONUNBUFFERED=1

# What fastdata and its tests import, installed as setup.sh would where a package index answers.
missing=$("$PYTHON" -c '
import importlib.util
need = {"numpy": "numpy", "h5py": "h5py", "pyarrow": "pyarrow", "PIL": "pillow", "tqdm": "tqdm", "click": "click",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis", "psutil": "psutil"}
print(" ".join(package for module, package in need.items() if importlib.util.find_spec(module) is None))')
if [ -n "$missing" ]; then
    echo "installing what $PYTHON lacks: $missing" >&2
    if ! "$PYTHON" -m pip install --quiet --retries 0 --timeout 15 -c constraints.txt $missing; then
        echo "$PYTHON lacks $missing and pip could not install them; install them, or set PYTHON" >&2
        exit 5
    fi
fi

echo "gpu-check: $PYTHON" >&2
timeout --kill-after=10 "${GPU_CHECK_SECONDS:-560}" "$PYTHON" benchmarks/gpucheck.py "$@"
