"""The images section's measurement of iterations left early: fresh epochs against epochs after them."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks.sections import images  # noqa: E402
from fastdata import open_dataset  # noqa: E402


def test_epochs_after_iterations_left_early_are_timed_in_turn_with_a_fresh_loader(packed_files, monkeypatch):
    monkeypatch.setattr(images, "ABANDONED_ITERATIONS", 5)
    path = packed_files("hdf5", "raw")
    count = len(open_dataset(path))
    setup = {"files": {"hdf5-raw": str(path)}, "num_samples": count, "batch_size": 256, "workers": 2,
             "paired_rounds": 2, "min_seconds": 0.01}
    result = images.measure_abandoned(setup)
    assert result["iterations"] == 5 and result["left_after"] == images.ABANDON_AFTER == 2
    assert result["batch_size"] == count // 4  # a loop has batches left to abandon
    assert set(result["rates"]) == set(result["first_epoch"]) == {"fresh", "after"}
    assert len(result["ratios"]) == 2 and all(rate > 0 for rate in result["rates"]["after"])
    target = images.summarize_abandoned(result)
    assert target["threshold"] == images.ABANDONED_VS_FRESH and "samples/s" in target["info"]
    assert "left after 2 batches" in images.abandoned_text(result)
