"""Batches read and decoded in one helper process with its own threads; the training process only maps them.

NOTE [helper process]: a training step that holds the GIL (Python and
small torch calls launching kernels) and loader threads in the same
process slow each other: each JPEG image costs a decode thread one GIL
hand-off, which waits up to the switch interval (5 ms) behind such a step
(issue 28: 64 px JPEG kept 0.39 of the loop's step rate with fastdata's
threads). A torch DataLoader worker reads off that GIL, but the batch
then costs the training thread the DataLoader's machinery and a copy out
of the worker's slot: 2.7-3.7 ms of its CPU per batch of 256 64 px images
(num_workers=1 or 2, thread CPU time inside next(), 2 shared cores),
against 88 us (raw) and 162 us (JPEG) in-process. So this helper reads
whole batches with ``threads`` threads in a process of its own, into
shared slots made before it starts, and the training process maps a slot
as the batch's tensors without copying them: a batch's tensors (and every
view of them) hold a lease on their slot, and the slot is reused once they
are all gone. The training thread pays one small message per batch. A
batch the loop keeps keeps its slot; when every slot is held, the helper
sends the next batch itself (torch shares its memory by descriptor), so
kept batches are never overwritten and reading never waits for them.

Order, resume and DDP stay in the training process: it sends each step's
indices (a few KB) and the helper reads them, ``ahead`` steps ahead, in
that order (the order's read-ahead runs in the helper: NOTE [read-ahead
in the helper] at HelperReadAhead). A loop that leaves an epoch early
leaves replies in flight; they are received and dropped when the next
iteration starts (or at ``close``). The helper ends with its loader
(``close``, garbage collection, or the interpreter's exit), when the
training process dies (PR_SET_PDEATHSIG), and on SIGTERM at any moment of
its start (NOTE [forked SIGTERM] in _processes.py).
"""

import collections
import functools
import multiprocessing
import os
import pickle
import signal
import warnings
import weakref
from contextlib import nullcontext
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

from fastdata._processes import die_with_parent, end_on_sigterm, end_processes, held_signals, start_method
from fastdata.errors import FastPathWarning
from fastdata.loading import slots as layouts
from fastdata.loading.device import HostBatch, read_batch
from fastdata.loading.workers import changed_under
from fastdata.reading.buffers import read_into
from fastdata.reading.readpaths import PATHS

_POLL_SECONDS = 1.0  # how long a helper whose pipe closed is given to exit, for its exit status


