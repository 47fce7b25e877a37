"""Window reads: a block order's windows read whole with direct I/O give the same batches as the files, safely."""

import gc
import multiprocessing
import os
import pickle
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import memory_short_of, planned, start_methods, wait_for, walk_windows

from fastdata import convert_imagefolder, make_loader, open_dataset
from fastdata.errors import FastPathWarning, FormatError
from fastdata.formats import column_offsets
from fastdata.formats.layout import COLUMN_ALIGNMENT
from fastdata.loading.helper import HelperReadAhead
from fastdata.measure.synthetic import make_imagefolder
from fastdata.reading.order import EpochOrder
from fastdata.reading.readahead import ReadAhead
from fastdata.reading.windows import (
    HUGE_PAGE,
    MAX_SLACK,
    WindowAhead,
    WindowReads,
    direct_alignment,
    direct_buffer,
    place_runs,
)

NUM_CLASSES, PER_CLASS = 5, 40  # 200 photos of varied sizes, modes and formats


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Return ``{size: raw HDF5 shard folder}`` of 200 varied photos at 32 px (rows of 3,072 bytes) and 40 px (4,800).

    Shards of 16 rows at 32 px: blocks span shards. At 40 px, 60 rows: a row
    of 4,800 bytes lands on a row of the view only every 8 rows (at 512-byte
    alignment; NOTE [window reads]), so blocks are larger than that.
    """
    work = tmp_path_factory.mktemp("windows")
    source = make_imagefolder(work / "photos", NUM_CLASSES, PER_CLASS, size=(60, 45), seed=3, vary=True)
    out = {}
    for size, shard_rows in ((32, 16), (40, 60)):
        out[size] = work / f"raw-{size}"
        convert_imagefolder(source, out[size], size=size, storage="raw", shard_size=shard_rows * 3 * size * size,
                            workers=1, progress=False)
    return out


def reference(folder, indices):
    """The batch read from the files (a dataset that reads no windows; its fast paths' warnings are not tested here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathWarning)
        images, labels = open_dataset(folder).read_batch(indices)
    return images.numpy(), labels.numpy()


def block_order(dataset, batch, block_size, window, seed=0):
    return EpochOrder(len(dataset), batch, shuffle="block", seed=seed, block_size=block_size, window=window)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.sampled_from([32, 40]), batch=st.integers(1, 40), block_size=st.integers(1, 40),
       window=st.integers(1, 8), epoch=st.integers(0, 3), seed=st.integers(0, 2**16))
@example(size=40, batch=16, block_size=30, window=4, epoch=1, seed=7)  # rows on the view's rows every 8 rows
@pytest.mark.slow
def test_every_batch_of_an_epoch_is_the_files_and_those_in_the_wanted_windows_come_from_them(
        folders, size, batch, block_size, window, epoch, seed):
    dataset = open_dataset(folders[size])
    assert dataset.num_shards >= 4
    order = block_order(dataset, batch, block_size, window, seed)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", FastPathWarning)
        reads = dataset.read_windows(order)
    assert (reads is None) == (len(said) == 1)  # a fast path that cannot apply says so
    if reads is None:  # only where the rows' places would leave more unused rows than MAX_SLACK allows
        assert "pass a larger block_size or window" in str(said[0].message)
        alignment = direct_alignment(dataset.shard_paths[0])
        assert WindowReads(dataset._store, order, alignment).slot_rows > (1 + MAX_SLACK) * window * block_size + 1
        return
    for indices, images, labels, from_windows in walk_windows(dataset, reads, epoch):
        assert from_windows or "window miss" in dataset.fallbacks()
        expected = reference(folders[size], indices)
        assert np.array_equal(images, expected[0]) and np.array_equal(labels, expected[1])


