"""Read-ahead: kernel hints put exactly the rows an order reads next into the page cache, and change no result."""

import gc
import os
import pickle
import shutil
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import column_regions, private_copy, wait_for

from fastdata import open_dataset
from fastdata.errors import FormatError
from fastdata.formats import read_packed
from fastdata.reading.kernel import PAGE, _page_spans, evict, resident_pages, sharded_spans
from fastdata.reading.order import EpochOrder
from fastdata.reading.readahead import HINT_THREADS, ReadAhead, runs

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore are Linux calls")


def row_pages(path):
    """Return ``(first page, stop page)`` int64 ``[N]`` of each stored sample of a packed file (format layer only)."""
    offset, _ = column_regions(path)["samples"]
    columns, _ = read_packed(path, check=False)
    if columns.offsets is None:
        size = columns.samples.nbytes // max(columns.num_samples, 1)
        bounds = np.arange(columns.num_samples + 1, dtype=np.int64) * size
    else:
        bounds = np.asarray(columns.offsets, dtype=np.int64) * columns.samples.itemsize
    bounds = bounds + offset
    return bounds[:-1] // PAGE, -(-bounds[1:] // PAGE)


class Residency:
    """Where each sample of a dataset's files lies, and which of them are in the page cache."""

    def __init__(self, dataset):
        self.files = dataset.shard_paths
        self.starts = np.cumsum([0] + [len(open_dataset(path)) for path in self.files])
        self.pages = [row_pages(path) for path in self.files]
        self.dataset, self.pinned = dataset, None

    def evict(self):
        """Evict the files; samples still cached after it share a page with a column the dataset has read.

        The dataset opens every shard and reads its labels and offsets in
        between two evictions: opening a shard reads ahead of its header, and
        a fault on an offsets page reads around it, into the samples; one on a
        cached page maps its cached neighbours too (fault-around), and mapped
        pages cannot be evicted.
        """
        for path in self.files:
            evict(path)
        dataset = self.dataset
        int(np.asarray(dataset.labels).sum() + (0 if dataset.storage == "raw" else dataset.lengths.sum()))
        for path in self.files:
            evict(path)
        self.pinned = self.resident()
        if self.pinned.all():
            pytest.skip("every sample shares a page with a column the dataset mapped, or eviction keeps pages cached")

    def resident(self):
        """Return bool ``[N]``: whether every page of each sample is cached."""
        flags = []
        for path, (first, stop) in zip(self.files, self.pages):
            cached = np.concatenate([resident_pages(path), [False]])
            counts = np.concatenate([[0], np.cumsum(~cached)])
            flags.append(counts[stop] - counts[first] == 0)
        return np.concatenate(flags)

    def shares_a_page(self, rows):
        """Return bool ``[N]``: whether a sample shares a page with one of ``rows`` (global indices)."""
        shared = []
        for number, (first, stop) in enumerate(self.pages):
            mine = rows[(rows >= self.starts[number]) & (rows < self.starts[number + 1])] - self.starts[number]
            pages = np.zeros(stop.max() + 1, bool)
            for row in mine.tolist():
                pages[first[row]:stop[row]] = True
            counts = np.concatenate([[0], np.cumsum(pages)])
            shared.append(counts[stop] - counts[first] > 0)
        return np.concatenate(shared)

    def wait_for(self, rows, timeout=20.0):
        """Poll until every one of ``rows`` is cached (the hint's reads are asynchronous); return the flags."""
        deadline = time.monotonic() + timeout
        while not (flags := self.resident())[rows].all() and time.monotonic() < deadline:
            time.sleep(0.02)
        return flags

    def check_exactly(self, rows):
        """Assert that ``rows`` became cached and that no sample sharing no page with them did."""
        flags = self.wait_for(rows)
        assert flags[rows].all(), np.flatnonzero(~flags)
        others = ~self.shares_a_page(rows) & ~self.pinned
        assert not flags[others].any(), np.flatnonzero(flags & others)


