"""A shard folder read as one dataset: equal to the single file it holds, item by item and batch by batch."""

import json
import os
import pickle
import re
import resource

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import column_regions, overwrite, start_methods, truncate_elsewhere

from fastdata import ArrowDataset, HDF5Dataset, make_loader, open_dataset
from fastdata.errors import FormatError, NotFoundError
from fastdata.formats.shards import INDEX_NAME, read_index
from fastdata.loading.samplers import BatchIndexSampler
from fastdata.reading import rowcopy

CLASSES = {"hdf5": HDF5Dataset, "arrow": ArrowDataset}
FILE_KEYS = ("checksums", "format", "format_version")


@pytest.fixture(params=["converted", "split"])
def pair(request, shard_converted, shard_folders, shard_single, fmt, kind):
    """``(folder dataset, single-file dataset)`` holding the same samples.

    The folder is the converter's, or the single file split into odd shards of 1-7 samples.
    """
    folders = shard_converted if request.param == "converted" else shard_folders
    return open_dataset(folders(fmt, kind)), open_dataset(shard_single(fmt, kind))


def assert_same_batch(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


def assert_same_items(a, b):
    assert len(a) == len(b)
    for (x, x_label), (y, y_label) in zip(a, b):
        assert torch.equal(x, y) and x_label == y_label


def open_shard_files(root):
    """Return the shard files of ``root`` this process has open (descriptors) and mapped (memory maps)."""
    root = os.path.realpath(root)
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed since
            continue
        if target.startswith(root + os.sep):
            fds.add(target)
    with open("/proc/self/maps") as f:
        maps = {line.split(maxsplit=5)[-1].strip() for line in f if root + os.sep in line}
    return fds, maps


# ---------------------------------------------------------------- one dataset over the shards


def test_open_dataset_and_the_container_class_read_a_folder(shard_folders, fmt):
    folder = shard_folders(fmt, "raw")
    assert type(open_dataset(folder)) is CLASSES[fmt]
    ds = CLASSES[fmt](folder)
    assert ds.num_shards == read_index(folder).num_shards == 7 and len(ds) == 24


def test_the_other_container_class_names_the_right_one(shard_folders, fmt):
    other = {"hdf5": ArrowDataset, "arrow": HDF5Dataset}[fmt]
    right = CLASSES[fmt].__name__
    with pytest.raises(FormatError, match=f"folder of {fmt} shards.*open it with {right} or open_dataset"):
        other(shard_folders(fmt, "raw"))


def test_a_folder_without_index_is_not_a_dataset(tmp_path):
    with pytest.raises(NotFoundError, match=f"has no {INDEX_NAME}"):
        open_dataset(tmp_path)


def test_len_metadata_classes_and_read_options_are_the_files(pair):
    folder, single = pair
    assert folder.num_shards >= 4 and single.num_shards == 1  # so batches span shards
    assert len(folder) == len(single) and folder.classes == single.classes
    assert folder.metadata == {key: value for key, value in single.metadata.items() if key not in FILE_KEYS}
    assert folder.read_options == single.read_options
    assert folder.max_batch_bytes(7) == single.max_batch_bytes(7)
    assert (folder.kind, folder.storage, folder.sample_shape) == (single.kind, single.storage, single.sample_shape)


def test_labels_and_lengths_span_every_shard(pair, kind):
    folder, single = pair
    assert folder.labels.dtype == np.int64 and np.array_equal(folder.labels, single.labels)
    if kind == "raw":
        with pytest.raises(TypeError, match="holds fixed-size image samples"):
            len(folder.lengths)
    else:  # tokens, or JPEG bytes
        assert folder.lengths.dtype == np.int64 and np.array_equal(folder.lengths, single.lengths)


def test_repr_shows_folder_container_and_shards(shard_folders, fmt):
    folder = shard_folders(fmt, "jpeg")
    text = repr(open_dataset(folder))
    assert text.startswith(f"<{CLASSES[fmt].__name__} {os.path.basename(folder)!r} {fmt}, 7 shards: 24 samples")


def test_items_equal_the_files_including_negative_indices(pair):
    folder, single = pair
    for index in [*range(len(single)), -1, -len(single), np.int64(3)]:
        assert_same_items([folder[index]], [single[index]])
    with pytest.raises(IndexError, match=f"index {len(single)} is out of range"):
        folder[len(single)]


BATCHES = {
    "all": np.arange(24),
    "spanning": np.array([0, 1, 5, 6, 7, 13, 23]),
    "unsorted": np.array([20, 3, 0, 13, 6, 12, 7]),
    "duplicates": np.array([4, 4, 6, 6, 6, 0, 4]),
    "negative": np.array([-1, -24, 5, -18, 6]),
    "one shard": np.array([8, 9, 10]),
    "one-sample shards": np.array([0, 6, 16]),
    "empty": np.array([], dtype=np.int64),
}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_read_batch_and_getitems_equal_the_files(pair, batch):
    folder, single = pair
    indices = BATCHES[batch]
    assert_same_batch(folder.read_batch(indices), single.read_batch(indices))
    assert_same_items(folder.__getitems__(indices), single.__getitems__(indices))
    for options in ({"pad_to": 5},) if "pad_to" in folder.read_options else ({"threads": 3},) * (
            folder.storage == "jpeg"):
        assert_same_batch(folder.read_batch(indices, **options), single.read_batch(indices, **options))


def test_batch_equals_items_of_the_folder(pair):
    folder, _ = pair
    indices = np.array([23, 1, 7, 7, 0])
    *samples, labels = folder.read_batch(indices)
    items = folder.__getitems__(indices)
    rows = samples[0] if folder.kind == "image" else [row[:n] for row, n in zip(*samples)]
    for row, label, index in zip(rows, labels.tolist(), indices.tolist()):
        sample, expected_label = folder[index]
        assert torch.equal(row, sample) and label == expected_label
    assert_same_items(items, [folder[i] for i in indices.tolist()])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.integers(1, 9), min_size=1, max_size=8),
       indices=st.lists(st.integers(-24, 23), max_size=30),
       fmt=st.sampled_from(["hdf5", "arrow"]), kind=st.sampled_from(["raw", "jpeg", "text"]))
