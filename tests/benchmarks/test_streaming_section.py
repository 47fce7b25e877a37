"""The streaming section of the benchmark suite, run small: a real S3 server, a real proxy, every sample read."""

import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks import report  # noqa: E402
from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import streaming  # noqa: E402
from fastdata.formats.shards import read_index  # noqa: E402

_name = streaming._name

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
pytestmark = [
    pytest.mark.slow,  # the section runs once for the module: ~40 s (moto, two proxies, a fresh process)
    pytest.mark.integration,  # benchmark sections in fresh processes
]


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    config = {"quick": True, "stream_images": 160, "batch_size": 16, "process_repeats": 1, "min_seconds": 0.01,
              "seed": 0, "workdir": str(tmp_path_factory.mktemp("work"))}
    with FreshProcesses() as fresh:
        return streaming.run(config, fresh)


def test_both_shard_folders_hold_every_image_in_enough_shards(section):
    for kind in streaming.KINDS:
        folder = section["folders"][kind]
        index = read_index(folder["path"])
        assert (folder["size"], folder["storage"]) == streaming.KINDS[kind]
        assert index.num_samples == folder["num_samples"] == section["source"]["num_images"] == 160
        assert index.num_shards == folder["num_shards"] >= streaming.MIN_SHARDS
        assert folder["largest_shard"] == max(index.sizes) and folder["sample_bytes"] > 0


def test_every_row_is_measured_through_the_proxies(section):
    rows = section["rows"]
    plain = [(row["kind"], row["latency"]) for row in rows if row["cache_shards"] is None]
    kinds = [*streaming.KINDS, *([streaming.LITDATA] if "skipped" not in section["peers"][0] else [])]
    assert plain == [(kind, latency) for kind in kinds for latency in streaming.LATENCIES]
    assert [row["cache_shards"] for row in rows if row["cache_shards"]] == list(streaming.CACHE_SHARDS)
    assert not [(_name(row), row["failed"]) for row in rows if row["failed"]]
    for row in rows:
        assert row["completed"] == row["rounds"] == 1
        for key in ("local_samples_per_s", "epoch1_samples_per_s", "epoch1_after_first_samples_per_s",
                    "epoch2_samples_per_s", "first_batch_seconds", "data_rate", "link_rate", "peak_cache_bytes"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    folders = section["folders"]
    for row in rows:  # an unlimited cache ends holding the whole folder; a limited one less
        if row["cache_shards"] is None:
            assert row["peak_cache_bytes"] >= folders[row["kind"]]["bytes"]
        else:
            assert row["cache_limit"] == row["cache_shards"] * folders[row["kind"]]["largest_shard"]
    assert set(section["proxy_requests"]) == set(streaming.LATENCIES)
    assert all(count >= 2 * streaming.MIN_SHARDS for count in section["proxy_requests"].values())


def test_the_cache_folders_are_removed(section):
    caches = os.path.join(os.path.dirname(section["folders"]["raw"]["path"]), os.pardir, "caches")
    assert not os.path.exists(caches) or not os.listdir(caches)


def test_targets_are_finite_and_the_report_renders_them(section):
    targets = [report.finish(t, "streaming") for t in section["targets"]]
    names = [t["name"] for t in targets]
    assert sum("epoch 2 vs local" in name for name in names) == 2 * len(streaming.LATENCIES)
    assert sum("first batch" in name for name in names) == 2 * len(streaming.LATENCIES)
    assert sum("peak cache" in name for name in names) == len(streaming.CACHE_SHARDS)
    assert all(math.isfinite(t["value"]) and t["value"] >= 0 and isinstance(t["pass"], bool) for t in targets)
    assert all(t["value"] > 0 for t in targets if "rounds that read" not in t["name"])  # that one: 0 of 1 rounds
    text = section["text"]
    assert text.startswith("## Streaming") and "| shards" in text and "| other tool" in text
    assert [row["tool"] for row in section["peers"]] == ["LitData StreamingDataset", "Mosaic StreamingDataset"]
