"""Copying a batch of fixed-size rows on helper threads while the calling thread works out the next one.

NOTE [copy on two cores]: a raw batch is one numpy take (NOTE [stitched
rows] in stitch.py), which frees the GIL while it copies, and one core does
not saturate the memory bus: a shuffled batch of 256 rows of 64 px raw
(3 MiB) from a cached file took a median 217 us on one thread and 165 us
in 4 pieces over 2 threads (9 rounds of 40 batches, 2 cores). In a loader
the calling thread also spends ~80-100 us a step in Python (the order,
the rows, the labels), so a batch's copy is started on the helpers one
step early (NOTE [pipelined reads] in batchloader.py) and the caller copies
only the last piece when it comes back for the batch. The pieces are few
and large: a helper needs the GIL between pieces, which the caller holds
while it runs Python, so with 4 small pieces a step took 380 us against
306 us with 2. Each thread takes the next unclaimed piece from one
counter, so a helper the OS has not run yet leaves its piece to the
caller, and the caller waits only for pieces a helper has claimed.

The caller's piece is ``share`` of a helper's, balanced as the loader
runs: up a step when the caller had to wait for a helper, down a step when
it did not. Measured on 64 px raw shards through make_loader (10 epochs
of 40 batches, 2 cores) with fixed shares: 0.5 of an equal piece 280-290
us a step, 0.35 260 us, 0.25 241-254 us, 0.15 284 us (the caller waits),
1 thread 336-354 us.

Batches under PARALLEL_BYTES (1.5 MiB) are copied in ``start`` by the
calling thread, with no Copy: its lock, event and hand-over cost more than
a second core saves. With a 512 KiB threshold and a Copy for every batch,
32 px batches (786 KB) had fallen to 0.78x of the commit before the helpers
(reviewer, quiet runs) while 64 px ones (3 MiB) gained 1.28x; the threshold
sits between. Measured on converted raw .h5 files of varied photos
(/tmp/rc in the commit message: alternating fresh processes, warm cache,
batch 256, 2 cores shared with other jobs at load ~4, under nice -15),
microseconds a step of read_batch / make_loader at 32 px: helpers 375-398
/ 424-437, copied here 228 / 260-263, before the helpers 218-232 /
245-269. On that busy machine the helpers did not pay at 64-224 px either
(64 px read_batch 987-992 us with them, 762-800 without, 737-751 before):
a helper gains only where a core is free. Nor does starting such a batch
a step early pay (it is copied as it is started): make_loader steps of
290-313 us against 354-372 us pipelined at 32 px, so the loader pipelines
only batches of PARALLEL_BYTES or more (``_pipelines_reads`` in batchloader.py).
Then, on a quieter machine (load ~1, Intel Xeon; /tmp/rc/sweep.sh "32 64",
alternating fresh processes, 2 rounds, samples/s of make_loader over one
file / a shard folder): 32 px 689k / 639k against 684k / 639k before the
helpers, 64 px 238k / 229k against 244k / 230k, with the helpers off at
64 px 241k: the regression is gone, and the helpers neither gain nor lose
at 64 px there (the reviewer's 1.28x came from another machine). On this
machine np.take into a fresh array runs as fast as into a reused one at
32 px (1.29-1.52M samples/s), so the loader is at 0.5 of either; the
~130 us of Python a step (order, parts, labels, tensors) is the gap. Such
batches are now read a few at a time, in reads of PARALLEL_BYTES or more
that go to the helpers (NOTE [grouped reads] in batchloader.py).

NOTE [caller first]: a helper parked on its lock needs the GIL again to
start its piece, and the caller holds it while it yields the batches of
the group before (a tight loop's Python); waking the idle core takes
25-60 us besides (/tmp/p32/wake2.py, rc3.py: a posted helper started its
take 59 us after the post, and the caller's wait at the end woke 100 us
after the helper's last row). So the helper's piece mostly began when the
caller released the GIL for its own piece at ``finish``, and the two
copies ran side by side there instead of beside the Python. Now, for
copies up to CALLER_FIRST_BYTES (a group of small batches, one 64 px
batch), the caller copies its piece as it starts the copy, right after
the post: the helper wakes and takes the GIL during that take, and its
piece then runs beside the caller's Python. Measured on converted raw .h5
files, warm, batch 256, make_loader against np.take of each batch in turn
in one process (3 passes), fresh processes alternating with the tree
before (/tmp/p32/ab.sh, 3 rounds; a host whose 480 MiB L3 holds the 32 px
file): 32 px 0.89-1.11 of the batched read against 0.86-0.91 (0.75-0.91
of the memcpy limit against 0.74-0.87), 64 px 1.44-1.55 against
1.38-1.53. Done for every copy, 128 px (12.6 MB batches) lost: 1.37-1.48
against 1.47-1.70, so larger copies keep the caller's piece for ``finish``.
"""

