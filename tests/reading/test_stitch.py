"""Stitched rows: the raw rows of a shard folder read as one array, equal to the per-item path, unmapped safely."""

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import start_methods

from fastdata import make_loader, open_dataset
from fastdata.errors import FastPathWarning, FormatError
from fastdata.reading.readpaths import ReadPaths
from fastdata.reading.stitch import StitchedRows


def mapped_slots(dataset):
    return set(np.flatnonzero(dataset._store._stitch._mapped).tolist())


def spanning(dataset, shards):
    """Return sorted indices holding the first two samples of each of ``shards``."""
    starts = dataset._store.index.starts
    return np.sort(np.concatenate([np.arange(starts[s], min(starts[s] + 2, starts[s + 1])) for s in shards]))


def per_item(dataset, indices):
    images = torch.stack([dataset[int(i)][0] for i in indices])
    return images, torch.tensor([dataset[int(i)][1] for i in indices])


@pytest.fixture(params=["hdf5", "arrow"])
def raw_folder(shard_converted, request):
    """The converter's raw shard folders: their sample columns sit at one page offset in every shard."""
    return shard_converted(request.param, "raw")


def test_a_batch_spanning_the_shards_of_a_converted_folder_is_one_stitched_take(raw_folder):
    dataset = open_dataset(raw_folder)
    assert dataset.num_shards >= 4
    indices = np.arange(len(dataset))
    parts = dataset._store.parts(indices)
    try:
        assert parts.stitched is not None and len(parts) == dataset.num_shards
        view, rows = parts.stitched
        assert np.array_equal(view[rows], per_item(dataset, indices)[0].numpy())
    finally:
        parts.release()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.slow
def test_stitched_batches_equal_the_per_item_path(raw_folder, data):
    dataset = open_dataset(raw_folder, max_open_shards=data.draw(st.integers(1, 8)))
    for _ in range(3):  # batches after shards were closed and reopened (their slots unmapped and mapped again)
        indices = np.array(data.draw(st.lists(st.integers(-len(dataset), len(dataset) - 1), max_size=40)), np.int64)
        images, labels = dataset.read_batch(indices)
        expected_images, expected_labels = per_item(dataset, indices) if len(indices) else (images, labels)
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
        assert dataset._store._stitch._leases == 0  # every lease released


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_steady_batch_equals_the_slow_parts_and_the_per_item_path(raw_folder, data):
    dataset = open_dataset(raw_folder)
    store = dataset._store
    store.recheck_seconds = 3600.0  # no shard comes due for its check during the example
    dataset.read_batch(np.arange(len(dataset)))  # every shard open and stitched: batches are steady
    indices = np.array(data.draw(st.lists(st.integers(0, len(dataset) - 1), min_size=1, max_size=40)), np.int64)
    if data.draw(st.booleans()):
        indices = np.sort(indices)
    steady = store.parts(indices)
    slow = store._parts(store.index.shard_of(indices), indices)
    try:
        assert steady._expand is not None  # the fast path: nothing but the stitched rows and label addresses yet
        assert np.array_equal(steady.stitched[1], slow.stitched[1])
        assert np.array_equal(steady.labels(), slow.labels())
        assert steady.columns == slow.columns and steady.bounds == slow.bounds and steady.paths == slow.paths
        assert np.array_equal(steady.indices, slow.indices) and steady.num_rows == slow.num_rows == len(indices)
    finally:
        steady.release()
        slow.release()
    images, labels = dataset.read_batch(indices)
    expected_images, expected_labels = per_item(dataset, indices)
    assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    assert store._stitch._leases == 0


def test_a_steady_batch_keeps_its_shards_mapped_while_they_close(raw_folder):
    dataset = open_dataset(raw_folder, max_open_shards=3)
    dataset._store.recheck_seconds = 3600.0
    dataset.read_batch(spanning(dataset, [0, 1, 2]))
    first = spanning(dataset, [0, 1])
    expected, expected_labels = per_item(dataset, first)
    parts = dataset._store.parts(first)
    assert parts._expand is not None  # steady: its shards were open and checked
    dataset.read_batch(spanning(dataset, [2]))
    dataset.read_batch(spanning(dataset, [3]))  # opens shard 3 and closes shard 0, the least recently used
    gc.collect()  # nothing but the lease keeps the closed shard's Columns (its label map) alive
    assert 0 not in dataset._store._held and 0 in mapped_slots(dataset)  # closed, but the lease keeps it mapped
    view, rows = parts.stitched
    assert np.array_equal(view[rows], expected.numpy())
    assert np.array_equal(parts.labels(), expected_labels.numpy())  # read by address from the closed shard
    parts.release()
    assert 0 not in mapped_slots(dataset) and not dataset._store._stitch._kept
    assert torch.equal(dataset.read_batch(first)[0], expected)  # reopened on the slow path


