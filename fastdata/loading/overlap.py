"""Reading while the training step runs: the loop body's timing, and a thread that reads batches ahead."""

import queue
import threading
import time
from contextlib import closing

BUSY_CONSUMER_SECONDS = 0.0005  # loop body time above which a read-ahead thread pays off
STREAK = 3  # bodies in a row that switch reading inline <-> on a thread
# The loop thread's CPU time / body time above which it computes (decoding leaves it a core, reading moves to
# the auto helper), and below which it no longer does: see NOTE [computing hysteresis].
COMPUTES_ABOVE, COMPUTES_UNTIL_BELOW = 0.6, 0.4
# The loop's share of its time spent waiting for batches above which decoding takes every core again, and below
# which it leaves the loop its core again: see NOTE [data-bound loop] in batchloader.py.
WAITS_ABOVE, WAITS_UNTIL_BELOW = 0.15, 0.08
_DONE = object()


class LoopBody:
    """Times the training loop's body, the code that runs between two batches.

    ``busy`` turns on after STREAK bodies in a row longer than
    BUSY_CONSUMER_SECONDS, and off after STREAK shorter ones (see NOTE
    [adaptive read-ahead] in batchloader.py). While busy, and on a streak of long
    bodies towards it, the CPU time of the loop's thread is measured too
    (0.4 us a call, so not in tight loops), for NOTE [leave a core] and NOTE
    [auto helper] in batchloader.py: it is measured by the time ``busy`` turns on.
    """

    _DECAY = 0.9  # weight of the past in the running sums: about the last 10 bodies count

    def __init__(self):
        self.busy = False
        self._streak = 0  # bodies in a row on the other side of the threshold from ``busy``
        self._wall = self._cpu = self._waited = 0.0  # running sums: body wall and CPU time, time waited in next()
        self._computes = False  # see keeps_a_core_busy
        self._waits = False  # see waits_for_data

    def timed(self, batches):
        """Yield ``batches``, timing the consumer's work after each one; close them when done."""
        with closing(batches):
            resumed = None  # when the last measured body ended: the wait for the next batch began
            for batch in batches:
                busy = self.busy
                measured = busy or self._streak > 0  # busy, or long bodies in a row so far
                wall = time.perf_counter()
                if resumed is not None:
                    self._waited = self._DECAY * self._waited + wall - resumed
                cpu = time.thread_time() if measured else 0.0
                yield batch
                resumed = time.perf_counter() if measured else None
                wall = (resumed or time.perf_counter()) - wall
                if measured:
                    self._wall = self._DECAY * self._wall + wall
                    self._cpu = self._DECAY * self._cpu + time.thread_time() - cpu
                if (wall > BUSY_CONSUMER_SECONDS) == busy:
                    self._streak = 0
                else:
                    self._streak += 1
                    if self._streak == STREAK:
                        self.busy, self._streak = not busy, 0

    def keeps_a_core_busy(self):
        """Whether the body is busy and computes on its thread: over COMPUTES_ABOVE of its time, and since then
        not under COMPUTES_UNTIL_BELOW.

        NOTE [computing hysteresis]: with one threshold (0.5), a loop whose
        body computed for about half its time flipped the decision back and
        forth as the running share wandered around it, and each flip of the
        auto helper ends a stretch of batches (those in flight are received
        and the next ones asked for the other way): a body of 4 ms, 55% of it
        computing, over 64 px JPEG (batches of 64, 3 epochs of 47 steps, 2
        cores) read in 23 stretches, 60% in 14; with the two thresholds, 3
        for each (one an epoch: neither moves to the helper), and 4 at 65%
        as before (the helper from the first streak on). Loops that hold the
        GIL (share about 1) or wait on a GPU or a sleep (about 0) are decided
        as before.
        """
        self._computes = computes(self._cpu / self._wall if self._wall else 0.0, self._computes)
        return self.busy and self._computes

    def waits_for_data(self):
        """Whether the loop spends over WAITS_ABOVE of its time waiting for batches, and since then not under
        WAITS_UNTIL_BELOW (measured while busy; see NOTE [data-bound loop] in batchloader.py)."""
        total = self._waited + self._wall
        share = self._waited / total if total else 0.0
        self._waits = share > (WAITS_UNTIL_BELOW if self._waits else WAITS_ABOVE)
        return self._waits


def computes(share, computed):
    """Whether a body whose thread computed ``share`` of its time computes: see NOTE [computing hysteresis];
    ``computed``: whether it did so far."""
    return share > (COMPUTES_UNTIL_BELOW if computed else COMPUTES_ABOVE)


def read_on_thread(batches, depth, at_end=None, first=None):
    """Yield ``first`` (if given), then ``batches`` produced up to ``depth`` ahead by a thread.

    ``at_end`` runs on the thread once ``batches`` is exhausted, before the end is signalled.
    """
    ready = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(item):
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for batch in batches:
                if not offer((batch, None)):
                    return
            if at_end is not None:
                at_end()
            offer((_DONE, None))
        except BaseException as exc:  # handed to the consumer, raised there
            offer((_DONE, exc))

    thread = threading.Thread(target=produce, name="fastdata-read-ahead", daemon=True)
    thread.start()
    try:
        if first is not None:
            yield first
        while True:
            batch, error = ready.get()
            if batch is _DONE:
                if error is not None:
                    raise error
                return
            yield batch
    finally:
        stop.set()
        thread.join()