def test_any_shard_layout_reads_as_the_file(shard_split, shard_single, tmp_path_factory, counts, indices, fmt, kind):
    path = shard_single(fmt, kind)
    folder = open_dataset(shard_split(path, tmp_path_factory.mktemp("layout") / "shards", tuple(counts)))
    single = open_dataset(path)
    indices = np.asarray(indices, dtype=np.int64)
    assert_same_batch(folder.read_batch(indices), single.read_batch(indices))
    assert_same_items(folder.__getitems__(indices), single.__getitems__(indices))


def test_a_transform_applies_to_folder_items_and_batches(shard_folders, shard_single):
    folder = open_dataset(shard_folders("arrow", "raw"), transform=lambda image: 255 - image)
    single = open_dataset(shard_single("arrow", "raw"), transform=lambda image: 255 - image)
    assert_same_batch(folder.read_batch(BATCHES["unsorted"]), single.read_batch(BATCHES["unsorted"]))
    assert torch.equal(folder[7][0], single[7][0])


# ---------------------------------------------------------------- lazy opening, bounded


def test_nothing_is_opened_until_read_and_pickles_stay_small(shard_folders, fmt):
    root = shard_folders(fmt, "jpeg")
    ds = open_dataset(root)
    assert open_shard_files(root) == (set(), set())
    before = ds.read_batch(np.arange(24))
    assert open_shard_files(root)[1]  # mapped now
    data = pickle.dumps(ds)
    assert len(data) < 8192
    clone = pickle.loads(data)
    assert_same_batch(clone.read_batch(np.arange(24)), before)


@pytest.mark.parametrize("bound", [1, 3])
def test_open_shards_stay_within_the_bound(shard_split, shard_single, fmt, kind, tmp_path, bound):
    single = open_dataset(shard_single(fmt, kind))
    root = shard_split(shard_single(fmt, kind), tmp_path / "tiny", (1,))  # 24 one-sample shards
    ds = open_dataset(root, max_open_shards=bound)
    rng = np.random.default_rng(0)
    for _ in range(6):
        indices = np.sort(rng.choice(24, 5, replace=False))
        assert_same_batch(ds.read_batch(indices), single.read_batch(indices))
        fds, maps = open_shard_files(root)
        assert len(fds) <= bound and len(maps) <= bound, (fds, maps)
    for index in range(24):
        assert_same_items([ds[index]], [single[index]])
    assert np.array_equal(ds.labels, single.labels)
    assert max(len(found) for found in open_shard_files(root)) <= bound


def test_a_batch_over_more_shards_than_the_bound_leaves_its_last_shard_open(shard_split, shard_single, tmp_path):
    # Shards 5 and 18 tie as this batch's; a set lists 18 first, and the store once closed it, the one being read.
    single = open_dataset(shard_single("arrow", "raw"))
    root = shard_split(shard_single("arrow", "raw"), tmp_path / "tiny", (1,))  # 24 one-sample shards
    ds = open_dataset(root, max_open_shards=1)
    assert_same_batch(ds.read_batch(np.array([5, 18])), single.read_batch(np.array([5, 18])))
    fds, maps = open_shard_files(root)
    assert {os.path.basename(path) for path in fds | maps} == {"shard-00018.arrow"}