import itertools
import os
import threading

PARALLEL_BYTES = 3 << 19  # 1.5 MiB: batches smaller than this are copied by the calling thread alone
CALLER_FIRST_BYTES = 3 << 20  # copies up to this size: the caller copies its piece at the start (NOTE [caller first])
SHARES = (0.1, 0.5)  # the caller's piece, as a fraction of a helper's: lowest and highest
SHARE_STEP = 0.02


class RowCopier:
    """Runs ``source.take(rows, 0, out, "clip")`` jobs on up to ``threads`` threads, the calling one included.

    The helper threads start on first use in each process (a forked child
    makes its own).
    """

    def __init__(self):
        self._threads, self._pid = [], None
        self.share = SHARES[1]

    def start(self, jobs, threads=1):
        """Begin ``source.take(rows, 0, out, "clip")`` of each ``(source, rows, out)`` of ``jobs``; return its Copy.

        Rows are checked by the caller, and ``len(out) == len(rows)``.

        The copy runs on helper threads until ``finish()``, which copies what
        they have not claimed and returns once all is copied; call it exactly
        once, before the outputs are used or the sources unmapped. On one
        thread or under PARALLEL_BYTES the rows are copied here (COPIED).
        """
        nbytes = sum(out.nbytes for _, _, out in jobs)
        if threads <= 1 or nbytes < PARALLEL_BYTES:
            for source, rows, out in jobs:  # copied here, with nothing to hand over (see NOTE [copy on two cores])
                source.take(rows, 0, out, "clip")
            return COPIED
        copy = Copy(_split(jobs, threads, self.share), self, caller_first=nbytes <= CALLER_FIRST_BYTES)
        copy.helpers = self._helpers(min(threads, len(copy.pieces)) - 1)
        for helper in copy.helpers:
            helper.post(copy)
        if copy.caller_first:
            copy.copy_own()
        return copy

    def balance(self, waited):
        """Move the caller's share: up if it ``waited`` for a helper at the end of a copy, else down."""
        self.share = min(SHARES[1], self.share + SHARE_STEP) if waited else max(SHARES[0], self.share - SHARE_STEP)

    def _helpers(self, size):
        """Return ``size`` of this process's helper threads (started when first asked for)."""
        if self._pid != os.getpid():
            self._threads, self._pid = [], os.getpid()
        while len(self._threads) < size:
            self._threads.append(Helper())
        return self._threads[:size]

    def __getstate__(self):
        return {**self.__dict__, "_threads": [], "_pid": None}


