"""PackedDataset.to_hf: a Hugging Face ``datasets.Dataset`` over the files, equal to what fastdata reads."""

import io
import os
import re
import shutil
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from support import FORMATS, column_regions, mapped_at, private_copy

from fastdata import convert_text, open_dataset
from fastdata.errors import FormatError, MissingDependencyError, OptionError
from fastdata.formats import read_packed

KINDS = ("raw", "jpeg", "text")
README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


@pytest.fixture(scope="module")
def hf():
    """The ``datasets`` module; its tests skip without it (``pip install 'fastdata[integrations]'``)."""
    return pytest.importorskip("datasets")


@pytest.fixture(params=[(fmt, kind, layout) for fmt in FORMATS for kind in KINDS for layout in ("file", "folder")],
                ids="-".join)
def case(request, shard_single, shard_converted):
    """Each container x kind as one file and as a converter's shard folder: ``(path, kind)``."""
    fmt, kind, layout = request.param
    return (shard_single if layout == "file" else shard_converted)(fmt, kind), kind


def sample_column(kind):
    return "input_ids" if kind == "text" else "image"


def stored_rows(dataset):
    """Return ``(samples, labels)`` of every sample as fastdata's read_batch gives them (text: the unpadded ids)."""
    *samples, labels = dataset.read_batch(np.arange(len(dataset)))
    rows = samples[0] if dataset.kind == "image" else [row[:n] for row, n in zip(*samples)]
    return rows, labels


def assert_same_samples(table, kind, rows):
    """Assert that the samples of Hugging Face ``table`` are fastdata's ``rows`` (``stored_rows``)."""
    if kind == "raw":
        assert np.array_equal(table.with_format("numpy", dtype=np.uint8)[:]["image"], rows.numpy())
    elif kind == "jpeg":  # Hugging Face decodes with PIL; fastdata with simplejpeg where installed
        images = table[:]["image"]
        assert all(image.mode == "RGB" for image in images)
        assert np.array_equal(np.stack([np.asarray(image) for image in images]), rows.permute(0, 2, 3, 1))
    else:
        assert table[:]["input_ids"] == [row.tolist() for row in rows]


def test_every_sample_and_label_is_what_fastdata_reads(hf, case):
    path, kind = case
    dataset = open_dataset(path)
    table = dataset.to_hf()
    rows, labels = stored_rows(dataset)
    assert len(table) == len(dataset) == len(labels) and table.column_names == [sample_column(kind), "label"]
    assert table.features["label"] == hf.ClassLabel(names=dataset.classes) and dataset.classes
    assert table[:]["label"] == labels.tolist()
    if kind == "raw":
        assert table.features["image"] == hf.Array3D(shape=tuple(rows.shape[1:]), dtype="uint8")
    elif kind == "jpeg":
        assert table.features["image"] == hf.Image()
    else:
        assert table.features["input_ids"] == hf.Sequence(hf.Value(dataset.metadata["sample_dtype"]))
    assert_same_samples(table, kind, rows)
    assert [table[i]["label"] for i in (0, len(table) - 1)] == [int(labels[0]), int(labels[-1])]


def test_the_torch_format_gives_fastdatas_tensors(hf, case):
    path, kind = case
    dataset = open_dataset(path)
    rows, labels = stored_rows(dataset)
    batch = dataset.to_hf().with_format("torch")[3:9]
    assert torch.equal(batch["label"], labels[3:9])
    samples = batch[sample_column(kind)]
    for got, expected in zip(samples, rows[3:9]):
        assert torch.equal(got, expected.to(got.dtype))  # Hugging Face's integers: int64, JPEG pixels uint8
    assert len(samples) == 6


def test_the_jpeg_column_holds_the_stored_bytes(hf, shard_single):
    path = shard_single("hdf5", "jpeg")
    dataset = open_dataset(path)
    columns, _ = read_packed(path)
    stored = dataset.to_hf().cast_column("image", hf.Image(decode=False))[:]["image"]
    for index, entry in enumerate(stored):
        encoded = columns.samples[columns.offsets[index] : columns.offsets[index + 1]].tobytes()
        assert entry == {"bytes": encoded, "path": None}
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(encoded))), dataset[index][0].permute(1, 2, 0).numpy())


def chunk_values(chunk, kind):
    """Return the Arrow buffer of a chunk's sample values."""
    if kind == "raw":
        return chunk.storage.values.values.values.buffers()[1]
    if kind == "jpeg":
        return chunk.field("bytes").buffers()[2]
    return chunk.values.buffers()[1]


