"""A block order's windows read once per machine into memory its ranks share, each rank reading a share of them.

NOTE [shared windows]: the ranks of a process group on one machine each
take a slice of every global batch (NOTE [global order] in order.py), so
each needs rows of every block of every window. Measured on a converted
64 px raw folder (360,000 images, 4.4 GB) in a 1.5 GB memory cgroup, two
gloo ranks in lockstep (an all_reduce a step), 15 s rows after the files
were evicted (benchmarks/results/tmp/ranks/probe.py), against a sequential
read of the files at 220,000 img/s (2.7 GB/s) and one process reading its
windows alone at 244,000: the kernel hints each rank gave (NOTE [read
ahead] in readahead.py) read 78,000-80,000 img/s between them (1.06x read
amplification, 17 of their 24 CPU seconds in the kernel's page work);
each rank reading every window whole (NOTE [window reads] in windows.py)
98,000-102,000 img/s, at 2.2x amplification. So the ranks of a machine
map one file in /dev/shm (made and filled by the lowest of them, unlinked
once every one has it open: nothing is left behind whatever ends them),
each lays out every window as a process alone would (the same runs in
the same places: the order and the files decide them), and each reads its
share of the window's shard runs (run group k of window n by local rank
(k + n) mod ranks). Window n of the order's sequence (epoch x windows per
epoch + window) goes to slot n mod SLOTS on every rank. The file's header
holds two int64 words per slot and rank: the window that rank has taken
the slot for (``taken``), and the one it has read its share of into it
(``read``, negative where its read failed), each as n + 1. A rank reads
its share of window n only once every rank has taken the slot for n (no
rank takes batches from the window before it there any more), and a
batch of window n is taken from the slot once every rank has read its
share. Waits poll the header: the ranks of a group step together, so a
wait is short; past PEER_SECONDS a claim gives up (that window's batches
are read from the files, warned) and a batch raises TimeoutError.
"""

import mmap
import os
import time

import numpy as np

from fastdata.errors import FormatError
from fastdata.reading.raggedwindows import RaggedWindowReads
from fastdata.reading.windows import WindowAhead, WindowReads
from fastdata.reading.windowslots import SLOTS, WindowSlots

PEER_SECONDS = 300.0  # the longest a rank waits for the others of its machine: see NOTE [shared windows]
POLL_SECONDS = (20e-6, 1e-3)  # a wait's first and longest pause between looks at the header
SHARED_FOLDER = "/dev/shm"  # where the file the ranks of a machine share is made


def _pages(size):
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def window_number(order, key):
    """Return window ``key``'s (``(epoch, window)``) place in ``order``'s sequence of windows: its slot is this
    mod SLOTS on every rank (see NOTE [shared windows])."""
    return key[0] * -(-order.num_blocks // order.window) + key[1]


def wait_for(done, why, stopped=None):
    """Poll ``done`` until true and return True; False once ``stopped()`` (where given); raise TimeoutError
    (``why()``) past PEER_SECONDS (see NOTE [shared windows])."""
    deadline, pause = time.monotonic() + PEER_SECONDS, POLL_SECONDS[0]
    while not done():
        if stopped is not None and stopped():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"{why()} within {PEER_SECONDS:.0f} s (NOTE [shared windows])")
        time.sleep(pause)
        pause = min(2 * pause, POLL_SECONDS[1])
    return True


def wait_for_reads(read, mark, what, stopped=None):
    """Wait for every rank's word of ``read`` to be ``mark`` (its share of ``what`` read) or ``-mark`` (failed);
    return False once ``stopped()``; raise FormatError naming a rank that failed, TimeoutError as wait_for."""
    if not wait_for(lambda: bool((np.abs(read) == mark).all()),
                    lambda: f"ranks {np.flatnonzero(np.abs(read) != mark).tolist()} of this machine did not read "
                            f"their share of {what}: are they still iterating this loader?", stopped):
        return False
    failed = np.flatnonzero(read == -mark)
    if len(failed):
        raise FormatError(f"rank {int(failed[0])} of this machine could not read its share of {what}; its own "
                          "error says why")
    return True


class SharedMemory:
    """The file the ranks of a machine map: header words ``taken`` and ``read`` ``[SLOTS, ranks]``, then the
    window rows' bytes (page-aligned, for direct reads), then their labels (int64 ``[rows]``).

    Args:
        fd: the open file (read and write), of ``size(ranks, sample_bytes, rows)`` bytes; closed by the caller.
        rank: this process's place among the machine's ranks; ranks: how many share the file.
        sample_bytes: the bytes of the rows' memory; rows: the labels held.
    """

    def __init__(self, fd, rank, ranks, sample_bytes, rows):
        header, samples = _pages(2 * SLOTS * ranks * 8), _pages(sample_bytes)
        self.rank, self.ranks = rank, ranks
        self._header = mmap.mmap(fd, header, mmap.MAP_SHARED, offset=0)
        words = np.frombuffer(self._header, np.int64, 2 * SLOTS * ranks).reshape(2, SLOTS, ranks)
        self.taken, self.read = words[0], words[1]
        self.samples = mmap.mmap(fd, samples, mmap.MAP_SHARED, offset=header)
        self._labels = mmap.mmap(fd, _pages(rows * 8), mmap.MAP_SHARED, offset=header + samples)
        self.labels = np.frombuffer(self._labels, np.int64, rows)

    @staticmethod
    def size(ranks, sample_bytes, rows):
        """The file's bytes for ``ranks`` ranks, ``sample_bytes`` of rows and ``rows`` labels."""
        return _pages(2 * SLOTS * ranks * 8) + _pages(sample_bytes) + _pages(rows * 8)