def test_make_loader_reads_windows_alone_and_resumes_to_the_same_batches(folders, monkeypatch):
    folder = folders[32]
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    loader = make_loader(dataset, 16, shuffle=True, block_size=6, window=5, seed=4)
    assert isinstance(loader.steps.readahead, WindowAhead)
    for epoch in range(2):
        seen, batches = [], planned(loader, epoch)
        for (images, labels), indices in zip(loader, batches, strict=True):
            expected = reference(folder, indices)
            assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
            seen.extend(indices.tolist())
        assert sorted(seen) == list(range(len(dataset)))
    batches = iter(loader)
    kept = [next(batches) for _ in range(5)]
    state = loader.state_dict()
    rest = [batch for batch in batches]
    resumed = make_loader(open_dataset(folder), 16, shuffle=True, block_size=6, window=5, seed=4)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(kept) + len(again) == len(loader) and len(again) == len(rest)
    assert all(a.equal(b) for x, y in zip(again, rest) for a, b in zip(x, y))


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn"))
def test_a_helper_process_reads_the_windows_itself_and_resumes_to_the_same_batches(folders, monkeypatch,
                                                                                   start_method):
    # NOTE [read-ahead in the helper]: the helper reads every batch, so it reads the windows too, told each step
    # by the training process's cursor; the training process reads none
    folder = folders[32]
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    options = {"shuffle": True, "block_size": 6, "window": 5, "seed": 4, "helper_process": True,
               "multiprocessing_context": start_method}

    def cloned(batch):
        return tuple(tensor.clone() for tensor in batch)

    with make_loader(dataset, 16, **options) as loader:
        assert isinstance(loader.steps.readahead, HelperReadAhead)
        for epoch in range(2):
            for (images, labels), indices in zip(loader, planned(loader, epoch), strict=True):
                expected = reference(folder, indices)
                assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
        batches = iter(loader)
        kept = [cloned(next(batches)) for _ in range(5)]
        state = loader.state_dict()
        rest = [cloned(batch) for batch in batches]
        report = loader.helper.report()
    assert report["readahead"] == "WindowAhead"
    counts = report["read_paths"]
    assert counts["windows"] == sum(counts.values()) == 3 * len(loader), counts
    assert dataset.read_paths() == counts and sum(dataset.read_path_log.counts.values()) == 0  # all in the helper
    with make_loader(open_dataset(folder), 16, **options) as resumed:
        resumed.load_state_dict(state)  # mid-epoch: the helper's windows start at the step the state names
        again = [cloned(batch) for batch in resumed]
        counts = resumed.helper.report()["read_paths"]
    assert len(kept) + len(again) == len(loader) and len(again) == len(rest)
    assert all(a.equal(b) for x, y in zip(again, rest, strict=True) for a, b in zip(x, y, strict=True))
    assert counts["windows"] == sum(counts.values()) == len(rest), counts


@pytest.mark.parametrize("shuffle", ["block", "uniform"])
def test_a_helper_process_of_one_rank_of_two_hints_its_own_maps(folders, monkeypatch, shuffle):
    # NOTE [read-ahead in the helper]: a rank of several would read every window, so it keeps the kernel hints
    # (NOTE [read ahead]), and the helper gives them on the maps it reads: the same batches as read in-process
    folder = folders[32]
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    options = {"shuffle": shuffle, "block_size": 6, "window": 5, "seed": 4, "rank": 1, "world_size": 2}
    expected = [tuple(tensor.clone() for tensor in batch) for batch in make_loader(open_dataset(folder), 8, **options)]
    with make_loader(dataset, 8, helper_process=True, **options) as loader:
        got = [tuple(tensor.clone() for tensor in batch) for batch in loader]
        report = loader.helper.report()
    assert len(got) == len(expected) and all(
        a.equal(b) for x, y in zip(got, expected, strict=True) for a, b in zip(x, y, strict=True))
    assert report["readahead"] == "ReadAhead" and report["batches"] == len(expected), report


def test_a_loader_closed_mid_epoch_reads_its_next_epochs_from_windows_again(folders, monkeypatch):
    folder = folders[32]
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    loader = make_loader(dataset, 16, shuffle=True, block_size=6, window=5, seed=4)
    for step, _ in enumerate(loader):  # a loop that breaks, then closes its loader (as a trainer's teardown)
        if step == 3:
            break
    loader.close()
    assert loader.steps.readahead.reads._pid is None  # its threads told to end: the next epoch starts new ones
    before = dataset.read_paths()["windows"]
    for epoch in (1, 2):
        for (images, labels), indices in zip(loader, planned(loader, epoch), strict=True):
            expected = reference(folder, indices)
            assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
    assert dataset.read_paths()["windows"] - before >= len(loader)  # both epochs' batches: windows read again
    loader.close()


def test_one_packed_file_reads_its_windows_too(packed_files, monkeypatch):
    path = packed_files("hdf5", "raw")
    dataset = open_dataset(path)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    # prefetch_factor=0: the loop body below (a reference read per batch) is slow enough for the loader to read
    # ahead on a thread, which reads the next epoch's first batch and moves the windows on past the last one.
    loader = make_loader(dataset, 5, shuffle=True, block_size=2, window=4, seed=1, prefetch_factor=0)
    reads = loader.steps.readahead.reads
    assert isinstance(reads, WindowReads) and dataset.num_shards == 1
    for (images, labels), indices in zip(loader, planned(loader, 0), strict=True):
        expected = reference(path, indices)
        assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
    order = loader.sampler.order
    last = order.window_ranges(0, order.window_of(0, order.epoch_length - 1))
    assert _taken(reads, np.concatenate([np.arange(a, b) for a, b in last]))  # held: read from its slot


