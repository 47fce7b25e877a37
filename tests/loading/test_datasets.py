"""HDF5Dataset / ArrowDataset: len, indexing, batch == per-item, pickling, lazy per-process open."""

import multiprocessing
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import torch
from support import (
    NUM_CLASSES,
    PER_CLASS,
    STORED_SIZE,
    column_regions,
    downgrade_to_version1,
    expected_images,
    overwrite,
    private_copy,
    raises_in_workers,
    start_methods,
)
from torch.utils.data import DataLoader

from fastdata import ArrowDataset, HDF5Dataset, open_dataset
from fastdata.codecs.images import ImageSpec
from fastdata.converters import find_images
from fastdata.errors import FormatError

NUM_SAMPLES = NUM_CLASSES * PER_CLASS
CLASSES = {"hdf5": HDF5Dataset, "arrow": ArrowDataset}


def invert(image):
    """A module-level transform (picklable for spawn)."""
    return 255 - image


def read_in_child(dataset, indices, queue):
    """Process target: read from a dataset that was opened (and read) in the parent."""
    items = np.stack([dataset[i][0].numpy() for i in indices])
    batch = dataset.read_batch(np.asarray(indices))[0].numpy()
    queue.put((os.getpid(), dataset._pid, items, batch))


@pytest.fixture
def ds(packed):
    return open_dataset(packed)


@pytest.fixture(scope="module")
def expected(source_root):
    """Expected CHW images per storage, from load_image on the sources."""
    _, relpaths, labels = find_images(source_root)
    spec = ImageSpec(STORED_SIZE, STORED_SIZE)
    images = {
        storage: expected_images(source_root, relpaths, spec, storage).transpose(0, 3, 1, 2)
        for storage in ("raw", "jpeg")
    }
    return images, labels


# ---------------------------------------------------------------- basics


def test_open_dataset_picks_the_class_by_extension(packed, fmt):
    assert type(open_dataset(packed)) is CLASSES[fmt]


def test_len_classes_labels_and_metadata(ds, storage, source_root):
    classes, _, labels = find_images(source_root)
    assert len(ds) == NUM_SAMPLES
    assert ds.classes == classes
    assert ds.labels.dtype == np.int64
    assert ds.labels.tolist() == labels.tolist()
    assert ds.metadata["num_samples"] == NUM_SAMPLES
    assert ds.metadata["storage"] == storage == ds.storage
    assert ds.metadata["class_counts"] == [PER_CLASS] * NUM_CLASSES
    assert len(ds.metadata["mean"]) == len(ds.metadata["std"]) == 3
    assert ds.metadata["preprocessing"]["resize"] == "crop"
    assert ds.metadata["skipped"] == []


def test_repr_shows_file_format_size_and_fields(ds, packed, fmt, storage):
    text = repr(ds)
    assert text.startswith(f"<{CLASSES[fmt].__name__} ")
    for part in (repr(packed.name), fmt, f"{NUM_SAMPLES} samples", f"uint8[3,{STORED_SIZE},{STORED_SIZE}]", storage):
        assert part in text, part


def test_items_equal_the_preprocessed_sources(ds, storage, expected):
    images, labels = expected
    for index in range(len(ds)):
        image, label = ds[index]
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
        assert tuple(image.shape) == (3, STORED_SIZE, STORED_SIZE)
        assert type(label) is int and label == labels[index]
        assert np.array_equal(image.numpy(), images[storage][index])


def test_negative_indices_work_like_a_sequence(ds):
    for index in (-1, -5, -NUM_SAMPLES):
        image, label = ds[index]
        other, other_label = ds[NUM_SAMPLES + index]
        assert torch.equal(image, other) and label == other_label


@pytest.mark.parametrize("index", [NUM_SAMPLES, NUM_SAMPLES + 10, -NUM_SAMPLES - 1])
def test_index_out_of_range(ds, index):
    with pytest.raises(IndexError, match="out of range"):
        ds[index]
    with pytest.raises(IndexError, match="out of range"):
        ds.__getitems__([0, index])
    with pytest.raises(IndexError, match="out of range"):
        ds.read_batch(np.array([0, index]))


