"""Text datasets and loaders: items, padded batches, workers under each start method, bucketing."""

import os
import pickle
import time

import numpy as np
import pytest
import torch
from support import MB, ProbeMixin, growth_per_worker, start_methods, stored_sequences
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from fastdata import BucketBatchSampler, HDF5Dataset, convert_text, make_loader, open_dataset
from fastdata.loading.samplers import BatchIndexSampler
from fastdata.measure.synthetic import make_text_corpus


def padded_reference(sequences, indices, pad_id, pad_to=None):
    """The simple path: cut and pad each stored sequence on its own."""
    rows = [torch.from_numpy(sequences[i][:pad_to]) for i in indices]
    width = max(len(row) for row in rows) if pad_to is None else pad_to
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    for r, row in enumerate(rows):
        tokens[r, : len(row)] = row
    return tokens, torch.tensor([len(row) for row in rows])


def test_items_are_1d_int64_tokens_and_int_labels(packed_text, text_fmt):
    dataset = open_dataset(packed_text(text_fmt))
    sequences, labels, metadata = stored_sequences(packed_text(text_fmt))
    assert len(dataset) == len(sequences) and dataset.classes == ["neg", "pos"]
    for index in (0, 7, len(dataset) - 1, -1):
        tokens, label = dataset[index]
        assert tokens.dtype == torch.int64 and tokens.ndim == 1
        np.testing.assert_array_equal(tokens.numpy(), sequences[index])
        assert label == labels[index] and isinstance(label, int)
    np.testing.assert_array_equal(dataset.lengths, [len(s) for s in sequences])
    assert "text uint16" in repr(dataset)


@pytest.mark.parametrize("pad_to", [None, 40, 5000])
def test_batch_path_equals_per_item_path(packed_text, text_fmt, pad_to):
    dataset = open_dataset(packed_text(text_fmt))
    pad_id = dataset.metadata["tokenizer"]["pad_id"]
    rng = np.random.default_rng(0)
    for _ in range(3):
        indices = np.sort(rng.choice(len(dataset), 9, replace=False))
        tokens, lengths, labels = dataset.read_batch(indices, pad_to=pad_to)
        items = [dataset[int(i)] for i in indices]
        expected, expected_lengths = padded_reference([t.numpy() for t, _ in items], range(9), pad_id, pad_to)
        assert torch.equal(tokens, expected) and torch.equal(lengths, expected_lengths)
        assert labels.tolist() == [label for _, label in items]


def test_getitems_gives_unpadded_items_in_caller_order(packed_text, text_fmt):
    dataset = open_dataset(packed_text(text_fmt))
    indices = [5, 0, 17, 5]
    for (tokens, label), index in zip(dataset.__getitems__(indices), indices):
        expected, expected_label = dataset[index]
        assert torch.equal(tokens, expected) and label == expected_label


def collate_padded(items):
    return pad_sequence([tokens for tokens, _ in items], batch_first=True), torch.tensor([y for _, y in items])


def test_stock_dataloader_with_own_collate(packed_text):
    dataset = open_dataset(packed_text("arrow"))
    batches = list(DataLoader(dataset, batch_size=8, collate_fn=collate_padded))
    assert sum(len(labels) for _, labels in batches) == len(dataset)


def all_samples(loader):
    """Return ``{index-free key: ...}``: every (row tokens, label) yielded, checked for padding."""
    seen = []
    for tokens, lengths, labels in loader:
        assert tokens.dtype == lengths.dtype == labels.dtype == torch.int64
        assert tokens.shape == (len(lengths), tokens.shape[1]) and len(labels) == len(lengths)
        for row, length, label in zip(tokens, lengths.tolist(), labels.tolist()):
            assert (row[length:] == 0).all()  # the stored pad id
            seen.append((tuple(row[:length].tolist()), label))
    return sorted(seen)


def expected_samples(path, pad_to=None):
    sequences, labels, _ = stored_sequences(path)
    return sorted((tuple(s[:pad_to].tolist()), int(y)) for s, y in zip(sequences, labels))


def test_make_loader_pads_to_the_longest_or_a_fixed_length(packed_text, text_fmt):
    path = packed_text(text_fmt)
    dataset = open_dataset(path)
    loader = make_loader(dataset, batch_size=5, shuffle=True)
    assert all_samples(loader) == expected_samples(path)
    widths = {tokens.shape[1] for tokens, lengths, _ in loader}
    assert len(widths) > 1
    fixed = make_loader(dataset, batch_size=5, pad_to=64)
    assert {tokens.shape[1] for tokens, _, _ in fixed} == {64}
    assert all_samples(fixed) == expected_samples(path, pad_to=64)


def test_pad_to_is_checked(packed_files):
    images = open_dataset(packed_files("hdf5", "raw"))
    with pytest.raises(ValueError, match="pad_to should be a positive integer"):
        make_loader(images, pad_to=0)
    with pytest.raises(ValueError, match="pad_to applies to text datasets"):
        make_loader(images, pad_to=8)


