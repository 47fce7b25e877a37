"""The processes fastdata starts end when asked: SIGTERM at any moment of their start, and a stop with a bound.

Pools of the measuring code (measure/limits.py), the converters' worker
pool (converters/parallel.py) and the loader's DataLoader workers
(loading/workers.py) all start their workers inside ``held_signals``;
the loader and benchmarks/fresh.py stop theirs with ``end_processes``.

NOTE [forked SIGTERM]: a forked worker inherits its parent's Python
SIGTERM handler, and one that returns (a test runner's, a training
script's "checkpoint on preemption" flag, a library's) left a worker alive
through the SIGTERM meant to end it: Pool.terminate's join then hung CI
runs for 7-10 minutes (1 run in about 20). Resetting the handler in the
worker's initializer was not enough: on a loaded machine a worker the OS
had not yet run took the SIGTERM before its initializer, into the
inherited handler (test_limits, 2026-11-26). The same window is open in
every forked worker. A DataLoader worker installs torch's SIGTERM handler
(which ends it) only once its loop runs; multiprocessing's exit sends its
daemonic children SIGTERM and joins them with no timeout, so a script
with such a handler that ended while a worker was starting never exited
(tests/loading/test_worker_ends.py, killed at 60 s). A converter worker
never reset the handler at all: SIGTERM at any moment left it running
(tests/converters/test_parallel.py, 12 of 12 cases). So SIGTERM is blocked
in the thread that forks (threads made there, a Pool's or an executor's,
inherit the mask, so workers they start again do too), and each worker
unblocks it once a handler that ends it is in place (the default action,
or torch's): a SIGTERM that came early is pending until then, and ends it.
In the parent, a Python handler that raises (the CLI's SIGTERM, Ctrl-C's
KeyboardInterrupt) could run between a worker's fork and the record of it
(a signal that arrived before the block still runs its handler later): the
worker, recorded nowhere, was left running after the pool was stopped (3
of 48 stops while a pool started). So in the main thread those handlers
only note a signal while processes start; it is raised again after. Other
start methods begin from a fresh interpreter or the forkserver's defaults,
so SIGTERM is not blocked for them, but their handlers are deferred too: a
converter pool started from a forkserver (a process with other threads)
and stopped by the CLI's SIGTERM handler mid-start raised "RuntimeError:
cannot join thread before it is started" from the executor's half-made
manager thread (1 in 113 hostile stops; a CI run of 2026-11-26).
"""

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from contextlib import contextmanager

END_SECONDS = 5.0  # how long a process asked to end may take before it is killed

_DEFERRED = (signal.SIGINT, signal.SIGTERM)  # signals whose Python handlers wait until the processes are recorded
_PR_SET_PDEATHSIG = 1


@contextmanager
def held_signals(method="fork"):
    """Start processes by ``method`` in this block with SIGTERM held (see NOTE [forked SIGTERM]).

    In the main thread the Python handlers of SIGINT and SIGTERM only note
    a signal; once the block ends, the handlers are back and a signal that
    came meanwhile is raised again, so it lands after every process started
    here is recorded. With "fork", SIGTERM is also blocked in this thread,
    and the workers must call ``end_on_sigterm`` or ``release_sigterm``
    first thing.
    """
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # this thread's mask, as it is
    caught, handlers = [], {}
    try:
        if method == "fork":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        if threading.current_thread() is threading.main_thread():  # Python handlers run only there
            for signum in _DEFERRED:
                handler = signal.getsignal(signum)
                if callable(handler):
                    handlers[signum] = signal.signal(signum, _Noting(handler, caught))
        yield
    finally:
        # The mask first, each step in a finally of its own: a Python signal handler may raise between any two
        # steps (torch's SIGCHLD handler raises a worker's death in the main thread), and a mask left blocking
        # SIGTERM would pass to every process started later (a CI run at 8360572 saw it once). A SIGTERM pending
        # now lands on the noting handler and is raised again below.
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        finally:
            try:
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
            finally:
                for signum in dict.fromkeys(caught):
                    signal.raise_signal(signum)


def end_on_sigterm():
    """A forked worker's first step: SIGTERM takes its default action (ends it), then one held since the fork lands."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    release_sigterm()


def release_sigterm():
    """Unblock SIGTERM in this worker, keeping its handler (a DataLoader worker's is torch's, which ends it).

    SIGINT gets the handler the worker would have inherited outside ``held_signals``.
    """
    handler = signal.getsignal(signal.SIGINT)
    if isinstance(handler, _Noting):
        signal.signal(signal.SIGINT, handler.original)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class _Noting:
    """A handler noting each signal for ``held_signals`` to raise again; ``original`` is the one it stands in for."""

    def __init__(self, original, caught):
        self.original, self.caught = original, caught

    def __call__(self, signum, frame):
        self.caught.append(signum)


def start_method(context=None):
    """Return how ``context`` (a multiprocessing context; None: the default one) starts processes."""
    return (context or multiprocessing).get_start_method()


def end_processes(processes, timeout=END_SECONDS):
    """Ask ``processes`` (multiprocessing.Process) to end, wait up to ``timeout`` s, then kill the rest; reap all.

    SIGTERM first (a worker's cleanup runs); SIGKILL for any still alive
    after ``timeout`` (a handler that returns, a worker stuck where SIGTERM
    cannot reach it), so the call ends within about ``timeout`` seconds.
    Returns the processes that had to be killed.
    """
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout
    for process in started:
        process.join(max(0.0, deadline - time.monotonic()))
    killed = [process for process in started if process.is_alive()]
    for process in killed:
        process.kill()
    for process in killed:
        process.join(END_SECONDS)  # SIGKILL ends it unless it waits on the kernel (a stuck disk)
    return killed


def die_with_parent(parent):
    """Have the kernel kill this process when the process that started it exits (Linux).

    NOTE [orphaned workers]: a parent killed with SIGKILL cannot stop its
    pool, and its workers waited on the task queue forever, holding their
    memory. With PR_SET_PDEATHSIG the kernel sends SIGKILL to the worker when
    its parent exits (the converting process, or the forkserver). A parent
    that died before this call is caught by the check after it: the worker
    was given to another parent. The forkserver does not exit with the
    converting process: it waits for its children, and each holds its
    "alive" pipe; after a kill -9 of a conversion to a URL (whose fsspec
    thread makes the pool start from a forkserver) both workers and the
    forkserver lived on, blocked on the dead owner's task queue. A forkserver
    worker therefore also watches the converting process (_die_with_owner
    in converters/parallel.py).
    """
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl: not Linux
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)
