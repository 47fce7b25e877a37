"""Tests of the benchmark suite (benchmarks/run.py): its helpers, and a tiny real run of every section."""

import json
import operator
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks import machine, report  # noqa: E402
from benchmarks import run as suite  # noqa: E402
from benchmarks.fresh import FreshProcesses, run_isolated  # noqa: E402
from benchmarks.samplers import EpochBatches, StreamBatches  # noqa: E402

SECTIONS = {"images", "gpustep", "text", "peers", "sweeps", "memory", "coldcache", "shards", "scale", "augment",
            "fusedcrop", "training", "streaming", "gpu", "busystep", "records", "lm", "lmscale"}


def test_only_selects_sections_and_rejects_unknown_ones(capsys):
    assert suite.parse_args(["--quick", "--only", "text, memory"]).sections == ("text", "memory")
    assert set(suite.parse_args([]).sections) == SECTIONS
    with pytest.raises(SystemExit):
        suite.parse_args(["--only", "images,nope"])
    assert "unknown sections ['nope']" in capsys.readouterr().err


def test_quick_changes_defaults_only():
    quick = suite.parse_args(["--quick", "--repeats", "2"])
    assert (quick.repeats, quick.num_images, quick.memory_samples) == (2, 200, 20_000)
    assert suite.parse_args([]).memory_samples == 1_000_000


def test_targets_pass_both_ways_with_margin():
    at_least = report.finish({"name": "a", "value": 3.0, "threshold": 2.0}, "s")
    at_most = report.finish({"name": "b", "value": 0.04, "threshold": 0.02, "at_least": False}, "s")
    assert at_least["pass"] and at_least["margin"] == pytest.approx(1.5)
    assert not at_most["pass"] and at_most["margin"] == pytest.approx(0.5)


def test_stream_batches_are_full_sorted_and_cover_each_epoch():
    stream = iter(StreamBatches(10, 4, seed=0))
    first_epoch = [next(stream) for _ in range(2)]  # 10 // 4 full batches per permutation
    assert all(len(b) == 4 and np.all(np.diff(b) > 0) for b in first_epoch)
    assert len(np.unique(np.concatenate(first_epoch))) == 8
    epochs = EpochBatches(10, 4, num_batches=5, seed=0)
    first = list(epochs)
    assert len(first) == len(epochs) == 5
    assert not np.array_equal(np.concatenate(first), np.concatenate(list(epochs)))  # a new draw each epoch
    assert epochs.epoch == 2 and np.array_equal(np.concatenate(list(epochs.batches(0))), np.concatenate(first))


def test_epoch_batches_give_make_loader_each_epoch_s_batches(packed_files):
    from fastdata import make_loader, open_dataset

    dataset = open_dataset(packed_files("hdf5", "raw"))
    sampler = EpochBatches(len(dataset), 4, num_batches=3, seed=0)
    loader = make_loader(dataset, batch_sampler=sampler)
    seen = [[labels.tolist() for _, labels in loader] for _ in range(3)]
    expected = [[dataset.labels[b].tolist() for b in sampler.batches(epoch)] for epoch in range(3)]
    assert seen == expected and sampler.epoch == 3


def test_page_cache_drop_is_checked_by_residency(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(1 << 20))
    path.read_bytes()
    dropped = machine.drop_from_page_cache([str(path)])
    if dropped["method"] is None:
        pytest.skip(f"this machine keeps the pages: {dropped['notes']}")
    assert dropped["resident_after"] <= 0.01
    path.read_bytes()
    assert machine.page_residency(str(path)) > 0.5


def test_fresh_processes_return_results_and_report_errors():
    with FreshProcesses(preload=()) as fresh:
        assert fresh.run(operator.add, 2, 3) == 5
        with pytest.raises(RuntimeError, match="ValueError"):
            fresh.run(int, "not a number")
        assert fresh.run(operator.mul, 4, 5) == 20  # the zygote survives a failed row


def test_isolated_process_returns_results_and_reports_errors():
    assert run_isolated(operator.add, 2, 3) == 5
    with pytest.raises(RuntimeError, match="ValueError"):
        run_isolated(int, "not a number")


SHADOW_CHECK = """
import importlib.util, os, runpy, sys
script, names = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(script))  # as Python does for a script
sys.argv = [script, "--help"]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
specs = {name: importlib.util.find_spec(name) for name in names}
print([name for name, spec in specs.items() if spec and os.path.dirname(script) in str(spec.origin)])
"""


@pytest.mark.integration
def test_run_as_a_script_leaves_no_benchmark_module_importable_by_a_bare_name():
    names = sorted({path.stem for path in (REPO / "benchmarks").rglob("*.py")} - {"__init__"})
    assert {"run", "images", "text"} <= set(names)
    done = subprocess.run([sys.executable, "-c", SHADOW_CHECK, str(REPO / "benchmarks" / "run.py"), *names],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.integration
def test_benchmark_suite_quick_run(tmp_path):
    # every section, quick: 547 s alone on 2 cores (2026-11-26), past 600 s in a CI run beside other work
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--workdir", str(tmp_path / "work"),
               "--out-dir", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    sections = results["sections"]
    assert set(sections) == SECTIONS
    assert not [name for name, section in sections.items() if "error" in section]
    rows = {row["key"] for result in sections["images"]["sizes"].values() for row in result["loading"]}
    assert {"folder", "folder_list_workers", "hdf5-raw", "arrow-jpeg", "copy_prealloc", "decode_threads"} <= rows
    assert {row["key"] for row in sections["text"]["rows"]} >= {"raw_files", "hdf5-padded", "arrow-bucketed"}
    assert all("samples_per_s" in row or row["skipped"] for row in sections["peers"]["rows"])
    assert {"num_workers", "batch_size", "prefetch_factor"} <= set(sections["sweeps"]["sweeps"])
    assert {row["start_method"] for row in sections["memory"]["rows"]} == {"fork", "spawn"}
    assert sections["coldcache"]["rows"] and sections["gpustep"]["rows"]
    targets = results["targets"]
    assert targets and all(isinstance(t["pass"], bool) and (t["margin"] is None or t["margin"] > 0) for t in targets)
    assert results["machine"]["cpu_count"] and results["run_seconds"] > 0
    images = [row for result in sections["images"]["sizes"].values() for row in result["loading"]]
    assert all(row["samples_per_s"] > 0 for row in images)
    assert all(isinstance(t["pass"], bool) for result in sections["images"]["sizes"].values()
               for t in result["targets"])
    assert all(result["abandoned"]["ratio"] > 0 for result in sections["images"]["sizes"].values())
    assert "| method" in finished.stdout and "## Targets" in finished.stdout
    markdown = (out / "results.md").read_text()
    assert "## Targets" in markdown and "| result" in markdown and "## Sweeps" in markdown
    if results["machine"]["versions"].get("matplotlib"):
        assert (out / "throughput_vs_num_workers.png").stat().st_size > 0
        assert (out / "worker_memory_over_epoch.png").stat().st_size > 0
