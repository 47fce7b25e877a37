"""A block order's windows of ragged samples (JPEG bytes) read whole with direct I/O: windows.py for any length.

NOTE [ragged windows]: a shard stores its samples' bytes back to back (the
values column) and where each starts (the offsets column), so a run of a
window, the rows ``[start, stop)`` of one shard, is one byte range of its
file. It is read with one O_DIRECT pread from the aligned offset below it
into the slot's next aligned byte: no row congruence to meet (the rows
are not of one size), at most two alignments of unused bytes per run. The
slot's offsets are the run's stored offsets moved to where the run landed,
and a row between two runs (never asked for) covers the bytes between
them, so that the whole memory, its labels and its offsets are one Columns
that a batch takes rows of, as it would of a file (the JPEG decoder reads
them unchanged). A slot's address space is what the ``window`` largest
blocks of the dataset hold, with that slack; its pages are made as read.
The ranks of a machine share such windows as they share raw ones
(SharedRaggedWindowReads, NOTE [shared windows] in sharedwindows.py).
Measured in benchmarks/results/scale/results.md (the 224 px jpeg rows from
disk, one process; the ranks' JPEG windows are tested, not measured).
"""

import os
from functools import partial

import numpy as np

from fastdata.formats import Columns
from fastdata.reading.parts import Parts
from fastdata.reading.windows import WindowReads, cut_short
from fastdata.reading.windowslots import RUN, SLOTS


class RaggedWindowReads(WindowReads):
    """WindowReads of samples stored ragged as bytes (JPEG): a run's bytes read whole, its offsets moved to them.

    Made by ``of`` (as WindowReads), or None where it cannot apply; see NOTE [ragged windows].
    """

    def __init__(self, store, order, alignment):
        self.store, self.order, self.alignment = store, order, alignment
        self._offsets = {}  # shard -> (value column offset, label column offset) in its file
        self._stored = {}  # shard -> int64 its stored offsets, read once
        runs = self._max_runs()
        self.slot_rows = order.window * order.block_size + runs + 1  # a row between runs; the last one's end
        self.window_bytes = largest_window_bytes(store.lengths(), order)
        self.slot_bytes = -(-(self.window_bytes + 2 * runs * alignment) // alignment) * alignment
        self._pid, self._padded = None, 0

    def _wasteful(self):
        return None  # at most two alignments a run: held_bytes counts them, window_room judges

    def held_bytes(self):
        """The most bytes of memory this process's windows hold: SLOTS slots' bytes, offsets and labels."""
        return SLOTS * (min(self.slot_bytes, self.store.lengths().sum() + self.alignment) + 16 * self.slot_rows)

    def _memory_size(self, rows):
        return SLOTS * self.slot_bytes

    def _make_views(self):
        """Make this process's window memory and the Columns (bytes, labels, offsets) batches are taken from."""
        rows = SLOTS * self.slot_rows
        self._memory, self.labels = self._make_memory(rows)
        self.offsets = np.zeros(rows + 1, np.int64)
        self.columns = Columns(np.frombuffer(self._memory, np.uint8), self.labels, self.offsets)

    def _parts_of(self, indices, rows, used):
        parts = Parts([self.columns], rows, [0, len(rows)], [self.store.index.root],
                      origin=partial(self._origin, indices))
        parts.hold(partial(self._slots.release, used))
        return parts

    def _origin(self, indices, row):
        """Return ``(path, index)``: the file and the sample in it of batch ``row`` (global ``indices[row]``)."""
        index = int(indices[row])
        shard = int(self.store.index.shard_of(np.array([index]))[0])
        return self.store.index.path(shard), index - int(self.store.index.starts[shard])

    def _stored_offsets(self, shard):
        """Return int64 ``shard``'s stored offsets (its samples' bytes in its values column), read once."""
        if shard not in self._stored:
            self._stored[shard] = np.array(self.store.columns([shard])[0].offsets, np.int64)
        return self._stored[shard]

    def _lay_out(self, runs, slot):
        """Return the RUN records of ``runs`` (shard, start, stop) in ``slot``, and set their rows' offsets."""
        starts, align = self.store.index.starts, self.alignment
        runs = np.array(runs, np.int64).reshape(-1, 3)
        out = np.zeros(len(runs), RUN)
        place, row = slot * self.slot_bytes, slot * self.slot_rows
        for k, (shard, start, stop) in enumerate(runs.tolist()):
            values_at, labels_at = self._column_offsets(shard)
            first, count = start - int(starts[shard]), stop - start
            stored = self._stored_offsets(shard)[first : first + count + 1]
            begin = values_at + int(stored[0])
            head = begin % align
            length = -(-(head + int(stored[-1] - stored[0])) // align) * align
            if place + length > (slot + 1) * self.slot_bytes or row + count + 1 > (slot + 1) * self.slot_rows:
                raise RuntimeError(f"a window of {len(runs)} runs does not fit its slot of {self.slot_bytes} bytes "
                                   f"and {self.slot_rows} rows")  # the bounds of __init__ are wrong
            self.offsets[row : row + count + 1] = stored - stored[0] + place + head
            out[k] = (shard, start, stop, row, begin - head, length, place, labels_at + first * 8, 0)
            place, row = place + length, row + count + 1
        self.offsets[row] = place  # the row after the last run ends where the slot's bytes in use do
        return out

    def _read_run(self, path, direct, plain, memory, start, stop, row, file_offset, length, place, labels_at, shift):
        """Read one run's bytes (``direct``) and labels (``plain``) into the slot's memory and labels."""
        got = os.preadv(direct, [memory[place : place + length]], file_offset)
        labels = os.pread(plain, (stop - start) * 8, labels_at)
        if got < int(self.offsets[row + stop - start]) - place or len(labels) < (stop - start) * 8:
            raise cut_short(path, start, stop)
        self.labels[row : row + stop - start] = np.frombuffer(labels, np.int64)

    def __getstate__(self):  # another process makes its own slots and threads
        keep = ("store", "order", "alignment", "_offsets", "_stored", "slot_rows", "window_bytes", "slot_bytes")
        return {**{key: self.__dict__[key] for key in keep}, "_pid": None, "_padded": 0}


def largest_window_bytes(lengths, order):
    """Return the most stored bytes one window of ``order`` can hold: its ``window`` largest blocks'."""
    ends = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    edges = np.minimum(np.arange(order.num_blocks + 1, dtype=np.int64) * order.block_size, len(lengths))
    blocks = np.diff(ends[edges])
    return int(np.sort(blocks)[-order.window :].sum()) if len(blocks) else 0
