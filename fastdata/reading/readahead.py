"""Reading data bigger than the page cache: kernel hints for the order's next reads.

NOTE [read ahead]: a memory map read in random order pays a page fault per
sample, and each fault reads the kernel's read-around window (128 KiB),
evicted before it is used when the data does not fit in the page cache.
Measured here on 64 px raw HDF5 (600,000 samples, 7.4 GB, 3.6 GB of cache
left): a uniform shuffle through the map ran at 456 img/s with 286x read
amplification; MADV_RANDOM on the map 9,800 img/s (1.2x); shuffled 3 MB
blocks, one read each, 130,000 img/s (1.18x). So a shuffled order marks
the sample column MADV_RANDOM: a fault reads its one page, not the disk's
read-around (8 MiB on this machine's disk), and since Linux 6.3 a read
through a random map does not make the page "recently used", so pages read
once are reclaimed before pages hinted and not yet read. A uniform order
then asks for the rows of the next steps with MADV_WILLNEED, which queues
their reads at once (the disk serves ~25,000 random 12 KiB reads/s at
depth, one at a time far fewer); a block order asks for windows of blocks,
large sorted runs (NOTE [window hints]). Many ranges go to the kernel in
one process_madvise call (up to 1,024 per call), not one madvise each.
Measured on 64 px raw shards (4.9 GB, 400,000 samples) read in-process in
a 1.5 GB memory cgroup (fastdata.measure.pagecache), files evicted first,
2 cores shared with other jobs (load 4-10), 20 s a run: the map as before
53-72 img/s, 570x read from disk; uniform with hints 9,400-17,000 img/s,
1.28-1.37x (a 12 KiB row not aligned to pages spans 4 pages: 1.33x), where
32 threads of random 16 KiB preads did 12,400 reads/s; block 14,700-30,300
img/s, 1.05-1.10x (NOTE [window hints]); sequential reads of the files
41,600-48,900 img/s (512-600 MB/s). LOOKAHEAD 8 did no better than 4
(10,300-11,700 img/s against 9,400-17,000). On cached data MADV_RANDOM
cost nothing measurable: the first 300 uniform batches of 256 through
fresh maps (every page faulted in once) ran at a median 52,000 img/s
against 47,000 with the default advice (7 interleaved pairs, 24k-104k).

NOTE [resident hints]: a hint is not free when the data is cached: the
kernel still walks the page cache for every range. Measured on 2 shared
(busy) cores, 64 px raw, 256 resident rows: process_madvise(WILLNEED) of
their 71-256 spans 67-190 us, the Python around it (spans per shard, pages
merged) 150-250 us, against 570-640 us for order.batch + read_batch of the
same step. So before asking, ``hint_spans`` probes HINT_PROBES of the
spans with mincore and asks nothing when they are all cached; and a uniform
ReadAhead whose rows were cached probes a few rows of a stretch of steps
instead of computing them all, the stretch doubling up to QUIET_STEPS (64)
while it stays cached, back to every step's rows as soon as a probe misses.
Over 300 steps of a cached 4.9 GB shard folder (100 shards, batches of
256): advance() cost 25-44 us a step, against 965-1,411 us for the step.

The calls are Linux's, in kernel.py; elsewhere (or on a kernel without
them) every hint is a no-op and reads are plain page faults.
"""

import os
import queue
import threading
import weakref
from typing import Protocol

import numpy as np

from fastdata.reading.kernel import HINT_PROBES
from fastdata.reading.order import EpochOrder

QUIET_STEPS = 64  # the longest stretch of steps left unhinted while the data is resident; NOTE [resident hints]
LOOKAHEAD = 4  # steps of a uniform order hinted ahead of the one read; see NOTE [read ahead]
PENDING_HINTS = 64  # hints queued for the hint threads before the reader waits; see NOTE [hint thread]
HINT_THREADS = 2  # threads giving one ReadAhead's hints; see NOTE [hint thread]


class ReadsAhead(Protocol):
    """What a loader's step cursor tells the read-ahead of its order (see NOTE [one read-ahead] in state.py).

    Kernel hints (ReadAhead), window reads (windows.WindowAhead) and shard
    fetches (remote.ShardReadAhead) implement it; ``close`` ends their
    threads, which a later ``start`` makes again.
    """

    order: EpochOrder

    def start(self, epoch: int, step: int) -> None:
        """Begin ``epoch`` at global step ``step``: get its first steps' reads going."""

    def advance(self, step: int) -> None:
        """Note that ``step``'s indices were just produced: get the next reads going."""

    def close(self) -> None:
        """End the threads started here (the reads already asked for may still land)."""


