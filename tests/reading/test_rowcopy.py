"""Copying a batch's rows on helper threads (rowcopy.py): the rows, the pieces, a late helper, a failing piece."""

import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdata.reading import rowcopy
from fastdata.reading.rowcopy import SHARES, Copy, RowCopier, _split

THRESHOLD = rowcopy.PARALLEL_BYTES  # read before any_batch_on_threads lowers it


@pytest.fixture(autouse=True)
def any_batch_on_threads(monkeypatch):
    monkeypatch.setattr(rowcopy, "PARALLEL_BYTES", 0)


def sources_and_jobs(tmp_path, draw_rows, sizes, row_shape=(3, 4, 5)):
    """Memory-mapped sources of ``sizes`` rows, their jobs (rows drawn per source) into one batch, and that batch."""
    jobs, expected, count = [], [], 0
    picks = [draw_rows(size) for size in sizes]
    out = np.zeros((sum(len(rows) for rows in picks), *row_shape), np.uint8)
    for k, (size, rows) in enumerate(zip(sizes, picks)):
        source = np.lib.format.open_memmap(tmp_path / f"{k}.npy", mode="w+", dtype=np.uint8, shape=(size, *row_shape))
        source[:] = np.random.default_rng(k).integers(0, 256, source.shape, dtype=np.uint8)
        rows = np.asarray(rows, np.int64)
        jobs.append((source, rows, out[count : count + len(rows)]))
        expected.append(np.asarray(source)[rows])
        count += len(rows)
    return jobs, out, np.concatenate(expected) if expected else out.copy()


@settings(max_examples=40)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5), threads=st.integers(1, 4),
       share=st.floats(SHARES[0], SHARES[1]), data=st.data())
def test_the_batch_equals_one_take_per_source(tmp_path_factory, sizes, threads, share, data):
    def draw_rows(size):  # unsorted, with repeats, possibly none
        return data.draw(st.lists(st.integers(0, size - 1), max_size=30))

    jobs, out, expected = sources_and_jobs(tmp_path_factory.mktemp("rows"), draw_rows, sizes)
    copier = RowCopier()
    copier.share = share
    copier.start(jobs, threads).finish()
    assert np.array_equal(out, expected)


@settings(max_examples=60)
@given(lengths=st.lists(st.integers(0, 50), min_size=1, max_size=6), threads=st.integers(2, 5),
       share=st.floats(SHARES[0], SHARES[1]))
def test_pieces_cover_every_row_once_in_order_and_the_callers_is_its_share(lengths, threads, share):
    jobs = [(k, np.arange(n) + 1000 * k, np.arange(n)) for k, n in enumerate(lengths)]
    pieces = _split(jobs, threads, share)
    flat = [(source, row, slot) for piece in pieces for source, rows, slots in piece
            for row, slot in zip(rows.tolist(), slots.tolist())]
    assert flat == [(k, row, slot) for k, rows, slots in jobs for row, slot in zip(rows.tolist(), slots.tolist())]
    total = sum(lengths)
    assert len(pieces) <= threads
    if total >= 10 * threads:  # the last piece is the caller's: about share / (threads - 1 + share) of the rows
        caller = sum(len(rows) for _, rows, _ in pieces[-1])
        assert abs(caller - total * share / (threads - 1 + share)) <= len(lengths) + 1


