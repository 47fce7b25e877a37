"""Ordered parallel map over worker processes, with a progress bar."""

import ctypes
import multiprocessing
import os
import signal
import threading
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from tqdm.auto import tqdm

from fastdata._cpu import usable_cpus
from fastdata.errors import FastdataError, OptionError


def ordered_map(fn, items, *, workers=None, progress=True, unit="it", desc=None):
    """Yield ``fn(item)`` for each of ``items``, in order, computed on ``workers`` processes.

    The result does not depend on ``workers``. ``fn`` must be a picklable
    top-level function. A worker that dies raises FastdataError.
    """
    workers = usable_cpus() if workers is None else workers
    if workers < 1:
        raise OptionError(f"workers should be a positive integer, got workers={workers}")
    # Start worker processes before the progress bar starts its thread.
    pool = None if workers == 1 or len(items) < 2 else start_pool(workers)
    bar = ProgressBar(total=len(items), unit=unit, desc=desc, disable=None if progress else True, dynamic_ncols=True)
    try:
        with bar:
            if pool is None:
                for item in items:
                    yield fn(item)
                    bar.update()
                return
            for chunk in _pooled_chunks(pool, fn, items, workers):
                yield from chunk
                bar.update(len(chunk))
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class ProgressBar(tqdm):
    """tqdm without its monitor thread, which would outlive the bar and make
    the next conversion in this process start its workers without fork (see
    NOTE [worker start])."""

    monitor_interval = 0


def start_pool(workers):
    method = _start_method()
    parent = None if method == "forkserver" else os.getpid()  # the process that starts the workers
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_init_worker,
                               initargs=(parent,))
    try:
        pool.submit(int).result()  # fork (or spawn) the workers now
    except BaseException:  # see NOTE [pool start]
        stop_pool(pool)
        raise
    return pool


def stop_pool(pool):
    """Kill a pool's workers now, mid-task, and reap them.

    NOTE [pool start]: Ctrl-C or SIGTERM while a pool forked its workers,
    before its manager thread ran, left workers that nothing would stop,
    and the interpreter's exit waited on them forever (a hung conversion,
    reproduced in test_shard_faults). The started workers are killed and
    joined instead.
    """
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.kill()
    pool.shutdown(wait=True, cancel_futures=True)
    for process in processes:
        process.join()


def _pooled_chunks(pool, fn, items, workers):
    chunk_size = max(1, min(64, len(items) // (workers * 8)))
    chunks = (items[i : i + chunk_size] for i in range(0, len(items), chunk_size))
    pending = deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(_map_chunk, fn, chunk))
            if len(pending) >= 4 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as exc:
        raise FastdataError(
            "a conversion worker process died (killed, or out of memory); nothing "
            "was written. Run again, with fewer --workers if memory is short."
        ) from exc


def _map_chunk(fn, chunk):
    return [fn(item) for item in chunk]


def _init_worker(parent):
    # Ctrl-C is handled once, in the parent, which stops the pool and cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent):
    """Have the kernel kill this worker when the process that started it exits (Linux).

    NOTE [orphaned workers]: a parent killed with SIGKILL cannot stop its
    pool, and its workers waited on the task queue forever, holding their
    memory. With PR_SET_PDEATHSIG the kernel sends SIGKILL to the worker when
    its parent exits (the converting process, or the forkserver, which exits
    with it). A parent that died before this call is caught by the check
    after it: the worker was given to another parent.
    """
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl: not Linux
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _start_method():
    # NOTE [worker start]: fork starts a pool in ~5 ms; forkserver takes
    # ~0.2 s, and its children re-import the caller's main module (torch
    # included, ~1 s each). Fork is safe while this process runs one thread
    # (no lock can be held by another thread at the fork); otherwise the
    # children start clean from a forkserver, and fastdata's package import
    # keeps them from importing torch.
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"