def test_a_closed_shard_stays_mapped_until_the_batch_reading_it_is_released(raw_folder):
    dataset = open_dataset(raw_folder, max_open_shards=2)
    first = spanning(dataset, [0, 1])
    expected = per_item(dataset, first)[0].numpy()
    parts = dataset._store.parts(first)  # leased: shards 0 and 1 mapped
    assert parts.stitched is not None and {0, 1} <= mapped_slots(dataset)
    dataset.read_batch(spanning(dataset, [2, 3]))  # closes shards 0 and 1; their slots wait for the lease
    assert {0, 1} <= mapped_slots(dataset)
    view, rows = parts.stitched
    assert np.array_equal(view[rows], expected)
    parts.release()
    assert not {0, 1} & mapped_slots(dataset) and {2, 3} <= mapped_slots(dataset)


def test_mapped_slots_stay_bounded_over_epochs_with_few_open_shards(raw_folder):
    dataset = open_dataset(raw_folder, max_open_shards=2)
    single = open_dataset(raw_folder)
    loader = make_loader(dataset, 5, shuffle=True, seed=3)
    for _ in range(2):
        for _ in loader:
            assert len(mapped_slots(dataset)) <= 2 + 5  # the open shards, plus those of the batch just read
    reference = make_loader(single, 5, shuffle=True, seed=3)
    loader = make_loader(dataset, 5, shuffle=True, seed=3)  # epoch 0 again, shards closing all along
    for (a, a_labels), (b, b_labels) in zip(loader, reference, strict=True):
        assert torch.equal(a, b) and torch.equal(a_labels, b_labels)


def test_rows_at_another_page_offset_are_read_into_their_slot_and_said_once(tmp_path):
    rows = np.arange(7 * 12, dtype=np.uint8).reshape(7, 3, 2, 2)
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(100) + rows[:4].tobytes() + bytes(8) + rows[4:].tobytes())
    read_paths = ReadPaths()
    stitch = StitchedRows(np.array([4, 3]), (3, 2, 2), np.uint8, read_paths)
    first = np.memmap(path, np.uint8, "r", offset=100, shape=(4, 3, 2, 2))
    assert stitch.map(0, first, path, lambda page: 100 % page)  # the offset most shards have: 100
    with pytest.warns(FastPathWarning, match="shard 1 .* at byte 156, not at 100 .* read into memory"):
        assert stitch.map(1, np.memmap(path, np.uint8, "r", offset=156, shape=(3, 3, 2, 2)), path, None)
    assert stitch.enabled and stitch.covers([0, 1]) and set(read_paths.fallbacks) == {"stitch copies"}
    shards, indices = np.array([0, 0, 1, 1, 1]), np.array([0, 3, 4, 5, 6])  # global indices
    assert np.array_equal(stitch.view[stitch.rows(shards, indices)], rows[[0, 3, 4, 5, 6]])
    with pytest.warns(FastPathWarning, match="not stitched into one array: its rows are not uint8 \\[3, 2, 2\\]"):
        assert not StitchedRows(np.array([4]), (3, 2, 2), np.uint8, ReadPaths()).map(0, rows[:4, :2], path, None)


@pytest.mark.parametrize("fmt, storage", [("arrow", "jpeg"), ("hdf5", "jpeg"), ("hdf5", "text")])
def test_other_folders_read_part_by_part(shard_converted, fmt, storage):
    dataset = open_dataset(shard_converted(fmt, storage))
    parts = dataset._store.parts(np.arange(len(dataset)))
    assert parts.stitched is None and len(parts) == dataset.num_shards
    parts.release()


@pytest.mark.parametrize("method", start_methods("fork", "spawn"))
def test_workers_read_stitched_batches_equal_to_the_main_process(raw_folder, method):
    dataset = open_dataset(raw_folder)
    dataset.read_batch(np.arange(len(dataset)))  # mapped here first: forked workers inherit the range
    plain = list(make_loader(open_dataset(raw_folder), 4, shuffle=True, seed=1))
    loader = make_loader(dataset, 4, shuffle=True, seed=1, num_workers=2, multiprocessing_context=method)
    for (a, a_labels), (b, b_labels) in zip(loader, plain, strict=True):
        assert torch.equal(a, b) and torch.equal(a_labels, b_labels)


@pytest.mark.integration
def test_reading_an_unmapped_slot_faults_instead_of_returning_another_shard(raw_folder):
    code = textwrap.dedent(f"""
        import numpy as np
        from fastdata import open_dataset
        dataset = open_dataset({str(raw_folder)!r}, max_open_shards=1)
        starts = dataset._store.index.starts
        parts = dataset._store.parts(np.array([starts[0]]))
        view, rows = parts.stitched
        parts.release()
        dataset.read_batch(np.array([starts[1]]))  # closes shard 0: its slot is unmapped
        print("read", int(view[int(rows[0])].sum()), flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == -11 and "read" not in result.stdout, (result.returncode, result.stderr[-2000:])


def test_a_damaged_shard_leaves_no_lease_behind(raw_folder, shard_copy):
    folder = shard_copy(raw_folder)
    dataset = open_dataset(folder)
    victim = dataset.shard_paths[2]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 1)
    with pytest.raises(FormatError, match="shard 2"):
        dataset.read_batch(spanning(dataset, [0, 1, 2, 3]))
    assert dataset._store._stitch._leases == 0
    images, _ = dataset.read_batch(spanning(dataset, [0, 1]))  # the other shards still read, stitched
    assert torch.equal(images, per_item(dataset, spanning(dataset, [0, 1]))[0])