class HelperProcess:
    """One process reading ``dataset``'s batches, into ``slots`` shared slots the caller maps (NOTE [helper process]).

    Args:
        dataset: a PackedDataset or RecordDataset (pickled into the helper under spawn); a RecordDataset's
            dict batches have their tensors in the slot, their text and JSON pickled with the reply.
        options: keyword options of every ``read_batch`` (with ``threads``: the threads it reads a batch with).
        reader: a device pipeline's HostReader, or None: batches are then HostBatches.
        slots: shared slots, at least the steps read ahead + 2 (the batch in the loop, and the one before).
        batch_bytes: the most bytes of a batch's tensors; a larger batch travels as itself.
        context: a multiprocessing start method, or None for the default.
    """

    def __init__(self, dataset, options, reader, slots, batch_bytes, context=None):
        self.dataset, self.reader, self.options = dataset, reader, options
        self.context = multiprocessing.get_context(context)
        self._buffers = torch.empty((slots, layouts.slot_bytes(batch_bytes)), dtype=torch.uint8).share_memory_()
        self._arrays = [buffer.numpy() for buffer in self._buffers]  # this process's views of the slots
        self._free = collections.deque(range(slots))  # slots no batch holds; a finalizer appends to it
        self._process = self._conn = None
        self._in_flight = 0  # replies of an iteration left early, received and dropped before the next
        self._forwarded = None  # the HelperReadAhead the helper runs, or None
        self._log = getattr(dataset, "read_path_log", None)  # see NOTE [paths read elsewhere]
        self._tally = torch.zeros(len(PATHS), dtype=torch.int64).share_memory_()
        if self._log is not None:
            tally = self._tally.numpy()
            self._log.add_tally(tally)
            weakref.finalize(self, self._log.fold_tally, tally)  # its counts stay; its shared memory goes

    def batches(self, steps, ahead, cursor=None, threads=None):
        """Yield the batch of each ``(epoch, indices)`` of ``steps``, ``ahead`` steps read ahead by the helper.

        ``cursor``: the Steps that ``steps`` come from; a HelperReadAhead it follows runs in the helper.
        ``threads``: returns the threads each batch is read with as it is asked for (None: ``options``'),
        NOTE [data-bound loop] in batchloader.py.
        """
        self._start()
        self._drop_in_flight()
        steps, sent, conn = iter(steps), collections.deque(), self._conn
        try:
            while True:
                while len(sent) < ahead and (step := next(steps, None)) is not None:
                    sent.append(step)
                    self._send(*step, self._forward(getattr(cursor, "readahead", None)),
                               threads=threads() if threads is not None else None)
                if not sent:
                    return
                yield self._receive(*sent.popleft())
        finally:
            if self._conn is conn:  # not a helper that died (its replies died with it)
                self._in_flight += len(sent)

    def drop_readahead(self):
        """Have the helper end the read-ahead it runs now: this process's follows the order again (NOTE [auto
        helper] in batchloader.py)."""
        if self._process is not None and self._process.is_alive() and self._forwarded is not None:
            self._forward(None)

    def report(self):
        """Return what the helper read so far: ``{"read_paths": the batches it read by each path since it started
        (they count in the dataset's ``read_paths()`` too), "readahead": its class name or None,
        "misses": batches outside its windows, "batches": ..., "read_in_place": tensors read straight into their
        slot}`` (None before it starts). Call it between iterations (an iteration ended or closed): it drops
        their replies left in flight, and would take a live iteration's next reply for its own."""
        if self._process is None:
            return None
        self._drop_in_flight()
        self._conn.send_bytes(_REPORT.tobytes())
        return self._reply()[2]

    def close(self):
        """End the helper process now (a later iteration starts a new one)."""
        if self._process is not None:
            _stop(self._process, self._conn)
            self._process = self._conn = None
            self._in_flight = 0
        self._forwarded = None

    def _start(self):
        if self._process is not None and self._process.is_alive():
            return
        self.close()
        ours, theirs = self.context.Pipe()
        process = self.context.Process(
            target=_serve, args=(theirs, self.dataset, self.reader, self.options, self._buffers, self._tally,
                                 os.getpid()),
            name="fastdata-helper", daemon=True)
        with held_signals(start_method(self.context)):  # see NOTE [forked SIGTERM]
            process.start()
        theirs.close()
        self._process, self._conn = process, ours
        self._forwarded = None  # a new helper runs no read-ahead yet
        weakref.finalize(self, _stop, process, ours)

    def _forward(self, readahead):
        """Have the helper run ``readahead`` (a HelperReadAhead; else none) from the next request on; return its
        calls not sent yet, for that request."""
        readahead = readahead if isinstance(readahead, HelperReadAhead) else None
        if readahead is not self._forwarded:
            self._conn.send_bytes(_READAHEAD.tobytes() + pickle.dumps(None if readahead is None else readahead.make))
            self._forwarded = readahead
        if readahead is None:
            return []
        events, readahead.events = readahead.events, []
        return events

    def _send(self, epoch, indices, events=(), threads=None):
        slot = self._free.popleft() if self._free else -1  # none free: every slot holds a batch the loop kept
        head = [epoch, slot, threads or 0, len(events)]  # NOTE [requests]
        self._conn.send_bytes(np.concatenate((np.array(head, np.int64),
                                              np.array(events, np.int64).reshape(-1),
                                              np.asarray(indices, dtype=np.int64))))

    def _receive(self, epoch, indices):
        slot, layout, payload = self._reply()
        if layout is None and slot is not None:  # the batch came as itself, or failed: its slot holds nothing
            self._free.append(slot)
        if isinstance(payload, _Failure):
            raise payload.error
        batch = payload if layout is None else layouts.joined(self._mapped(slot, layout), payload)
        return batch if self.reader is None else HostBatch(batch, np.asarray(indices, dtype=np.int64), epoch)

    def _reply(self):
        """Return the next ``(slot, layout, payload)`` the helper sent; raise if it died.

        NOTE [requests]: the pipe's own send and poll cost the training
        thread 133 + 94 us of CPU a batch (a pickler made per message, a
        selector per poll; 2 shared cores); a request is instead one int64
        array ``[epoch, slot or -1, threads or 0, K, *K read-ahead calls of 3,
        *indices]`` as bytes (a HelperReadAhead's calls: NOTE [read-ahead in the
        helper]), and a reply is awaited by a blocking read: the helper's
        death closes its end of the pipe, which ends the read. A message
        whose first int64 is negative is not a request: -1 and a pickled
        read-ahead maker, or -2 asking for the helper's report.
        """
        try:
            slot, layout, payload, said = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._process.join(_POLL_SECONDS)
            self._died()
        for key, message in (said or {}).items():  # see NOTE [paths read elsewhere]
            self._log.fall_back(key, message)
        return slot, layout, payload

    def _died(self):
        process, code = self._process, self._process.exitcode
        self._process = self._conn = None
        self._in_flight = 0
        changed = self.dataset.changed_files()
        if changed:
            raise changed_under("fastdata's helper process", changed)
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        raise RuntimeError(f"fastdata's helper process (pid {process.pid}) ended unexpectedly ({how}), as if killed "
                           "or out of memory; the next iteration starts a new one")

    def _drop_in_flight(self):
        while self._in_flight:
            slot, _, _ = self._reply()
            self._in_flight -= 1
            if slot is not None:
                self._free.append(slot)

    def _mapped(self, slot, layout):
        """Return the batch in ``slot`` as tensors over it; the slot is free again once they are all gone.

        The views are made by numpy and handed to torch (2 tensors: 18 us, against 45 us for torch's own
        slicing and a weakref.finalize per batch; best of 5 x 5,000 calls, 2 loaded cores).
        """
        memory = np.asarray(_SlotLease(self._arrays[slot], self._free, slot))
        return [torch.from_numpy(np.ndarray(shape, _numpy_dtype(dtype), memory, start,
                                            [stride * dtype.itemsize for stride in strides]))
                for dtype, shape, strides, start in layout]

    def __getstate__(self):
        raise TypeError("a HelperProcess belongs to the process that started it")