class SharedWindowReads(WindowReads):
    """The WindowReads of one rank among the ranks of its machine, reading its share into memory they share.

    Made by ``of`` (as a WindowReads), then given the machine's SharedMemory
    by ``attach`` in the process that reads (see NOTE [shared windows]); in
    any other process (a forked child) it reads nothing and holds no batch.
    """

    def __init__(self, store, order, alignment):
        super().__init__(store, order, alignment)
        self.shared, self._owner = None, None

    def memory_bytes(self):
        """Return ``(bytes of the rows' memory, labels)`` this reads into: what SharedMemory holds for it."""
        rows = SLOTS * self.slot_rows + 1
        return rows * self.row_bytes + self.alignment, rows

    def held_bytes(self):
        """The bytes of the rows' memory and labels: the machine's file takes them all at once (fallocated)."""
        sample_bytes, rows = self.memory_bytes()
        return sample_bytes + 8 * rows

    def attach(self, shared):
        """Read into ``shared`` (a SharedMemory) from this process on."""
        self.shared, self._owner = shared, os.getpid()

    def sequence(self, key):
        """Return window ``key``'s (``(epoch, window)``) place in the order's sequence of windows."""
        return window_number(self.order, key)

    def want(self, keys):
        if os.getpid() != self._owner:
            return
        if self._pid != os.getpid():
            self._start()
        self._slots.want(keys)  # placed by the placing thread: a claim waits for the other ranks

    def parts(self, indices):
        if os.getpid() != self._owner:
            return None
        return super().parts(indices)

    def _make_memory(self, rows):
        return self.shared.samples, self.shared.labels  # not dropped at fork: a child reads none of it

    def _make_slots(self):
        return SharedWindowSlots(self.sequence)

    def _claim(self, slot, key):
        mark, taken = self.sequence(key) + 1, self.shared.taken[slot]
        taken[self.shared.rank] = mark
        return self._wait(lambda: bool((taken == mark).all()),
                          lambda: f"ranks {np.flatnonzero(taken != mark).tolist()} of this machine did not take the "
                                  f"slot of window {key}", stops=True)

    def _mine(self, groups, key):
        first = self.sequence(key)
        return [group for k, group in enumerate(groups) if (k + first) % self.shared.ranks == self.shared.rank]

    def _read_done(self, slot, window):
        mark = self.sequence(window.key) + 1
        self.shared.read[slot, self.shared.rank] = -mark if window.error is not None else mark
        super()._read_done(slot, window)

    def _wait_read(self, window):
        super()._wait_read(window)
        mark = self.sequence(window.key) + 1
        read = self.shared.read[(mark - 1) % SLOTS]
        wait_for_reads(read, mark, f"window {window.key} of {self.store.index.root!r}")

    def _wait(self, done, why, stops=False):
        return wait_for(done, why, stopped=(lambda: self._slots.stopped) if stops else None)

    def close(self):
        """As WindowReads.close, and wait for this rank's reads under way: none lands in a slot after it."""
        pool = self._pool if self._pid == os.getpid() else None
        super().close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __getstate__(self):
        return {**super().__getstate__(), "shared": None, "_owner": None}


class SharedRaggedWindowReads(SharedWindowReads, RaggedWindowReads):
    """The SharedWindowReads of JPEG rows (NOTE [ragged windows] in raggedwindows.py): the runs' bytes and labels
    in the file the ranks share; each rank lays out every window itself, so its rows' offsets are its own."""

    def memory_bytes(self):
        return SLOTS * self.slot_bytes, SLOTS * self.slot_rows


class SharedWindowSlots(WindowSlots):
    """WindowSlots whose window ``n`` of the order's sequence always goes to slot n mod SLOTS (every rank's alike)."""

    def __init__(self, sequence):
        super().__init__()
        self._sequence = sequence

    def _slot_for(self, key, reading=False):
        slot = self._sequence(key) % SLOTS
        return slot if slot in self._free(reading) else None


class SharedWindowAhead(WindowAhead):
    """The WindowAhead of a rank that shares its machine's windows: it wants the windows of each global step, so
    every rank of the machine wants the same ones in the same order (see NOTE [shared windows])."""

    shared = True  # reading stays in this process: the other ranks read their shares of its windows

    def advance(self, step: int) -> None:
        if self.order.step_positions(step, self.rank, self.world_size)[1] > self.order.num_samples:
            self.reads.expect_padded()
        start, stop = self.order.step_positions(step)
        if start >= stop:
            return
        first = self.order.window_of(self._epoch, start)
        if first != self._window:
            last = self.order.window_of(self._epoch, stop - 1)
            after = (self._epoch, last) if last != first else self.order.window_after(self._epoch, first)
            self.reads.want([(self._epoch, first), after])
            self._window = first