@pytest.mark.parametrize("index", [1.0, "3", None, True, (1,), slice(0, 2)])
def test_non_integer_index_is_a_type_error(ds, index):
    with pytest.raises(TypeError, match="index should be an integer"):
        ds[index]


def test_numpy_and_torch_integer_indices(ds):
    assert torch.equal(ds[np.int64(3)][0], ds[3][0])
    assert torch.equal(ds[np.int32(-2)][0], ds[NUM_SAMPLES - 2][0])


def test_items_do_not_share_memory_with_the_file(ds):
    image, _ = ds[0]
    image += 1  # writable, owns its memory: the packed file must not change
    assert not torch.equal(ds[0][0], image)


# ---------------------------------------------------------------- batch path == per-item path


@pytest.mark.parametrize("seed", [0, 1])
def test_getitems_equals_items_in_caller_order(ds, seed):
    indices = np.random.default_rng(seed).integers(-NUM_SAMPLES, NUM_SAMPLES, 40).tolist()
    indices += [indices[0], indices[0], 5, 5]  # duplicates
    batch = ds.__getitems__(indices)
    assert len(batch) == len(indices)
    for index, (image, label) in zip(indices, batch):
        single, single_label = ds[index]
        assert torch.equal(image, single)
        assert type(label) is int and label == single_label


@pytest.mark.parametrize("seed", [0, 1])
def test_read_batch_equals_items(ds, seed):
    indices = np.random.default_rng(seed).integers(0, NUM_SAMPLES, 30)
    indices[-3:] = indices[0]  # duplicates, unsorted
    images, labels = ds.read_batch(indices)
    assert images.dtype == torch.uint8 and tuple(images.shape) == (30, 3, STORED_SIZE, STORED_SIZE)
    assert labels.dtype == torch.int64 and tuple(labels.shape) == (30,)
    for row, index in enumerate(indices):
        image, label = ds[int(index)]
        assert torch.equal(images[row], image)
        assert labels[row].item() == label


def test_read_batch_of_sorted_indices_and_empty_batch(ds):
    images, labels = ds.read_batch(np.arange(NUM_SAMPLES))
    assert torch.equal(images, torch.stack([ds[i][0] for i in range(NUM_SAMPLES)]))
    assert labels.tolist() == ds.labels.tolist()
    images, labels = ds.read_batch(np.array([], np.int64))
    assert tuple(images.shape) == (0, 3, STORED_SIZE, STORED_SIZE) and tuple(labels.shape) == (0,)
    assert ds.__getitems__([]) == []


def test_kept_batches_are_never_overwritten(ds):
    # see NOTE [buffer reuse]: later reads must not write into a batch still held
    rng = np.random.default_rng(7)
    kept = [ds.read_batch(np.sort(rng.integers(0, NUM_SAMPLES, 8))) for _ in range(12)]
    views = [images[1:3] for images, _ in kept[:4]]  # views keep their batch alive too
    expected = [images.clone() for images, _ in kept]
    del kept[:4]
    for _ in range(20):
        ds.read_batch(np.sort(rng.integers(0, NUM_SAMPLES, 8)))
    assert all(torch.equal(view, images[1:3]) for view, images in zip(views, expected[:4]))
    assert all(torch.equal(images, copy) for (images, _), copy in zip(kept, expected[4:]))


def test_raw_batch_buffers_are_reused_once_dropped(packed_files):
    ds = open_dataset(packed_files("hdf5", "raw"))
    indices = np.arange(8)
    address = ds.read_batch(indices)[0].data_ptr()  # the batch is dropped at once
    assert ds.read_batch(indices[::-1])[0].data_ptr() == address
    held = ds.read_batch(indices)[0]
    assert ds.read_batch(indices)[0].data_ptr() != held.data_ptr()


def test_jpeg_batches_are_channels_last_views(packed_files):
    # see NOTE [channels last]: same values as per item, no transposing copy
    ds = open_dataset(packed_files("hdf5", "jpeg"))
    images, _ = ds.read_batch(np.arange(4))
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    assert torch.equal(images.contiguous(), torch.stack([ds[i][0] for i in range(4)]))


