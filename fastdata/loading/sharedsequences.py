"""Concat sequences' block windows read once per machine into memory its ranks share, each rank reading a share.

NOTE [shared sequence windows]: the ranks of a process group take slices of
every global batch (NOTE [global order] in reading/order.py), so each needs
ids of every window. Each rank reading every window whole would read the
corpus once per rank; the kernel hints they had instead read through the
maps page by page (NOTE [sequence windows] in sequencewindows.py). So, as
for images (NOTE [shared windows] in reading/sharedwindows.py, whose file,
header and waits this uses), the ranks of a machine map one file in
/dev/shm, window n of the order's sequence goes to slot n mod SLOTS of it
on every rank, each rank lays out every window as a process alone would
(the same runs in the same places: the order and the lengths decide them),
and reads every ranks-th of its pieces (runs cut at shard ends, in file
order, from piece n mod ranks): the stored ids with the end-of-document ids
put in, into the slot. A rank takes the slot for window n once it has let
go the window before there, reads its pieces once every rank has taken
it, and cuts rows from window n once every rank has read its pieces. A
slot holds the ids of the ``window`` largest blocks (largest_window_ids),
and a group of batches spans two windows at most (``batches_per_read``
counts global batches), so two slots do: a global batch longer than the
shortest window is refused. Not yet measured against the kernel hints
the ranks had before (issue 31).
"""

import os

import numpy as np
import torch.distributed as dist

from fastdata.errors import FormatError
from fastdata.loading.sequencewindows import SequenceWindows
from fastdata.reading.sharedwindows import wait_for, wait_for_reads, window_number
from fastdata.reading.windows import window_room
from fastdata.reading.windowslots import SLOTS


def largest_window_ids(sequences, order):
    """Return the most stream ids one window of ``order`` over concat ``sequences`` holds: its ``window`` largest
    blocks' documents' ids, each followed by its end-of-document id."""
    edges = np.minimum(np.arange(order.num_blocks + 1, dtype=np.int64) * order.block_size, order.num_samples)
    documents = sequences._document_ranges(np.stack([edges[:-1], edges[1:]], axis=1))
    starts = sequences._stream()[0]
    ids = np.sort(starts[documents[:, 1]] - starts[documents[:, 0]])
    return int(ids[-order.window :].sum()) if len(ids) else 0


class SharedSequenceWindows(SequenceWindows):
    """The SequenceWindows of one rank among the ranks of its machine, read into the file they share.

    Made by ``of``, then given the machine's SharedMemory by ``attach`` in the
    process that reads (see NOTE [shared sequence windows]); in any other
    process (a forked child) it reads nothing and holds no row.
    """

    def __init__(self, sequences, order, rank, world_size):
        super().__init__(sequences, order)
        self.rank, self.world_size = rank, world_size
        self.slot_ids = max(1, largest_window_ids(sequences, order))
        self.shared, self._owner, self._slots, self._stopped = None, None, None, False
        self.ids_held = self.ids_read = 0  # stream ids of the windows held, and of the pieces this rank read of them

    @classmethod
    def of(cls, sequences, order):
        """Return ``(windows, None)`` for this rank of the process group, or ``(None, why not)``: concat rows of
        local files in a block order (TokenSequences.share_windows asks for no other)."""
        shortest = order.window * order.block_size - order.block_size + 1
        if order.global_batch > shortest:
            return None, (f"a global batch of {order.global_batch} sequences can span three windows of "
                          f"{order.window} blocks of {order.block_size}; pass a larger window or block_size")
        windows = cls(sequences, order, dist.get_rank(), dist.get_world_size())
        why = window_room(windows.memory_bytes()[0], order)
        return (None, why) if why is not None else (windows, None)

    def memory_bytes(self):
        """Return ``(bytes of the slots, labels)`` this reads into: what SharedMemory holds for it (no labels:
        one word, unused)."""
        return SLOTS * self.slot_ids * self._itemsize, 1

    def attach(self, shared):
        """Read into ``shared`` (a SharedMemory) from this process on."""
        self.shared, self._owner = shared, os.getpid()
        count = SLOTS * self.slot_ids
        self._slots = np.frombuffer(shared.samples, self.sequences.dtype, count).reshape(SLOTS, self.slot_ids)

    def sequence(self, key):
        """Return window ``key``'s (``(epoch, window)``) place in the order's sequence of windows."""
        return window_number(self.order, key)

    def batches_per_read(self, batch_size):
        """As SequenceWindows', counting the global batches of the order: every rank's groups span its steps."""
        return super().batches_per_read(self.order.global_batch)

    def start(self, epoch, step):
        if os.getpid() == self._owner:
            self._stopped = False
            super().start(epoch, step)

    def advance(self, step):
        if os.getpid() == self._owner:
            super().advance(step)

    def rows(self, positions, width):
        if os.getpid() != self._owner:
            return None
        return super().rows(positions, width)

    def close(self):
        """End the waits for the other ranks, then as SequenceWindows.close."""
        self._stopped = True
        super().close()

    def __getstate__(self):
        return {**super().__getstate__(), "shared": None, "_owner": None, "_slots": None}

    def _hold(self, key):
        if self._reader is not None:  # the window it reads may lie in the slot ``key`` takes
            self._reader.join()
        super()._hold(key)

    def _read(self, epoch, window):
        """Read this rank's pieces of window ``(epoch, window)`` into its slot once every rank has taken the slot;
        return its Stream once every rank has read its pieces, or None where closed meanwhile."""
        key = (epoch, window)
        number = self.sequence(key)
        slot, mark, shared = number % SLOTS, number + 1, self.shared
        layout = self._layout(self.sequences._document_ranges(self.order.window_ranges(epoch, window)))
        if layout.size > self.slot_ids:
            raise FormatError(f"window {key} of {self.sequences.path!r} holds {layout.size} ids, more than the "
                              f"{self.slot_ids} of its slot: a fault in largest_window_ids")
        with self._lock:  # this rank lets go the window it held in the slot
            self._held = {held: stream for held, stream in self._held.items() if self.sequence(held) % SLOTS != slot}
        taken, read = shared.taken[slot], shared.read[slot]
        taken[shared.rank] = mark
        if not wait_for(lambda: bool((taken == mark).all()),
                        lambda: f"ranks {np.flatnonzero(taken != mark).tolist()} of this machine did not take the "
                                f"slot of window {key}", stopped=lambda: self._stopped):
            return None
        mine = layout.pieces[(shared.ranks - number % shared.ranks + shared.rank) % shared.ranks :: shared.ranks]
        try:
            self._read_pieces(mine, self._slots[slot, : layout.size])
        except BaseException:
            read[shared.rank] = -mark
            raise
        read[shared.rank] = mark
        starts = self.sequences._stream()[0]
        self.ids_read += sum(int(starts[stop] - starts[first]) for _, first, stop, _ in mine)
        if not wait_for_reads(read, mark, f"window {key} of {self.sequences.path!r}", stopped=lambda: self._stopped):
            return None
        self.ids_held += layout.size
        return layout.stream(self._slots[slot])
