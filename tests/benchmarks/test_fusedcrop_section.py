"""The fused-crop section of the benchmark suite, run small: real rates of real jpeg files, no speed asserted."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import fusedcrop  # noqa: E402
from fastdata.formats import read_packed  # noqa: E402

pytestmark = pytest.mark.integration  # benchmark sections in fresh processes


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return {"quick": True, "batch_size": 16, "min_seconds": 0.01, "seed": 0,
            "workdir": str(tmp_path_factory.mktemp("work"))}


@pytest.fixture(scope="module")
def section(config):
    with FreshProcesses() as fresh:
        return fusedcrop.run(config, fresh)


def test_every_case_and_method_has_a_positive_rate_per_round(section):
    keys = [(row["stored"], row["output"], row["threads"], row["method"]) for row in section["rows"]]
    threads = sorted({row["threads"] for row in section["rows"]})
    assert threads[0] == 1 and len(keys) == len(set(keys))
    assert set(keys) == {(s, o, t, m) for s in fusedcrop.STORED_SIZES for o in fusedcrop.OUTPUT_SIZES
                         for t in threads for m in fusedcrop.METHODS}
    for row in section["rows"]:
        assert len(row["rates"]) == 1 and all(rate > 0 for rate in row["rates"])  # --quick: one round
        assert row["samples_per_s"] == row["rates"][0] and row["num_samples"] == 32


def test_the_speedup_is_the_ratio_of_cpu_times_at_one_thread_and_of_rates_on_more(section):
    rows = {(r["stored"], r["output"], r["threads"], r["method"]): r for r in section["rows"]}
    assert len(section["pairs"]) == len(rows) // len(fusedcrop.METHODS)
    for pair in section["pairs"]:
        key = (pair["stored"], pair["output"], pair["threads"])
        fused, full = rows[(*key, "fused")], rows[(*key, "decode, then crop")]
        assert pair["fused"] == fused["samples_per_s"]
        assert pair["read_batch"] == rows[(*key, "read_batch(crop=)")]["samples_per_s"]
        assert pair["wall_speedup"] == pytest.approx(fused["samples_per_s"] / full["samples_per_s"])
        if pair["threads"] == 1:
            assert fused["cpu_ms"] > 0 and full["cpu_ms"] > 0
            assert pair["speedup"] == pytest.approx(full["cpu_ms"] / fused["cpu_ms"])
        else:
            assert fused["cpu_ms"] is None and pair["speedup"] == pair["wall_speedup"]


def test_bigger_stored_images_and_smaller_outputs_decode_at_smaller_scales(section):
    scale = {(p["stored"], p["output"]): p["mean_scale"] for p in section["pairs"]}
    assert all(0.125 <= value <= 1 for value in scale.values())
    assert scale[512, 112] < scale[512, 224] and scale[512, 112] < scale[256, 112] < scale[256, 224]
    assert scale[512, 224] < scale[256, 224]


def test_targets_and_table_name_every_case(section):
    one_thread = [p for p in section["pairs"] if p["threads"] == 1]
    assert len(one_thread) == len(fusedcrop.STORED_SIZES) * len(fusedcrop.OUTPUT_SIZES)
    reduced = [p for p in one_thread if p["mean_scale"] < fusedcrop.REDUCED_SCALE]  # the others: equal work
    assert reduced and [t["value"] for t in section["targets"]] == [p["speedup"] for p in reduced]
    assert all(t["at_least"] and t["threshold"] == fusedcrop.FUSED_VS_FULL for t in section["targets"])
    lines = section["table"].splitlines()
    assert len(lines) == 2 + len(section["pairs"]) and "fused CPU ms/img" in lines[0]


def test_the_packed_files_are_made_once_by_the_converter(section, config):
    for stored in fusedcrop.STORED_SIZES:
        path = fusedcrop.jpeg_file(config, stored)
        metadata = read_packed(path)[1]
        assert metadata["storage"] == "jpeg" and metadata["sample_shape"] == [3, stored, stored]
        made = os.stat(path).st_mtime_ns
        assert fusedcrop.jpeg_file(config, stored) == path and os.stat(path).st_mtime_ns == made  # cached