@pytest.fixture(params=["file", "folder"])
def copied(request, packed_files, shard_folders, fmt, storage, tmp_path):
    """A private copy of the session's file (or shard folder): no other test's maps hold its pages."""
    if request.param == "file":
        return open_dataset(private_copy(packed_files(fmt, storage), tmp_path))
    return open_dataset(shutil.copytree(shard_folders(fmt, storage), tmp_path / "shards"))


@linux_only
def test_will_need_reads_evicted_samples_into_the_page_cache(copied):
    where = Residency(copied)
    where.evict()
    copied.will_need(np.array([[17, 21], [3, 9], [5, 6]]))  # overlapping, unsorted, over shards
    where.check_exactly(np.r_[3:9, 17:21])


@linux_only
@pytest.mark.parametrize("storage", ["raw"])
def test_will_need_asks_nothing_when_the_samples_are_cached(copied):
    for path in copied.shard_paths:
        with open(path, "rb") as f:
            f.read()
    assert not copied.will_need(np.array([[0, len(copied)]]))
    Residency(copied).evict()
    assert copied.will_need(np.array([[0, len(copied)]]))


def mapped_with_random_advice(path):
    """Return how many of this process's maps of ``path`` carry MADV_RANDOM ("rr" in smaps VmFlags)."""
    real, count, current = os.path.realpath(path), 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                current = fields[5] if len(fields) == 6 else None
            elif fields[0] == "VmFlags:" and current == real:
                count += "rr" in fields[1:]
    return count


@linux_only
def test_advice_reaches_open_shards_later_shards_and_pickled_copies(copied):
    indices = np.arange(len(copied))
    expected = copied.read_batch(indices)
    copied.read_batch(indices[:1])  # the first shard open before the advice
    copied.advise("random")
    assert mapped_with_random_advice(copied.shard_paths[0]) == 1  # the sample column's map only
    copy = pickle.loads(pickle.dumps(copied))
    for dataset in (copied, copy):
        got = dataset.read_batch(indices)
        assert all(a.equal(b) for a, b in zip(got, expected))
    assert {mapped_with_random_advice(path) for path in copied.shard_paths} == {2}
    copied.advise("normal")
    assert {mapped_with_random_advice(path) for path in copied.shard_paths} == {1}  # the copy's stay random


def test_advice_and_hints_change_no_read_result(copied):
    indices = np.random.default_rng(0).permutation(len(copied))
    expected = copied.read_batch(indices)
    for pattern in ("random", "normal"):
        copied.advise(pattern)
        copied.will_need(np.array([[0, len(copied)], [-5, 3], [20, 10**9]]))
        assert all(a.equal(b) for a, b in zip(copied.read_batch(indices), expected))
    with pytest.raises(ValueError, match="pattern should be one of 'normal', 'random'; got pattern='sequential'"):
        copied.advise("sequential")


def rows_of(order, epoch, steps, rank, world_size):
    return np.unique(np.concatenate([order.batch(epoch, step, rank, world_size) for step in steps]))


@linux_only
@pytest.mark.parametrize("storage", ["raw"])
def test_a_uniform_read_ahead_hints_this_ranks_rows_of_the_next_steps(copied):
    order = EpochOrder(len(copied), 4, shuffle="uniform", seed=7)
    where = Residency(copied)
    read_ahead = ReadAhead(copied, order, rank=1, world_size=2, lookahead=2, fits=True)
    where.evict()
    read_ahead.start(epoch=3, step=1)  # hints steps 1-4: lookahead steps and as many more, in one chunk
    read_ahead.flush()  # given on the hint thread (NOTE [hint thread])
    where.check_exactly(rows_of(order, 3, range(1, 5), 1, 2))
    assert "fastdata-hints" in {thread.name for thread in threading.enumerate()}
    where.evict()
    for step in (2, 3):  # still ahead by lookahead: nothing new
        read_ahead.advance(step)
    read_ahead.flush()
    assert not where.resident()[~where.pinned].any()
    read_ahead.advance(4)
    read_ahead.flush()
    where.check_exactly(rows_of(order, 3, range(5, order.num_steps), 1, 2))