def test_threads_sharing_a_small_cache_read_the_right_rows(shard_split, shard_single, tmp_path):
    # As make_loader's read-ahead thread and the training loop's ds[i] share one dataset.
    from concurrent.futures import ThreadPoolExecutor

    single = open_dataset(shard_single("hdf5", "text"))
    ds = open_dataset(shard_split(shard_single("hdf5", "text"), tmp_path / "tiny", (1, 2)), max_open_shards=2)
    batches = [np.sort(np.random.default_rng(seed).choice(24, 6, replace=False)) for seed in range(40)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ds.read_batch, batches))
    for indices, batch in zip(batches, results):
        assert_same_batch(batch, single.read_batch(indices))


@pytest.mark.parametrize(("limit", "bound"), [(256, 128), (1024, 128), (4096, 512), (16000, 2000)])
def test_the_default_bound_follows_the_descriptor_limit(shard_folders, limit, bound):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = min(limit, hard)  # lowering the soft limit needs no privilege; raising it past the hard limit does
    bound = min(bound, max(limit // 8, 128))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        assert open_dataset(shard_folders("hdf5", "raw"))._store.max_open_shards == bound
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_max_open_shards_must_be_positive(shard_folders):
    with pytest.raises(ValueError, match="max_open_shards should be a positive integer, got max_open_shards=0"):
        open_dataset(shard_folders("hdf5", "raw"), max_open_shards=0)


def read_in_child(dataset, indices, queue):
    """Process target: read from a dataset that the parent opened and read."""
    batch = dataset.read_batch(np.asarray(indices))[0].numpy()
    queue.put((os.getpid(), dataset._store._pid, batch, open_shard_files(dataset.path)[1]))


def test_a_forked_child_opens_its_own_shards(shard_folders, fmt):
    import multiprocessing

    root = shard_folders(fmt, "jpeg")
    ds = open_dataset(root, max_open_shards=2)
    expected = ds.read_batch(np.arange(24))[0].numpy()  # the parent has two shards open
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=read_in_child, args=(ds, [0, 23], queue))
    child.start()
    try:
        child_pid, store_pid, batch, mapped = queue.get(timeout=60)
    finally:
        child.join(10)
    assert child.exitcode == 0 and store_pid == child_pid != os.getpid()
    assert np.array_equal(batch, expected[[0, 23]])
    index = read_index(root)
    assert mapped == {os.path.realpath(index.path(k)) for k in (0, 6)}  # the parent's maps were dropped
    assert ds._store._pid == os.getpid()


# ---------------------------------------------------------------- damaged and changed shards


def test_a_missing_shard_is_named_when_it_is_read(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "raw"))
    name = read_index(root).names[2]
    os.remove(root / name)
    ds = open_dataset(root)  # the index alone: no shard is opened yet
    assert_same_batch(ds.read_batch([0, 1]), open_dataset(shard_folders(fmt, "raw")).read_batch([0, 1]))
    message = re.escape(repr(os.fspath(root / name))) + " is missing: shard 2 .*fastdata verify"
    for read in (lambda: ds[6], lambda: ds.read_batch(np.arange(10)), lambda: ds.labels):
        with pytest.raises(FormatError, match=message):
            read()


def test_a_shard_of_the_wrong_size_is_named(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "jpeg"))
    name = read_index(root).names[3]
    with open(root / name, "ab") as f:
        f.write(b"more")
    with pytest.raises(FormatError, match=re.escape(name) + r"' has \d+ bytes, the index says \d+.*convert"):
        open_dataset(root).read_batch(np.arange(24))


def test_a_shard_with_damaged_labels_is_refused_at_open(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "raw"))
    path = root / read_index(root).names[1]
    overwrite(path, column_regions(path)["labels"][0] + 8, np.int64(77).tobytes())
    with pytest.raises(FormatError, match=re.escape(path.name) + "' is damaged.*outside -1..3 at sample 1"):
        open_dataset(root)[2]


def test_a_damaged_stored_jpeg_names_the_shard_and_its_sample(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "jpeg"))
    path = root / read_index(root).names[3]  # samples 7-13
    start, _ = column_regions(path)["samples"]
    overwrite(path, start, b"\0" * 64)  # sample 7's header; the checksums are not looked at when reading
    message = re.escape(repr(os.fspath(path))) + ": the stored JPEG of sample 0 does not decode"
    with pytest.raises(FormatError, match=message):
        open_dataset(root).read_batch(np.arange(5, 10))
    with pytest.raises(FormatError, match=message):
        open_dataset(root)[7]