class HelperReadAhead:
    """The ReadsAhead of a loader whose helper process reads: its calls go to the helper with the next request.

    NOTE [read-ahead in the helper]: with helper_process=True every batch is
    read in the helper, so a read-ahead in the training process could only
    hint the kernel: the windows of a block order read whole (NOTE [window
    reads] in windows.py, NOTE [sequence windows] in sequencewindows.py)
    would land in memory the helper never reads. So the training process
    keeps the order and the cursor (NOTE [one read-ahead] in state.py), and
    this stand-in records what the cursor tells it (``start``, ``advance``);
    the helper makes the real read-ahead with ``make(dataset)`` on its own
    copy of the dataset, and makes the same calls on it before it reads
    each request's batch. A 2.3 GB folder of 64 px raw shards (converted,
    200,000 samples) in a 0.9 GB memory cgroup, block order, 15 s a row in
    fresh processes, 3 rounds in turn (/tmp/hp/drive2.py): through the
    helper 47,649 / 66,165 / 62,846 img/s with its windows, 34,059 / 42,377 /
    41,734 with the training process's hints before; read in the training
    process 53,872 / 79,861 / 63,588; the files' sequential read 823-977 MB/s
    (67,000-79,500 img/s).

    Args:
        order: the EpochOrder it follows.
        make: ``make(dataset)`` returns the read-ahead (a ReadsAhead, or None), picklable.
    """

    def __init__(self, order, make):
        self.order, self.make = order, make
        self.events = []  # [kind, a, b] of each call, not yet sent: _STARTED (epoch, step), _ADVANCED (step, 0)

    def start(self, epoch, step):
        self.events.append([_STARTED, epoch, step])

    def advance(self, step):
        self.events.append([_ADVANCED, step, 0])

    def close(self):
        """Nothing to end here: the helper's read-ahead ends with the helper, or when another replaces it."""


