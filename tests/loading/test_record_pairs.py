"""(sample, label) files of the converters opened as records: the same bytes as their pairs, as dicts."""

import numpy as np
import pytest
import torch
from support import (
    FORMATS,
    STORED_SIZE,
    assert_same_batches,
    column_regions,
    downgrade_to_version1,
    overwrite,
    private_copy,
    rewrite_metadata,
)

from fastdata import FormatError, OptionError, RecordDataset, make_loader, open_dataset
from fastdata.info import describe
from fastdata.loading import records as record_loading


@pytest.fixture(params=["file", "folder"])
def pairs(request, shard_single, shard_converted, fmt, kind):
    """``(path, kind)`` of every file of pairs the converters write: each format and kind, one file or shards."""
    files = shard_single if request.param == "file" else shard_converted
    return files(fmt, kind), kind


def _sample_field(kind):
    return "tokens" if kind == "text" else "image"


def _stacked(items, kind):
    """Return the dict batch of tuple ``items``: images stacked, tokens zero-padded beside their lengths."""
    samples, labels = zip(*items)
    if kind != "text":
        return {"image": torch.stack(samples), "label": torch.tensor(labels)}
    lengths = torch.tensor([len(tokens) for tokens in samples])
    padded = torch.zeros((len(samples), int(lengths.max())), dtype=torch.int64)
    for row, tokens in enumerate(samples):
        padded[row, : len(tokens)] = tokens
    return {"tokens": padded, "tokens_lengths": lengths, "label": torch.tensor(labels)}


def test_every_record_is_the_pair_the_tuple_api_reads(pairs):
    path, kind = pairs
    records, tuples = RecordDataset(path), open_dataset(path)
    name = _sample_field(kind)
    assert list(records.schema) == [name, "label"] and len(records) == len(tuples)
    assert records.schema["label"].type == "int" and records.schema["label"].names == tuple(tuples.classes)
    for index in range(len(tuples)):
        sample, label = tuples[index]
        record = records[index]
        assert record[name].dtype == sample.dtype and torch.equal(record[name], sample)
        assert record["label"] == label
    indices = np.random.default_rng(0).permutation(len(tuples))
    assert_same_batches(records.read_batch(indices), _stacked([tuples[int(i)] for i in indices], kind))


def test_the_implied_schema_is_the_files_size_storage_and_dtype(packed_text, packed_files, fmt, storage):
    image = RecordDataset(packed_files(fmt, storage)).schema["image"]
    assert (image.type, image.size, image.storage, image.resize) == ("image", (STORED_SIZE, STORED_SIZE), storage,
                                                                     "crop")
    assert image.quality == (90 if storage == "jpeg" else None)
    text = RecordDataset(packed_text(fmt))
    assert text.schema["tokens"].type == "tokens" and text.schema["tokens"].dtype == text.metadata["sample_dtype"]
    assert repr(text) == (f"<RecordDataset 'reviews{FORMATS[fmt]}' {fmt}: {len(text)} records, tokens tokens "
                          f"{text.metadata['sample_dtype']}, label int>")


