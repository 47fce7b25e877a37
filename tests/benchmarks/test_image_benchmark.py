"""Smoke test of the benchmark entry: a tiny real run, every row measured and reported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_image_benchmark_quick_run(tmp_path):
    out = tmp_path / "results.json"
    command = [sys.executable, str(REPO / "benchmarks" / "images.py"), "--quick",
               "--workdir", str(tmp_path / "work"), "--out", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads(out.read_text())
    rates = {row["key"]: row["samples_per_s"] for row in results["loading"]}
    assert {"folder", "hdf5-raw", "arrow-jpeg", "copy_prealloc", "decode_threads"} <= set(rates)
    assert all(rate > 0 for rate in rates.values())
    assert results["targets"] and all(isinstance(t["pass"], bool) for t in results["targets"])
    assert "| method" in finished.stdout and "## Targets" in finished.stdout
