"""The converters' worker pool ends when asked, at any moment of its start (NOTE [forked SIGTERM], [pool start])."""

import concurrent.futures.process
import multiprocessing.forkserver
import os
import signal
import subprocess
import time

import pytest
from support import descendants, returning_sigterm_handler, sigterm_after, still_running

from fastdata.converters import parallel
from fastdata.converters.parallel import ordered_map, run_tasks
from fastdata.errors import FastdataError

DELAYS = [0.0, 0.0005, 0.002, 0.01, 0.05, 0.2]  # before, during and after each worker's initializer


def run_slow_tasks(seconds):
    """Run 4 tasks of ``seconds`` each on 2 worker processes through run_tasks."""
    return run_tasks(time.sleep, [seconds] * 4, [1] * 4, workers=2, progress=False)


def map_slowly(seconds):
    """Map 4 items of ``seconds`` each on 2 worker processes through ordered_map."""
    return list(ordered_map(time.sleep, [seconds] * 4, workers=2, progress=False))


RUNS = [pytest.param(run_slow_tasks, id="run_tasks"), pytest.param(map_slowly, id="ordered_map")]


@pytest.fixture(autouse=True)
def forked_workers(monkeypatch):
    """Start the pools by fork, as the converters do from a process of one thread (NOTE [worker start]).

    A thread an earlier test left running in this process would start them from a forkserver, whose forks
    fork_hook cannot see: all 12 SIGTERM cases and one stop failed in a full-suite run, none alone.
    """
    monkeypatch.setattr(parallel, "_start_method", lambda: "fork")


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("delay", DELAYS)
def test_workers_sent_sigterm_at_any_moment_of_their_start_end_under_a_returning_handler(fork_hook, run, delay):
    returning_sigterm_handler()  # what each forked worker inherits
    before = set(descendants())
    fork_hook.in_child = sigterm_after(delay)
    started = time.monotonic()
    with pytest.raises(FastdataError, match="worker process died"):
        run(1.0)  # 2 s of tasks: every SIGTERM lands before they are done
    assert time.monotonic() - started < 10
    assert len(fork_hook.pids) == 2
    assert still_running(fork_hook.pids, 10) == [], f"a worker outlived a SIGTERM {delay} s after its fork"
    assert set(descendants()) <= before


class Stop(Exception):
    """What the test's SIGTERM handler raises (the CLI's raises SystemExit)."""


def raise_stop(signum, frame):
    raise Stop


@pytest.mark.parametrize("method", ["fork", "forkserver"])
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("delay", [0.0, 0.001, 0.005, 0.02, 0.1, 0.3])
@pytest.mark.integration
def test_a_run_asked_to_stop_as_its_pool_starts_ends_at_once_with_no_worker_left(monkeypatch, method, run, delay):
    # forkserver: as from a process with other threads; its stop once raised "cannot join thread before it is started"
    monkeypatch.setattr(parallel, "_start_method", lambda: method)
    if method == "forkserver":
        multiprocessing.forkserver.ensure_running()  # the server outlives the run; its workers must not
    signal.signal(signal.SIGTERM, raise_stop)  # as the CLI's main() does (sys.exit)
    before = set(descendants())
    # The SIGTERM comes from another process, told when to start, as a job scheduler's would
    script = f"read go; {f'sleep {delay}; ' if delay else ''}kill -TERM {os.getpid()}"
    sender = subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.PIPE)
    started = time.monotonic()
    try:
        with pytest.raises(Stop):
            sender.stdin.write(b"go\n")
            sender.stdin.close()
            run(30.0)  # tasks far longer than the bound: the stop must not wait for them
    finally:
        sender.wait(10)
    assert time.monotonic() - started < 10
    assert still_running(set(descendants()) - before, 10) == []


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_stop_just_before_the_pools_manager_thread_starts_ends_the_run_cleanly(monkeypatch, method):
    # The narrowest moment of a pool's start: its manager thread made, not yet started. A stop raised there left
    # a thread that could not be joined ("RuntimeError: cannot join thread before it is started", 1 in 113 stops).
    monkeypatch.setattr(parallel, "_start_method", lambda: method)
    if method == "forkserver":
        multiprocessing.forkserver.ensure_running()
    signal.signal(signal.SIGTERM, raise_stop)
    start = concurrent.futures.process._ExecutorManagerThread.start

    def stopped_first(thread):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # Python steps, where a handler not deferred would raise
            pass
        start(thread)

    monkeypatch.setattr(concurrent.futures.process._ExecutorManagerThread, "start", stopped_first)
    before = set(descendants())
    with pytest.raises(Stop):
        run_slow_tasks(30.0)
    assert still_running(set(descendants()) - before, 10) == []
