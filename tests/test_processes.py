"""fastdata._processes: signals held while workers fork, and a stop that ends every process within a bound."""

import multiprocessing
import os
import signal
import time

import pytest

from fastdata._processes import end_processes, held_signals

FORK = multiprocessing.get_context("fork")


def wait_forever(ready, ignore_sigterm):
    # either way, not the test runner's inherited handler (in a full run one exited with status 143)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_sigterm else signal.SIG_DFL)
    ready.set()
    time.sleep(120)


def test_end_processes_kills_what_sigterm_does_not_end():
    ready = [FORK.Event(), FORK.Event()]
    stubborn, willing = (FORK.Process(target=wait_forever, args=(event, ignore), daemon=True)
                         for event, ignore in zip(ready, (True, False)))
    stubborn.start()
    willing.start()
    assert all(event.wait(10) for event in ready)
    started = time.monotonic()
    assert end_processes([stubborn, willing], timeout=0.5) == [stubborn]
    assert time.monotonic() - started < 5
    assert (stubborn.exitcode, willing.exitcode) == (-signal.SIGKILL, -signal.SIGTERM)


class Stop(Exception):
    pass


def raise_stop(signum, frame):
    raise Stop


@pytest.mark.parametrize("signum, raised", [(signal.SIGTERM, Stop), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_while_held_lands_once_the_block_ends_with_the_handlers_and_mask_as_before(signum, raised):
    signal.signal(signal.SIGTERM, raise_stop)  # the autouse restore_sigterm fixture puts the runner's back
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    reached = []
    with pytest.raises(raised):
        with held_signals("fork"):
            os.kill(os.getpid(), signum)
            for step in range(1000):  # Python calls, where a handler would run
                reached.append(step)
    assert len(reached) == 1000  # the whole block ran
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == mask


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_other_start_methods_defer_the_handlers_but_block_nothing(method):
    signal.signal(signal.SIGTERM, raise_stop)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    reached = []
    with pytest.raises(Stop), held_signals(method):
        assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == mask  # their workers inherit no mask to undo
        os.kill(os.getpid(), signal.SIGTERM)
        for step in range(1000):
            reached.append(step)
    assert len(reached) == 1000
    assert signal.getsignal(signal.SIGTERM) is raise_stop
