"""The benchmark suite's fresh processes end when the run is stopped, at any moment (NOTE [fresh processes end])."""

import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from support import descendants, still_running

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks.fresh import FreshProcesses  # noqa: E402


class Stop(Exception):
    """What the test's SIGTERM handler raises, as Ctrl-C raises KeyboardInterrupt in run.py."""


def raise_stop(signum, frame):
    raise Stop


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3, 1.0])  # the zygote starting, importing, then its row running
@pytest.mark.slow
def test_a_run_stopped_while_a_row_runs_ends_the_zygote_and_the_row_at_once(delay):
    signal.signal(signal.SIGTERM, raise_stop)  # the autouse restore_sigterm fixture puts the runner's back
    before, seen = set(descendants()), set()

    def watch_then_stop():  # every process started until the stop, grandchildren included
        deadline = time.monotonic() + delay
        while True:
            seen.update(descendants())
            if time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    watcher = threading.Thread(target=watch_then_stop, daemon=True)
    started = time.monotonic()
    try:
        with pytest.raises(Stop), FreshProcesses(preload=("json",)) as fresh:
            watcher.start()
            fresh.run(time.sleep, 60)  # a row far longer than the bound
    finally:
        watcher.join(10)
    assert time.monotonic() - started < 20
    assert still_running((seen | set(descendants())) - before, 10) == []
