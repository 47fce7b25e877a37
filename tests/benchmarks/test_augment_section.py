"""The augmentation section of the benchmark suite, run small: every row measured, the report renders."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks import report  # noqa: E402
from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import augment  # noqa: E402


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    config = {"quick": True, "batch_size": 256, "repeats": 1, "min_seconds": 0.01, "seed": 0,
              "workdir": str(tmp_path_factory.mktemp("work"))}
    with FreshProcesses() as fresh:
        return augment.run(config, fresh)


@pytest.mark.slow
def test_every_recipe_has_every_row_measured(section):
    expected = [(name, kind, threads) for name, _, _ in augment.QUICK_RECIPES for kind, threads in augment.kinds()]
    assert [(row["recipe"], row["kind"], row["threads"]) for row in section["rows"]] == expected
    assert {kind for _, kind, _ in expected} == {"eval", "batched", "per-sample"}
    for row in section["rows"]:
        assert row["batch_size"] == section["batch_size"] == augment.QUICK_BATCH and row["batches"] >= 1
        assert row["samples_per_s"] > 0 and row["batch_ms"] > 0 and row["cpu_ms"] > 0
        assert row["samples_per_s"] == pytest.approx(row["batch_size"] / row["batch_ms"] * 1e3)


def test_targets_are_finite_ratios_and_the_text_holds_the_table(section):
    targets = [report.finish(t, "augment") for t in section["targets"]]
    assert len(targets) == len(augment.QUICK_RECIPES)
    assert all(math.isfinite(t["value"]) and t["value"] > 0 and isinstance(t["pass"], bool) for t in targets)
    text = section["text"]
    assert text.startswith("## Augmentation") and "| recipe" in text and text.count("per-sample") >= 2


@pytest.mark.parametrize("recipe", augment.RECIPES[:2], ids=lambda recipe: recipe[0])
@pytest.mark.slow
def test_the_per_sample_and_batched_rows_do_the_same_work(recipe):
    # On a constant image every crop, resize and flip gives the same pixels: both rows must give its normalized value
    name, stored, size = recipe
    images = torch.full((5, 3, stored, stored), 200, dtype=torch.uint8)
    indices = np.arange(5)
    expected = ((200 / 255 - torch.tensor(augment.MEAN)) / torch.tensor(augment.STD)).view(1, 3, 1, 1)
    for kind in ("eval", "batched", "per-sample"):
        out = augment.pipeline_of(name, kind, size)(images, indices, 1, 0)
        assert out.shape == (5, 3, size, size) and out.dtype == torch.float32
        if name != "cifar" or kind == "eval":  # the CIFAR crop pads with zeros
            torch.testing.assert_close(out, expected.expand_as(out), rtol=0, atol=1e-4)


def test_the_per_sample_boxes_lie_inside_the_image():
    import random

    draws = random.Random(0)
    for height, width in ((80, 80), (256, 256), (20, 300)):
        for _ in range(200):
            top, left, h, w = augment.get_params(height, width, (0.08, 1.0), (3 / 4, 4 / 3), draws)
            assert 0 <= top <= top + h <= height and 0 <= left <= left + w <= width and h > 0 and w > 0