@linux_only
@pytest.mark.parametrize("storage", ["raw"])
def test_a_uniform_read_ahead_over_cached_rows_hints_again_once_they_are_evicted(copied):
    order = EpochOrder(len(copied), 1, shuffle="uniform", seed=11)
    where = Residency(copied)
    read_ahead = ReadAhead(copied, order, lookahead=1, fits=True)
    for path in copied.shard_paths:
        with open(path, "rb") as f:
            f.read()
    read_ahead.start(0, 0)  # steps 0-1 cached: nothing asked; steps 2-3 probed next
    where.evict()
    for step in range(1, order.num_steps):
        read_ahead.advance(step)
    read_ahead.flush()
    where.check_exactly(rows_of(order, 0, range(2, order.num_steps), 0, 1))


def samples_of(ranges):
    return np.concatenate([np.arange(a, b) for a, b in ranges])


@linux_only
@pytest.mark.parametrize("storage", ["raw"])
def test_a_block_read_ahead_hints_the_next_window_a_share_per_step(copied):
    order = EpochOrder(len(copied), 2, shuffle="block", seed=3, block_size=2, window=3)  # 4 windows of 3 steps
    where = Residency(copied)
    read_ahead = ReadAhead(copied, order, fits=True)
    windows = [order.window_ranges(5, window) for window in range(4)]
    assert np.isin(rows_of(order, 5, range(3, 6), 0, 1), samples_of(windows[1])).all()
    where.evict()
    read_ahead.start(epoch=5, step=4)  # window 1 at once, and 2 of window 2's 3 blocks (2 of its 3 steps done)
    read_ahead.flush()  # block hints are given on a thread (NOTE [hint thread])
    where.check_exactly(np.concatenate([samples_of(windows[1]), samples_of(windows[2][:2])]))
    read_ahead.advance(5)  # the last step of window 1: all of window 2
    read_ahead.flush()  # block hints are given on a thread (NOTE [hint thread])
    where.check_exactly(np.concatenate([samples_of(windows[1]), samples_of(windows[2])]))
    where.evict()
    read_ahead.advance(6)  # window 2 starts: the first of window 3's blocks, in file order
    read_ahead.flush()  # block hints are given on a thread (NOTE [hint thread])
    where.check_exactly(samples_of(windows[3][:1]))
    for step in (7, 8):
        read_ahead.advance(step)
    read_ahead.flush()  # block hints are given on a thread (NOTE [hint thread])
    where.check_exactly(samples_of(windows[3]))
    where.evict()
    for step in (9, 10, 11):  # the last window: the next epoch's first
        read_ahead.advance(step)
    read_ahead.flush()  # block hints are given on a thread (NOTE [hint thread])
    where.check_exactly(samples_of(order.window_ranges(6, 0)))


@linux_only
@pytest.mark.parametrize("storage", ["raw"])  # a few pages of JPEGs lie in folios that the labels' map shares
def test_done_with_drops_the_pages_this_process_read(copied):
    where = Residency(copied)
    where.evict()
    expected = copied.read_batch(np.arange(len(copied)))  # maps every sample's pages here
    copied.done_with(np.array([[0, len(copied)]]))  # colder: still cached
    assert where.resident().all()

    def dropped():  # MADV_PAGEOUT skips pages the kernel has not put on its LRU lists yet (a CI run kept all of
        copied.done_with(np.array([[0, len(copied)]]), drop=True)  # one shard's 19 pages once): ask again
        return not where.resident()[~where.pinned].any()

    wait_for(dropped, "the pages to be reclaimed", seconds=10)
    assert all(a.equal(b) for a, b in zip(copied.read_batch(np.arange(len(copied))), expected))


@linux_only
@pytest.mark.parametrize("storage", ["raw"])
def test_a_sequential_read_ahead_hints_nothing(copied):
    order = EpochOrder(len(copied), 4, shuffle="none")
    where = Residency(copied)
    read_ahead = ReadAhead(copied, order, fits=True)
    where.evict()
    read_ahead.start(0, 0)
    for step in range(order.num_steps):
        read_ahead.advance(step)
    time.sleep(0.2)
    assert not where.resident()[~where.pinned].any()


