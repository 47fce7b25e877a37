"""A loader's worker processes end when asked, at any moment of their start (NOTE [forked SIGTERM], [bounded stop])."""

import subprocess
import sys
import time

import pytest
from support import descendants, returning_sigterm_handler, sigterm_after, still_running

from fastdata import make_loader, open_dataset
from fastdata.measure.engine import consume

pytestmark = pytest.mark.integration  # scripts ended by signals while workers start

DELAYS = [0.0, 0.0005, 0.002, 0.005, 0.02, 0.1]  # after the fork: before, during and after torch's worker start
LONG_EPOCH = [[index % 24] for index in range(4000)]  # 1-2 s of batches: a SIGTERM lands inside the epoch


@pytest.fixture
def raw_loader(packed_files):
    """Return ``make(**options)``: a 2-worker forked loader over the converter's raw file, closed after the test."""
    made = []

    def make(**options):
        dataset = open_dataset(packed_files("hdf5", "raw"))
        made.append(make_loader(dataset, num_workers=2, multiprocessing_context="fork", **options))
        return made[-1]

    yield make
    for loader in made:
        loader.close()


# torch's SIGCHLD handler raises a worker's death in the main thread wherever it is: once inside
# Thread.start of torch's own queue feeder, whose thread then could not unregister itself (a warning
# from that thread, not from fastdata).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("delay", DELAYS)
def test_workers_sent_sigterm_at_any_moment_of_their_start_end_under_a_returning_handler(
        raw_loader, fork_hook, delay):
    returning_sigterm_handler()
    before = set(descendants())
    loader = raw_loader(batch_sampler=LONG_EPOCH, persistent_workers=False)
    for _ in loader:  # torch's first iteration imports a module whose guard would swallow the worker's error
        break
    fork_hook.in_child = sigterm_after(delay)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="DataLoader worker"):  # killed: torch says so, the epoch stops
        consume(loader)
    fork_hook.in_child = None
    assert time.monotonic() - started < 30
    assert still_running(fork_hook.pids, 10) == [], f"a worker outlived a SIGTERM {delay} s after its fork"
    loader.close()
    assert set(descendants()) <= before


EXIT_WHILE_STARTING = """
import os, signal, sys, time
from fastdata import make_loader, open_dataset

signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a training script's "checkpoint on preemption" flag
fork, forks = os.fork, []

def slow_second_start():  # the second worker starts late, as on a loaded machine
    pid = fork()
    if pid == 0 and len(forks) == 1:
        time.sleep(1.0)
    elif pid:
        forks.append(pid)
    return pid

os.fork = slow_second_start
loader = make_loader(open_dataset(sys.argv[1]), 4, shuffle=True, num_workers=2, multiprocessing_context="fork")
batches = iter(loader)
next(batches)  # from worker 0; then the script ends, the loop still open, while worker 1 starts
"""


def test_a_script_that_ends_while_a_worker_starts_exits(packed_files):
    # multiprocessing's exit sends its daemonic children SIGTERM, then joins them without a timeout: before
    # NOTE [forked SIGTERM] reached the loader's workers, this script never exited (killed at 60 s)
    done = subprocess.run([sys.executable, "-c", EXIT_WHILE_STARTING, str(packed_files("hdf5", "raw"))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow  # ~10 s: torch's shutdown waits 5 s, sends SIGTERM, waits 5 s more
def test_close_kills_a_worker_that_sigterm_cannot_reach(raw_loader, fork_hook):
    def stall_second_worker():  # its SIGTERM is held until its start, which never comes
        if len(fork_hook.pids) == 1:
            time.sleep(120)

    loader = raw_loader(batch_size=4, shuffle=True)
    fork_hook.in_child = stall_second_worker
    batches = iter(loader)
    next(batches)  # batch 0 comes from worker 0
    fork_hook.in_child = None
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 30
    assert still_running(fork_hook.pids, 5) == []
