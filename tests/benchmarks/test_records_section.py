"""The records section of the benchmark suite, run small: every reader measured over the same stored records."""

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import records  # noqa: E402
from fastdata import open_dataset  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # ~40 s of fresh processes, peers and pools


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    config = {"quick": True, "num_images": 40, "batch_size": 16, "repeats": 1, "process_repeats": 1,
              "min_seconds": 0.01, "seed": 0, "workdir": str(tmp_path_factory.mktemp("work"))}
    with FreshProcesses() as fresh:
        return records.run(config, fresh)


def test_every_reader_reads_every_record_of_every_set(section):
    sets = {records.set_key(*spec) for spec in records.SETS}
    assert {row["data"] for row in section["rows"]} == sets
    for row in section["rows"]:
        assert row["samples_per_s"] > 0 and row["samples_per_pass"] % 40 == 0  # every epoch checked: 40 records
    peers = {row["tool"] for row in section["rows"]}
    assert peers == {"fastdata", "hf", "wds"}  # datasets and webdataset are installed by scripts/setup.sh


def test_the_peers_hold_the_values_fastdata_stored(section):
    import datasets

    files = section["files"][records.set_key("pairs", 64, "raw")]
    ours = open_dataset(files["fastdata"])
    hf = datasets.load_from_disk(files["hf"])
    batch = ours.read_batch(np.arange(len(ours)))
    assert hf["caption"] == batch["caption"]
    np.testing.assert_array_equal(np.asarray(hf[5]["image"], np.uint8), batch["image"][5].numpy())
    assert hf[7]["tokens"] == batch["tokens"][7, : int(batch["tokens_lengths"][7])].tolist()
    assert len(files["wds"]) == records.NUM_SHARDS


def test_targets_are_ratios_of_rows_measured_in_the_run(section):
    rate = {row["key"]: row["samples_per_s"] for row in section["rows"]}
    by_name = {target["name"]: target for target in section["targets"]}
    limit = by_name["records pairs-64-jpeg: fastdata dict batches over the decode limit, in turn"]
    (pair,) = [pair for pair in section["limits"] if pair["data"] == "pairs-64-jpeg"]
    assert len(pair["ratios"]) == len(pair["fastdata"]) == len(pair["limit"]) == 2  # quick: 2 rounds
    assert pair["ratios"] == pytest.approx([a / b for a, b in zip(pair["fastdata"], pair["limit"])])
    assert limit["value"] == pytest.approx(sum(pair["ratios"]) / 2)  # the median of two rounds
    raw = next(target for name, target in by_name.items() if name.startswith("records pairs-64-raw"))
    peers = [value for key, value in rate.items() if key.startswith("pairs-64-raw/") and "fastdata" not in key]
    assert raw["value"] == pytest.approx(rate["pairs-64-raw/fastdata"] / max(peers))
    conversion = by_name["records conversion (64 px jpeg pairs): fastdata.write over a plain Pool writing the same "
                         "columns"]
    speeds = {row["tool"]: row for row in section["conversions"]}
    assert all(row["num_records"] == 40 for row in speeds.values()) and len(speeds) == 3
    assert "| pairs-224-jpeg |" in section["text"] and conversion["threshold"] == records.VS_POOL
