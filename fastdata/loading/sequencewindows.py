"""Concat sequences of a corpus bigger than memory: each block window's token ids read whole, rows cut from there.

NOTE [sequence windows]: in the block order (NOTE [sequence blocks] in
sequences.py) a window's rows are the documents of its blocks, so its ids
are a few long runs of each shard file. Read through the memory map with
kernel hints, every row still faulted its pages in: the lmscale folder
(1.07 GB, 16 shards) in a 1 GB memory cgroup gave 37.5M tokens/s at 1.20x
read amplification, against 507-541M for a sequential read of the files.
So one process reading alone reads each window's runs itself into a
buffer of its own, the next window on a thread while rows are cut from
this one. The buffer holds the window's stream, not its stored ids: each
document's end-of-document id is put in once as the window is read (one
masked copy per CHUNK_IDS), so a row is one slice of it and a batch of
rows one gather of a strided view (8.4 us for 64 rows of 2,049 against
32 us a slice per row, /tmp/lmt/sw.py). And make_loader reads a group of
batches at once beside the windows (NOTE [grouped sequences] in
sequences.py), up to a window's rows: ``advance`` runs the group's steps
ahead of its reads, so the window of the group's first step is kept until
the next group's first step leaves it (``read_in_groups``), and two
windows are held as before. A window's shards are read at once, each on a
thread of READ_THREADS in file order (one stream per shard suits this
virtual disk: NOTE [window reads] in reading/windows.py), with direct I/O
where the files take it (aligned blocks into an aligned buffer per thread,
the ids cut from there by the masked copy; else buffered preads, their
pages dropped behind), into the memory of the window let go last (no new
pages to fault in and zero). The lmscale folder in a 1.07 GB cgroup, 8 s
a row in fresh processes, each step measured in turn against the one
before (/tmp/lmt/cold.py): at 661deda a batch a read with the
end-of-document ids put in per batch 98.4M tokens/s at 1.13x; windows of
the stream and groups 172.7-189.5M at 1.04-1.08x (LitData 85.0-125.1M);
buffered reads of the shards on 16 threads 188-191M against 149-157M on
one; direct I/O and reused memory 236.6-236.8M at 1.09x, against the
sequential read of the files 665-685M and LitData 82.0M in the same run.
On that host what was left was CPU on 2 cores: an epoch after its first
window took 1.4-2.3 s, with 1.4-2.4 s of user and 0.4-0.5 s of system time
(/tmp/lmt/wtime.py), the masked copies ~0.64 ns a token
(/tmp/lmt/maskb.py). On an AMD EPYC host whose disk reads the shards at
2.2-2.4 GB/s the reads were the limit instead: direct reads into 4 KiB
pages gave 1.2-1.5 GB/s, and the loop waited 0.3-0.4 s an epoch for
windows (epochs of 0.66-0.79 s, 0.5-0.7 s of CPU). Read buffers of huge
pages (NOTE [huge read buffers] in reading/windows.py) read a window
alone at 2.3-2.5 GB/s, 1.9-2.1 GB/s with its masked copies (0.36 ns a
token alone, /tmp/lmt/winread.py, /tmp/lmt/spread.py); in the loader
(/tmp/lmt/wtime.py 1.07, 3-5 epochs in a fresh process each, the disk's
rate drifting between runs) 776-887M tokens/s on 16 threads and
743-1,068M on 4, with less system time (0.13-0.18 s an epoch against
0.26-0.33), so READ_THREADS is 4; against the sequential read around
each run (/tmp/lmt/cmp.sh) 0.70-0.75 on 4, 16 or 32 threads, and 0.65
before the huge pages. The windows' own memory is huge pages too
(direct_buffer: faulted in 2 MiB at a time, gathered from with fewer TLB
misses): 15 s rows, alternating with the commit before, 3 rounds in one
session: 0.748-0.772 of the sequential read against 0.664-0.720. Reading
each run's stored ids straight into the window's memory and spreading them
in place read a window alone faster (2.12 against 1.63 GB/s,
/tmp/lmt/winab.py) but not in the loader (0.69-0.76 against 0.72-0.73),
so it was left out.
Workers keep the hints: each would read every window; the ranks of a
machine share theirs (NOTE [shared sequence windows] in
sharedsequences.py); a helper process reads them itself (NOTE [read-ahead
in the helper] in helper.py). A row outside the windows held (a sampler
walked by hand beside the loader) is read through the map and warns once.
"""

import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fastdata.errors import FastPathWarning
from fastdata.formats import column_offsets
from fastdata.reading.windows import direct_alignment, direct_buffer