class ReadAhead:
    """Ask the kernel for the samples an order will read next, a few steps before they are read.

    Made before workers start (the advice set here travels with the
    dataset), then told where an epoch starts and which step is about to be
    read (see NOTE [read ahead]): "uniform" marks the sample maps random and
    hints this rank's rows of the next ``lookahead`` steps, "block" hints a
    whole window of blocks when the one before it starts, "none" leaves the
    kernel's own read-ahead to the sequential reads. A ReadsAhead.

    Args:
        dataset: a PackedDataset (anything with ``advise``, ``will_need`` and ``done_with``).
        order: the EpochOrder the batches come from.
        rank: this rank; world_size: ranks sharing each global batch.
        lookahead: steps hinted ahead of the one being read ("uniform").
        fits: whether the dataset stays in the page cache (make_loader's decision, NOTE [auto shuffle] in
            shuffles.py): a "block" window's pages are then marked done when it ends, else reclaimed at once.
    """

    def __init__(self, dataset, order, rank=0, world_size=1, lookahead=LOOKAHEAD, *, fits):
        self.dataset, self.order, self.rank, self.world_size = dataset, order, rank, world_size
        self.lookahead = lookahead
        self.mode = order.shuffle
        dataset.advise("normal" if self.mode == "none" else "random")
        self._drop = self.mode == "block" and not fits  # reclaimed at once
        self._epoch, self._hinted, self._window, self._quiet = 0, 0, None, 0
        self._next, self._done = np.empty((0, 2), np.int64), 0  # the next window's ranges, how many hinted
        self._hints = _HintThread() if self.mode != "none" else None

    def start(self, epoch: int, step: int) -> None:
        """Begin ``epoch`` at ``step``: hint what its first steps read."""
        self._epoch, self._hinted, self._window, self._quiet = epoch, step, None, 0
        self.advance(step)

    def flush(self) -> None:
        """Wait until every hint asked for so far was given (a block order gives them on a thread)."""
        if self._hints is not None:
            self._hints.flush()

    def close(self) -> None:
        """End the hint threads once the hints queued are given; a later hint starts them again."""
        if self._hints is not None:
            self._hints.close()

    def advance(self, step: int) -> None:
        """Note that ``step``'s indices were just produced; hint what is read next."""
        if self.mode == "uniform" and self._hinted < min(step + self.lookahead, self.order.num_steps):
            self._hint_steps(max(self._hinted, step))
        elif self.mode == "block":
            self._hint_windows(step)

    def _hint_steps(self, first):
        """Hint the rows of a chunk of steps from ``first`` (one samples() call), or probe a longer stretch.

        See NOTE [resident hints]: while the rows found are in the page cache,
        a few rows of ``_quiet`` steps are probed instead, ``_quiet`` doubling
        up to QUIET_STEPS; rows that are not start hinting every step again.
        """
        if self._quiet:
            stop = min(first + self._quiet, self.order.num_steps)
            probes = np.unique(np.linspace(first, stop - 1, HINT_PROBES).astype(np.int64)).tolist()
            positions = [self.order.step_positions(step, self.rank, self.world_size)[0] for step in probes]
            if not self._will_need(positions):
                self._hinted, self._quiet = stop, min(2 * self._quiet, QUIET_STEPS)
                return
        stop = min(first + 2 * self.lookahead, self.order.num_steps)
        spans = [self.order.step_positions(step, self.rank, self.world_size) for step in range(first, stop)]
        positions = np.concatenate([np.empty(0, np.int64)] + [np.arange(a, b, dtype=np.int64) for a, b in spans])
        self._quiet = 0 if self._will_need(positions) else 2 * self.lookahead
        self._hinted = stop

    def _will_need(self, positions):
        positions = np.asarray(positions, dtype=np.int64)
        positions = positions[positions < self.order.epoch_length]
        if not len(positions):
            return False
        return self.dataset.will_need(runs(self.order.samples(self._epoch, positions)), give=self._hints.submit)

    # NOTE [window hints]: a block order hints its window whole when an
    # epoch starts in it, and the next window a share per step, in file
    # order, so that the disk streams while batches are copied; when a
    # window ends, its pages are marked done (MADV_COLD; MADV_PAGEOUT when
    # the dataset cannot stay cached, NOTE [auto shuffle] in shuffles.py). One 64 px raw
    # epoch (4.9 GB, 100 shards) in a 1.5 GB memory cgroup, in-process,
    # 2 cores shared with other jobs (load 4-7): with the map's default
    # advice 3,099 img/s, 11.2x read from disk; MADV_RANDOM and the whole next
    # window hinted when one starts 22,300 img/s, 1.125x (the hint blocked
    # 0.7 s a window); a share per step and PAGEOUT 14,700-27,400 img/s,
    # 1.047-1.075x, COLD 22,000-30,300 img/s, 1.10x; sequential reads of the
    # files 458-544 MB/s (37,000-44,000 img/s). Both include the next epoch's
    # first window (5% of this dataset). The hints spent 5-11 s of a 13-25 s
    # epoch in the kernel (page allocation reclaims inside the cgroup), not
    # overlapped with the copy; without the cgroup's limit the same epoch ran
    # at 37,600 img/s, the sequential rate, CPU-bound. done_with acts on the
    # pages this process mapped: a worker's reads are not reclaimed early.
    # One process reading alone reads its windows whole instead, with no
    # hints (windows.WindowAhead, NOTE [window reads] in windows.py).
    def _hint_windows(self, step):
        """Hint the window of ``step`` whole when an epoch starts there, and the next one a share per step.

        See NOTE [window hints]: the next window's blocks are asked for in
        the order they lie on disk, in as many parts as this window has steps.
        """
        start, stop = self.order.step_positions(step, self.rank, self.world_size)
        if start >= stop:
            return
        order = self.order
        window = order.window_of(self._epoch, start)
        if window != self._window:
            if self._window is None:  # an epoch starts here: its current window too, at once
                self._hints.submit(self.dataset.will_need, order.window_ranges(self._epoch, window))
            else:  # the rest of this window, hinted as the next one; the last one read
                self._hints.submit(self.dataset.will_need, self._next[self._done:])
                self._hints.submit(self.dataset.done_with, order.window_ranges(self._epoch, self._window), self._drop)
            self._next = order.window_ranges(*order.window_after(self._epoch, window))
            self._window, self._done = window, 0
        span = order.window * order.block_size
        progress = min(1.0, (start - self._window * span + (stop - start)) / span)  # of this window, after step
        due = min(len(self._next), int(np.ceil(progress * len(self._next))))
        if due > self._done:
            self._hints.submit(self.dataset.will_need, self._next[self._done:due])
            self._done = due

    def __getstate__(self):
        return {**self.__dict__, "_hints": None if self._hints is None else _HintThread()}


