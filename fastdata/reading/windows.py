"""A block order's windows read whole into this process's memory with direct I/O, and batches taken from there.

NOTE [window reads]: a block shuffle from data bigger than the page cache
read through the memory map (MADV_WILLNEED on each window, PAGEOUT after,
NOTE [window hints] in readahead.py) paid the kernel per page: inserting
each page in the cache, mapping it at the fault, unmapping and reclaiming
it, 11-12 s of system time in a 17 s read, and reached 0.69-0.74 of the
disk's sequential rate once the disk gave 1.5 GB/s. A window is instead
read with O_DIRECT preads straight into one of two slots of an anonymous
buffer, the next window while batches are taken from the current one, and
a batch is one take of its rows from the slots' single row view. Measured
on 64 px raw (175 shards, 6.1 GB, windows of 1,024 blocks of 21 samples)
in a 1.5 GB memory cgroup, 15 s each, in turn: the sequential read of the
files 118,000-125,000 img/s; make_loader through the map with hints
83,055; prototypes of this module (/tmp scripts): buffered preads of the
sorted blocks on 4-32 threads 58,500-67,300 img/s (9-10 s of system time;
the kernel's page cache work again), O_DIRECT with a task per block
94,300-95,600 (3.2 s of system time), O_DIRECT with a task per shard that
reads its blocks of the window in file order 126,413 (one stream per
shard suits this virtual disk); then make_loader with this module 126,962
img/s between sequential reads of 122,866 and 123,969 (1.03x; 9.2 s user,
7.0 s system), read amplification 1.05 (the window read ahead when the
run stops, alignment). The order is the same, so every batch holds the
same samples either way.

Direct I/O wants the file offset, the length and the memory address
aligned (the device's logical block, probed: 512 or 4,096 bytes). Each
run of rows is read from the aligned offset below it into an aligned
place chosen so that its first row lands on a row of the view (a
solution of two congruences, found per run): the rows need no second
copy, at the cost of a few unused rows per run, bounded by
``MAX_SLACK``. Reads past the data (the alignment's tail) stop at the
end of the file. That lands only where the run's offset in its file has
the view's remainder modulo ``gcd(row bytes, alignment)``; the view takes
the remainder most of the folder's shards have (probed on the first,
middle and last), and the runs of a shard whose column lies elsewhere
(a folder written before NOTE [aligned columns] in formats/layout.py put
shard 0's column 8 bytes before the others') are read to an aligned
place and moved onto the view's rows by one memmove, off the GIL: a copy
of those shards' bytes, said once (FastPathWarning). Placed from shard 0
alone, every window of such a folder failed and its batches were read
sample by sample through the map, at 0.035 of the disk.

This takes only what one process reads alone: with workers or several
ranks on a machine, each would read every window whole, where the page
cache shares one read (so those keep the hints), and only files of
fixed-size rows (raw images, HDF5 or Arrow), whose columns are plain byte
ranges of the file. Before its reads, every shard is compared with the fingerprint
taken when the store checked it (NOTE [shard fingerprint] in fingerprints.py),
through the descriptor it is read from.
"""

import ctypes
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np

from fastdata.errors import FormatError
from fastdata.reading import shuffles
from fastdata.reading.parts import Parts
from fastdata.reading.readpaths import BY_SHARD
from fastdata.reading.windowslots import RUN, SLOTS, Window, WindowSlots

ALIGNMENTS = (512, 4096)  # direct I/O alignments tried, least first; see NOTE [window reads]
HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB pages) huge page: see NOTE [huge read buffers]
READ_THREADS = 32  # shards of a window read at once
MAX_SLACK = 1.0  # the most unused view rows of a slot, as a share of a window's rows (address space only)


