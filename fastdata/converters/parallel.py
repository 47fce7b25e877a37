"""Worker processes for the converters: an ordered map, and tasks run on a pool, an executor or Dask."""

import multiprocessing
import os
import select
import signal
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from functools import partial

from tqdm.auto import tqdm

from fastdata._cpu import usable_cpus
from fastdata._optional import require
from fastdata._processes import die_with_parent, end_on_sigterm, held_signals
from fastdata.converters.staging import SignalWatch
from fastdata.errors import FastdataError, OptionError


def ordered_map(fn, items, *, workers=None, progress=True, unit="it", desc=None, batched=False):
    """Yield ``fn(item)`` for each of ``items``, in order, computed on ``workers`` processes.

    The result does not depend on ``workers``. ``fn`` must be a picklable
    top-level function; with ``batched`` it takes a list of items and returns
    the list of their results (one call per chunk). A worker that dies raises
    FastdataError.
    """
    workers = usable_cpus() if workers is None else workers
    if workers < 1:
        raise OptionError(f"workers should be a positive integer, got workers={workers}")
    # Start worker processes before the progress bar starts its thread.
    pool = None if workers == 1 or len(items) < 2 else start_pool(workers)
    bar = ProgressBar(total=len(items), unit=unit, desc=desc, disable=None if progress else True, dynamic_ncols=True)
    finished = False
    try:
        with bar:
            if pool is None:
                size = _chunk_size(items, workers) if batched else 1
                for start in range(0, len(items), size):
                    chunk = items[start : start + size]
                    yield from fn(chunk) if batched else map(fn, chunk)
                    bar.update(len(chunk))
                return
            for chunk in _pooled_chunks(pool, fn if batched else partial(_map_chunk, fn), items, workers):
                yield from chunk
                bar.update(len(chunk))
        finished = True
    finally:
        if pool is not None and finished:
            pool.shutdown(wait=True)
        elif pool is not None:  # left early (an error, a signal, the caller stopped): no wait for running chunks
            stop_pool(pool)


def run_tasks(fn, tasks, sizes, *, executor=None, workers=None, progress=True, unit="img"):
    """Run ``fn(task)`` for each of ``tasks``; return the results in the order they finish.

    Args:
        fn: a picklable top-level function.
        tasks: picklable task descriptions.
        sizes: inputs per task, for the progress bar.
        executor: a ``concurrent.futures.Executor`` or a ``dask.distributed.Client``;
            None: a local pool of ``workers`` processes (in this process for 1).
        workers: local processes; default all usable cores.
    """
    workers = usable_cpus() if workers is None else workers
    if workers < 1:
        raise OptionError(f"workers should be a positive integer, got workers={workers}")
    if hasattr(executor, "get_executor"):  # a dask.distributed Client
        executor = executor.get_executor()
    pool = None
    if executor is None and workers > 1 and len(tasks) > 1:
        pool = executor = start_pool(min(workers, len(tasks)))  # before the bar's thread (NOTE [worker start])
    try:
        with ProgressBar(total=int(sum(sizes)), unit=unit, disable=None if progress else True,
                          dynamic_ncols=True) as bar:
            if executor is None:
                return _run_here(fn, tasks, sizes, bar)
            return _run_on(executor, fn, tasks, sizes, bar)
    finally:
        if pool is not None:
            stop_pool(pool)  # a stopped conversion does not wait for its shards


def streamed_tasks(fn, tasks, *, executor=None, workers=1, ahead=2):
    """Yield ``fn(task)`` for each of the iterable ``tasks``, in their order, however they are run.

    Tasks run in this process (``workers`` 1 and no executor), on a local pool
    of ``workers`` processes, or on ``executor`` (a ``concurrent.futures``
    executor or a ``dask.distributed`` Client). At most ``ahead`` tasks per
    worker (per Dask thread) are taken from ``tasks`` before the oldest one's
    result is yielded, so a stream of tasks is never held whole.
    """
    if workers < 1:
        raise OptionError(f"workers should be a positive integer, got workers={workers}")
    slots = workers
    if hasattr(executor, "get_executor"):  # a dask.distributed Client
        slots = max(1, sum(executor.nthreads().values()))
        executor = executor.get_executor()
    if executor is None and workers == 1:
        with SignalWatch() as watch:  # see NOTE [swallowed signals]
            for task in tasks:
                yield fn(task)
                watch.reraise()
        return
    pool = None
    if executor is None:
        pool = executor = start_pool(workers)
    pending, finished = deque(), False
    try:
        for task in tasks:
            pending.append(executor.submit(fn, task))
            if len(pending) >= ahead * slots:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
        finished = True
    except BrokenProcessPool as exc:
        raise FastdataError("a conversion worker process died (killed, or out of memory); the finished shards "
                            "are kept. Run again with --resume (resume=True), with fewer workers if memory is "
                            "short.") from exc
    finally:
        for future in pending:
            future.cancel()
        if pool is not None and finished:
            pool.shutdown(wait=True)
        elif pool is not None:  # left early: no wait for running tasks
            stop_pool(pool)


def _run_here(fn, tasks, sizes, bar):
    """Run the tasks in this process; a SIGINT or SIGTERM that h5py swallowed stops after the task it hit.

    See NOTE [swallowed signals]: a SIGTERM while a shard was written here was
    dropped and the conversion ran on to write its index (1 trial in 5).
    """
    results = []
    with SignalWatch() as watch:
        for task, size in zip(tasks, sizes):
            results.append(_counted(fn(task), bar, size))
            watch.reraise()
    return results