class _HintThread:
    """Give kernel hints on HINT_THREADS threads of their own, taken in the order asked, at most PENDING_HINTS behind.

    NOTE [hint thread]: a block order's hints (MADV_WILLNEED on a window's
    blocks, MADV_COLD or PAGEOUT on the last) wait in the kernel while it
    allocates and reclaims pages: given by the thread that reads the batches,
    they took 4.3 s of a 15 s block read (1,233 calls, 3.5 ms each; 64 px
    raw, 6.5 GB in a 1.5 GB cgroup, cProfile) and the copies waited behind
    them. ctypes calls release the GIL, so on a thread of their own the
    hints run while batches are copied. The same read, 15 s from a cold
    cache in the cgroup, four pairs in turn on a quiet machine: 28.0k,
    33.0k, 37.5k, 35.0k img/s with the hints given inline, 32.9k, 35.8k,
    38.0k, 38.7k on this thread (every pair faster, +9% on average; the
    disk sped up during the run). A uniform order's MADV_WILLNEED goes to
    the thread too (its probe of what is cached stays inline, see NOTE
    [resident hints]): 224 px jpeg from disk in the cgroup, 15 s each, two
    pairs in turn: 10,094 and 10,055 img/s inline, 10,264 and 10,195 on
    the thread. One thread is busy in the kernel while the next hint waits:
    64 px raw block from disk at 1.45 GB/s sequential, the hint thread used
    60% of a core and the reader 15%, 30% of the cores idle; on two threads
    (taken in order, given two at a time) 86,758 and 87,456 img/s against
    76,105 and 74,663 on one, in turn, 15 s each in the cgroup; three and
    four threads 83,088-87,107, no better; a uniform order 52,465 against
    52,877 (its hints are small). Hints are advice: one that fails (a
    shard that will not open) is left for the read of its samples to raise.
    The threads start on first use in each process (a forked child has
    none) and end when their ReadAhead is collected.
    """

    def __init__(self):
        self._tasks, self._pid, self._stop = None, None, None

    def submit(self, call, *args):
        """Queue ``call(*args)``; wait first while PENDING_HINTS calls are queued."""
        if self._pid != os.getpid():
            self._tasks, self._pid = queue.Queue(PENDING_HINTS), os.getpid()
            for _ in range(HINT_THREADS):
                threading.Thread(target=_give_hints, args=(self._tasks,), daemon=True, name="fastdata-hints").start()
            self._stop = weakref.finalize(self, _stop_hints, self._tasks)  # the threads end with their ReadAhead
        self._tasks.put((call, args))

    def flush(self):
        """Wait until every queued call has run."""
        if self._pid == os.getpid():
            self._tasks.join()

    def close(self):
        """End this process's threads after the calls queued (the next ``submit`` starts new ones)."""
        if self._pid == os.getpid():
            self._stop()
        self._tasks, self._pid, self._stop = None, None, None


def _stop_hints(tasks):
    """End every thread of a _HintThread's queue ``tasks``: one None each, after the calls queued."""
    for _ in range(HINT_THREADS):
        tasks.put(None)


def _give_hints(tasks):
    """Run the calls of a _HintThread's queue until a None (its _HintThread was collected)."""
    while (task := tasks.get()) is not None:
        call, args = task
        try:
            call(*args)
        except Exception:  # see NOTE [hint thread]: the read raises it with its context
            pass
        finally:
            tasks.task_done()


def runs(indices: np.ndarray) -> np.ndarray:
    """Return int64 ``[K, 2]`` ranges ``[start, stop)`` of consecutive values among sample ``indices`` (any order)."""
    values = np.unique(np.asarray(indices, dtype=np.int64))
    if not len(values):
        return np.empty((0, 2), np.int64)
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    return np.stack([values[np.r_[0, breaks]], values[np.r_[breaks - 1, len(values) - 1]] + 1], axis=1)