def test_windows_let_go_while_read_keep_their_slots_until_the_reads_end(folders, monkeypatch):
    # The loader and a second walk of its step cursor (which moves the same WindowAhead) want windows in turn,
    # letting each go while it is still being read: a slot reused then took a late label write (a bug, found so).
    folder = folders[32]
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    loader = make_loader(dataset, 16, shuffle=True, block_size=6, window=5, seed=4)
    with warnings.catch_warnings():  # the batches outside the windows the walk left are read from the files, said so
        warnings.filterwarnings("ignore", "a batch .* lies outside the block order's windows", FastPathWarning)
        for epoch in range(3):
            for (images, labels), indices in zip(loader, loader.steps.batches(epoch), strict=True):
                expected = reference(folder, indices)
                assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])


def test_workers_ranks_and_a_uniform_order_keep_the_hints(folders, monkeypatch):
    dataset = open_dataset(folders[32])
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    for options in ({"num_workers": 1}, {"rank": 0, "world_size": 2}, {"shuffle": "uniform"}):
        loader = make_loader(dataset, 8, **{"shuffle": True, **options})
        assert isinstance(loader.steps.readahead, ReadAhead), options
    make_loader(dataset, 8, shuffle=True, block_size=6, window=5)
    assert dataset._store.windows is not None
    assert pickle.loads(pickle.dumps(dataset))._store.windows is None  # a worker reads its files, not our windows


def test_a_slot_is_read_again_only_once_no_batch_reads_it(folders):
    folder = folders[32]
    dataset = open_dataset(folder)
    order = block_order(dataset, 8, 4, 3)  # windows of 12 samples
    reads = dataset.read_windows(order)
    reads.want([(0, 0), (0, 1)])
    held_indices = np.sort(order.samples(0, np.arange(0, 8)))
    held = reads.parts(held_indices)  # window 0, leased
    assert held is not None
    reads.want([(0, 1), (0, 2)])  # window 2 waits for window 0's slot
    time.sleep(0.3)
    later = np.sort(order.samples(0, np.arange(24, 32)))  # window 2
    assert reads.parts(later) is None
    view, rows = held.stitched
    assert np.array_equal(view[rows], reference(folder, held_indices)[0])  # not overwritten
    held.release()
    wait_for(lambda: _taken(reads, later), "window 2 to be read", seconds=10)
    images, labels = dataset.read_batch(later)
    assert np.array_equal(images.numpy(), reference(folder, later)[0])


def _taken(reads, indices):
    parts = reads.parts(indices)
    if parts is None:
        return False
    parts.release()
    return True


def test_a_shard_changed_after_it_was_checked_is_reported_by_the_batch_that_reads_it(folders, shard_copy):
    folder = shard_copy(folders[32])
    dataset = open_dataset(folder)
    dataset.read_batch(np.arange(len(dataset)))  # every shard opened and checked
    order = block_order(dataset, 8, 4, 1000)  # one window: every sample
    reads = dataset.read_windows(order)
    victim = dataset.shard_paths[3]
    os.utime(victim, ns=(time.time_ns(), time.time_ns() + 10**9))
    reads.want([(0, 0)])
    with pytest.raises(FormatError, match="was modified.*must not change while it is read"):
        dataset.read_batch(np.arange(len(dataset)))
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    reads.want([(1, 0)])
    with pytest.raises(FormatError, match=f"{os.path.basename(victim)}.*changed size"):
        dataset.read_batch(np.arange(len(dataset)))
    os.remove(victim)
    reads.want([(2, 0)])
    with pytest.raises(FormatError, match=f"{os.path.basename(victim)}.*was deleted"):
        dataset.read_batch(np.arange(len(dataset)))


