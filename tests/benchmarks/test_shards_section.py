"""The shards section of the benchmark suite, run small: its rows are real measurements of real shard folders."""

import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks import report  # noqa: E402
from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import shards  # noqa: E402
from fastdata.formats.shards import read_index  # noqa: E402

pytest.importorskip("psutil")
pytestmark = [
    pytest.mark.slow,  # the section runs once for the module: ~50 s of subprocesses (2 Dask clusters, LitData)
    pytest.mark.integration,  # benchmark sections in fresh processes
]


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    config = {"quick": True, "shard_images": 150, "shard_compare": 100, "batch_size": 32, "repeats": 1,
              "process_repeats": 1, "min_seconds": 0.01, "seed": 0, "workers": 2,
              "workdir": str(tmp_path_factory.mktemp("work"))}
    with FreshProcesses() as fresh:
        return shards.run(config, fresh)


def written(section):
    """Return the rows of the shard folders written and watched."""
    return [row for row in section["conversions"] if "disk" in row and row["key"] != shards.SINGLE]


def test_every_conversion_keeps_every_image_and_is_timed(section):
    rows = [row for row in section["conversions"] if "skipped" not in row]
    assert {row["engine"] for row in rows} >= {"pool", "local"}
    for row in rows:
        assert row["num_samples"] == row["num_images"] and row["seconds"] > 0
        assert row["images_per_s"] == pytest.approx(row["num_samples"] / row["seconds"])


def test_the_pool_and_fastdata_are_timed_in_alternating_rounds_over_every_image(section):
    for storage in ("raw", "jpeg"):
        pair = section["pairs"][storage]
        assert len(pair["ratios"]) == len(pair["pool"]) == len(pair["ours"]) >= 1
        for who in ("pool", "ours"):
            assert pair["num_samples"][who] == [section["compare_source"]["num_images"]] * len(pair["ratios"])
            assert pair[who] == pytest.approx([n / s for n, s in zip(pair["num_samples"][who], pair["seconds"][who])])
        assert pair["ratios"] == pytest.approx([ours / pool for ours, pool in zip(pair["ours"], pair["pool"])])


def test_shard_sizes_add_up_to_the_folder_and_the_peak_is_at_least_the_final_size(section):
    for row in written(section):
        index = read_index(row["out"])
        on_disk = [os.path.getsize(os.path.join(row["out"], name)) for name in index.names]
        assert row["shard_bytes"] == sum(on_disk) == sum(index.sizes) and row["num_shards"] == len(on_disk)
        assert row["final_bytes"] > row["shard_bytes"]  # plus index.json
        assert row["disk"] >= row["final_disk"] > 0 and row["disk_bytes"] >= row["final_bytes"]
        assert row["peak_disk_ratio"] >= 1 and row["readings"] >= 2


def test_the_single_file_row_holds_the_same_images_in_one_file(section):
    row = next(row for row in section["conversions"] if row["key"] == shards.SINGLE)
    assert row["out"].endswith(".h5") and row["shard_bytes"] == os.path.getsize(row["out"])
    assert row["num_samples"] == section["compare_source"]["num_images"] and row["disk"] >= row["final_disk"] > 0


def test_the_small_shards_are_byte_identical_across_processes_and_engines(section):
    compared = [row for row in written(section) if row["shard_size"]]
    assert len(compared) >= 4 and all(row["identical"] for row in compared)
    assert all(row["num_shards"] > 2 for row in compared)


def test_rss_is_read_from_the_driver_and_its_workers(section):
    for row in written(section):
        # peaks of separate readings: the driver's may come after its workers ended, so only each bounds the total
        assert row["driver_rss"] > 10 << 20 and row["total_rss"] >= max(row["driver_rss"], row["worker_rss"])
        if row["engine"] == "local" and row["workers"] == 2 and row["num_shards"] > 1:
            assert row["descendants"] >= 2 and row["worker_rss"] > 10 << 20


def test_resume_after_a_kill_keeps_the_shards_written_and_ends_equal(section):
    resume = section["resume"]
    assert resume["kill_at"] <= resume["shards_at_kill"] < resume["num_shards"]
    assert resume["same_as_full_run"] and 0 < resume["resume_seconds"] and 0 < resume["full_seconds"]
    assert resume["resume_vs_full"] == pytest.approx(resume["resume_seconds"] / resume["full_seconds"])


def test_loading_rows_are_measured_over_every_sample(section):
    keys = [row["key"] for row in section["loading"]]
    assert keys == ["single_file", "shard_folder", "copy_prealloc", "copy_fresh", "copy_two_threads"]
    for row in section["loading"]:
        assert row["samples_per_s"] > 0 and row["samples_per_pass"] % section["compare_source"]["num_images"] == 0


def test_sample_size_rows_time_the_loader_a_read_and_the_limit_on_converted_files(section):
    rows = section["sample_sizes"]
    assert [row["size"] for row in rows] == list(shards.SAMPLE_SIZES)
    compare = section["compare_source"]["num_images"]
    for row in rows:
        assert row["path"].endswith(".h5") and row["sample_bytes"] == 3 * row["size"] ** 2
        assert row["num_samples"] == (shards.SIZES_SOURCE * compare if row["size"] == 32 else compare)
        rates = row["rates"]
        assert set(rates) == {"loader", "read", "copy"}
        assert len(rates["loader"]) == len(rates["read"]) == len(rates["copy"]) >= 2
        assert all(rate > 0 for values in rates.values() for rate in values)
        assert row["vs_read"] == pytest.approx([a / b for a, b in zip(rates["loader"], rates["read"])])
        assert row["vs_copy"] == pytest.approx([a / b for a, b in zip(rates["loader"], rates["copy"])])
    names = [t["name"] for t in section["targets"]]
    for size in shards.SAMPLE_SIZES:
        assert f"raw {size}px one file, make_loader defaults vs batched memmap read" in names
        assert f"raw {size}px one file, make_loader defaults vs memcpy limit" in names


def test_peers_are_measured_or_say_why_not(section):
    for row in section["peers"]:
        assert row.get("skipped") or (row["images_per_s"] > 0 and row["final_bytes"] > 0)
    litdata = section["peers"][0]
    if litdata["version"]:  # installed: every image stored
        out = os.path.join(section["compare_source"]["root"], os.pardir, "out", f"{litdata['num_images']}-litdata")
        assert "skipped" not in litdata and shards._litdata_samples(out) == litdata["num_images"]


def test_targets_are_finite_ratios_and_the_report_renders_them(section):
    targets = [report.finish(t, "shards") for t in section["targets"]]
    assert len(targets) >= 8 + 2 * len(shards.SAMPLE_SIZES)
    assert all(math.isfinite(t["value"]) and t["value"] > 0 and isinstance(t["pass"], bool) for t in targets)
    text = section["text"]
    assert text.startswith("## Shards") and "| conversion" in text and "Resume:" in text and "| loading" in text
    assert "| raw, one .h5 file" in text


@pytest.mark.skipif(shards.installed_version("litdata") is None, reason="litdata is not installed")
def test_a_peer_that_fails_is_a_row_saying_so(tmp_path):
    (tmp_path / "out").mkdir()
    row = shards.litdata_row({"root": str(tmp_path / "missing"), "num_images": 3}, str(tmp_path), 1 << 20)
    assert row["skipped"].startswith("failed (1, 0 samples written)") and "SourceError" in row["skipped"]