class Helper:
    """A daemon thread that copies pieces of the last Copy posted to it.

    NOTE [lean helpers]: the helper holds the GIL only to take a copy, claim
    its pieces and count them done (two locks, no queue), so that the
    caller's Python beside it is held up as little as possible; until
    2026-11-26 the helpers were a ThreadPoolExecutor, whose per-job
    bookkeeping (a future, a condition, the queue) ran with the GIL. Reading
    32 px batches in groups of 4 (NOTE [grouped reads] in batchloader.py),
    make_loader ran at 0.76-0.88 of a plain batched read on the executor
    and 0.93-1.05 on these threads; 64 px batches (3 MiB, one a read) at
    1.17-1.24 and 1.20-1.34 (/tmp/p32/sizes.py, sweep.py: warm converted
    .h5 files, batch 256, interleaved rounds, 2 cores).
    """

    def __init__(self):
        self._go, self._lock, self._copy = threading.Lock(), threading.Lock(), None
        self._go.acquire()  # released when a copy is posted
        threading.Thread(target=self._run, name="fastdata-copy", daemon=True).start()

    def post(self, copy):
        """Have the thread copy pieces of ``copy`` (if it is busy, once it is free; a later post replaces it)."""
        with self._lock:
            self._copy = copy
            if self._go.locked():
                self._go.release()

    def _run(self):
        while True:
            self._go.acquire()
            with self._lock:
                copy, self._copy = self._copy, None  # not kept: it holds the batch's buffer (NOTE [buffer reuse])
            # None: a post that came between the wake-up and the lock was taken with the copy before it, yet
            # released the go a second time (a plain pytest run saw the thread die of it).
            if copy is not None:
                copy.copy()
            del copy


class Copy:
    """Pieces (lists of take jobs) claimed from one counter by every thread that runs ``copy``; with
    ``caller_first`` the last piece is the caller's own (``copy_own``), and only the others are claimed."""

    def __init__(self, pieces, copier=None, caller_first=False):
        self.pieces, self.helpers, self._copier, self._error = pieces, [], copier, None
        self.caller_first = caller_first and len(pieces) > 1
        self._claimed = len(pieces) - 1 if self.caller_first else len(pieces)  # pieces the counter hands out
        self._next, self._ended = itertools.count(), itertools.count(1)  # next() is atomic under the GIL
        self._done = threading.Lock()  # held until the last piece ends
        if pieces:
            self._done.acquire()

    def copy(self):
        """Copy pieces until none is left unclaimed."""
        for number in self._next:
            if number >= self._claimed:
                return
            self._copy_piece(number)

    def copy_own(self):
        """Copy the caller's piece (the last one) now: see NOTE [caller first]."""
        self._copy_piece(len(self.pieces) - 1)

    def _copy_piece(self, number):
        try:
            for source, rows, out in self.pieces[number]:
                source.take(rows, 0, out, "clip")
        except BaseException as exc:
            self._error = exc
        if next(self._ended) == len(self.pieces):
            self._done.release()

    def finish(self):
        """Copy the pieces nobody claimed, wait for the claimed ones; raise the first error of any."""
        self.copy()
        waited = not self._done.acquire(blocking=False)
        if waited:
            self._done.acquire()  # never return (or raise) while a helper still writes into the batch
        if self._copier is not None:
            self._copier.balance(waited)
        self.pieces = ()  # a helper that takes this copy late finds nothing, and holds no buffer
        if self._error is not None:
            raise self._error


class Copied:
    """A copy done by ``start`` on the calling thread: no pieces, no helpers, nothing left to finish."""

    pieces = helpers = ()

    def finish(self):
        """Return at once: the rows are copied."""


COPIED = Copied()


def _split(jobs, threads, share):
    """Return ``jobs`` cut by rows into a piece per thread: the last (the caller's) ``share`` of each other's."""
    total = sum(len(rows) for _, rows, _ in jobs)
    unit = total / (threads - 1 + share)  # a helper's rows (Python floats: numpy costs more on so few)
    edges = [round(unit * piece) for piece in range(threads)] + [total]
    pieces, first = [[] for _ in range(threads)], 0
    for source, rows, out in jobs:
        last = first + len(rows)
        for piece, (a, b) in enumerate(zip(edges, edges[1:])):
            a, b = max(a, first), min(b, last)
            if b > a:
                pieces[piece].append((source, rows[a - first : b - first], out[a - first : b - first]))
        first = last
    return [piece for piece in pieces if piece]