def test_jpeg_decode_threads_give_the_same_batch(packed_files):
    ds = open_dataset(packed_files("arrow", "jpeg"))
    indices = np.arange(NUM_SAMPLES)
    batches = [ds.read_batch(indices, threads=threads)[0] for threads in (1, 3)]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[0], ds.read_batch(indices)[0])


@pytest.mark.parametrize("threads", [1, 3])
def test_a_damaged_stored_jpeg_names_the_file_and_the_sample(packed_files, tmp_path, threads):
    damaged = tmp_path / "damaged.h5"
    shutil.copy(packed_files("hdf5", "jpeg"), damaged)
    with h5py.File(damaged, "r") as f:
        start, stop = f["offsets"][5:7]
        where = f["samples"].id.get_offset() + int(start)
    with open(damaged, "r+b") as f:  # zero sample 5's JPEG bytes, SOI marker included
        f.seek(where)
        f.write(bytes(int(stop - start)))
    ds = open_dataset(damaged)
    with pytest.raises(FormatError, match=r"damaged\.h5.*sample 5 does not decode.*convert the source again"):
        ds.read_batch(np.arange(NUM_SAMPLES), threads=threads)
    with pytest.raises(FormatError, match="sample 5"):
        ds[5]
    assert ds.read_batch(np.array([4, 6]), threads=threads)[0].shape[0] == 2  # the other samples still read


def test_jpeg_decoders_agree(packed_files, monkeypatch):
    # simplejpeg (fastdata[jpeg]) and the Pillow fallback give the same pixels.
    pytest.importorskip("simplejpeg")
    ds = open_dataset(packed_files("arrow", "jpeg"))
    fast = ds.read_batch(np.arange(NUM_SAMPLES))[0]
    monkeypatch.setattr("fastdata.codecs.images._simplejpeg", None)
    assert torch.equal(ds.read_batch(np.arange(NUM_SAMPLES))[0], fast)
    assert torch.equal(ds[3][0], fast[3])


def test_read_batch_rejects_2d_indices(ds):
    with pytest.raises(ValueError, match="1-D"):
        ds.read_batch(np.zeros((2, 2), np.int64))


def test_hdf5_and_arrow_give_identical_samples(packed_files, storage):
    h5 = HDF5Dataset(packed_files("hdf5", storage))
    arrow = ArrowDataset(packed_files("arrow", storage))
    everything = np.arange(NUM_SAMPLES)
    for a, b in zip(h5.read_batch(everything), arrow.read_batch(everything)):
        assert torch.equal(a, b)
    assert h5.classes == arrow.classes
    assert h5.metadata["mean"] == arrow.metadata["mean"]


# ---------------------------------------------------------------- transform


def test_transform_is_applied_on_both_paths(packed):
    plain, inverted = open_dataset(packed), open_dataset(packed, transform=invert)
    assert torch.equal(inverted[3][0], 255 - plain[3][0])
    assert inverted[3][1] == plain[3][1]
    indices = np.array([7, 2, 2, 11])
    images, labels = inverted.read_batch(indices)
    assert torch.equal(images, 255 - plain.read_batch(indices)[0])
    for (image, _), index in zip(inverted.__getitems__(indices.tolist()), indices):
        assert torch.equal(image, 255 - plain[int(index)][0])


def test_transform_may_change_dtype_and_shape(packed):
    ds = open_dataset(packed, transform=lambda image: image.float().mean(0, keepdim=True) / 255)
    image, _ = ds[0]
    assert image.dtype == torch.float32 and tuple(image.shape) == (1, STORED_SIZE, STORED_SIZE)
    images, _ = ds.read_batch(np.array([0, 1]))
    assert images.dtype == torch.float32 and tuple(images.shape) == (2, 1, STORED_SIZE, STORED_SIZE)
    assert torch.equal(images[0], image)


# ---------------------------------------------------------------- pickling and processes


def test_pickle_after_reading_carries_no_memory_map(ds, packed):
    ds.read_batch(np.arange(NUM_SAMPLES))  # opens the maps (and a decoding pool for jpeg)
    ds[0]
    data = pickle.dumps(ds)
    assert len(data) < 4096 < os.path.getsize(packed)
    clone = pickle.loads(data)
    assert len(clone) == len(ds) and repr(clone) == repr(ds)
    for index in (0, 5, NUM_SAMPLES - 1):
        assert torch.equal(clone[index][0], ds[index][0])
    assert torch.equal(clone.read_batch(np.arange(6))[0], ds.read_batch(np.arange(6))[0])


