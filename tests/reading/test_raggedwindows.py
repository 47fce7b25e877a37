"""Ragged window reads: a block order's windows of JPEG rows read whole with direct I/O give the files' batches."""

import os
import shutil
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import memory_short_of, planned, start_methods, walk_windows

from fastdata import convert_imagefolder, make_loader, open_dataset
from fastdata.errors import FastPathWarning, FormatError
from fastdata.loading.helper import HelperReadAhead
from fastdata.measure.synthetic import make_imagefolder
from fastdata.reading.order import EpochOrder
from fastdata.reading.raggedwindows import RaggedWindowReads, largest_window_bytes
from fastdata.reading.windows import WindowAhead

NUM_CLASSES, PER_CLASS = 5, 40  # 200 photos of varied sizes, modes and formats


@pytest.fixture(scope="module")
def jpeg_folders(tmp_path_factory):
    """Return ``{container: jpeg shard folder}`` of 200 varied photos at 32 px: 10 shards of about 20 rows of
    600-1,300 bytes, so that blocks span shards and no two rows are one size."""
    work = tmp_path_factory.mktemp("ragged-windows")
    source = make_imagefolder(work / "photos", NUM_CLASSES, PER_CLASS, size=(60, 45), seed=5, vary=True)
    out = {}
    for container in ("hdf5", "arrow"):
        out[container] = work / f"jpeg-{container}"
        convert_imagefolder(source, out[container], size=32, storage="jpeg", format=container, shard_size=20_000,
                            workers=1, progress=False)
    return out


def reference(folder, indices):
    """The batch read from the files by a dataset that reads no windows."""
    images, labels = open_dataset(folder).read_batch(indices)
    return images.numpy(), labels.numpy()


def stored_bytes(parts):
    """Return the stored bytes of each row of ``parts``, in batch order."""
    return [bytes(np.asarray(columns.samples)[columns.offsets[row] : columns.offsets[row + 1]])
            for columns, rows, _ in parts for row in rows.tolist()]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(container=st.sampled_from(["hdf5", "arrow"]), batch=st.integers(1, 40), block_size=st.integers(1, 40),
       window=st.integers(1, 8), epoch=st.integers(0, 3), seed=st.integers(0, 2**16),
       alignment=st.sampled_from([None, 4096]))
@example(container="hdf5", batch=9, block_size=1, window=1, epoch=0, seed=1, alignment=None)  # windows turn over
def test_every_batch_in_the_wanted_windows_holds_the_files_bytes_and_decodes_as_they_do(
        jpeg_folders, container, batch, block_size, window, epoch, seed, alignment):
    folder = jpeg_folders[container]
    dataset, files = open_dataset(folder), open_dataset(folder)
    assert dataset.num_shards >= 8 and len(set(dataset.lengths.tolist())) > 100
    order = EpochOrder(len(dataset), batch, shuffle="block", seed=seed, block_size=block_size, window=window)
    if alignment is None:  # the file system's, probed
        reads = dataset.read_windows(order)
    else:  # a coarser one: runs land further apart, read from further below
        reads = dataset._store.windows = RaggedWindowReads(dataset._store, order, alignment)
    assert isinstance(reads, RaggedWindowReads)

    def same_bytes(parts, indices):
        assert stored_bytes(parts) == stored_bytes(files._store.parts(indices))

    for indices, images, labels, _ in walk_windows(dataset, reads, epoch, look=same_bytes):
        expected = reference(folder, indices)
        assert np.array_equal(images, expected[0]) and np.array_equal(labels, expected[1])