def _run_on(executor, fn, tasks, sizes, bar):
    futures = {}
    try:
        for task, size in zip(tasks, sizes):  # a pool whose worker died as it started refuses a submit
            futures[executor.submit(fn, task)] = size
        return [_counted(future.result(), bar, futures[future]) for future in _completed(futures)]
    except BrokenProcessPool as exc:
        raise FastdataError("a conversion worker process died (killed, or out of memory); the finished "
                            "shards are kept. Run again with --resume, with fewer --workers if memory "
                            "is short.") from exc
    finally:
        for future in futures:
            future.cancel()


def _counted(result, bar, size):
    bar.update(size)
    return result


def dask_client(address):
    """Return a ``dask.distributed.Client`` connected to the scheduler at ``address``."""
    distributed = require("distributed", "dask", "converting on a Dask cluster (--dask)")
    try:
        return distributed.Client(address, timeout=30)
    except OSError as exc:
        raise FastdataError(f"cannot reach the Dask scheduler at {address!r} ({exc}); check the address") from exc


class ProgressBar(tqdm):
    """tqdm without its monitor thread, which would outlive the bar and make
    the next conversion in this process start its workers without fork (see
    NOTE [worker start])."""

    monitor_interval = 0


class WorkerPool(ProcessPoolExecutor):
    """A ProcessPoolExecutor that knows this process's other children, so that stop_pool finds every worker."""

    def __init__(self, *args, **kwargs):
        self.other_children = set(multiprocessing.active_children())
        super().__init__(*args, **kwargs)


def start_pool(workers):
    method = _start_method()
    parent = None if method == "forkserver" else os.getpid()  # the process that starts the workers
    pool = WorkerPool(workers, mp_context=multiprocessing.get_context(method), initializer=_init_worker,
                      initargs=(parent, os.getpid()))
    try:
        with held_signals(method):  # see NOTE [forked SIGTERM] in fastdata/_processes.py
            pool.submit(int).result()  # fork (or spawn) the workers now
    except BrokenProcessPool as exc:
        stop_pool(pool)
        raise FastdataError("a conversion worker process died as it started (killed, or out of memory); "
                            "nothing was written. Run again, with fewer --workers if memory is short.") from exc
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
    joined instead. A signal can also land between a worker's fork and the
    pool's record of it (``_spawn_process`` adds it to ``_processes`` after
    ``start()`` returns): the driver then waited at exit on a worker reading
    its empty call queue (a CI run of 2026-11-23 hung so). So a WorkerPool's
    workers are the children this process started after the pool, recorded
    by the pool or not.
    """
    processes = [child for child in multiprocessing.active_children() if child not in pool.other_children]
    for process in processes:
        process.kill()
    pool.shutdown(wait=True, cancel_futures=True)
    for process in processes:
        process.join()


def _chunk_size(items, workers):
    return max(1, min(64, len(items) // (workers * 8)))


def _pooled_chunks(pool, fn, items, workers):
    """Yield ``fn(chunk)`` (a list of results) for each chunk of ``items``, in order, computed on ``pool``."""
    chunk_size = _chunk_size(items, workers)
    chunks = (items[i : i + chunk_size] for i in range(0, len(items), chunk_size))
    pending = deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(fn, chunk))
            if len(pending) >= 4 * workers:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    except BrokenProcessPool as exc:
        raise FastdataError(
            "a conversion worker process died (killed, or out of memory); nothing "
            "was written. Run again, with fewer --workers if memory is short."
        ) from exc


# NOTE [signals in waits]: Python runs a signal handler in the main
# thread, between bytecodes. A signal the kernel gives to another thread
# (one an earlier library or test left running) does not interrupt the
# main thread's untimed wait on a future, so the handler waits for a task
# to finish. A fresh-clone CI run's stop took 30.1 s, the length of its
# tasks (test_parallel, 1 of 24 stops, under heavy load; not reproduced
# alone, 120 runs), which this explains. So the main thread waits on the
# pool in slices of _WAKE_SECONDS, after each of which a pending handler
# runs.
_WAKE_SECONDS = 0.2


def _completed(futures):
    """Yield ``futures`` as they complete, waking every _WAKE_SECONDS (NOTE [signals in waits])."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=_WAKE_SECONDS, return_when=FIRST_COMPLETED)
        yield from done


def _result(future):
    """Return ``future.result()``, waking every _WAKE_SECONDS (NOTE [signals in waits])."""
    while True:
        try:
            return future.result(timeout=_WAKE_SECONDS)
        except TimeoutError:
            continue


def _map_chunk(fn, chunk):
    return [fn(item) for item in chunk]


def _init_worker(parent, owner):
    end_on_sigterm()  # a SIGTERM ends a worker, whatever its parent's handler (NOTE [forked SIGTERM])
    # The workers are the parallelism: a Hugging Face tokenizer in one runs on its thread alone, not on a pool of
    # threads per worker (40,000 documents on 2 workers: 6.0-6.7 s against 6.9-7.0 s with its threads).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ctrl-C is handled once, in the parent, which stops the pool and cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    if parent is None:  # a forkserver's child: its parent outlives the owner (NOTE [orphaned workers])
        _die_with_owner(owner)


_OWNER_POLL_SECONDS = 0.5  # where pidfd_open is missing


def _die_with_owner(owner):
    """Exit this worker when process ``owner`` exits: a daemon thread waits on its pidfd (polls without one)."""
    try:
        fd = os.pidfd_open(owner)
    except (AttributeError, OSError):  # not Linux >= 5.3, or already gone
        fd = None
        if not _alive(owner):
            os._exit(1)

    def wait():
        if fd is not None:
            select.select([fd], [], [])  # readable once the owner has exited
        else:
            while _alive(owner):
                time.sleep(_OWNER_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=wait, name="fastdata-owner-watch", daemon=True).start()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