def test_pickle_before_reading(packed):
    ds = open_dataset(packed)
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[1][0], ds[1][0])


def test_forked_child_reopens_the_file(ds):
    ds[0]  # opened in the parent...
    ds.read_batch(np.arange(NUM_SAMPLES))  # ...with a decoding thread pool for jpeg
    parent_pid = ds._pid
    assert parent_pid == os.getpid()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=read_in_child, args=(ds, [0, 3, NUM_SAMPLES - 1], queue))
    child.start()
    try:
        child_pid, pid_seen_by_dataset, items, batch = queue.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()  # e.g. stuck on the parent's thread pool, which has no threads in the child
    assert child.exitcode == 0
    assert child_pid != parent_pid
    assert pid_seen_by_dataset == child_pid  # reopened in the child
    assert ds._pid == parent_pid  # the parent's state is untouched
    expected = np.stack([ds[i][0].numpy() for i in (0, 3, NUM_SAMPLES - 1)])
    assert np.array_equal(items, expected) and np.array_equal(batch, expected)


@pytest.mark.parametrize("start_method", start_methods("spawn", "fork"))
def test_plain_torch_dataloader_with_workers(packed_files, start_method):
    ds = HDF5Dataset(packed_files("hdf5", "jpeg"), transform=invert)
    expected_images, expected_labels = ds.read_batch(np.arange(NUM_SAMPLES))  # opened in the parent first
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=start_method)
    batches = list(loader)
    assert [len(labels) for _, labels in batches] == [8, 8, 8]
    images = torch.cat([images for images, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    assert torch.equal(images, expected_images)
    assert torch.equal(labels, expected_labels)


# ---------------------------------------------------------------- damaged and changed files


def test_a_version1_file_reads_as_before(packed, tmp_path):
    old = downgrade_to_version1(private_copy(packed, tmp_path, "old"))
    ds, new = open_dataset(old), open_dataset(packed)
    assert ds.metadata["format_version"] == 1 and "checksums" not in ds.metadata
    for a, b in zip(ds.read_batch(np.arange(NUM_SAMPLES)), new.read_batch(np.arange(NUM_SAMPLES))):
        assert torch.equal(a, b)


def test_a_label_outside_the_classes_is_refused_at_open(packed_files, fmt, tmp_path):
    path = private_copy(packed_files(fmt, "raw"), tmp_path)
    overwrite(path, column_regions(path)["labels"][0] + 5 * 8, np.int64(6772140792788799435).tobytes())
    named = re.escape(os.fspath(path)) + r".*outside -1..3 at sample 5 .*6772140792788799435"
    with pytest.raises(FormatError, match=named):
        open_dataset(path)


@pytest.mark.parametrize("value", [2**60, 2**40, -(2**40), -5, 3])
def test_damaged_text_offsets_are_refused_at_open(packed_text, fmt, tmp_path, value):
    # Before: wrong tokens, empty samples, "array is too big" or a 512 TiB MemoryError.
    path = private_copy(packed_text(fmt), tmp_path)
    overwrite(path, column_regions(path)["offsets"][0] + 4 * 8, np.int64(value).tobytes())
    with pytest.raises(FormatError, match=re.escape(os.fspath(path)) + ".*offsets of (sample 3|samples 3-4) are out"):
        ds = open_dataset(path)
        ds.read_batch(np.arange(len(ds)))


def test_a_damaged_last_offset_is_refused_at_open(packed_files, fmt, tmp_path):
    path = private_copy(packed_files(fmt, "jpeg"), tmp_path)
    overwrite(path, column_regions(path)["offsets"][0] + NUM_SAMPLES * 8, np.int64(2**50).tobytes())
    with pytest.raises(FormatError, match=re.escape(os.fspath(path)) + f".*sample {NUM_SAMPLES - 1} "):
        open_dataset(path)


def reads(ds):
    """Every public way to read a dataset."""
    return [lambda: ds[0], lambda: ds.__getitems__([0, 1]), lambda: ds.read_batch(np.arange(3)), lambda: ds.labels]


@pytest.mark.parametrize("opened", [False, True])
def test_a_file_replaced_after_the_dataset_was_made(packed_files, fmt, tmp_path, opened):
    # Before: a bare IndexError/ValueError, or other data, depending on what replaced it.
    path = private_copy(packed_files(fmt, "raw"), tmp_path)
    ds = open_dataset(path)
    if opened:
        ds.read_batch(np.arange(4))
    os.replace(private_copy(packed_files(fmt, "jpeg"), tmp_path, "other"), path)
    for read in reads(ds):
        with pytest.raises(FormatError, match=re.escape(os.fspath(path)) + ".* replaced by another file.*open_dataset"):
            read()
    assert len(open_dataset(path)[0]) == 2  # opened again, it reads the new file


def test_a_file_touched_or_resized_after_the_dataset_was_made(packed_files, fmt, tmp_path):
    path = private_copy(packed_files(fmt, "raw"), tmp_path)
    ds = open_dataset(path)
    ds[0]
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    with pytest.raises(FormatError, match="was modified after this dataset was opened"):
        ds[0]
    with open(path, "ab") as f:
        f.write(b"more")
    with pytest.raises(FormatError, match=f"changed size from {stat.st_size} to {stat.st_size + 4} bytes"):
        ds.read_batch(np.arange(2))
    os.remove(path)
    with pytest.raises(FormatError, match="was deleted"):
        ds.read_batch(np.arange(2))


def test_workers_refuse_a_file_replaced_before_they_open_it(packed_files, tmp_path):
    path = private_copy(packed_files("arrow", "raw"), tmp_path)
    ds = ArrowDataset(path)
    ds.read_batch(np.arange(2))  # the parent's map still holds the old file...
    os.replace(private_copy(packed_files("arrow", "jpeg"), tmp_path, "other"), path)
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
    raises_in_workers(loader, FormatError, "replaced by another file")  # ...the workers would map the new one
    with pytest.raises(FormatError, match="replaced by another file"):  # as a spawned worker gets it
        pickle.loads(pickle.dumps(ds))[0]


def test_workers_reading_a_file_truncated_under_them_raise_instead_of_sigbus(packed_files, tmp_path):
    # Before: a worker died of SIGBUS, and torch blamed shared memory.
    path = private_copy(packed_files("hdf5", "raw"), tmp_path)
    loader = DataLoader(HDF5Dataset(path), batch_size=8, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    assert len(list(loader)) == 3  # the workers have mapped and read the file
    os.truncate(path, os.path.getsize(path) // 2)
    raises_in_workers(loader, FormatError, "changed size from")


TRUNCATE_UNDER_A_READER = textwrap.dedent("""
    import os, subprocess, sys
    import numpy as np
    from fastdata import FormatError, open_dataset

    for path in sys.argv[1:]:
        ds = open_dataset(path)
        ds.read_batch(np.arange(len(ds)))  # the file is mapped and read
        # by another program: in this one, truncate(2) of a leased file is interrupted (NOTE [read leases])
        subprocess.run([sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], int(sys.argv[2]))",
                        path, str(os.path.getsize(path) // 2)], check=True, timeout=60)
        for read in (lambda: ds.read_batch(np.arange(len(ds))), lambda: ds[len(ds) - 1]):
            try:
                read()
            except FormatError as exc:
                print("FormatError:", exc)
            else:
                sys.exit(f"read the truncated {path} without an error")
""")


@pytest.mark.integration
def test_a_file_truncated_under_a_reader_raises_instead_of_sigbus(packed_files, tmp_path):
    # Before: touching the mapped pages past the new end killed the process with SIGBUS.
    paths = [os.fspath(private_copy(packed_files(fmt, storage), tmp_path, f"{fmt}-{storage}"))
             for fmt in ("hdf5", "arrow") for storage in ("raw", "jpeg")]
    done = subprocess.run([sys.executable, "-c", TRUNCATE_UNDER_A_READER, *paths],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert done.stdout.count("FormatError:") == 2 * len(paths) and "changed size from" in done.stdout