def test_labels_alone_decode_no_image_and_read_no_image_bytes(packed_files, fmt, storage, tmp_path, monkeypatch):
    path = packed_files(fmt, storage)
    labels = torch.tensor([label for _, label in open_dataset(path)])
    copy = private_copy(path, tmp_path)
    offset, nbytes = column_regions(copy)["samples"]
    overwrite(copy, offset, b"\x00" * nbytes)  # every stored image gone: a JPEG cannot decode
    for decoder in ("RawImageDecoder", "JpegImageDecoder"):  # no image decoder is even made
        monkeypatch.setattr(record_loading, decoder, None)
    picked = RecordDataset(copy, fields=["label"])
    indices = np.random.default_rng(1).permutation(len(labels))
    assert_same_batches(picked.read_batch(indices), {"label": labels[indices]})
    assert list(picked._open(0)) == ["label"]  # the only column this process holds
    monkeypatch.undo()
    if storage == "jpeg":
        with pytest.raises(FormatError, match="copy.*JPEG of sample 0 does not decode"):
            RecordDataset(copy).read_batch([0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_yields_dict_batches_of_a_file_of_pairs(shard_converted, num_workers):
    for kind in ("jpeg", "text"):
        path = shard_converted("arrow", kind)
        loader = make_loader(RecordDataset(path), 5, shuffle=True, seed=3, num_workers=num_workers)
        try:
            batches = list(loader)
            if num_workers:  # the file's longest sample bounds a batch: shared slots, as a record file's
                assert loader.dataset.slots is not None
        finally:
            if num_workers:
                loader.close()
        pairs = list(make_loader(open_dataset(path), 5, shuffle=True, seed=3))  # the same order: seed and epoch's
        assert len(batches) == len(pairs)
        for batch, (*samples, labels) in zip(batches, pairs):
            assert isinstance(batch, dict) and torch.equal(batch["label"], labels)
            if kind == "text":  # the pairs' tokens are padded with the file's pad id, the records' with zeros
                tokens, lengths = samples
                assert torch.equal(batch["tokens_lengths"], lengths)
                assert all(torch.equal(batch["tokens"][row, :length], tokens[row, :length])
                           for row, length in enumerate(lengths.tolist()))
            else:
                assert set(batch) == {"image", "label"} and torch.equal(batch["image"], samples[0])
        every = torch.cat([batch["label"] for batch in batches])
        assert every.tolist() != open_dataset(path).labels.tolist() and sorted(every.tolist()) == sorted(
            open_dataset(path).labels.tolist())


def test_a_text_file_of_pairs_bounds_its_batches_by_its_longest_sample(packed_text, fmt):
    records = RecordDataset(packed_text(fmt))
    batch = records.read_batch(np.arange(len(records)))
    promised = records.max_batch_bytes(len(records))
    assert promised is not None and batch["tokens"].shape[1] == records.metadata["lengths"]["max"]
    assert promised >= sum(value.nbytes for value in batch.values())


def test_a_file_written_before_checksums_reads_as_records(packed_files, tmp_path):
    path = packed_files("hdf5", "jpeg")
    old = downgrade_to_version1(private_copy(path, tmp_path))
    assert_same_batches(RecordDataset(old).read_batch([3, 0]), RecordDataset(path).read_batch([3, 0]))


def test_samples_without_a_record_view_are_named_with_what_to_do(packed_files, packed_text, tmp_path):
    copy = private_copy(packed_files("hdf5", "raw"), tmp_path)
    rewrite_metadata(copy, lambda metadata: metadata.update(storage="webp"))
    with pytest.raises(FormatError, match=r"copy.h5.* holds 'image' samples stored as 'webp'.*upgrade fastdata"):
        RecordDataset(copy)
    with pytest.raises(OptionError, match=r"fields=\['image'\]: .*reviews.h5.* has fields tokens, label"):
        RecordDataset(packed_text("hdf5"), fields=["image"])


def test_a_shard_of_other_classes_is_refused(shard_converted, shard_copy):
    from fastdata.formats.shards import read_index

    folder = shard_copy(shard_converted("hdf5", "raw"))
    index = read_index(folder)
    rewrite_metadata(index.path(1), lambda metadata: metadata.update(classes=["a", "b", "c", "d"]))
    records = RecordDataset(folder)
    records.read_batch([0])
    with pytest.raises(FormatError, match=r"shard-00001.* differs from the dataset in classes"):
        records.read_batch([int(index.starts[1])])


def test_info_names_the_fields_a_file_of_pairs_reads_as(shard_single, shard_converted, kind):
    for path in (shard_single("hdf5", kind), shard_converted("arrow", kind)):
        assert f"as records:  {_sample_field(kind)} (" in describe(path)
        assert "label (int) with fastdata.RecordDataset" in describe(path)


def test_open_dataset_points_fields_of_pairs_to_recorddataset(packed_files):
    with pytest.raises(OptionError, match=r"fields= picks .*fastdata.RecordDataset\(.*photos-raw.h5', fields="):
        open_dataset(packed_files("hdf5", "raw"), fields=["label"])
