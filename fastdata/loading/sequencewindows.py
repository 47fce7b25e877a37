"""Concat sequences of a corpus bigger than memory: each block window's token ids read whole, rows cut from there.

NOTE [sequence windows]: in the block order (NOTE [sequence blocks] in
sequences.py) a window's rows are the documents of its blocks, so its ids
are a few long runs of each shard file. Read through the memory map with
kernel hints, every row still faulted its pages in: the lmscale folder
(1.07 GB, 16 shards) in a 1 GB memory cgroup gave 37.5M tokens/s at 1.20x
read amplification, against 507-541M for a sequential read of the files.
So one process reading alone reads each window's runs with plain preads
(the pages dropped behind them: the copy here is the one kept) into a
buffer of its own, the next window on a thread while rows are cut from
this one; a row is one slice of a buffer. The lmscale section at 661deda:
tokens_only 98.4M tokens/s at 1.13x (0.18 of the sequential read, 0.92x
LitData's whole-chunk reads), concat 53.7M; the warm rate is 180.7M, the
rest is one batch a read (grouped reads stop where a read-ahead follows
the order). Workers and ranks keep the hints: each would read every
window. A row outside the windows held (a sampler walked by hand beside
the loader) is read through the map and warns once.
"""

import os
import threading
import warnings

import numpy as np

from fastdata.errors import FastPathWarning
from fastdata.formats import column_offsets

READ_BYTES = 16 << 20  # bytes a pread asks for at most