class WindowReads:
    """Read the windows of a block order whole (direct I/O, on threads) and serve the batches that lie in them.

    Made by ``of``, or None where the dataset cannot be read this way; the
    WindowAhead of the order calls ``want`` as the order enters a window, and
    the dataset's store asks ``parts`` for each batch (see NOTE [window reads]).
    Slots, views and threads are made in each process on first use.

    Args:
        store: the dataset's ShardStore.
        order: the EpochOrder (``shuffle="block"``).
        alignment: the direct I/O alignment of the files, in bytes.
    """

    def __init__(self, store, order, alignment):
        metadata = store.index.metadata
        self.store, self.order, self.alignment = store, order, alignment
        self.row_shape, self.dtype = tuple(metadata["sample_shape"]), np.dtype(metadata["sample_dtype"])
        self.row_bytes = int(np.prod(self.row_shape)) * self.dtype.itemsize
        self._offsets = {}  # shard -> (sample column offset, label column offset) in its file
        self.slot_rows = order.window * order.block_size + self._max_runs() * self._run_slack() + 1
        self._pid, self._base = None, None
        self._padded = 0  # batches of padded steps told by expect_padded, not yet asked for

    def expect_padded(self):
        """Be told the next batch not in the windows is a padded step's: its samples wrap to the epoch's first
        window (NOTE [remainder] in order.py), gone by then, and it is read from the files unwarned."""
        self._padded += 1

    def padded(self):
        """Return whether a batch outside the windows was a padded step's (expect_padded), counting it."""
        if not self._padded:
            return False
        self._padded -= 1
        return True

    def _max_runs(self):
        """The most runs (rows of one shard) a window can hold: its blocks, cut at the shards' starts."""
        index, order = self.store.index, self.order
        cuts = -(-(order.block_size - 1) // max(int(np.diff(index.starts).min()), 1))  # shard starts inside a block
        return order.window + min(index.num_shards - 1, order.window * cuts)

    def _run_slack(self):
        """The most view rows a run leaves unused: its placement's congruence (or its move), its head and tail."""
        period = self.alignment // int(np.gcd(self.row_bytes, self.alignment))  # placements repeat every this many rows
        landing = period - 1 + -(-2 * self.alignment // self.row_bytes)
        moved = 1 + -(-3 * self.alignment // self.row_bytes)  # see place_runs
        return max(landing, moved)

    @classmethod
    def of(cls, store, order):
        """Return ``(WindowReads, None)`` of a local ``store`` of fixed-size rows under ``order``, or ``(None, why)``.

        ``why`` says what stands in the way: an order that is not "block", a
        disk without direct I/O, rows whose aligned places would take over
        MAX_SLACK unused rows, or windows too big for the memory available
        (NOTE [window room]).
        """
        if order.shuffle != "block" or store.is_remote:
            return None, "only a block order of local files is read in windows"
        if not hasattr(os, "O_DIRECT"):
            return None, "this system has no direct I/O (O_DIRECT)"
        alignment = direct_alignment(store.index.path(0))
        if alignment is None:
            return None, f"the file system of {store.index.path(0)!r} refuses direct I/O (O_DIRECT)"
        reads = cls(store, order, alignment)
        why = reads._wasteful() or window_room(reads.held_bytes(), order)
        return (reads, None) if why is None else (None, why)

    def _wasteful(self):
        """Return why a slot's view would leave over MAX_SLACK of its rows unused, or None."""
        order = self.order
        if self.slot_rows <= (1 + MAX_SLACK) * order.window * order.block_size + 1:
            return None
        return (f"rows of {self.row_bytes} bytes in windows of {order.window} blocks of {order.block_size} would "
                f"leave more than {MAX_SLACK:.0%} of a window's memory unused at {self.alignment}-byte alignment; "
                "pass a larger block_size or window")

    def held_bytes(self):
        """The most bytes of memory this process's windows hold: SLOTS windows' rows (their pages made as read)."""
        return SLOTS * min(self.order.window * self.order.block_size, self.order.num_samples) * self.row_bytes

    def want(self, keys):
        """Keep the windows ``keys`` (``(epoch, window)``, the one read now first) and read those not read yet.

        Windows not in ``keys`` are let go: their slots are reused once no batch and no read is in them.
        """
        if self._pid != os.getpid():
            self._start()
        self._slots.want(keys)
        while (placement := self._slots.next_placement(wait=False)) is not None:  # here, where a slot is free
            self._place(*placement)

    def parts(self, indices):
        """Return the Parts of global ``indices`` (int64, checked) from the windows read, or None where not all are.

        Waits for the reads of the windows they lie in; raises what failed there.
        """
        if self._pid != os.getpid() or not len(indices):
            return None
        rows, used = self._slots.lease(indices)
        if rows is None:
            return None
        try:
            for window in used:
                self._wait_read(window)
        except BaseException:
            self._slots.release(used)
            raise
        return self._parts_of(indices, rows, used)

    def _parts_of(self, indices, rows, used):
        """Return the Parts of global ``indices`` read as view ``rows`` of the windows ``used`` (leased)."""
        return Parts.of_stitched_rows(self.view, rows, self._label_base + rows * 8,
                                      partial(self.store.expand_parts, self.store.index.shard_of(indices), indices),
                                      partial(self._slots.release, used), keep=self.labels)

    def _wait_read(self, window):
        """Wait until ``window`` is read into its slot; raise what failed there."""
        window.done.wait()
        if window.error is not None:
            raise window.error

    def _memory_size(self, rows):
        """The bytes of memory ``rows`` view rows take, from an aligned byte."""
        return rows * self.row_bytes + self.alignment

    def _make_memory(self, rows):
        """Return ``(memory, labels)`` of ``rows`` view rows: page-aligned bytes (pages made as read), int64 labels."""
        memory = mmap.mmap(-1, self._memory_size(rows), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _WITH_MEMORY.add(self)  # see NOTE [windows after fork]
        return memory, np.zeros(rows, np.int64)

    def _start(self):
        """Make this process's slots, views and threads (a forked child makes its own).

        This process's ``_pid`` is set last: until then a batch asked for on another thread is read from the
        files, not from views and slots half made (see NOTE [reset once] in store.py).
        """
        self._make_views()
        self._slots = self._make_slots()
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="fastdata-window")
        threading.Thread(target=_place_windows, args=(self._slots, weakref.ref(self)), daemon=True,
                         name="fastdata-windows").start()
        self._stop = weakref.finalize(self, _stop, self._slots, self._pool)
        self._pid = os.getpid()

    def _make_views(self):
        """Make this process's window memory, labels and the row view batches are taken from."""
        rows = SLOTS * self.slot_rows + 1
        self._memory, self.labels = self._make_memory(rows)
        step = int(np.gcd(self.row_bytes, self.alignment))
        usual = self.store.usual_remainder(step)  # view row 0's byte: see NOTE [window reads]
        self._base = self._column_offsets(0)[0] % step if usual is None else usual
        self.view = np.ndarray((rows, *self.row_shape), self.dtype, buffer=self._memory, offset=self._base)
        self._label_base = self.labels.ctypes.data

    def _make_slots(self):
        return WindowSlots()

    def close(self):
        """End this process's placing thread, and its read threads once the reads queued are done.

        Those reads are not cancelled: a batch of a window being read waits
        for them. Batches come from the files until the next ``want``, which
        starts the threads again.
        """
        if self._pid == os.getpid():
            self._stop.detach()
            self._slots.stop()
            self._pool.shutdown(wait=False)
        self._pid = None

    def _column_offsets(self, shard):
        """Return ``(samples, labels)``: where ``shard``'s columns start in its file (the shard checked first)."""
        if shard not in self._offsets:
            self._offsets[shard] = self.store.column_offsets(shard)
        return self._offsets[shard]

    def _place(self, slot, key):
        """Lay out window ``key`` (``(epoch, window)``) in ``slot`` and queue its reads, a task per shard."""
        window = Window(key)
        try:
            if not self._claim(slot, key):  # closed meanwhile: nothing waits for this window
                return
            window.set_runs(self._lay_out(self._runs(self.order.window_ranges(*key)), slot))
        except Exception as exc:  # held no sample: its batches are read from the files, and meet the problem there
            window.fail(exc)
            self.store.read_paths.fall_back("window", (
                f"window {key} of {self.store.index.root!r} could not be laid out for direct reads ({exc}); its "
                f"batches are read '{BY_SHARD}' through the memory map, at a fraction of the disk's rate"))
        self._slots.put(slot, window)
        shards = window.runs["shard"]
        groups = np.split(np.arange(len(shards)), np.flatnonzero(np.diff(shards)) + 1) if len(shards) else []
        groups = self._mine(groups, key)
        window.expect(len(groups))
        if not groups:
            self._read_done(slot, window)
        for group in groups:
            try:
                self._pool.submit(self._read_shard, slot, window, group)
            except RuntimeError as exc:  # closed while placing: the window fails whole, no batch waits on it
                window.fail(exc)
                if window.finish_one():
                    self._read_done(slot, window)

    def _claim(self, slot, key):
        """Take ``slot`` for window ``key`` before it is laid out; return False where closed meanwhile (here the
        slot is this process's alone: True)."""
        return True

    def _mine(self, groups, key):
        """Return the groups of runs (one shard's each) of window ``key`` that this process reads: all of them."""
        return groups

    def _read_done(self, slot, window):
        """Be told this process's reads of ``window`` (in ``slot``) are done: its slot may be free now."""
        self._slots.notify()

    def _runs(self, ranges):
        """Return int64 ``[K, 3]`` (shard, start, stop) of sorted sample ``ranges``, cut at shard starts, merged."""
        starts = self.store.index.starts
        first, last = self.store.index.shard_of(ranges[:, 0]), self.store.index.shard_of(ranges[:, 1] - 1)
        runs = []
        for (start, stop), a, b in zip(ranges.tolist(), first.tolist(), last.tolist()):
            for shard in range(a, b + 1):
                piece = [shard, max(start, int(starts[shard])), min(stop, int(starts[shard + 1]))]
                if runs and runs[-1][0] == shard and runs[-1][2] == piece[1]:
                    runs[-1][2] = piece[2]
                else:
                    runs.append(piece)
        return runs

    def _lay_out(self, runs, slot):
        """Return the RUN records of ``runs`` (shard, start, stop): what each reads, and where, in ``slot``."""
        starts = self.store.index.starts
        runs = np.array(runs, np.int64).reshape(-1, 3)
        offsets = np.array([self._column_offsets(shard) for shard in runs[:, 0].tolist()], np.int64).reshape(-1, 2)
        first = runs[:, 1] - starts[runs[:, 0]]  # each run's first row in its shard
        out = np.zeros(len(runs), RUN)
        out["shard"], out["start"], out["stop"] = runs.T
        out["file_offset"], out["length"], out["place"], out["row"], out["shift"] = place_runs(
            offsets[:, 0] + first * self.row_bytes, runs[:, 2] - runs[:, 1], self.row_bytes, self.alignment,
            self._base, slot * self.slot_rows)
        if out["shift"].any():
            moved = np.unique(runs[out["shift"] != 0, 0])
            self.store.read_paths.fall_back("moved rows", (
                f"shard {int(moved[0])} of {self.store.index.root!r} (and {len(moved) - 1} more in this window) has "
                f"its sample column at another byte modulo {int(np.gcd(self.row_bytes, self.alignment))} than most "
                "shards: its rows are read, then moved onto the window's rows, a copy of their bytes. Converting "
                "the folder again aligns every shard's column (NOTE [aligned columns])"))
        out["labels_at"] = offsets[:, 1] + first * 8
        limit = self._base + (slot + 1) * self.slot_rows * self.row_bytes
        ends = np.maximum(out["place"] + out["length"], self._base + out["row"] * self.row_bytes
                          + (out["stop"] - out["start"]) * self.row_bytes)
        if len(runs) and ends[-1] > limit:  # the slack bound of __init__ is wrong
            raise RuntimeError(f"a window of {len(runs)} runs does not fit its slot of {self.slot_rows} rows")
        return out

    def _read_shard(self, slot, window, group):
        """Read the runs ``group`` of ``window`` (one shard's, in file order) into their places; record a failure."""
        try:
            runs = window.runs[group]
            shard = int(runs["shard"][0])
            path = self.store.index.path(shard)
            try:
                direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except FileNotFoundError:
                self.store.check_unchanged(shard, None)  # raises: the shard was deleted
                raise
            plain = None
            try:
                plain = os.open(path, os.O_RDONLY)
                self.store.check_unchanged(shard, os.fstat(direct))
                self.store.check_unchanged(shard, os.fstat(plain))
                memory = np.frombuffer(self._memory, np.uint8)
                for run in runs.tolist():
                    self._read_run(path, direct, plain, memory, *run[1:])
            finally:
                os.close(direct)
                if plain is not None:
                    os.close(plain)
        except BaseException as exc:
            window.fail(exc)
        finally:
            if window.finish_one():
                self._read_done(slot, window)

    def _read_run(self, path, direct, plain, memory, start, stop, row, file_offset, length, place, labels_at, shift):
        """Read one run's samples (``direct``) and labels (``plain``) into the view and labels of this process.

        A run read ``shift`` bytes before its rows' place is moved there (see ``place_runs``).
        """
        got = os.preadv(direct, [memory[place:place + length]], file_offset)
        target = self._base + row * self.row_bytes
        needed = target - shift - place + (stop - start) * self.row_bytes
        labels = os.pread(plain, (stop - start) * 8, labels_at)
        if got < needed or len(labels) < (stop - start) * 8:
            raise cut_short(path, start, stop)
        if shift:  # ctypes calls free the GIL
            address = memory.ctypes.data
            ctypes.memmove(address + target, address + target - shift, (stop - start) * self.row_bytes)
        self.labels[row:row + stop - start] = np.frombuffer(labels, np.int64)

    def __getstate__(self):  # another process makes its own slots and threads
        keep = ("store", "order", "alignment", "row_shape", "dtype", "row_bytes", "_offsets", "slot_rows")
        return {**{key: self.__dict__[key] for key in keep}, "_pid": None, "_padded": 0}


class WindowAhead:
    """Keep the window a block order reads now and the next one read whole, as the order enters each.

    The ReadsAhead (readahead.py) of one process reading a block order alone
    (see NOTE [window reads]): told each step, it wants the step's window and
    the one after from its WindowReads (``reads``), which reads them on its threads.
    """

    def __init__(self, reads, rank=0, world_size=1):
        self.reads, self.order, self.rank, self.world_size = reads, reads.order, rank, world_size
        reads.store.advise("random")  # a batch outside the windows is read through the map, sample by sample
        self._epoch, self._window = 0, None

    def start(self, epoch: int, step: int) -> None:
        """Begin ``epoch`` at ``step``: want its window and the next."""
        self._epoch, self._window = epoch, None
        self.advance(step)

    def advance(self, step: int) -> None:
        """Note that ``step``'s indices were just produced: want its window and the next, if it entered one."""
        start, stop = self.order.step_positions(step, self.rank, self.world_size)
        if stop > self.order.num_samples:
            self.reads.expect_padded()
        if start >= stop:
            return
        window = self.order.window_of(self._epoch, start)
        if window != self._window:
            self.reads.want([(self._epoch, window), self.order.window_after(self._epoch, window)])
            self._window = window

    def close(self) -> None:
        """End the window reads' threads (the next ``start`` begins them again)."""
        self.reads.close()
        self._window = None


# NOTE [windows after fork]: a forked child (the auto helper: NOTE [auto
# helper] in batchloader.py; a DataLoader worker) makes its own windows and
# never reads the ones it inherits, yet it held their pages: with the auto
# helper forked beside 512 MB of windows this process was letting go, a
# 1.2 GB memory cgroup killed the helper (/tmp/big/drive.py). MADV_DONTFORK
# left the child without the mapping, but an inherited mmap object then
# unmapped whatever the child had put at that address since (the helper
# crashed with SIGSEGV in its own window reads and in its garbage
# collector). So the child keeps the mappings and drops their pages
# (MADV_DONTNEED): reading them would give zeros, and nothing reads them.
_WITH_MEMORY = weakref.WeakSet()  # this process's WindowReads whose memory is mapped


def _drop_inherited_windows():
    for reads in list(_WITH_MEMORY):
        try:
            reads._memory.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, ValueError):  # no memory yet, or closed
            pass


os.register_at_fork(after_in_child=_drop_inherited_windows)


def _place_windows(slots, reads):
    """The placing thread: give each wanted window a free slot and queue its reads, until stopped.

    Holds its WindowReads (``reads``, a weak reference) only while placing, so that the reads can be collected.
    """
    while (placement := slots.next_placement()) is not None:
        owner = reads()
        if owner is None:
            return
        owner._place(*placement)
        del owner


def _stop(slots, pool):
    slots.stop()
    pool.shutdown(wait=False, cancel_futures=True)


def place_runs(offsets, counts, row_bytes, alignment, base, first_row):
    """Return ``(read offsets, read lengths, places, rows, shifts)``, int64 ``[K]`` each, of runs of rows read in turn.

    Run ``k`` holds ``counts[k]`` rows of ``row_bytes`` at byte ``offsets[k]``
    of its file. It is read from the ``alignment``-aligned offset at or below
    it, for a whole number of aligned blocks, into the memory bytes
    ``[place, place + length)``: aligned, after the run before it, and such
    that its first row lands on view row ``rows[k]``, the view's row 0 being
    memory byte ``base`` and the first row free ``first_row``. Such a place
    recurs every ``alignment / gcd(row_bytes, alignment)`` rows; the first
    one is taken (see NOTE [window reads]), and ``shifts[k]`` is 0. A run
    whose offset is not ``base`` modulo ``gcd(row_bytes, alignment)`` cannot
    land on a row: it is read to the first aligned place free and its rows
    then belong ``shifts[k]`` bytes further on, at the first view row after
    where they were read (less than a row on; the caller moves them).
    """
    step = int(np.gcd(row_bytes, alignment))
    period = alignment // step
    inverse = pow(row_bytes // step, -1, period) if period > 1 else 0
    heads = np.asarray(offsets, np.int64) % alignment
    reads = np.asarray(offsets, np.int64) - heads
    lengths = -(-(heads + np.asarray(counts, np.int64) * row_bytes) // alignment) * alignment
    places, rows, shifts = (np.zeros(len(heads), np.int64) for _ in range(3))
    end = base + first_row * row_bytes  # the first memory byte free
    for k, (head, length, count) in enumerate(zip(heads.tolist(), lengths.tolist(), np.asarray(counts).tolist())):
        if (head - base) % step:  # moved: read at the first aligned byte free, rows to the next view row
            place = -(-end // alignment) * alignment
            row = -(-(place + head - base) // row_bytes)
            shifts[k] = base + row * row_bytes - place - head
            end = max(place + length, base + (row + count) * row_bytes)
        else:
            least = -(-(end + head - base) // row_bytes)  # the first row whose place starts at or after ``end``
            row = least + ((head - base) // step * inverse - least) % period  # base + row * size = head mod align
            place = base + row * row_bytes - head
            end = place + length
        places[k], rows[k] = place, row
    return reads, lengths, places, rows, shifts


def cut_short(path, start, stop):
    """Return the error for a file that ended before samples ``start..stop`` of a window were read from it."""
    return FormatError(f"{path!r} ended before samples {start}..{stop} were read: the file was cut short while it "
                       "was read. Open the dataset again, or convert its source again.")


def direct_buffer(size):
    """Return uint8 ``[size]`` memory for direct reads: anonymous and private, from a HUGE_PAGE boundary, backed by
    huge pages where the kernel has them to give.

    NOTE [huge read buffers]: a direct read is split into requests of at
    most the device's ``max_segments`` pieces of memory, and into 4 KiB
    pages that is 1 MiB at most on this virtual disk (254 segments), where
    2 MiB huge pages make requests of up to ``max_sectors_kb`` (4 MiB). The
    lmscale shards evicted, O_DIRECT preads of 2 MiB on 16 threads, 3
    rounds in turn (/tmp/lmt/dio.py, an AMD EPYC host): 1.19-1.52 GB/s into
    4 KiB pages, 3.32-3.75 GB/s into huge pages, against 2.32-2.38 GB/s for
    the sequential buffered read of the files. With transparent huge pages
    set to "madvise" (this machine's), only memory so advised gets them;
    where the kernel has none to give, the reads are as before.
    """
    memory = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no such call here, or no transparent huge pages in this kernel
        pass
    array = np.frombuffer(memory, np.uint8)
    first = -array.ctypes.data % HUGE_PAGE
    return array[first : first + size]


def window_room(held, order):
    """Return why windows holding ``held`` bytes of memory would not fit in this process's room, or None.

    NOTE [window room]: windows take the memory the page cache would give
    the dataset's pages, as anonymous or shared pages that are not reclaimed:
    one process reading 2 windows of 256 MiB in a 512 MB memory cgroup was
    killed by the kernel (benchmarks/results/tmp/ranks/probe.py, 64 px raw),
    where the kernel hints read at 0.05 of the disk but read. So windows are
    read only where they hold at most CACHE_SHARE of the memory available
    (shuffles.available_memory: the system's or its cgroup's), the share the
    auto shuffle leaves the dataset (NOTE [auto shuffle] in shuffles.py).
    """
    room, where = shuffles.available_memory()
    if held <= shuffles.CACHE_SHARE * room:
        return None
    return (f"its windows ({order.window} blocks of {order.block_size} samples, {SLOTS} held) would hold "
            f"{held / 1e6:,.1f} MB, more than {shuffles.CACHE_SHARE:.0%} of the {room / 1e6:,.1f} MB of memory "
            f"available ({where}; NOTE [window room]); pass a smaller window or block_size")


def direct_alignment(path):
    """Return the least alignment (bytes) at which the file at ``path`` reads with O_DIRECT, or None where none does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return None
    memory = mmap.mmap(-1, 2 * max(ALIGNMENTS))
    try:
        for align in ALIGNMENTS:
            try:
                os.preadv(fd, [memoryview(memory)[align:2 * align]], align)
                return align
            except OSError:
                continue
        return None
    finally:
        os.close(fd)