@pytest.mark.parametrize("container", ["hdf5", "arrow"])
def test_make_loader_reads_a_converted_jpeg_folder_from_its_windows_and_resumes_to_the_same_batches(
        jpeg_folders, monkeypatch, container):
    folder = jpeg_folders[container]
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    options = {"shuffle": True, "block_size": 5, "window": 4, "seed": 3}  # 10 windows an epoch
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        loader = make_loader(dataset, 12, **options)
        assert loader.sampler.shuffle == "block" and isinstance(loader.steps.readahead, WindowAhead)
        assert isinstance(loader.steps.readahead.reads, RaggedWindowReads)
        for epoch in range(2):
            for (images, labels), indices in zip(loader, planned(loader, epoch), strict=True):
                expected = reference(folder, indices)
                assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
    counts = dataset.read_paths()  # the padded last step's wrapped samples are read from the files, unwarned
    assert counts["windows"] >= 2 * (len(loader) - 1) and counts["windows"] + counts["by shard"] == sum(
        counts.values()), counts
    batches = iter(loader)
    kept = [next(batches) for _ in range(4)]
    state = loader.state_dict()
    rest = list(batches)
    resumed = make_loader(open_dataset(folder), 12, **options)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(kept) + len(again) == len(loader) and len(again) == len(rest)
    assert all(a.equal(b) for x, y in zip(again, rest, strict=True) for a, b in zip(x, y, strict=True))


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn"))
def test_a_helper_process_reads_the_jpeg_windows_itself(jpeg_folders, monkeypatch, start_method):
    folder = jpeg_folders["arrow"]
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    with make_loader(dataset, 10, shuffle=True, block_size=5, window=4, seed=8, helper_process=True,
                     multiprocessing_context=start_method) as loader:
        assert isinstance(loader.steps.readahead, HelperReadAhead)
        for (images, labels), indices in zip(loader, planned(loader, 0), strict=True):
            expected = reference(folder, indices)
            assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
        report = loader.helper.report()
    assert report["readahead"] == "WindowAhead"
    assert report["read_paths"]["windows"] == sum(report["read_paths"].values()) == len(loader), report


def test_a_damaged_jpeg_read_from_a_window_names_its_file_and_its_sample_there(jpeg_folders, tmp_path):
    folder = shutil.copytree(jpeg_folders["hdf5"], tmp_path / "damaged")
    dataset = open_dataset(folder)
    shard, row = 3, 7
    victim = dataset.shard_paths[shard]
    offsets = np.asarray(dataset._store.columns([shard])[0].offsets)
    values_at = dataset._store.column_offsets(shard)[0]
    del dataset
    with open(victim, "r+b") as f:  # the JPEG's start-of-image marker and header gone, its length kept
        f.seek(values_at + int(offsets[row]))
        f.write(b"\0" * 64)
    dataset = open_dataset(folder)
    index = int(dataset._store.index.starts[shard]) + row
    order = EpochOrder(len(dataset), 8, shuffle="block", seed=0, block_size=len(dataset), window=1)
    reads = dataset.read_windows(order)
    WindowAhead(reads).start(0, 0)
    batch = np.array([index - 1, index, index + 1])
    with pytest.raises(FormatError, match=rf"{os.path.basename(victim)}.*sample {row} does not decode"):
        dataset.read_batch(batch)
    assert dataset.read_paths()["windows"] == 1


def test_windows_too_big_for_the_memory_available_keep_the_hints_and_say_so(jpeg_folders, monkeypatch):
    dataset = open_dataset(jpeg_folders["arrow"])
    order = EpochOrder(len(dataset), 8, shuffle="block", seed=0, block_size=20, window=8)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (dataset.nbytes, "test"))
    with pytest.warns(FastPathWarning, match="would hold .* MB.*pass a smaller window or block_size"):
        assert dataset.read_windows(order) is None
    assert dataset._store.windows is None and "window" in dataset.fallbacks()


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=300), block_size=st.integers(1, 50),
       window=st.integers(1, 10), epoch=st.integers(0, 5))
def test_a_slot_holds_the_bytes_of_any_window_and_of_the_largest(lengths, block_size, window, epoch):
    lengths = np.array(lengths, np.int64)
    order = EpochOrder(len(lengths), 1, shuffle="block", seed=epoch, block_size=block_size, window=window)
    bound = largest_window_bytes(lengths, order)
    ends = np.concatenate(([0], np.cumsum(lengths)))
    held = [int(sum(ends[stop] - ends[start] for start, stop in order.window_ranges(epoch, w).tolist()))
            for w in range(-(-order.num_blocks // window))]
    assert max(held) <= bound
    blocks = sorted((int(ends[min(b * block_size + block_size, len(lengths))] - ends[b * block_size])
                     for b in range(order.num_blocks)), reverse=True)
    assert bound == sum(blocks[:window])