class SequenceWindows:
    """Hold the window of a block order that is read now and the next one, read whole; cut rows' ids from them.

    A ReadsAhead (reading/readahead.py) of TokenSequences (concat) over a
    local text file or folder, read by one process (see NOTE [sequence
    windows]). ``spans`` gives the stored ids of rows from the windows held.

    Args:
        sequences: the TokenSequences.
        order: its EpochOrder (``shuffle="block"``).
    """

    def __init__(self, sequences, order):
        self.sequences, self.order = sequences, order
        dataset = sequences.dataset
        self.paths = dataset.shard_paths
        starts, lengths = sequences._stream()
        self._first = starts[:-1] - np.arange(len(lengths))  # each document's first id among all stored ids
        self._shard_first = np.append(self._first[dataset.shard_index.starts[:-1]], self._first[-1] + lengths[-1])
        self._itemsize = sequences.dtype.itemsize
        self._epoch, self._window = 0, None
        self._held, self._lock, self._reader = {}, threading.Lock(), None  # (epoch, window) -> its runs
        self._files = None
        self.misses = 0  # spans asked for outside the windows held (read through the map instead)

    # ------------------------------------------------------------ ReadsAhead

    def start(self, epoch, step):
        """Begin ``epoch`` at ``step``: hold its window, and read the next."""
        self._epoch, self._window = epoch, None
        self.advance(step)

    def advance(self, step):
        """Note that ``step``'s rows are read next: hold their windows, read the one after."""
        start, stop = self.order.step_positions(step)
        if start >= stop:
            return
        self._open()  # here, before any thread reads
        window, last = self.order.window_of(self._epoch, start), self.order.window_of(self._epoch, stop - 1)
        if last != window:  # a step across two windows: the next one's rows are read now too
            self._hold((self._epoch, last))
        if window == self._window:
            return
        wanted = [(self._epoch, window), self.order.window_after(self._epoch, window)]
        self._hold(wanted[0])
        with self._lock:
            self._held = {key: runs for key, runs in self._held.items() if key in wanted}
        self._read_later(wanted[1])
        self._window = window

    def close(self):
        """Wait for the window being read, let the windows go, close the files."""
        if self._reader is not None:
            self._reader.join()
        self._reader, self._held, self._window = None, {}, None
        if self._files is not None:
            for descriptor in self._files:
                os.close(descriptor)
        self._files = None

    def __getstate__(self):
        return {**self.__dict__, "_held": {}, "_lock": None, "_reader": None, "_files": None, "_window": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    # ------------------------------------------------------------ rows

    def spans(self, first_documents, begins, last_documents, ends):
        """Return the stored ids of each span (as ``read_token_spans`` takes them), joined, or None where one lies
        outside the windows held."""
        low = self._first[first_documents] + begins
        high = self._first[last_documents] + ends
        with self._lock:
            held = list(self._held.values())
        which = np.full(len(low), -1, np.int64)  # the held window of each span, and its place in that one's ids
        place = np.zeros(len(low), np.int64)
        for number, (starts, stops, places, _) in enumerate(held):
            run = np.searchsorted(starts, low, side="right") - 1
            inside = (which < 0) & (run >= 0) & (high <= stops[np.maximum(run, 0)])
            which[inside] = number
            place[inside] = places[run[inside]] + low[inside] - starts[run[inside]]
        if (which < 0).any():
            self.misses += 1
            if self.misses == 1:
                warnings.warn("a batch of sequences lies outside the block order's windows read whole (the one read "
                              "now and the next): it is read through the memory map, page by page, as is any other "
                              "such batch (a loader and a walk of its sampler over one dataset at once do this)",
                              FastPathWarning, stacklevel=4)
            return None
        pools = [ids for *_, ids in held]
        return np.concatenate([pools[w][a : a + n] for w, a, n in zip(which.tolist(), place.tolist(),
                                                                       (high - low).tolist())])

    # ------------------------------------------------------------ reads

    def _hold(self, key):
        """Have window ``key`` held, read here unless the thread reads it (then wait for it)."""
        if self._reader is not None and self._reader.key == key:
            self._reader.join()
        with self._lock:
            if key in self._held:
                return
        runs = self._read(*key)
        with self._lock:
            self._held[key] = runs

    def _read_later(self, key):
        """Read window ``key`` on a thread, unless held or being read."""
        with self._lock:
            if key in self._held:
                return
        if self._reader is not None:
            self._reader.join()
        self._reader = threading.Thread(target=self._hold_read, args=(key,), name="fastdata-sequence-window",
                                        daemon=True)
        self._reader.key = key
        self._reader.start()

    def _hold_read(self, key):
        runs = self._read(*key)
        with self._lock:
            self._held[key] = runs

    def _read(self, epoch, window):
        """Read the ids of ``window``'s documents; return its runs ``(starts, stops, places, ids)``."""
        documents = self.sequences._document_ranges(self.order.window_ranges(epoch, window))
        last = documents[:, 1] - 1
        low, high = self._first[documents[:, 0]], self._first[last] + self.sequences._stream()[1][last]
        order = np.argsort(low, kind="stable")
        low, high = low[order], high[order]
        new = np.r_[True, low[1:] > np.maximum.accumulate(high)[:-1]]  # a run starts past every span before it
        starts = low[new]
        stops = np.maximum.reduceat(high, np.flatnonzero(new))
        places = np.r_[0, np.cumsum(stops - starts)[:-1]]
        ids = np.empty(int((stops - starts).sum()), self.sequences.dtype)
        for start, stop, place in zip(starts.tolist(), stops.tolist(), places.tolist()):
            self._read_run(start, stop, ids[place : place + stop - start])
        return starts, stops, places, ids

    def _read_run(self, start, stop, into):
        """Read stored ids ``[start, stop)`` into ``into``, shard by shard, dropping their pages from the cache."""
        files = self._open()
        while start < stop:
            shard = int(np.searchsorted(self._shard_first, start, side="right")) - 1
            end = min(stop, int(self._shard_first[shard + 1]))
            offset = self._columns[shard] + (start - int(self._shard_first[shard])) * self._itemsize
            view = memoryview(into[: end - start]).cast("B")
            done = 0
            while done < len(view):
                got = os.preadv(files[shard], [view[done : done + READ_BYTES]], offset + done)
                if got <= 0:
                    raise OSError(f"{self.paths[shard]!r} ended at byte {offset + done}, inside its token ids: "
                                  "the file changed since it was opened; open the dataset again")
                done += got
            os.posix_fadvise(files[shard], offset, len(view), os.POSIX_FADV_DONTNEED)
            into, start = into[end - start :], end
        return into

    def _open(self):
        if self._files is None:
            changed = self.sequences.changed_files()
            if changed:
                raise OSError(f"the files changed since they were opened: {changed}; open the dataset again")
            self._columns = [column_offsets(path)[0] for path in self.paths]
            self._files = [os.open(path, os.O_RDONLY) for path in self.paths]
        return self._files
