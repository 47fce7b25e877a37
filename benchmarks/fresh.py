"""Fresh measuring processes, forked from one clean process that imported the heavy modules once.

NOTE [fresh process per row]: every row is measured in a newly spawned
process, as a training script would run it. Fresh batch arrays of a few MB
are served by glibc malloc either from reused heap memory or from new pages
(a minor page fault per 4 KB), depending on what the process allocated and
freed before; in one process shared by all rows, a row's rate depended on
the rows run before it.

NOTE [zygote]: spawning a process costs ~1.7 s on 2 cores, most
of it importing torch, and the suite measures ~150 rows. So one "zygote"
process is spawned at the start; it imports the modules the rows need and
does nothing else. Each row runs in a fork of it: a new process whose heap
holds only what those imports allocated, as a training script's does when
it reaches its loop. The request is unpickled in the row's process, so the
zygote never imports a row's module or allocates for it.

NOTE [fresh processes end]: leaving the ``with`` block by an exception
(Ctrl-C, a failed section) while a row ran waited 10 s for the zygote,
which waits for its row, then terminated the zygote alone: the row, a
grandchild, lived on as an orphan until it finished (tests/benchmarks/
test_fresh_ends.py). Each row and the zygote now die with their parent
(PR_SET_PDEATHSIG), and the zygote is ended at once when the block is left
by an exception, within a bound (terminate, then kill) otherwise.

Only the standard library and fastdata._processes are imported at module
level (see NOTE [light main] in sections/images.py).
"""

import importlib
import multiprocessing
import os
import pickle
import sys
import traceback

from fastdata._processes import die_with_parent, end_processes

# Imported once in the zygote, so each row's process starts with them loaded.
PRELOAD = (
    "numpy",
    "torch",
    "torch.utils.data",
    "h5py",
    "pyarrow",
    "PIL.Image",
    "fastdata.loading.datasets",
    "fastdata.loading.loader",
    "fastdata.loading.samplers",
    "fastdata.codecs.tokenizers",
)


class FreshProcesses:
    """Run functions each in a new process forked from a preloaded zygote.

    Use as a context manager; ``run(fn, *args)`` returns ``fn(*args)``. ``fn``
    must be a module-level function; its result must pickle. Where fork is
    not available, each call spawns a process instead (slower, same result).

    Args:
        preload: modules the zygote imports before it forks anything.
    """

    def __init__(self, preload=PRELOAD):
        self.preload = tuple(preload)
        self._conn, self._process = None, None

    def __enter__(self):
        if "fork" not in multiprocessing.get_all_start_methods():
            return self
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        args = (child_conn, self.preload, multiprocessing.get_start_method(), os.getpid())
        self._process = context.Process(target=_zygote, args=args, name="benchmark-zygote")
        try:
            self._process.start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        finally:
            child_conn.close()
        return self

    def run(self, fn, *args):
        """Return ``fn(*args)`` computed in a new process.

        Raises:
            RuntimeError: ``fn`` raised (with the child's traceback) or its process died.
        """
        if self._conn is None:
            return run_isolated(fn, *args)  # no fork: a spawned process per call
        try:
            self._conn.send_bytes(pickle.dumps((fn, args)))
            ok, value = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"the benchmark zygote process died (exit code {self._process.exitcode})") from exc
        if not ok:
            raise RuntimeError(f"measuring in a child process failed:\n{value}")
        return value

    def run_median(self, count, fn, *args):
        """Run ``fn(*args)`` (returning a row dict) in ``count`` new processes; return the median row.

        NOTE [process to process]: the same row measured in fresh processes
        on this machine gave e.g. 0.64, 0.74, 1.07, 1.17 and 1.29 million
        samples/s (HDF5 raw, 64x64): a process keeps its speed for all its
        passes, so the median of passes inside one process does not smooth
        it out. Fast rows are therefore measured in several processes and
        the row of the median process is kept, with every process's rate in
        ``process_rates``.
        """
        rows = [self.run(fn, *args) for _ in range(max(1, count))]
        rows.sort(key=lambda row: row["samples_per_s"])
        median = dict(rows[(len(rows) - 1) // 2])
        median["process_rates"] = [row["samples_per_s"] for row in rows]
        return median

    def __exit__(self, exc_type, *exc_info):
        if self._conn is not None:  # see NOTE [fresh processes end]
            try:
                self._conn.send_bytes(b"")
            except OSError:
                pass
            self._conn.close()
            if exc_type is None:  # idle: it ends on the empty request
                self._process.join(10)
            end_processes([self._process])  # its row dies with it
            self._conn, self._process = None, None
        return False


def run_isolated(fn, *args):
    """Return ``fn(*args)`` computed in a newly spawned Python process.

    ``fn`` must be importable by name in the child; its output is shared.
    The child's own subprocesses (DataLoader workers) use this process's
    start method, as they would in a script run directly.

    Raises:
        RuntimeError: ``fn`` raised (the child's traceback is in the message) or the child died.
    """
    context = multiprocessing.get_context("spawn")
    reply = _reply_of(context, multiprocessing.get_start_method(), pickle.dumps((fn, args)))
    ok, value = pickle.loads(reply)
    if not ok:
        raise RuntimeError(f"measuring in a child process failed:\n{value}")
    return value


def _reply_of(context, start_method, request):
    """Run ``request`` in a new process of ``context``; return its pickled ``(ok, value)``."""
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_row, args=(sender, start_method, request, os.getpid()), name="benchmark-row")
    process.start()
    sender.close()
    try:
        reply = receiver.recv_bytes()
    except EOFError:
        process.join()
        reply = pickle.dumps((False, f"the measuring process died with exit code {process.exitcode}"))
    except BaseException:  # Ctrl-C, or a signal's exception, while it ran: see NOTE [fresh processes end]
        end_processes([process])
        raise
    finally:
        receiver.close()
    process.join()
    return reply


def _zygote(conn, preload, start_method, parent):
    die_with_parent(parent)  # see NOTE [fresh processes end]
    for name in preload:
        importlib.import_module(name)
    context = multiprocessing.get_context("fork")
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:
            return
        if not request:
            return
        conn.send_bytes(_reply_of(context, start_method, request))


def _row(sender, start_method, request, parent):
    die_with_parent(parent)  # see NOTE [fresh processes end]
    multiprocessing.set_start_method(start_method, force=True)  # DataLoader workers start as in a script
    try:
        fn, args = pickle.loads(request)
        reply = (True, fn(*args))
    except BaseException:  # reported to the parent, which raises
        reply = (False, traceback.format_exc())
    try:
        payload = pickle.dumps(reply)
    except Exception:  # an unpicklable result
        payload = pickle.dumps((False, traceback.format_exc()))
    sender.send_bytes(payload)
    sender.close()
    sys.stdout.flush()
