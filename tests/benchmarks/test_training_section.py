"""The training section of the benchmark suite, run quick: the example's loop over a folder and packed files."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks import report  # noqa: E402
from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import training  # noqa: E402
from fastdata import open_dataset  # noqa: E402
from fastdata.measure.baselines import load_resized  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # the quick section runs once for the module: ~24 s idle, ~55 s on a busy machine
    pytest.mark.integration,  # benchmark sections in fresh processes
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("work"))


@pytest.fixture(scope="module")
def section(workdir):
    with FreshProcesses() as fresh:
        return training.run({"quick": True, "workdir": workdir, "seed": 0}, fresh)


def test_every_row_ran_the_same_steps_and_has_positive_figures(section):
    assert [row["kind"] for row in section["rows"]] == ["memory", "folder", "folder", "packed", "packed"]
    assert section["steps"] == training.STEPS // 10 and section["num_images"] == training.IMAGES // 10
    for row in section["rows"]:
        assert row["steps"] == section["steps"] and row["batch_size"] == training.BATCH_SIZE
        assert row["samples_per_s"] > 0 and row["seconds"] > 0 and row["body_seconds"] > 0
        assert 0 <= row["data_wait"] < 1 and row["wait_seconds"] >= 0 and np.isfinite(row["loss"])


def test_the_target_table_and_text_report_the_rows(section):
    (target,) = [report.finish(t, "training") for t in section["targets"]]
    folder = max(row["samples_per_s"] for row in section["rows"][1:3])
    assert target["value"] == pytest.approx(section["rows"][3]["samples_per_s"] / folder)
    assert target["threshold"] == training.PACKED_VS_FOLDER_MIN and isinstance(target["pass"], bool)
    assert section["text"].startswith("## Training example") and section["table"] in section["text"]
    for row in section["rows"]:
        assert row["key"] in section["table"]


def test_the_data_is_made_once_and_the_packed_files_hold_the_shapes(section, workdir):
    root, files = training.prepare(workdir, section["num_images"], 0)  # cached: nothing is made again
    stamps = {path: os.path.getmtime(path) for path in files.values()}
    assert training.prepare(workdir, section["num_images"], 0) == (root, files)
    assert {path: os.path.getmtime(path) for path in files.values()} == stamps
    for storage, path in files.items():
        dataset = open_dataset(path)
        assert dataset.storage == storage and len(dataset) == section["num_images"]
        assert dataset.sample_shape == (3, training.SIZE, training.SIZE) and len(dataset.classes) == 10


def test_a_folder_sample_is_a_shifted_maybe_flipped_normalized_crop(section, workdir):
    root, _ = training.prepare(workdir, section["num_images"], 0)
    path = os.path.join(root, sorted(os.listdir(root))[3], sorted(os.listdir(os.path.join(root, sorted(
        os.listdir(root))[3])))[0])
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    samples = training.FolderSamples([path], [3], training.SIZE, mean, std)
    pad = training.PADDING
    reference = torch.nn.functional.pad(torch.from_numpy(load_resized(path, training.SIZE)).permute(2, 0, 1),
                                        (pad,) * 4)
    torch.manual_seed(0)
    for _ in range(6):
        image, label = samples[0]
        assert label == 3 and image.shape == (3, training.SIZE, training.SIZE) and image.dtype == torch.float32
        pixels = torch.round((image * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)) * 255)
        crops = [reference[:, top:top + training.SIZE, left:left + training.SIZE].float()
                 for top in range(2 * pad + 1) for left in range(2 * pad + 1)]
        assert any(torch.equal(pixels, crop) or torch.equal(pixels, crop.flip(2)) for crop in crops)
