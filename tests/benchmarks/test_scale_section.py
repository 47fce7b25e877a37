"""The scale section of the benchmark suite, run small: converted folders, bounded-cache rows, DDP groups, resume."""

import hashlib
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
from fastdata.formats.shards import read_index  # noqa: E402
from fastdata.measure.pagecache import cgroup_problem  # noqa: E402
from fastdata.verify import verify  # noqa: E402

pytestmark = pytest.mark.integration  # benchmark sections in fresh processes

SMALL = {"quick": True, "seed": 0, "scale_raw_images": 700, "scale_jpeg_images": 300, "scale_classes": 20,
         "scale_distinct": 61, "scale_shard_bytes": 1 << 20, "scale_folders": scale.QUICK["scale_folders"],
         "scale_ddp_images": 61, "scale_ddp_shard_bytes": 256 << 10, "scale_cache_limit": 1 << 30,
         "scale_seconds": 0.5, "scale_order_samples": (10**5, 10**6), "scale_world_sizes": ((1, 0), (2, 0), (3, 1)),
         "scale_epochs": 2}
FOLDERS = ["raw-hdf5", "raw-arrow", "jpeg-hdf5", "jpeg-arrow"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("work"))


@pytest.fixture(scope="module")
def data(workdir):
    return scale.datasets(os.path.join(workdir, "scale"), scale.settings(SMALL), 0)


def test_every_folder_is_converter_output_of_several_shards_of_varied_photos_sorted_by_class(data):
    assert list(data) == [*FOLDERS, "ddp"]
    for key in FOLDERS:
        facts, storage = data[key], key.split("-")[0]
        dataset, index = open_dataset(facts["path"]), read_index(facts["path"])
        assert len(dataset) == facts["num_samples"] == SMALL[f"scale_{storage}_images"]
        assert index.num_shards == facts["num_shards"] > 1 and facts["paths"] == dataset.shard_paths
        assert index.settings["source"] == facts["source"] and index.settings["format"] == key.split("-")[1]
        labels = dataset.labels  # an ImageFolder converts in class order
        assert np.all(np.diff(labels) >= 0) and len(np.unique(labels)) == SMALL["scale_classes"]
        assert dataset.metadata["class_counts"] == np.bincount(labels).tolist()
        images = dataset.read_batch(np.arange(len(dataset)))[0].numpy()
        digests = {hashlib.blake2b(image.tobytes(), digest_size=8).digest() for image in images}
        assert len(digests) == SMALL["scale_distinct"]  # each linked photo decoded and resized, none alike
        assert verify(facts["path"]).ok, verify(facts["path"]).problems
    assert data["ddp"]["num_samples"] == SMALL["scale_ddp_images"] and data["ddp"]["num_shards"] > 1


def test_converted_folders_are_made_once(data, workdir):
    again = scale.datasets(os.path.join(workdir, "scale"), scale.settings(SMALL), 0)
    assert all(again[key]["convert_seconds"] is None and again[key]["path"] == data[key]["path"] for key in again)