def test_dataset_pickles_small(packed_text):
    dataset = open_dataset(packed_text("hdf5"))
    dataset[0]
    assert len(pickle.dumps(dataset)) < 200_000  # metadata (vocabulary) only, no arrays


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn", "forkserver"))
def test_workers_under_each_start_method(packed_text, start_method):
    path = packed_text("hdf5" if start_method != "spawn" else "arrow")
    dataset = open_dataset(path)
    sampler = BucketBatchSampler(dataset.lengths, 4, pool_batches=2, seed=1)
    loader = make_loader(dataset, num_workers=2, batch_sampler=sampler, multiprocessing_context=start_method,
                         persistent_workers=False)
    assert all_samples(loader) == expected_samples(path)
    fixed = make_loader(dataset, 6, num_workers=1, pad_to=32, multiprocessing_context=start_method,
                        persistent_workers=False)
    assert all_samples(fixed) == expected_samples(path, pad_to=32)


# ----- bucketing ----------------------------------------------------------------------------------------

LENGTHS = np.random.default_rng(0).lognormal(np.log(200), 0.7, 1003).astype(np.int64) + 1


@pytest.mark.parametrize("drop_last", [False, True])
def test_bucketing_covers_every_sample_once(drop_last):
    sampler = BucketBatchSampler(LENGTHS, 32, pool_batches=4, seed=3, drop_last=drop_last)
    batches = list(sampler)
    assert len(batches) == len(sampler) == (31 if drop_last else 32)
    assert all(b.dtype == np.int64 and (np.diff(b) > 0).all() and len(b) <= 32 for b in batches)
    flat = np.concatenate(batches)
    assert len(flat) == len(set(flat.tolist())) == (31 * 32 if drop_last else len(LENGTHS))
    if drop_last:
        assert all(len(b) == 32 for b in batches)


def test_bucketing_is_seeded_and_changes_every_epoch():
    first = BucketBatchSampler(LENGTHS, 32, seed=3)
    second = BucketBatchSampler(LENGTHS, 32, seed=3)
    epoch0 = [b.tolist() for b in first]
    assert epoch0 == [b.tolist() for b in second]
    assert epoch0 != [b.tolist() for b in first]
    first.set_epoch(0)
    assert epoch0 == [b.tolist() for b in first]


def test_bucketing_reduces_padding():
    sampler = BucketBatchSampler(LENGTHS, 32, pool_batches=8, seed=3)
    report = sampler.padding()
    assert report["bucketed"] < report["random"] / 2 and report["saved"] > 0.2

    def padded_cells(batches):
        return sum(int(LENGTHS[b].max()) * len(b) for b in batches)

    random_batches = list(BatchIndexSampler(len(LENGTHS), 32, shuffle="uniform", seed=3))
    assert padded_cells(list(sampler)) < padded_cells(random_batches)


def test_bucketed_loader_pads_less(packed_text):
    dataset = open_dataset(packed_text("hdf5"))
    bucketed = make_loader(dataset, batch_sampler=BucketBatchSampler(dataset.lengths, 4, pool_batches=6))
    plain = make_loader(dataset, batch_size=4, shuffle=True)
    assert sum(t.numel() for t, _, _ in bucketed) < sum(t.numel() for t, _, _ in plain)
    with pytest.raises(ValueError, match="batch_sampler replaces"):
        make_loader(dataset, batch_sampler=BucketBatchSampler(dataset.lengths, 4), shuffle=True)


def test_busy_loop_over_a_bucket_sampler_reads_each_epoch_of_the_sampler(packed_text):
    # see NOTE [next epoch's first batch]: read early from the sampler's next epoch, then that epoch is done
    dataset = open_dataset(packed_text("hdf5"))
    sampler = BucketBatchSampler(dataset.lengths, 4, pool_batches=2, seed=5)
    loader = make_loader(dataset, batch_sampler=sampler)
    for epoch in range(3):
        expected = [dataset.read_batch(batch) for batch in sampler.batches(epoch)]
        got = []
        for batch in loader:
            got.append(batch)
            time.sleep(0.002)  # a busy loop: the reading moves to a thread
        assert sampler.epoch == epoch + 1
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for batch, reference in zip(got, expected) for a, b in zip(batch, reference))


def test_bucketing_checks_its_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        BucketBatchSampler(LENGTHS, 0)
    with pytest.raises(ValueError, match="pool_batches"):
        BucketBatchSampler(LENGTHS, 4, pool_batches=0)


class ProbeText(ProbeMixin, HDF5Dataset):
    """Text dataset whose batches end with the worker's memory reading (module level for spawn)."""


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn"))
@pytest.mark.slow
def test_text_worker_memory_stays_flat(tmp_path, start_method):
    corpus = make_text_corpus(tmp_path / "corpus", per_class=1500)
    path = tmp_path / "reviews.h5"
    convert_text(os.path.join(corpus, "train"), path, workers=1, progress=False)
    loader = make_loader(ProbeText(path), 32, shuffle=True, num_workers=2, multiprocessing_context=start_method)
    batches = [batch for _ in range(2) for batch in loader]
    assert sum(len(batch[2]) for batch in batches) == 2 * 3000
    growth = growth_per_worker(batches)
    assert len(growth) == 2
    for pid, (anon, private) in growth.items():
        assert anon < 8 * MB and private < 8 * MB, f"worker {pid} grew by {anon} kB anon, {private} kB private"
