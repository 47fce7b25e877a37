"""The two slots a block order's windows are read into (windows.py): what each holds, and the batches leased from it.

A Window is one window being read into a slot, its runs of rows laid out
(RUN records); WindowSlots holds the windows wanted, placed and leased,
under one condition that the reader, the placing thread and the read
tasks share (see NOTE [window reads] in windows.py).
"""

import threading

import numpy as np

SLOTS = 2  # windows held: the one read from and the next

RUN = np.dtype([("shard", np.int64), ("start", np.int64), ("stop", np.int64), ("row", np.int64),
                 ("file_offset", np.int64), ("length", np.int64), ("place", np.int64), ("labels_at", np.int64),
                 ("shift", np.int64)])


class Window:
    """One window being read into a slot: its runs (RUN), reads outstanding, first failure, batches reading it."""

    def __init__(self, key):
        self.key, self.error, self.leases, self._pending, self.placed = key, None, 0, 0, False
        self.done = threading.Event()
        self._lock = threading.Lock()
        self.set_runs(np.zeros(0, RUN))  # none yet: it holds no sample until laid out

    def set_runs(self, runs):
        self.runs = runs
        self._starts, self._stops, self._rows = (np.ascontiguousarray(runs[name]) for name in ("start", "stop", "row"))

    def rows(self, indices):
        """Return int64 view rows of global ``indices`` read by this window, -1 for those it does not hold."""
        if not len(self._starts):
            return np.full(len(indices), -1, np.int64)
        run = np.searchsorted(self._starts, indices, side="right") - 1
        inside = run >= 0
        run = np.maximum(run, 0)
        inside &= indices < self._stops[run]
        return np.where(inside, self._rows[run] + indices - self._starts[run], -1)

    def expect(self, tasks):
        self._pending = tasks
        if not tasks:
            self.done.set()

    def fail(self, exc):
        with self._lock:
            if self.error is None:
                self.error = exc

    def finish_one(self):
        """Count one read task done; return whether it was the last."""
        with self._lock:
            self._pending -= 1
            if not self._pending:
                self.done.set()
            return not self._pending


class WindowSlots:
    """The windows held in each slot, those wanted and those waiting for a slot, under one condition."""

    def __init__(self):
        self.windows = [None] * SLOTS
        self.wanted, self.queue, self.stopped = [], [], False
        self.condition = threading.Condition()

    def want(self, keys):
        with self.condition:
            self.wanted = list(keys)
            held = {window.key for window in self.windows if window is not None}
            self.queue = [key for key in self.wanted if key not in held]
            self.condition.notify_all()

    def next_placement(self, wait=True):
        """Return ``(slot, key)``: a wanted window and a free slot, waiting for both unless not ``wait``.

        None once stopped, or where nothing can be placed now and not ``wait``.
        """
        with self.condition:
            while not self.stopped:
                slot = self._slot_for(self.queue[0]) if self.queue else None
                if slot is not None:
                    self.windows[slot] = Window(self.queue[0])  # taken: being placed
                    return slot, self.queue.pop(0)
                if not wait:
                    return None
                self.condition.wait()
            return None

    def _slot_for(self, key, reading=False):
        """The slot window ``key`` can be placed in now, or None (under the condition): here, any free one.

        With ``reading``, a slot also counts as free where only reads in it stand in the way (see ``_free``).
        """
        free = self._free(reading)
        return free[0] if free else None

    def _free(self, reading=False):
        """The slots that hold no window, or one not wanted with no batch and no read in it (under the condition).

        With ``reading``, also those whose window is not wanted and has no batch but still has reads: those end.
        """
        return [slot for slot, window in enumerate(self.windows)
                if window is None or (window.key not in self.wanted and not window.leases
                                      and (reading or window.done.is_set()))]

    def put(self, slot, window):
        """Hold ``window``, laid out, in ``slot`` (taken by next_placement)."""
        with self.condition:
            window.placed = True
            self.windows[slot] = window
            self.condition.notify_all()

    def lease(self, indices):
        """Return ``(view rows of indices, the windows they lie in)`` leased, or ``(None, [])`` where not all are.

        Waits for a window being laid out (that never waits for a slot), and for a wanted window that a slot
        free or freed by reads under way is about to take, before it answers. Answered early, a batch of the
        window wanted next was read from the files while the placing thread had not yet woken (4 of 69 batches
        in a test), or while the reads of a window let go still held the slot it takes (windows of one sample,
        a test's pinned example beside a busy core: 6 of 20 runs).
        """
        with self.condition:
            while True:
                rows, used = np.full(len(indices), -1, np.int64), []
                for window in self.windows:
                    if window is None:
                        continue
                    found = window.rows(indices)
                    if (found >= 0).any():
                        rows = np.where(found >= 0, found, rows)
                        used.append(window)
                if not (rows < 0).any():
                    for window in used:
                        window.leases += 1
                    return rows, used
                placing = any(window is not None and not window.placed for window in self.windows)
                coming = bool(self.queue) and self._slot_for(self.queue[0], reading=True) is not None
                if self.stopped or not (placing or coming):
                    return None, []
                self.condition.wait()

    def release(self, windows):
        with self.condition:
            for window in windows:
                window.leases -= 1
            self.condition.notify_all()

    def notify(self):
        with self.condition:
            self.condition.notify_all()

    def stop(self):
        with self.condition:
            self.stopped = True
            self.condition.notify_all()