_STARTED, _ADVANCED = 1, 2  # a HelperReadAhead's calls, as requests carry them
_READAHEAD = np.array([-1], np.int64)  # a message that begins so: the helper's read-ahead maker follows, pickled
_REPORT = np.array([-2], np.int64)  # a message that is only this: the helper replies with its report


class _SlotLease:
    """The owner numpy sees of a slot's memory: alive while any tensor or view of the batch is; then frees the slot."""

    def __init__(self, array, free, slot):
        self.array, self._free, self._slot = array, free, slot
        self.__array_interface__ = array.__array_interface__

    def __del__(self):
        self._free.append(self._slot)


@functools.cache
def _numpy_dtype(dtype):
    """Return the numpy dtype of torch ``dtype``."""
    return torch.empty(0, dtype=dtype).numpy().dtype


class _Failure:
    """An error the helper raised reading a batch, re-raised in the training process in the batch's turn."""

    def __init__(self, error):
        try:
            ForkingPickler.dumps(error)
        except Exception:  # an exception that cannot travel: its type and message do
            error = RuntimeError(f"{type(error).__name__}: {error}")
        self.error = error


def _serve(conn, dataset, reader, options, buffers, tally, parent):
    """The helper's loop: read each requested batch, into its slot (or as itself), until the pipe closes."""
    end_on_sigterm()  # see NOTE [forked SIGTERM]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    warnings.simplefilter("ignore", FastPathWarning)  # warned in the training process: NOTE [paths read elsewhere]
    paths = _PathsHere(getattr(dataset, "read_path_log", None), tally.numpy())
    die_with_parent(parent if start_method() == "fork" else None)
    torch.set_num_threads(1)  # as a DataLoader worker does: OpenMP threads do not survive a fork (copy_ hung)
    readahead = None  # see NOTE [read-ahead in the helper]
    counts = {"batches": 0, "read_in_place": 0}  # batches read, and tensors read straight into their slot
    try:
        while (message := _received(conn)) is not None:
            head = int(np.frombuffer(message[:8], np.int64)[0])
            if head == _READAHEAD[0]:
                if readahead is not None:
                    readahead.close()
                make = pickle.loads(message[8:])
                readahead = None if make is None else make(dataset)
            elif head == _REPORT[0]:
                report = {"read_paths": paths.counts(), "readahead": None if readahead is None else
                          type(readahead).__name__, "misses": getattr(readahead, "misses", None), **counts}
                conn.send_bytes(pickle.dumps((None, None, report, paths.news())))
            else:
                counts["batches"] += 1
                counts["read_in_place"] += _serve_request(conn, np.frombuffer(message, np.int64), dataset, reader,
                                                          options, buffers, readahead, paths)
    finally:
        if readahead is not None:
            readahead.close()


def _received(conn):
    """Return the next message from the training process, or None once it closed the pipe (or died)."""
    try:
        message = conn.recv_bytes()
    except (EOFError, OSError):
        return None
    return message or None  # an empty message: _stop asks the helper to end


