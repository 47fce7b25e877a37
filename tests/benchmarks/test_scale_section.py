"""The scale section of the benchmark suite, run small: grown datasets, bounded-cache rows, DDP groups, resume."""

import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks import report  # noqa: E402
from benchmarks.sections import scale  # noqa: E402
from fastdata import open_dataset  # noqa: E402
from fastdata.measure.pagecache import cgroup_problem  # noqa: E402
from fastdata.verify import verify  # noqa: E402

SMALL = {"quick": True, "seed": 0, "scale_images": 61, "scale_raw_bytes": 6 << 20, "scale_jpeg_bytes": 3 << 20,
         "scale_cache_limit": 512 << 20, "scale_seconds": 0.5, "scale_order_samples": (10**5, 10**6),
         "scale_world_sizes": ((1, 0), (2, 0), (3, 1)), "scale_epochs": 2}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("work"))


@pytest.fixture(scope="module")
def data(workdir):
    return scale.datasets(os.path.join(workdir, "scale"), scale.settings(SMALL), 0)


def test_the_grown_datasets_are_copies_sorted_by_class_that_verify_passes(data):
    for kind in ("raw", "jpeg"):
        grown, base = open_dataset(data[kind]["path"]), open_dataset(data[kind]["base"])
        count, copies = len(base), data[kind]["copies"]
        assert len(grown) == count * copies == data[kind]["num_samples"] and copies > 1
        labels = grown.labels
        assert np.all(np.diff(labels) >= 0) and len(np.unique(labels)) == len(base.classes)
        assert grown.metadata["class_counts"] == np.bincount(labels).tolist()
        again = grown.read_batch(np.array([3, count + 3, (copies - 1) * count + 3]))[0]
        assert all(np.array_equal(again[k].numpy(), base.read_batch(np.array([3]))[0][0].numpy()) for k in range(3))
        assert verify(data[kind]["path"]).ok, verify(data[kind]["path"]).problems
        assert data[kind]["bytes"] >= SMALL[f"scale_{kind}_bytes"] and data[kind]["paths"] == grown.shard_paths


def test_grown_datasets_are_made_once(data, workdir):
    again = scale.datasets(os.path.join(workdir, "scale"), scale.settings(SMALL), 0)
    assert again["raw"]["grow_seconds"] is None and again["raw"]["path"] == data["raw"]["path"]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.data())
def test_the_batch_digest_is_the_same_however_the_batch_is_split(count, draw):
    rng = np.random.default_rng(count)
    images = rng.integers(0, 256, (count, 3, 4, 4), dtype=np.uint8)
    labels = rng.integers(0, 10, count)
    cuts = sorted(draw.draw(st.lists(st.integers(0, count), max_size=3)))
    parts = [scale.batch_digest(images[a:b], labels[a:b]) for a, b in zip([0, *cuts], [*cuts, count])]
    whole = scale.batch_digest(images, labels)
    assert np.array_equal(np.sum(parts, axis=0), whole) and whole[0] == count
    labels[0] += 1
    assert not np.array_equal(scale.batch_digest(images, labels), whole)


def test_a_ddp_run_past_its_timeout_is_killed_with_its_ranks_and_called_a_hang(data, workdir, monkeypatch):
    monkeypatch.setattr(scale, "DDP_TIMEOUT", 2)  # the ranks are still starting torch
    row = scale.ddp_run({"what": "ddp", "path": data["raw"]["base"], "world_size": 2, "num_workers": 0,
                         "epochs": 1, "out": os.path.join(workdir, "hang.json")})
    assert row["hang"] and 2 <= row["seconds"] < 30
    for _ in range(50):  # the ranks, orphaned by the driver's death, are reaped by init
        try:
            os.killpg(row["group"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"processes of group {row['group']} outlived the kill")


@pytest.fixture(scope="module")
def section(workdir, data):
    return scale.run({**SMALL, "workdir": workdir})


@pytest.mark.slow
@pytest.mark.skipif(cgroup_problem() is not None, reason=f"no memory cgroup: {cgroup_problem()}")
def test_bounded_rows_read_evicted_files_from_disk_inside_the_cgroup(section):
    for data in section["cache"]:
        rows = data["rows"] + data["cached"]
        assert [row.get("shuffle", row["what"]) for row in data["rows"]] == ["limit", "block", "limit", "uniform",
                                                                             "random"]
        assert not [row["skipped"] for row in rows if "skipped" in row]
        for row in data["rows"]:
            assert row["drop"]["method"] and row["drop"]["resident_after"] < 0.01
            assert row["cgroup"]["max_usage"] <= row["cgroup"]["limit"] == SMALL["scale_cache_limit"]
            distinct = min(row.get("samples", data["num_samples"]), data["num_samples"]) * data["sample_bytes"]
            if row["what"] == "random":  # offsets at random: some read twice (cached), so only some bytes
                distinct = min(row["reads"], data["num_samples"]) * data["sample_bytes"] * 0.1
            assert row["samples_per_s"] > 0 and row["process_bytes"] >= 0.9 * distinct  # evicted: read from disk
        for row in data["rows"][1::2]:  # the loaders: img/s from the first batch on (NOTE [first batch apart])
            assert 0 < row["first_batch_seconds"] < row["seconds"] and row["end_to_end_samples_per_s"] > 0
        for row in data["rows"][1::2]:
            assert 1 <= row["classes_per_batch"] <= min(scale.BATCH, 61) and row["order"]["shuffle"] == row["shuffle"]
            assert row["process_bytes"] <= row["disk_bytes"] * 1.01  # the device counts every process
        assert [row["warm"] for row in data["cached"]] == ([True, True] if data["storage"] == "jpeg" else [])
        for row in data["cached"]:  # the same files as the disk rows, every page cached (NOTE [cached baseline])
            assert row["path"] == data["rows"][1]["path"] and row["resident_after"] > 0.99


@pytest.mark.slow
def test_every_world_size_and_worker_count_sees_the_same_global_batches(section):
    rows = section["ddp"]
    assert [(row["world_size"], row["num_workers"]) for row in rows] == list(SMALL["scale_world_sizes"])
    assert all(not row["hang"] and row["same_as_first"] for row in rows)
    assert len({row["steps_per_epoch"] for row in rows}) == 1
    for row in rows:
        assert len(row["ranks"]) == row["world_size"]
        assert {rank["steps"] for rank in row["ranks"]} == {row["steps_per_epoch"] * SMALL["scale_epochs"]}


@pytest.mark.slow
def test_resume_lands_on_the_order_s_batch_with_a_small_state(section):
    orders = [row for row in section["order"] if row["what"] == "order"]
    assert len(orders) == 2 * len(SMALL["scale_order_samples"])
    assert all(row["resumed_batch_right"] and row["state_bytes"] < 1024 and row["resume_seconds"] > 0
               for row in orders)
    permutation = section["order"][-1]
    assert permutation["what"] == "permutation" and permutation["peak_bytes"] >= 8 * 10**6


@pytest.mark.slow
def test_targets_are_finite_and_the_report_renders_them(section):
    targets = [report.finish(t, "scale") for t in section["targets"]]
    assert len(targets) >= 10
    assert all(math.isfinite(t["value"]) and isinstance(t["pass"], bool) for t in targets)
    text = section["text"]
    assert text.startswith("## Scale") and "| read" in text and "| ranks" in text and "| order" in text