@given(st.lists(st.integers(0, 200), max_size=60))
def test_runs_cover_exactly_the_indices_in_disjoint_sorted_ranges(indices):
    ranges = runs(np.array(indices, dtype=np.int64))
    covered = np.concatenate([np.empty(0, np.int64)] + [np.arange(a, b) for a, b in ranges])
    assert np.array_equal(covered, np.unique(np.array(indices, dtype=np.int64)))
    assert (ranges[1:, 0] > ranges[:-1, 1]).all()  # apart: adjacent runs would be one


@given(st.lists(st.tuples(st.integers(0, 40 * PAGE), st.integers(0, 3 * PAGE)), min_size=1, max_size=30))
def test_page_spans_cover_the_pages_of_the_ranges_merged(ranges):
    starts = np.array([a for a, _ in ranges], dtype=np.uint64)
    stops = starts + np.array([n for _, n in ranges], dtype=np.uint64)
    spans = _page_spans(starts, stops)
    expected = set()
    for a, b in zip(starts.tolist(), stops.tolist()):
        expected |= set(range(a // PAGE, -(-b // PAGE)))
    got = set()
    for address, length in spans.tolist():
        assert address % PAGE == 0 and length % PAGE == 0
        got |= set(range(address // PAGE, (address + length) // PAGE))
    assert got == expected
    assert (spans[1:, 0] > spans[:-1, 0] + spans[:-1, 1]).all()  # sorted, with a gap between spans


@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=8), min_size=1, max_size=5), st.booleans(),
       st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6))
def test_sharded_spans_are_each_rows_bytes_in_its_own_shard(shards, ragged, ranges):
    # a range over shards is cut at their bounds, and each piece's bytes are found in the shard that holds it
    lengths = [np.array(sizes, np.int64) for sizes in shards]
    columns = [(np.zeros(int(sizes.sum()), np.uint16), np.append(0, np.cumsum(sizes))) if ragged
               else (np.zeros((len(sizes), 3), np.uint32), None) for sizes in lengths]
    shard_starts = np.append(0, np.cumsum([len(sizes) for sizes in lengths]))
    total = int(shard_starts[-1])
    ranges = np.array([(min(a, total - 1), min(a + n, total)) for a, n in ranges], np.int64)
    asked = []

    def columns_of(numbers):
        asked.append(numbers)
        return (columns[number] for number in numbers)

    starts, stops = sharded_spans(ranges, shard_starts, columns_of)
    expected = set()
    for start, stop in ranges.tolist():
        for row in range(start, stop):
            shard = int(np.searchsorted(shard_starts, row, side="right")) - 1
            samples, offsets = columns[shard]
            local = row - int(shard_starts[shard])
            base = samples.ctypes.data
            if offsets is None:
                expected |= set(range(base + local * 12, base + local * 12 + 12))
            else:
                expected |= set(range(base + int(offsets[local]) * 2, base + int(offsets[local + 1]) * 2))
    got = set()
    for begin, end in zip(starts.tolist(), stops.tolist()):
        got |= set(range(begin, end))
    assert got == expected and asked == [sorted(asked[0])] and len(set(asked[0])) == len(asked[0])


def test_hints_run_on_their_threads_and_a_failing_one_stops_none(copied):
    order = EpochOrder(len(copied), 2, shuffle="block", seed=3, block_size=2, window=3)
    read_ahead = ReadAhead(copied, order, fits=True)
    seen, main = [], threading.get_ident()

    def record(value):
        time.sleep(0.01)  # long enough for every hint thread to take a call
        seen.append((value, threading.get_ident()))
        if value == 1:
            raise FormatError("a shard that will not open")  # advice: dropped, the read raises it

    for value in range(8):
        read_ahead._hints.submit(record, value)
    read_ahead.flush()  # returns once every call ran, on whichever thread
    assert sorted(value for value, _ in seen) == list(range(8))
    idents = {thread for _, thread in seen}
    assert 1 <= len(idents) <= HINT_THREADS and main not in idents
    threads = [t for t in threading.enumerate() if t.name == "fastdata-hints" and t.ident in idents]
    del read_ahead
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)  # they end with their ReadAhead
        assert not thread.is_alive()