def test_samples_and_labels_are_views_of_the_files(hf, case):
    """Every chunk's values and labels lie in the samples and labels columns of a shard's file (/proc/self/maps)."""
    path, kind = case
    dataset = open_dataset(path)
    table = dataset.to_hf().data.table
    regions = {os.path.realpath(shard): column_regions(shard) for shard in dataset.shard_paths}
    seen = {"samples": 0, "labels": 0}
    for column, name in enumerate(seen):
        for chunk in table.column(column).chunks:
            buffer = chunk_values(chunk, kind) if name == "samples" else chunk.buffers()[1]
            mapped, offset = mapped_at(buffer.address)
            start, nbytes = regions[mapped][name]
            assert start <= offset and offset + buffer.size <= start + nbytes
            seen[name] += buffer.size
    assert seen == {name: sum(found[name][1] for found in regions.values()) for name in seen}


def open_descriptors(root):
    root = os.path.realpath(root) + os.sep
    return sum(os.path.realpath(f"/proc/self/fd/{fd}").startswith(root) for fd in os.listdir("/proc/self/fd"))


def test_a_folder_holds_no_descriptor_once_made(hf, shard_converted):
    root = shard_converted("hdf5", "jpeg")  # an HDF5 shard's numpy maps hold one per column
    table = open_dataset(root).to_hf()
    assert open_descriptors(root) == 0 and len(table.data.column(0).chunks) == open_dataset(root).num_shards


@pytest.mark.parametrize("limit, value", [("_CHUNK_ROWS", 5), ("_CHUNK_BYTES", 1)])
def test_chunks_keep_to_their_limits_and_share_their_offsets(hf, shard_single, monkeypatch, limit, value):
    from fastdata.loading import huggingface

    monkeypatch.setattr(huggingface, limit, value)  # 1 byte: one sample a chunk
    for kind in KINDS:
        dataset = open_dataset(shard_single("arrow", kind))
        rows, labels = stored_rows(dataset)
        table = dataset.to_hf()
        chunks = table.data.column(0).chunks
        assert [len(chunk) for chunk in chunks] == [min(value, len(dataset) - start)
                                                    for start in range(0, len(dataset), value)]
        assert table.with_format("numpy")[:]["label"].tolist() == labels.tolist()
        assert_same_samples(table, kind, rows)
        if kind == "raw":  # one set of offsets for every chunk
            assert len({chunk.storage.buffers()[1].address for chunk in chunks}) == 1


def test_unlabeled_text_without_classes_has_plain_int_labels(hf, tmp_path):
    (tmp_path / "lines.txt").write_text("one line\nand another one\nthird\n")
    dataset = open_dataset(convert_text(tmp_path / "lines.txt", tmp_path / "lines.arrow", workers=1,
                                        progress=False).path)
    table = dataset.to_hf()
    assert table.features["label"] == hf.Value("int64") and table[:]["label"] == [-1, -1, -1]
    assert table[:]["input_ids"] == [dataset[i][0].tolist() for i in range(3)]


def test_a_file_changed_since_opening_is_refused(hf, shard_single, tmp_path):
    path = private_copy(shard_single("hdf5", "raw"), tmp_path)
    dataset = open_dataset(path)
    os.utime(path, ns=(0, 0))
    with pytest.raises(FormatError, match="was modified"):
        dataset.to_hf()


def test_without_datasets_the_error_names_the_extra(shard_single, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(MissingDependencyError, match=re.escape("pip install 'fastdata[integrations]'")):
        open_dataset(shard_single("arrow", "raw")).to_hf()


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # fsspec's aiohttp sessions, closed at exit
def test_a_url_is_refused_naming_what_to_do(shard_converted, http_server, tmp_path):
    pytest.importorskip("fsspec")
    shutil.copytree(shard_converted("arrow", "raw"), tmp_path / "served")
    remote = open_dataset(http_server.url_of("served"), cache_dir=tmp_path / "cache")
    with pytest.raises(OptionError, match=r"reads local files.*copy the folder to a local disk"):
        remote.to_hf()


def test_the_readme_line_runs(hf, shard_single):
    with open(README) as f:
        text = f.read()
    line = re.search(r"```python\n(hf = open_dataset\(\"train.h5\"\)\.to_hf\(\).*?)\n```", text, re.S).group(1)
    namespace = {"open_dataset": open_dataset}
    exec(line.replace('"train.h5"', repr(os.fspath(shard_single("hdf5", "raw")))), namespace)
    assert namespace["hf"].features["image"] == hf.Array3D(shape=(3, 32, 32), dtype="uint8")