@pytest.mark.parametrize("container", ["hdf5", "arrow"])
def test_every_batch_of_a_converted_folder_is_read_from_its_windows_without_a_warning(
        shard_converted, monkeypatch, container):
    folder = shard_converted(container, "raw")
    dataset = open_dataset(folder)
    assert {column_offsets(path)[0] % COLUMN_ALIGNMENT for path in dataset.shard_paths} == {0}  # NOTE [aligned columns]
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        loader = make_loader(dataset, 8, shuffle=True, block_size=4, window=2, seed=2)  # 3 windows an epoch
        assert loader.sampler.shuffle == "block" and isinstance(loader.steps.readahead, WindowAhead)
        for (images, labels), indices in zip(loader, planned(loader, 0), strict=True):
            expected = reference(folder, indices)
            assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
    counts = dataset.read_paths()  # every batch (the next epoch's first, read early, too): none from the files
    assert counts["windows"] == sum(counts.values()) >= len(loader), counts


@pytest.fixture(scope="module")
def unaligned(folders):
    """An Arrow raw shard folder of ``folders``' photos written as before NOTE [aligned columns]: shard 0's pixels
    lie 8 bytes before the other shards' (their metadata, which names the inputs [16, 32], is longer)."""
    out = folders[32].parent / "unaligned-32"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("fastdata.formats.arrow.COLUMN_ALIGNMENT", 1)
        convert_imagefolder(folders[32].parent / "photos", out, size=32, storage="raw", format="arrow",
                            shard_size=16 * 3 * 32 * 32, workers=1, progress=False)
    return out


def test_shards_whose_columns_lie_apart_are_read_from_windows_moved_onto_rows_and_said_once(unaligned, monkeypatch):
    dataset = open_dataset(unaligned)
    starts = [column_offsets(path)[0] for path in dataset.shard_paths]
    assert len(set(starts)) > 1 and starts[0] != starts[1] and len(set(starts[1:])) == 1  # as the issue found
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", FastPathWarning)
        loader = make_loader(dataset, 6, shuffle=True, block_size=4, window=3, seed=9)
        for epoch in range(2):
            for (images, labels), indices in zip(loader, planned(loader, epoch), strict=True):
                expected = reference(unaligned, indices)
                assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
    counts = dataset.read_paths()
    assert counts["windows"] == sum(counts.values()) >= 2 * len(loader), (counts, [str(w.message)[:150] for w in said])
    said = dataset.fallbacks()  # warned on the placing thread (a test's warnings filters are not its to see)
    assert "shard 0 " in said["moved rows"] and "moved onto the window's rows" in said["moved rows"], said


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn"))
def test_a_helper_process_says_in_the_training_process_what_could_not_apply(unaligned, monkeypatch, start_method):
    # NOTE [paths read elsewhere]: the helper's fallbacks are warned here, once, and its batches counted here
    dataset = open_dataset(unaligned)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", FastPathWarning)
        with make_loader(dataset, 6, shuffle=True, block_size=4, window=3, seed=9, helper_process=True,
                         multiprocessing_context=start_method) as loader:
            for epoch in range(2):
                for (images, labels), indices in zip(loader, planned(loader, epoch), strict=True):
                    expected = reference(unaligned, indices)
                    assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
            helper = loader.helper.report()
    warned = [str(w.message) for w in said if w.category is FastPathWarning]
    assert warned == list(dataset.fallbacks().values()) and len(set(warned)) == len(warned), warned  # each once
    moved = dataset.fallbacks()["moved rows"]
    assert "shard 0 " in moved and "onto the window's rows" in moved, moved
    counts = dataset.read_paths()
    assert counts == helper["read_paths"] and counts["windows"] == sum(counts.values()) == 2 * len(loader), counts


def test_a_shard_whose_column_lies_apart_is_stitched_from_memory_and_said_once(unaligned):
    dataset = open_dataset(unaligned)
    indices = np.arange(len(dataset))[::-1].copy()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", FastPathWarning)
        for _ in range(3):
            images, labels = dataset.read_batch(indices)
    expected = reference(unaligned, indices)
    assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
    counts = dataset.read_paths()
    assert counts["stitched"] == 3 and counts["by shard"] == 0, counts
    assert len(said) == 1 and "shard 0 " in str(said[0].message) and "read into memory" in str(said[0].message)


@given(data=st.data(), row_bytes=st.integers(1, 20000), alignment=st.sampled_from([512, 4096]),
       first_row=st.integers(0, 50))