class Blocking:
    """A source whose take waits for ``release``: it keeps the helper thread that runs it busy."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def take(self, rows, axis, out, mode):
        self.started.set()
        self.release.wait(30)


def test_a_helper_that_never_runs_leaves_its_piece_to_the_caller(tmp_path):
    jobs, out, expected = sources_and_jobs(tmp_path, lambda size: np.arange(size)[::-1], [64, 64])
    copier = RowCopier()
    blocker = Blocking()
    (helper,) = copier._helpers(1)
    helper.post(Copy([[(blocker, np.arange(1), np.empty(1))]]))  # the only helper is taken: no piece of ours starts
    assert blocker.started.wait(30)
    try:
        copy = copier.start(jobs, threads=2)
        share = copier.share
        copy.finish()  # returns: the caller copied both pieces, waiting for nobody
        assert np.array_equal(out, expected)
        assert copier.share < share  # the caller did not wait, so it takes less next time
        assert copy.helpers == [helper] and copy.pieces == ()  # posted to it; it finds nothing left once free
    finally:
        blocker.release.set()


@pytest.mark.parametrize("caller_first", [True, False])
def test_the_callers_piece_is_copied_as_a_small_copy_starts(tmp_path, monkeypatch, caller_first):
    # NOTE [caller first]: up to CALLER_FIRST_BYTES, before start returns; larger copies leave it for finish
    monkeypatch.setattr(rowcopy, "CALLER_FIRST_BYTES", 1 << 40 if caller_first else 0)
    jobs, out, expected = sources_and_jobs(tmp_path, lambda size: np.arange(size)[::-1], [64, 64])
    copier = RowCopier()
    blocker = Blocking()
    (helper,) = copier._helpers(1)
    helper.post(Copy([[(blocker, np.arange(1), np.empty(1))]]))  # the helper is busy: only the caller copies
    assert blocker.started.wait(30)
    try:
        copy = copier.start(jobs, threads=2)
        own = sum(len(rows) for _, rows, _ in copy.pieces[-1])
        assert 0 < own < len(out)
        assert np.array_equal(out[-own:], expected[-own:]) == caller_first  # the caller's rows, before finish
        assert not np.array_equal(out[:-own], expected[:-own])  # the helper's piece: not begun
        copy.finish()  # the caller copies the helper's piece too
        assert np.array_equal(out, expected)
    finally:
        blocker.release.set()


def test_a_helper_woken_with_nothing_posted_waits_for_the_next_copy():
    # The state a post leaves when it comes between the helper's wake-up and its lock: the go released, no copy.
    (helper,) = RowCopier()._helpers(1)
    blocker = Blocking()
    helper._go.release()
    deadline = time.monotonic() + 5
    while not helper._go.locked() and time.monotonic() < deadline:  # it woke up
        time.sleep(0.001)
    time.sleep(0.05)  # and found nothing
    helper.post(Copy([[(blocker, np.arange(1), np.empty(1))]]))
    try:
        assert blocker.started.wait(5)  # the helper lived through the empty wake-up and took the copy
    finally:
        blocker.release.set()


def test_a_helper_holds_no_batch_once_its_pieces_are_copied(tmp_path):
    jobs, out, expected = sources_and_jobs(tmp_path, lambda size: np.arange(size), [300, 300])
    copier = RowCopier()
    copier.share = 0.1  # the helper's piece is most of the batch: it runs
    copy = copier.start(jobs, threads=2)
    copy.finish()
    assert np.array_equal(out, expected)
    (helper,) = copy.helpers
    for _ in range(3000):  # the helper lets go of its copy right after its last piece
        if sys.getrefcount(copy) == 2:
            break
        time.sleep(0.01)
    assert sys.getrefcount(copy) == 2  # ours and getrefcount's: the buffer can be reused (NOTE [buffer reuse])


class Unreadable:
    """A source whose rows cannot be read, as a page of a truncated file mapped."""

    def take(self, rows, axis, out, mode):
        raise OSError("the rows are gone")


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_piece_raises_from_finish_after_every_piece_ended(tmp_path, failing):
    jobs, out, _ = sources_and_jobs(tmp_path, lambda size: np.arange(size), [200, 200])
    jobs[failing] = (Unreadable(), jobs[failing][1], jobs[failing][2])
    copier = RowCopier()
    copier.share = 1.0  # equal pieces: each source is one piece, whichever thread runs it
    copy = copier.start(jobs, threads=2)
    with pytest.raises(OSError, match="the rows are gone"):
        copy.finish()
    good = 1 - failing  # raised only after the other piece ended, whichever thread copied it
    assert np.array_equal(out[200 * good : 200 * good + 200], np.asarray(jobs[good][0]))


def test_one_thread_or_a_small_batch_is_copied_at_start(tmp_path, monkeypatch):
    monkeypatch.setattr(rowcopy, "PARALLEL_BYTES", 1 << 30)
    jobs, out, expected = sources_and_jobs(tmp_path, lambda size: np.arange(size), [10])
    copy = RowCopier().start(jobs, threads=4)
    assert np.array_equal(out, expected) and not copy.helpers  # before finish: no helper took part
    copy.finish()


def batch_jobs(tmp_path, size, batch_size=256):
    """Jobs copying a shuffled, sorted batch of ``size`` px raw rows from two memory-mapped files, and the batch."""
    picks = np.random.default_rng(size).permutation(2 * batch_size)[:batch_size]
    halves = iter([np.sort(picks[picks < batch_size]), np.sort(picks[picks >= batch_size]) - batch_size])
    return sources_and_jobs(tmp_path, lambda rows: next(halves), [batch_size] * 2, row_shape=(3, size, size))


@pytest.mark.parametrize(("size", "on_helpers"), [(16, False), (32, False), (64, True), (128, True)])
def test_a_batch_of_256_goes_to_helpers_from_64_px(tmp_path, monkeypatch, size, on_helpers):
    monkeypatch.setattr(rowcopy, "PARALLEL_BYTES", THRESHOLD)  # see NOTE [copy on two cores]
    jobs, out, expected = batch_jobs(tmp_path, size)
    copy = RowCopier().start(jobs, threads=2)
    assert bool(copy.helpers) == on_helpers and (len(copy.pieces) == 2) == on_helpers
    if not on_helpers:  # copied at start, on the calling thread
        assert np.array_equal(out, expected)
    copy.finish()
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("size", [32, 64])
def test_a_batch_is_the_same_copied_on_one_thread_or_on_helpers(tmp_path, monkeypatch, size):
    batches = []
    for threshold in (0, 1 << 40):
        monkeypatch.setattr(rowcopy, "PARALLEL_BYTES", threshold)
        (tmp_path / str(threshold)).mkdir()
        jobs, out, expected = batch_jobs(tmp_path / str(threshold), size)
        copy = RowCopier().start(jobs, threads=2)
        assert bool(copy.helpers) == (threshold == 0)
        copy.finish()
        batches.append(out)
    assert np.array_equal(batches[0], expected) and np.array_equal(batches[1], expected)


def test_a_pickled_copier_starts_its_own_threads(tmp_path):
    import pickle

    copier = RowCopier()
    copier._helpers(1)
    clone = pickle.loads(pickle.dumps(copier))
    assert clone._threads == [] and clone.share == copier.share
    jobs, out, expected = sources_and_jobs(tmp_path, lambda size: np.arange(size), [50])
    clone.start(jobs, threads=2).finish()
    assert np.array_equal(out, expected)