READ_BYTES = 16 << 20  # bytes a pread asks for at most
CHUNK_IDS = 1 << 20  # stored ids read, then spread around their end-of-document ids, at a time (per thread)
READ_THREADS = 4  # shards of a window read at once: NOTE [sequence windows]
SPARE_ROOM = 1.05  # a window's memory is made this much larger than its ids, so the next ones fit in it again
HOLD_SHARE = 0.25  # the share of available memory a stream WholeStream holds may take: NOTE [whole stream]
GROUP_ANY = 1 << 30  # batches read as one beside WholeStream: no bound of its own
WHOLE = ("all",)  # WholeStream's key of its one Stream


class Stream:
    """A window's stream ids held in memory: runs ``[starts[k], stops[k])`` of stream positions, run ``k`` at
    ``ids[places[k]:]``; each document followed by its end-of-document id. ``memory``: the array ``ids`` begins."""

    def __init__(self, starts, stops, places, ids, memory):
        self.starts, self.stops, self.places, self.ids, self.memory = starts, stops, places, ids, memory
        self._rows = {}

    def rows(self, width):
        """Return the ``[len(ids) - width + 1, width]`` view of every ``width`` ids in a row (no copy)."""
        if width not in self._rows:
            self._rows[width] = np.lib.stride_tricks.sliding_window_view(self.ids, width)
        return self._rows[width]


class Layout:
    """Where a window's runs of documents lie in its ids: runs ``[starts[k], stops[k])`` of stream positions at
    ``places[k]``, ``size`` ids in all, read as ``pieces`` (shard, first document, stop, place), in file order."""

    def __init__(self, starts, stops, places, size, pieces):
        self.starts, self.stops, self.places, self.size, self.pieces = starts, stops, places, size, pieces

    def stream(self, memory):
        """Return the Stream of these runs read into ``memory`` (from its start)."""
        return Stream(self.starts, self.stops, self.places, memory[: self.size], memory)