def test_the_window_target_fails_when_a_block_row_past_its_first_window_was_not_read_from_windows():
    order = {"shuffle": "block", "block_size": 21, "window": 1024}  # 84 batches of 256 a window
    block = {"shuffle": "block", "order": order, "fast_path_warnings": [],
             "read_paths": {"windows": 200, "stitched": 0, "by shard": 84, "one file": 0}}
    passed = report.finish(scale.window_target("t", block), "scale")
    assert passed["pass"] and passed["value"] == 0 and "windows 200 of 284" in passed["info"]
    block.update(read_paths={"windows": 0, "stitched": 0, "by shard": 284, "one file": 0},
                 fast_path_warnings=["cannot"])
    failed = report.finish(scale.window_target("t", block), "scale")
    assert not failed["pass"] and failed["value"] == 200 and "FastPathWarning: cannot" in failed["info"]


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
    row = scale.ddp_run({"what": "ddp", "path": data["ddp"]["path"], "world_size": 2, "num_workers": 0,
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
    assert [(data["storage"], data["format"]) for data in section["cache"]] == list(SMALL["scale_folders"])
    for data in section["cache"]:
        rows = data["rows"] + data["cached"]
        ranks = ["ranks"] if data["storage"] == "raw" else []  # 2 ranks sharing windows (NOTE [shared windows])
        assert [row["what"] if row["what"] == "ranks" else row.get("shuffle", row["what"]) for row in data["rows"]] \
            == ["limit", "block", *ranks, "limit", "uniform", "random"]
        assert not [row["skipped"] for row in rows if "skipped" in row]
        for row in data["rows"]:
            assert row["drop"]["method"] and row["drop"]["resident_after"] < 0.01
            assert row["cgroup"]["max_usage"] <= row["cgroup"]["limit"] == SMALL["scale_cache_limit"]
            distinct = min(row.get("samples", data["num_samples"]), data["num_samples"]) * data["sample_bytes"]
            if row["what"] == "random":  # offsets at random: some read twice (cached), so only some bytes
                distinct = min(row["reads"], data["num_samples"]) * data["sample_bytes"] * 0.1
            # evicted: read from disk (by the ranks' processes, or before they counted: the device's bytes)
            read = row["disk_bytes"] if row["what"] == "ranks" else row["process_bytes"]
            assert row["samples_per_s"] > 0 and read >= 0.9 * distinct
        for row in loader_rows(data):  # img/s from the first batch on (NOTE [first batch apart])
            assert 0 < row["first_batch_seconds"] and 0 < row["seconds"]
            assert row["what"] == "ranks" or (row["first_batch_seconds"] < row["seconds"]
                                              and row["end_to_end_samples_per_s"] > 0)
            assert 1 <= row["classes_per_batch"] <= min(scale.BATCH, SMALL["scale_classes"])
            assert row["order"]["shuffle"] == row["shuffle"]
            assert row["process_bytes"] <= row["disk_bytes"] * 1.01  # the device counts every process
        assert [row["warm"] for row in data["cached"]] == ([True, True] if data["storage"] == "jpeg" else [])
        for row in data["cached"]:  # the same files as the disk rows, every page cached (NOTE [cached baseline])
            assert row["path"] == data["rows"][1]["path"] and row["resident_after"] > 0.99


@pytest.mark.slow
@pytest.mark.skipif(cgroup_problem() is not None, reason=f"no memory cgroup: {cgroup_problem()}")
def test_every_loader_row_counts_its_batches_by_read_path_and_takes_the_fast_one(section):
    # The small folders fit in the cgroup, so no window is read: a raw batch is one take from the stitched rows of
    # the shards (offsets as the converter wrote them), a jpeg batch a take per shard; no fast path gave up.
    for data in section["cache"]:
        for row in [*loader_rows(data), *data["cached"]]:
            paths = row["read_paths"]
            assert set(paths) == {"windows", "stitched", "by shard", "one file"}
            assert sum(paths.values()) >= row["batches"] > 0 and row["fast_path_warnings"] == []
            fast = "stitched" if data["storage"] == "raw" else "by shard"
            assert paths[fast] == sum(paths.values()), (data["storage"], data["format"], row["shuffle"], paths)
            assert f"{fast} {paths[fast]:,}/{paths[fast]:,}" in section["text"]


def loader_rows(data):
    """The rows of ``data`` that a loader read: one process's, and the ranks' sharing windows."""
    return [row for row in data["rows"] if row["what"] in ("loader", "ranks")]


@pytest.mark.slow
def test_every_world_size_and_worker_count_sees_the_same_global_batches(section):
    rows = section["ddp"]
    assert [(row["world_size"], row["num_workers"]) for row in rows] == list(SMALL["scale_world_sizes"])
    assert all(not row["hang"] and row["same_as_first"] for row in rows)
    assert len({row["steps_per_epoch"] for row in rows}) == 1
    for row in rows:
        assert len(row["ranks"]) == row["world_size"] and row["path"] == section["data"]["ddp"]["path"]
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
    assert "| read paths" in text and "written by fastdata convert" in text
    assert not [t for t in targets if "first window" in t["name"]]  # the small folders fit: no windows to read