class _PathsHere:
    """The helper's side of NOTE [paths read elsewhere]: its dataset's ReadPaths (or None), and what of it the
    training process has been told: the counts in ``tally`` (shared), the fallbacks sent with replies.

    NOTE [paths read elsewhere]: the batches a helper reads are counted in
    its own copy of the dataset, and a fast path that could not apply there
    warned on the helper's stderr, out of reach of the training process's
    warning filters: ``dataset.read_paths()`` and ``fastdata.profile``
    showed zeros through a helper, and no test could see its fallbacks.
    So the helper adds its counts, after each batch, to a shared int64
    tally that the training process's ReadPaths sums in (a read of 4
    values, when asked; nothing per batch), and sends each new fallback
    with the next reply, to be warned by the training process's ReadPaths
    (once per reason there, as for its own reads). The helper warns none
    itself.
    """

    def __init__(self, log, tally):
        self.log, self.tally = log, tally
        self._started = self._counted = None if log is None else self._now()  # the counts inherited under fork
        self._said = 0 if log is None else len(log.fallbacks)

    def counts(self):
        """Return the batches this helper read by each path, or None where its dataset counts none."""
        return None if self.log is None else dict(zip(PATHS, np.subtract(self._now(), self._started).tolist()))

    def news(self):
        """Add the batches read since the last call to the tally; return the fallbacks not sent yet, or None."""
        if self.log is None:
            return None
        now = self._now()
        self.tally += np.subtract(now, self._counted)  # the training process only reads it
        self._counted = now
        if len(self.log.fallbacks) == self._said:
            return None
        said, self._said = dict(list(self.log.fallbacks.items())[self._said :]), len(self.log.fallbacks)
        return said

    def _now(self):
        return [self.log.counts[path] for path in PATHS]


def _serve_request(conn, request, dataset, reader, options, buffers, readahead, paths):
    """Make the read-ahead's calls the request carries, read its batch into its slot (or as itself), reply; return
    how many of its tensors were read straight into the slot."""
    epoch, slot, threads, count = (int(value) for value in request[:4])
    if threads and "threads" in options:  # see NOTE [data-bound loop] in batchloader.py
        options = {**options, "threads": threads}
    for kind, first, second in request[4 : 4 + 3 * count].reshape(count, 3).tolist():
        if readahead is None:  # its maker found none to make (e.g. a stream too large to hold)
            break
        if kind == _STARTED:
            readahead.start(first, second)
        else:
            readahead.advance(first)
    indices = request[4 + 3 * count :]
    slot = None if slot < 0 else slot
    layout, in_place = None, 0
    try:
        with nullcontext() if slot is None else read_into(buffers[slot].numpy()):  # NOTE [read into the slot]
            if reader is None:
                batch = read_batch(dataset, indices, epoch, options=options)
            else:
                batch = reader.read(dataset, indices, epoch, options=options).tensors
        tensors, shape = layouts.split(batch)
        written, end = layouts.layout_of(tensors, None if slot is None else buffers[slot])
        if slot is not None and end <= len(buffers[slot]):
            in_place = layouts.write(buffers[slot], tensors, written)
            layout = written
        elif slot is not None:  # the batch travels as itself: none of it may stay in the slot it frees
            batch = layouts.joined(layouts.moved_out(tensors, buffers[slot]), shape)
        reply = (slot, layout, shape) if layout is not None else (slot, None, batch)
    except Exception as exc:
        reply = (slot, None, _Failure(exc))
    # (slot, its layout, a dict batch's shape) or (slot or None, None, the batch or a _Failure): the batch's
    # tensors by descriptor; then the fallbacks to warn of (NOTE [paths read elsewhere])
    reply = (*reply, paths.news())
    conn.send_bytes(pickle.dumps(reply) if layout is not None else ForkingPickler.dumps(reply))
    return in_place


def _stop(process, conn):
    """Ask the helper to end (its pipe closed), then end it within a bound (NOTE [bounded stop])."""
    try:
        conn.send_bytes(b"")
    except (OSError, ValueError):
        pass
    conn.close()
    process.join(1.0)
    end_processes([process])