class SequenceWindows:
    """Hold the window of a block order that is read now and the next one, read whole; cut rows' ids from them.

    A ReadsAhead (reading/readahead.py) of TokenSequences (concat) over a
    local text file or folder, or a record file's tokens field, read by one
    process (see NOTE [sequence windows]). ``rows`` cuts rows' ids from the
    windows held.

    Args:
        sequences: the TokenSequences.
        order: its EpochOrder (``shuffle="block"``).
    """

    drop_behind = True  # drop the pages read from the page cache: the copy held here is the one kept

    def __init__(self, sequences, order):
        self.sequences, self.order = sequences, order
        dataset = sequences.dataset
        self.paths = dataset.shard_paths
        self._shard_starts = dataset.shard_starts
        starts, lengths = sequences._stream()
        first = starts[:-1] - np.arange(len(lengths))  # each document's first id among all stored ids
        self._shard_first = np.append(first[self._shard_starts[:-1]], first[-1] + lengths[-1])
        self._itemsize = sequences.dtype.itemsize
        self._epoch, self._first_step, self._window, self._lag = 0, 0, None, 0
        self._padded = False  # the epoch's padded last step was reached: its rows wrap to the epoch's first window
        self._window_stop = 0  # the first position past ``_window``: a step before it needs no window work
        self._held, self._lock, self._reader = {}, threading.Lock(), None  # (epoch, window) -> its Stream
        self._files = self._pool = None  # this process's descriptors, and the threads that read a window's shards
        self._alignment, self._local = None, threading.local()  # direct I/O's (None: buffered); each thread's buffer
        self._spare = None  # the memory of the window let go last: the next window is read into it (no new pages)
        self.misses = 0  # batches asked for outside the windows held (read through the map instead)

    @staticmethod
    def held_bytes(sequences, order):
        """The bytes of memory the windows of ``order`` over ``sequences`` hold, about: two windows and the spare
        one read into, each of a window's share of the stream's ids (SPARE_ROOM more)."""
        ids = int(sequences._stream()[0][-1])
        return int(3 * SPARE_ROOM * sequences.dtype.itemsize * ids * min(1.0, order.window / order.num_blocks))

    # ------------------------------------------------------------ ReadsAhead

    def batches_per_read(self, batch_size):
        """The most batches of ``batch_size`` a loader may read as one here: those of the shortest window, so
        that a group spans two windows at most (the held ones; see ``read_in_groups``)."""
        rows = self.order.window * self.order.block_size - self.order.block_size + 1
        return max(1, rows // max(batch_size, 1))

    def read_in_groups(self, batches):
        """Be told the loader reads ``batches`` steps as one: ``advance`` then runs that many steps ahead of the
        reads, so the window of the group's first step stays held until the next group's first step leaves it."""
        self._lag = max(0, batches - 1)

    def start(self, epoch, step):
        """Begin ``epoch`` at ``step``: hold its window, and read the next."""
        self._epoch, self._first_step, self._window, self._window_stop = epoch, step, None, 0
        self._padded = False
        self.advance(step)

    def advance(self, step):
        """Note that ``step``'s rows are read next: hold their windows (and those of the steps read with it since
        ``step - lag``), read the one after."""
        start, stop = self.order.step_positions(step)
        self._padded |= stop > self.order.num_samples  # the last step, padded: see ``rows``
        if start >= stop or stop <= self._window_stop:  # the rows lie in the window held since an earlier step
            return
        self._open()  # here, before any thread reads
        first = self.order.step_positions(max(step - self._lag, self._first_step))[0]
        window, last = self.order.window_of(self._epoch, first), self.order.window_of(self._epoch, stop - 1)
        key = (self._epoch, window)
        if window != self._window:
            wanted = [key, self.order.window_after(*key)]
            self._hold(key)
            with self._lock:
                dropped = [stream.memory for held, stream in self._held.items() if held not in wanted]
                self._held = {held: stream for held, stream in self._held.items() if held in wanted}
                self._spare = max(dropped, key=len, default=self._spare)  # the next window is read into it
            self._read_later(wanted[1])
            self._window, self._window_stop = window, self.order.window_stop(*key)
        while key[1] != last:  # steps across windows: the later ones' rows are read now too
            key = self.order.window_after(*key)
            self._hold(key)

    def close(self):
        """Wait for the window being read, let the windows go, close the files."""
        if self._reader is not None:
            self._reader.join()
        self._reader, self._held, self._window, self._window_stop, self._spare = None, {}, None, 0, None
        self._close_files()

    def _close_files(self):
        """Close the files, and end the threads that read them."""
        if self._pool is not None:
            self._pool.shutdown()
        if self._files is not None:
            for descriptor in self._files:
                os.close(descriptor)
        self._files = self._pool = None

    def __getstate__(self):
        return {**self.__dict__, "_held": {}, "_lock": None, "_reader": None, "_files": None, "_pool": None,
                "_window": None, "_window_stop": 0, "_local": None, "_spare": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock(), _local=threading.local())

    # ------------------------------------------------------------ rows

    def rows(self, positions, width):
        """Return the stream's ids ``[p, p + width)`` for each position ``p`` (``[N, width]``, the stored dtype, end-of-
        document ids in place), or None where one lies outside the windows held (warned once, unless the
        epoch's padded last step was reached: it wraps to the epoch's first window, let go long before)."""
        with self._lock:
            held = list(self._held.values())
        for stream in held:  # every row in one window, as in all but the groups that span two: one gather
            run = np.searchsorted(stream.starts, positions, side="right") - 1
            if run.min(initial=0) >= 0 and (positions + width <= stream.stops[run]).all():
                return stream.rows(width)[stream.places[run] + (positions - stream.starts[run])]
        which = np.full(len(positions), -1, np.int64)  # the held window of each row, and its place in that one's ids
        place = np.zeros(len(positions), np.int64)
        for number, stream in enumerate(held):
            run = np.searchsorted(stream.starts, positions, side="right") - 1
            inside = (which < 0) & (run >= 0) & (positions + width <= stream.stops[np.maximum(run, 0)])
            which[inside] = number
            place[inside] = stream.places[run[inside]] + positions[inside] - stream.starts[run[inside]]
        if (which < 0).any():
            if self._padded:  # the padded last step's rows: read through the map, as expected (remainder="pad")
                return None
            self.misses += 1
            if self.misses == 1:
                warnings.warn("a batch of sequences lies outside the block order's windows read whole (the one read "
                              "now and the next): it is read through the memory map, page by page, as is any other "
                              "such batch (a loader and a walk of its sampler over one dataset at once do this)",
                              FastPathWarning, stacklevel=4)
            return None
        out = np.empty((len(positions), width), self.sequences.dtype)
        for number in np.unique(which).tolist():
            mine = which == number
            out[mine] = held[number].rows(width)[place[mine]]
        return out

    # ------------------------------------------------------------ reads

    def _hold(self, key):
        """Have window ``key`` held, read here unless the thread reads it (then wait for it)."""
        if self._reader is not None and self._reader.key == key:
            self._reader.join()
        with self._lock:
            if key in self._held:
                return
        runs = self._read(*key)
        if runs is not None:  # None: given up (a SharedSequenceWindows closed while it waited for its ranks)
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
        if runs is not None:
            with self._lock:
                self._held[key] = runs

    def _read(self, epoch, window):
        """Read ``window``'s documents and put their end-of-document ids in; return its Stream."""
        return self._stream_of(self.sequences._document_ranges(self.order.window_ranges(epoch, window)))

    def _stream_of(self, documents):
        """Return the Stream of the documents of ranges ``documents`` (int64 ``[K, 2]``), read here."""
        layout = self._layout(documents)
        with self._lock:
            memory, self._spare = self._spare, None
        if memory is None or len(memory) < layout.size:  # see SPARE_ROOM
            memory = direct_buffer(int(layout.size * SPARE_ROOM) * self._itemsize).view(self.sequences.dtype)
        self._read_pieces(layout.pieces, memory[: layout.size])
        return layout.stream(memory)

    def _layout(self, documents):
        """Return the Layout of the documents of ranges ``documents`` (int64 ``[K, 2]``) in a window's ids."""
        starts = self.sequences._stream()[0]
        documents = documents[np.argsort(documents[:, 0], kind="stable")]
        new = np.r_[True, documents[1:, 0] > np.maximum.accumulate(documents[:, 1])[:-1]]  # runs of documents
        firsts = documents[new, 0]
        stops = np.maximum.reduceat(documents[:, 1], np.flatnonzero(new))
        places = np.r_[0, np.cumsum(starts[stops] - starts[firsts])[:-1]]
        shard_starts = self._shard_starts  # each shard's first document
        pieces = []  # (shard, first, stop, place in ids): the runs cut where a shard ends, in file order
        for first, stop, place in zip(firsts.tolist(), stops.tolist(), places.tolist()):
            while first < stop:
                shard = int(np.searchsorted(shard_starts, first, side="right")) - 1
                end = min(stop, int(shard_starts[shard + 1]))
                pieces.append((shard, first, end, place))
                place, first = place + int(starts[end] - starts[first]), end
        pieces.sort()
        return Layout(starts[firsts], starts[stops], places, int((starts[stops] - starts[firsts]).sum()), pieces)

    def _read_pieces(self, pieces, ids):
        """Read ``pieces`` (a Layout's, or some of them) into their places in ``ids``, each shard's on a thread."""
        starts = self.sequences._stream()[0]
        shards = {}
        for shard, first, stop, place in pieces:
            shards.setdefault(shard, []).append((first, stop, place))

        def read_shard(runs):
            for first, stop, place in runs:
                self._read_documents(first, stop, ids[place : place + int(starts[stop] - starts[first])])

        self._open()
        list(self._pool.map(read_shard, shards.values()))

    def _read_documents(self, first, stop, into):
        """Read documents ``[first, stop)`` into ``into``, each followed by the end-of-document id, CHUNK_IDS of
        stored ids at a time (one read and one masked copy each)."""
        starts = self.sequences._stream()[0]
        while first < stop:
            last = max(first + 1, min(stop, int(np.searchsorted(starts, starts[first] + CHUNK_IDS, side="right")) - 1))
            low, high = int(starts[first]) - first, int(starts[last]) - last  # the stored ids of first..last - 1
            chunk = into[: int(starts[last] - starts[first])]
            self._spread(self._read_stored(low, high), chunk, first, last)
            into, first = into[len(chunk) :], last

    def _spread(self, stored, into, first, stop):
        """Copy the stored ids of documents ``[first, stop)`` into their stream ``into``, each followed by the
        end-of-document id (one masked copy)."""
        starts = self.sequences._stream()[0]
        eods = starts[first + 1 : stop + 1] - 1 - starts[first]  # where each document's end-of-document id goes
        kept = np.ones(len(into), bool)
        kept[eods] = False
        into[kept] = stored
        into[eods] = self.sequences.eod

    def _read_stored(self, start, stop):
        """Return stored ids ``[start, stop)`` of one shard, read from its file into this thread's buffer (a view of
        it), with direct I/O where the files take it, else dropping their pages from the cache behind."""
        files = self._open()
        shard = int(np.searchsorted(self._shard_first, start, side="right")) - 1
        offset = self._columns[shard] + (start - int(self._shard_first[shard])) * self._itemsize
        size, align = (stop - start) * self._itemsize, self._alignment or 1
        low = offset // align * align  # direct I/O reads whole aligned blocks into aligned memory
        view = self._buffer(-(-(offset + size) // align) * align - low)
        done = 0
        while done < offset + size - low:
            got = os.preadv(files[shard], [view[done : done + READ_BYTES]], low + done)
            if got <= 0:
                raise OSError(f"{self.paths[shard]!r} ended at byte {low + done}, inside its token ids: the file "
                              "changed since it was opened; open the dataset again")
            done += got
        if self.drop_behind and self._alignment is None:
            os.posix_fadvise(files[shard], offset, size, os.POSIX_FADV_DONTNEED)
        return np.frombuffer(view, self.sequences.dtype, stop - start, offset - low)

    def _buffer(self, size):
        """Return this thread's buffer of ``size`` bytes (a memoryview), on a huge page and so at any direct I/O
        alignment (NOTE [huge read buffers] in reading/windows.py)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < size:
            buffer = self._local.buffer = direct_buffer(size)
        return memoryview(buffer[:size])

    def _open(self):
        if self._files is None:
            changed = self.sequences.changed_files()
            if changed:
                raise OSError(f"the files changed since they were opened: {changed}; open the dataset again")
            field = self.sequences.field  # each shard's first stored id: a text file's samples, a record field's
            self._columns = ([column_offsets(path)[0] for path in self.paths] if field is None
                             else self.sequences.documents.file_offsets())
            self._alignment = direct_alignment(self.paths[0]) if self.drop_behind else None
            flags = os.O_RDONLY | (os.O_DIRECT if self._alignment else 0)
            self._files = [os.open(path, flags) for path in self.paths]
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="fastdata-sequence-reads")
        return self._files


class WholeStream(SequenceWindows):
    """The stream of every document held at once, read when the first epoch starts: for a corpus that fits in the
    page cache, read by one process alone in any order (see NOTE [whole stream]).

    NOTE [whole stream]: a uniform order's rows lie anywhere, so a corpus
    that fits in the page cache was read through its maps, each row's
    stored ids joined and the end-of-document ids put in per batch (NOTE
    [concat rows] in sequences.py). A process reading alone a corpus whose
    stream takes at most HOLD_SHARE of the memory it may fill (reading/
    shuffles.available_memory: the system's or its cgroup's) holds all of
    it instead, read once from the cache when the first epoch starts (its
    files closed after, its pages left cached: the corpus fits), and cuts
    every batch as the windows do. Holding is a read path, not an order:
    the same batches come either way, so it may follow this machine's
    memory. The lm benchmark's file (58 MB, 28.9M tokens), warm, batches of
    8 x 2048 through make_loader(shuffle=True, tokens_only=True), 3 epochs
    in one process (/tmp/lmt/tp.py):
    11.8-12.7 us a batch against 55-72 us through the maps, and 10.8-11.5
    us for the copy of the same rows from a plain view of nanoGPT's map
    beside it. A record file's tokens field is held the same way, from its
    mapped columns (a shard's values back to back): 30,000 documents written
    by fastdata.write, tokens_only batches of 8 x 2048, 57 us a batch
    against 426 us by the pieces through the maps (while the test suite ran
    beside it, /tmp/lmt/rec.py). Workers and ranks keep the maps: each would
    hold a copy.
    """

    drop_behind = False  # the corpus fits in the page cache: its pages stay for the next reader

    def batches_per_read(self, batch_size):
        """Any group: every row is held."""
        return GROUP_ANY

    def start(self, epoch, step):
        """Hold the stream (read once, kept until ``close``)."""
        self._whole()

    def advance(self, step):
        """Nothing: every row is held."""

    def rows(self, positions, width):
        """Return the stream's ids ``[p, p + width)`` for each position ``p`` (``[N, width]``; the stream is read
        first if it is not held: a read before the loader's first epoch, or after its ``close``)."""
        stream = self._whole()
        if positions.max(initial=0) + width > stream.stops[0]:  # past the stream's end: said, as SequenceWindows'
            return super().rows(positions, width)
        return stream.rows(width)[positions]  # one run, from stream position 0

    def _whole(self):
        with self._lock:
            stream = self._held.get(WHOLE)
        if stream is None:
            try:
                self._hold(WHOLE)
            finally:  # read once: the files are not needed after
                self._close_files()
            stream = self._held[WHOLE]
        return stream

    def _read(self, key):
        starts = self.sequences._stream()[0]
        if self.sequences.field is None:  # a text file or folder: preads of its shards
            return self._stream_of(np.array([[0, len(starts) - 1]], np.int64))
        ids = np.empty(int(starts[-1]), self.sequences.dtype)  # a record file's field: from its mapped columns
        shards = list(self.sequences.documents.values())
        for (first, values), stop in zip(shards, [first for first, _ in shards[1:]] + [len(starts) - 1]):
            self._spread(values, ids[starts[first] : starts[stop]], first, stop)
        return Stream(starts[:1], starts[-1:], np.zeros(1, np.int64), ids, ids)