def test_a_shard_replaced_while_closed_is_refused_when_reopened(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "raw"))
    ds = open_dataset(root, max_open_shards=1)
    ds[8]  # shard 3 checked, then closed by reading shard 0
    ds[0]
    path = root / read_index(root).names[3]
    (root / "new").write_bytes(path.read_bytes())
    os.replace(root / "new", path)  # the same bytes in another file: not the one that was checked
    with pytest.raises(FormatError, match=re.escape(path.name) + "' was replaced by another file"):
        ds[8]


@pytest.mark.integration
def test_a_shard_truncated_while_open_is_refused_at_the_next_read(shard_folders, shard_copy, fmt):
    # its read lease broke (NOTE [read leases]): no wait for the fingerprint's RECHECK_SECONDS
    root = shard_copy(shard_folders(fmt, "raw"))
    ds = open_dataset(root)
    before = ds.read_batch(np.arange(24))
    path = root / read_index(root).names[5]
    size = os.path.getsize(path)
    truncate_elsewhere(path, size // 2)
    with pytest.raises(FormatError, match=f"changed size from {size} to {size // 2} bytes"):
        ds.read_batch(np.arange(24))
    assert before[0].shape[0] == 24


# ---------------------------------------------------------------- make_loader


def assert_same_loader_batches(folder, single, **options):
    options = dict(batch_size=5, shuffle=True, seed=3, **options)
    for _ in range(2):  # two epochs: a new order each
        batches = list(make_loader(folder, **options))
        expected = list(make_loader(single, **options))
        assert len(batches) == len(expected) == 5
        for a, b in zip(batches, expected):
            assert_same_batch(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_make_loader_yields_the_files_batches(pair, num_workers):
    folder, single = pair
    assert_same_loader_batches(folder, single, num_workers=num_workers, multiprocessing_context="fork")


@pytest.fixture
def pieces_on_threads(monkeypatch):
    """Copy every raw batch in pieces on helper threads, however small (see NOTE [copy on two cores])."""
    monkeypatch.setattr(rowcopy, "PARALLEL_BYTES", 0)


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_pipelined_batches_are_the_files_and_kept_ones_stay_intact(shard_converted, shard_single, fmt,
                                                                    pieces_on_threads, threads):
    folder, single = open_dataset(shard_converted(fmt, "raw")), open_dataset(shard_single(fmt, "raw"))
    loader = make_loader(folder, 7, shuffle=True, seed=1)
    if threads is not None:
        loader.options = {"threads": threads}
    for epoch in range(2):
        batches = list(loader)  # every batch kept: none may be overwritten by a later copy
        order = BatchIndexSampler(len(folder), 7, shuffle="uniform", seed=1)
        order.set_epoch(epoch)
        assert len(batches) == len(order)
        for batch, indices in zip(batches, order):
            assert_same_batch(batch, single.read_batch(indices))


def test_stopping_a_pipelined_loader_early_ends_its_copies_and_leases(shard_converted, fmt, pieces_on_threads):
    folder = open_dataset(shard_converted(fmt, "raw"))
    batches = iter(make_loader(folder, 6, shuffle=True))
    first = next(batches)
    kept = first[0].clone()
    next(batches)  # the next batch is started already
    batches.close()
    stitch = folder._store._stitch
    assert stitch is None or stitch._leases == 0  # every started batch finished and released its rows
    assert torch.equal(first[0], kept)


@pytest.mark.parametrize("start_method", start_methods("spawn", "forkserver"))
def test_make_loader_workers_started_afresh(shard_converted, shard_single, start_method):
    folder, single = open_dataset(shard_converted("arrow", "jpeg")), open_dataset(shard_single("arrow", "jpeg"))
    assert_same_loader_batches(folder, single, num_workers=2, multiprocessing_context=start_method)


def test_the_fingerprint_follows_the_data_not_the_place(shard_folders, shard_copy, packed_files, fmt):
    root = shard_folders(fmt, "raw")
    copied = shard_copy(root)
    assert open_dataset(copied).fingerprint == open_dataset(root).fingerprint
    assert len({open_dataset(root).fingerprint, open_dataset(shard_folders(fmt, "jpeg")).fingerprint,
                open_dataset(packed_files(fmt, "raw")).fingerprint}) == 3
    index = json.loads((copied / "index.json").read_text())
    index["metadata"]["mean"][0] += 0.5  # the same files, other statistics: other data to a resumed loader
    (copied / "index.json").write_text(json.dumps(index))
    assert open_dataset(copied).fingerprint != open_dataset(root).fingerprint
