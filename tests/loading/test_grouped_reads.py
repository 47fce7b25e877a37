"""Small raw batches read several at a time (NOTE [grouped reads] in batchloader.py): the same batches, in order."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import NUM_CLASSES, PER_CLASS
from torch.utils.data import BatchSampler, SequentialSampler

from fastdata import make_loader, open_dataset
from fastdata.loading import batchloader
from fastdata.loading.samplers import BatchIndexSampler

NUM_SAMPLES = NUM_CLASSES * PER_CLASS


@pytest.fixture(params=["hdf5", "arrow"])
def raw(request, packed_files):
    return open_dataset(packed_files(request.param, "raw"))


def counting_starts(dataset, monkeypatch):
    """Count the dataset's grouped reads: a list that gets each read's batch sizes."""
    reads, start = [], dataset.start_batches

    def counted(indices, sizes, *args, **kwargs):
        reads.append(list(sizes))
        return start(indices, sizes, *args, **kwargs)

    monkeypatch.setattr(dataset, "start_batches", counted)
    return reads


def test_small_batches_are_read_a_group_at_a_time_and_counted_as_batches(raw, monkeypatch):
    reads = counting_starts(raw, monkeypatch)
    loader = make_loader(raw, 5, shuffle=True, seed=1)
    group = batchloader._read_group(raw, loader.steps, 5)
    assert group == batchloader.MAX_GROUP  # 5 samples of 32 px: far below GROUP_BYTES
    batches = list(loader)
    assert reads == [[5, 5, 5, 5, 4]]  # 24 samples: one read of every batch
    assert raw.read_paths()["one file"] == len(batches) == 5
    for (images, labels), indices in zip(batches, BatchIndexSampler(NUM_SAMPLES, 5, shuffle="uniform", seed=1),
                                         strict=True):
        expected_images, expected_labels = raw.read_batch(indices)
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_size=st.integers(1, NUM_SAMPLES + 2), group=st.integers(2, 7), drop_last=st.booleans(),
       seed=st.integers(0, 3))
def test_any_group_size_gives_the_batches_of_the_order_and_kept_batches_stay_intact(
        packed_files, monkeypatch, batch_size, group, drop_last, seed):
    dataset = open_dataset(packed_files("hdf5", "raw"))
    monkeypatch.setattr(batchloader, "MAX_GROUP", group)
    reads = counting_starts(dataset, monkeypatch)
    loader = make_loader(dataset, batch_size, shuffle=True, seed=seed, drop_last=drop_last)
    sampler = BatchIndexSampler(NUM_SAMPLES, batch_size, shuffle="uniform", seed=seed, drop_last=drop_last)
    for epoch in range(2):  # every batch kept: no buffer is reused while a batch of it is alive
        kept = list(loader)
        sampler.set_epoch(epoch)
        expected = list(sampler)
        assert len(kept) == len(expected)
        for (images, labels), indices in zip(kept, expected, strict=True):
            expected_images, expected_labels = dataset.read_batch(indices)
            assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    sizes = [len(indices) for indices in expected]
    assert reads[-((len(sizes) + group - 1) // group):] == [sizes[i : i + group] for i in range(0, len(sizes), group)]


def test_an_index_out_of_range_comes_after_the_batches_before_it(raw):
    sampler = BatchSampler(SequentialSampler(range(NUM_SAMPLES + 4)), 4, drop_last=False)  # its 7th batch is past
    got = []
    with pytest.raises(IndexError, match="out of range"):
        for images, _ in make_loader(raw, batch_sampler=sampler):
            got.append(images)
    assert [len(images) for images in got] == [4] * 6
    assert torch.equal(torch.cat(got), raw.read_batch(np.arange(NUM_SAMPLES))[0])


def test_a_loop_that_breaks_early_and_starts_again_gets_whole_epochs(raw):
    loader = make_loader(raw, 3, shuffle=True, seed=2)
    for _ in range(3):  # each break leaves a group started and one read: both end with the loop
        for step, _ in enumerate(loader):
            if step == 1:
                break
    epoch = [labels for _, labels in loader]
    assert sorted(torch.cat(epoch).tolist()) == sorted(raw.labels.tolist())


def test_large_batches_and_other_storage_are_read_one_at_a_time(packed_files):
    jpeg = open_dataset(packed_files("hdf5", "jpeg"))
    assert batchloader._read_group(jpeg, make_loader(jpeg, 4).steps, 4) == 1  # decoded: no copy to group
    raw = open_dataset(packed_files("hdf5", "raw"))
    big = batchloader.GROUP_BYTES // raw.max_batch_bytes(1)  # samples in a batch of about GROUP_BYTES
    assert batchloader._read_group(raw, make_loader(raw, big).steps, big) == 1
