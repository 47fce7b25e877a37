"""fastdata.measure: engine, baselines and `fastdata bench`; the results they report, never speed itself."""

import json
import os
import sys

import numpy as np
import pytest
import torch
from support import run_cli

from fastdata import convert_text, make_loader, open_dataset
from fastdata.codecs.tokenizers import Tokenizer
from fastdata.converters import find_images, find_texts
from fastdata.measure.baselines import PadCollate, RawFolderDataset, RawTextDataset
from fastdata.measure.bench import bench_file, format_results, results_table
from fastdata.measure.engine import consume, measure_loader, measure_rate, touch
from fastdata.measure.memory import memory_growth, process_memory, worker_pids
from fastdata.measure.synthetic import make_text_corpus

QUICK = {"repeats": 1, "min_seconds": 0.01}


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A 2 x 6 review folder and its .h5 file (read-only)."""
    folder = tmp_path_factory.mktemp("bench-texts")
    root = os.path.join(make_text_corpus(folder / "reviews", per_class=6), "train")
    path = folder / "reviews.h5"
    convert_text(root, path, workers=1, progress=False)
    return root, path


def one_error_line(result):
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert lines[-1].startswith("Error: ") and "Traceback" not in result.output, result.output
    return lines[-1]


# ---------------------------------------------------------------- measuring


class Epochs:
    """An iterable of ``(tensor [B, 2], labels)`` batches; the epoch sizes come from a list."""

    def __init__(self, sizes):
        self.sizes, self.epochs = list(sizes), 0

    def __iter__(self):
        size = self.sizes[min(self.epochs, len(self.sizes) - 1)]
        self.epochs += 1
        for start in range(0, size, 4):
            count = min(4, size - start)
            yield torch.zeros(count, 2), torch.zeros(count, dtype=torch.int64)


def test_measure_loader_counts_whole_epochs():
    loader = Epochs([10])
    rate = measure_loader(lambda: loader, repeats=2, min_seconds=0.001, expected=10)
    assert rate.samples_per_pass == 10 * rate.epochs_per_pass
    assert len(rate.pass_rates) == 2 and rate.samples_per_s == np.median(rate.pass_rates)
    assert loader.epochs == 1 + (rate.warmup_seconds < 0.001) + 2 * rate.epochs_per_pass
    json.dumps(rate.to_dict())


def test_measure_loader_fails_on_a_changing_epoch():
    with pytest.raises(RuntimeError, match="consumed 9 samples, expected 10"):
        measure_loader(lambda: Epochs([10, 9]), repeats=1, min_seconds=0)


def test_measure_loader_fails_on_the_wrong_epoch_size():
    with pytest.raises(RuntimeError, match="expected 12"):
        measure_loader(lambda: Epochs([10]), repeats=1, min_seconds=0, expected=12)


def test_measure_rate_stops_passes_after_max_seconds():
    rate = measure_rate(lambda: 5, repeats=50, min_seconds=0.001, max_seconds=0)
    assert len(rate.pass_rates) == 1


@pytest.mark.parametrize("batch", [(torch.ones(3, 2), torch.ones(3)), [torch.ones(3, 2)], torch.ones(3, 2)])
def test_consume_counts_the_first_tensor(batch):
    assert consume([batch, batch]) == 6


def test_consume_counts_a_dict_batch_by_key():
    batch = {"label": torch.ones(5), "image": torch.ones(3, 2)}
    assert consume([batch, batch], key="image") == 6


# ---------------------------------------------------------------- memory


def test_process_memory_of_this_process():
    memory = process_memory(os.getpid())
    assert memory["uss"] > 0 and memory["rss"] >= memory["uss"]


def test_memory_growth_subtracts_per_worker():
    before = [{"pid": 1, "uss": 10, "pss": 20, "rss": 30, "private_dirty": 5}]
    after = [{"pid": 1, "uss": 14, "pss": 26, "rss": 30, "private_dirty": 7}]
    growth = memory_growth(before, after)
    assert growth["workers"][0]["uss_growth"] == 4 and growth["workers"][0]["private_dirty_growth"] == 2
    assert growth["mean_pss"] == 26 and growth["mean_pss_growth"] == 6
    assert memory_growth([], [])["mean_uss"] is None


def test_worker_memory_is_recorded_and_workers_stop(small_photos):
    dataset = open_dataset(small_photos[1]["raw"])
    made = []

    def build():
        made.append(make_loader(dataset, 4, num_workers=1, multiprocessing_context="fork"))
        return made[-1]

    rate = measure_loader(build, memory=True, expected=len(dataset), **QUICK)
    (worker,) = rate.worker_memory["workers"]
    assert worker["uss"] > 0 and "uss_growth" in worker
    assert worker_pids(made[0]) == []  # persistent workers were shut down


# ---------------------------------------------------------------- baselines


def test_raw_folder_dataset_items(small_photos):
    root, _ = small_photos
    _, paths, labels = find_images(root)
    dataset = RawFolderDataset([os.path.join(root, p) for p in paths], labels, 16)
    image, label = dataset[7]
    assert image.shape == (3, 16, 16) and image.dtype == torch.uint8 and label == labels[7]


def test_raw_text_dataset_reads_what_the_packed_file_holds(texts):
    root, path = texts
    _, paths, labels = find_texts(root)
    raw = RawTextDataset([os.path.join(root, p) for p in paths], labels, Tokenizer.from_file(path))
    packed = open_dataset(path)
    for index in (0, 5, 11):
        assert torch.equal(raw[index][0], packed[index][0]) and raw[index][1] == packed[index][1]


def test_pad_collate():
    ids, lengths, labels = PadCollate(0)([(torch.tensor([5, 6, 7]), 1), (torch.tensor([8]), 0)])
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and lengths.tolist() == [3, 1] and labels.tolist() == [1, 0]


# ---------------------------------------------------------------- bench_file


@pytest.mark.parametrize("storage, limit", [("raw", "copy_limit"), ("jpeg", "decode_limit")])
def test_bench_file_rows(small_photos, storage, limit):
    path = small_photos[1][storage]
    results = bench_file(path, batch_size=4, workers=(0, 1), **QUICK)
    fmt = "hdf5" if storage == "raw" else "arrow"
    keys = [row["key"] for row in results["rows"]]
    assert keys == [f"{fmt}-{storage}", f"{fmt}-{storage}_workers1", "per_item", limit]
    assert all(row["samples_per_s"] > 0 for row in results["rows"])
    assert results["reference"] == "per_item" and results["limit"] == limit
    assert results["rows"][-1]["fraction_of_limit"] == 1.0
    assert results["rows"][1]["worker_memory"]["workers"]
    read = results["rows"][0]["read_paths"]  # the 0-worker loader's batches, by the way they were read
    assert read["one file"] >= 3 and sum(read.values()) == read["one file"]
    assert all("read_paths" not in row for row in results["rows"][1:])  # workers count in their own processes
    assert json.loads(json.dumps(results))["num_samples"] == 12
    table = results_table(results)
    assert table.startswith("| method") and len(table.splitlines()) == 2 + len(keys)
    assert "= LIMIT" in format_results(results)


def test_bench_file_on_text_has_no_limit_row(texts):
    results = bench_file(texts[1], batch_size=4, workers=(0,), **QUICK)
    assert [row["key"] for row in results["rows"]] == ["hdf5-tokens", "per_item"]
    assert results["limit"] is None and results["kind"] == "text"


# ---------------------------------------------------------------- fastdata bench


@pytest.mark.slow
def test_cli_bench_image_folder_writes_json_and_plot(small_photos, tmp_path):
    pytest.importorskip("matplotlib")
    root, _ = small_photos
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run_cli("bench", root, "--quick", "--workers", "0,1", "--batch-size", "4", "--size", "16",
                 "--json", out, "--plot", plot, "--quiet")
    assert result.exit_code == 0, result.output
    assert "| method" in result.output and f"wrote {out}" in result.output
    results = json.loads(out.read_text())
    keys = [row["key"] for row in results["rows"]]
    assert keys[:2] == ["raw_folder", "raw_folder_workers1"] and "arrow-raw" in keys and "copy_limit" in keys
    assert results["source"] == "folder" and results["reference"] == "raw_folder" and len(results["files"]) == 2
    assert not any(os.path.exists(entry["path"]) for entry in results["files"])  # temporary files are gone
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_cli_bench_text_folder(texts):
    result = run_cli("bench", texts[0], "--quick", "--workers", "0", "--batch-size", "4", "--quiet")
    assert result.exit_code == 0, result.output
    assert "read + tokenize each .txt" in result.output and "Arrow tokens" in result.output


def test_cli_bench_packed_file(small_photos):
    result = run_cli("bench", small_photos[1]["raw"], "--quick", "--workers", "0", "--batch-size", "4", "--quiet")
    assert result.exit_code == 0, result.output
    assert "per-item DataLoader" in result.output and "memcpy limit" in result.output


@pytest.mark.parametrize("storage, limit", [("raw", "copy_limit"), ("jpeg", "decode_limit")])
def test_cli_bench_shard_folder_is_measured_as_a_packed_dataset(shard_converted, storage, limit, tmp_path):
    folder = shard_converted("hdf5", storage)
    out = tmp_path / "bench.json"
    result = run_cli("bench", folder, "--quick", "--workers", "0", "--batch-size", "4", "--quiet", "--json", out)
    assert result.exit_code == 0, result.output
    with open(out) as f:
        saved = json.load(f)
    assert [row["key"] for row in saved["rows"]] == [f"hdf5-{storage}", "per_item", limit]  # not a raw folder
    read = saved["rows"][0]["read_paths"]
    assert read["stitched" if storage == "raw" else "by shard"] == sum(read.values()) > 0, read
    assert f"{'stitched' if storage == 'raw' else 'by shard'} {sum(read.values()):,}" in result.output
    shard_bytes = sum(os.path.getsize(path) for path in open_dataset(folder).shard_paths)
    assert [entry["bytes"] for entry in saved["files"]] == [shard_bytes]


def test_cli_bench_refuses_to_overwrite_before_measuring(small_photos, tmp_path):
    out = tmp_path / "bench.json"
    out.write_text("{}")
    line = one_error_line(run_cli("bench", small_photos[1]["raw"], "--quick", "--json", out))
    assert "already exists" in line and "--overwrite" in line
    assert out.read_text() == "{}"


@pytest.mark.parametrize("workers", ["0,two", "-1", ""])
def test_cli_bench_rejects_bad_workers(small_photos, workers):
    assert "--workers should be" in one_error_line(run_cli("bench", small_photos[1]["raw"], "--workers", workers))


def test_cli_bench_rejects_other_folders(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert "neither an image folder" in one_error_line(run_cli("bench", tmp_path / "empty", "--quick"))


def test_cli_bench_plot_without_matplotlib(small_photos, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    line = one_error_line(run_cli("bench", small_photos[1]["raw"], "--quick", "--plot", tmp_path / "p.png"))
    assert "pip install 'fastdata[plot]'" in line


def test_touch_reads_the_last_element_of_any_batch_tensor():
    # consume()'s touch: through a numpy view where there is one, else torch's indexing (bfloat16, grad)
    values = torch.arange(24).reshape(2, 3, 4)
    for tensor in (values, values.to(torch.uint16), values.permute(0, 2, 1), values.float().requires_grad_(),
                   values.to(torch.bfloat16), torch.tensor(7)):
        assert touch(tensor) == tensor[(-1,) * tensor.dim()].item()