def test_placed_runs_are_aligned_apart_and_put_each_first_row_on_a_row(data, row_bytes, alignment, first_row):
    step = int(np.gcd(row_bytes, alignment))
    base = data.draw(st.integers(0, step - 1))
    counts = np.array(data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=20)), np.int64)
    landing = data.draw(st.lists(st.booleans(), min_size=len(counts), max_size=len(counts)))
    offsets = np.array([(base if lands else data.draw(st.integers(0, alignment))) + step * data.draw(
        st.integers(0, 10**7)) for lands in landing], np.int64)
    reads, lengths, places, rows, shifts = place_runs(offsets, counts, row_bytes, alignment, base, first_row)
    assert not (reads % alignment).any() and not (lengths % alignment).any() and not (places % alignment).any()
    assert (reads <= offsets).all() and (reads + lengths >= offsets + counts * row_bytes).all()  # covers its run
    assert (lengths < offsets - reads + counts * row_bytes + alignment).all()  # no aligned block more than needed
    off = (offsets - base) % step != 0
    assert not shifts[~off].any() and (shifts[off] > 0).all() and (shifts < row_bytes).all()
    assert np.array_equal(places + (offsets - reads) + shifts, base + rows * row_bytes)  # rows land (moved) on rows
    ends = np.maximum(places + lengths, base + (rows + counts) * row_bytes)
    assert places[0] >= base + first_row * row_bytes and (places[1:] >= ends[:-1]).all()  # apart
    assert (base + rows[1:] * row_bytes >= ends[:-1]).all()  # moved rows overwrite no run before
    period = alignment // step
    gaps = np.diff(np.concatenate(([first_row], rows))) - np.concatenate(([0], counts[:-1]))
    slack = np.where(off, 1 + -(-3 * alignment // row_bytes), period - 1 + -(-2 * alignment // row_bytes))
    assert (gaps <= slack).all()  # WindowReads' slack per run


def _vm_flags(address):
    """Return the VmFlags of this process's mapping holding ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(bound, 16) for bound in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_direct_buffers_start_on_a_huge_page_ask_for_huge_pages_and_take_direct_reads(tmp_path):
    # NOTE [huge read buffers]: the memory a window's direct reads go to starts on a huge page and is advised
    buffer = direct_buffer(3 * HUGE_PAGE + 5)
    assert buffer.dtype == np.uint8 and buffer.nbytes == 3 * HUGE_PAGE + 5
    assert buffer.ctypes.data % HUGE_PAGE == 0
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("this kernel has no transparent huge pages to ask for")
    assert "hg" in _vm_flags(buffer.ctypes.data)
    path = tmp_path / "data.bin"
    data = np.random.default_rng(0).integers(0, 256, 2 * HUGE_PAGE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    alignment = direct_alignment(path)
    if alignment is None:
        pytest.skip(f"the file system of {tmp_path} refuses direct I/O")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [memoryview(buffer[: 2 * HUGE_PAGE])], 0) == 2 * HUGE_PAGE
    finally:
        os.close(fd)
    assert np.array_equal(buffer[: 2 * HUGE_PAGE], data)


def _child_of_windows(reads, indices, folder, done):
    """In a forked child: the inherited windows' pages are dropped, and windows of its own read and go safely."""
    try:
        parts = reads.parts(indices)  # not this process's windows: none
        inherited = np.asarray(reads.view[: len(indices)])
        dataset = open_dataset(folder)
        loader = make_loader(dataset, 16, shuffle=True, block_size=6, window=5, seed=4)
        batches = sum(1 for _ in loader)
        del reads, loader, dataset
        gc.collect()  # the inherited mmap objects go: nothing of the child's may be unmapped with them
        done.put((parts is None, bool(inherited.any()), batches))
    except BaseException as exc:  # the parent reports it
        done.put(repr(exc))


@pytest.mark.parametrize("start_method", start_methods("fork"))
def test_a_forked_child_drops_the_pages_of_the_windows_it_inherits(folders, monkeypatch, start_method):
    # NOTE [windows after fork]: with MADV_DONTFORK the child crashed once it had mapped memory where they lay
    folder = folders[32]
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    loader = make_loader(dataset, 16, shuffle=True, block_size=6, window=5, seed=4)
    next(iter(loader))  # this process's windows hold rows now
    reads = loader.steps.readahead.reads
    indices = np.sort(loader.sampler.order.batch(0, 0))
    assert reads.parts(indices) is not None and np.asarray(reads.view).any()
    context = multiprocessing.get_context(start_method)
    done = context.Queue()
    child = context.Process(target=_child_of_windows, args=(reads, indices, folder, done))
    child.start()
    try:
        wait_for(lambda: not done.empty() or not child.is_alive(), "the child's answer or its end")
        result = done.get(timeout=5) if child.exitcode in (None, 0) else None  # None: it crashed
    finally:
        child.join(30)
    assert result == (True, False, len(loader)) and child.exitcode == 0, (result, child.exitcode)
    assert np.asarray(reads.view).any()  # the parent's rows stay
    loader.close()
