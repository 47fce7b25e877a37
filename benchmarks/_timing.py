"""Timing helpers of the benchmark scripts: isolated processes, a quiet machine.

Timed passes (``Rate``, ``measure_rate``), the machine description and
Markdown tables live in ``fastdata.measure.engine``, shared with `fastdata bench`
and `fastdata tune`; they are re-exported here under their old names.
Only the standard library, numpy and Pillow are imported (psutil on first
use), so that processes started from a benchmark script (which re-import
``__main__`` under forkserver or spawn) stay light.
"""

import math
import multiprocessing
import time
import traceback

from fastdata.measure.engine import Rate, markdown_table, measure_rate
from fastdata.measure.engine import describe_machine as machine_info

__all__ = ["Rate", "busy_percent", "interleaved_rates", "machine_info", "markdown_table", "measure_rate",
           "run_isolated", "wait_until_quiet"]


def run_isolated(fn, *args):
    """Return ``fn(*args)`` computed in a newly spawned Python process.

    ``fn`` must be importable by name in the child (a module-level function
    of an importable module or of the main script); its output is shared.
    The child's own subprocesses (DataLoader workers) use this process's
    start method, as they would in a script run directly.

    Raises:
        RuntimeError: ``fn`` raised (the child's traceback is in the message)
            or the child died.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    start_method = multiprocessing.get_start_method()
    process = context.Process(target=_run_child, args=(sender, start_method, fn, args), name="benchmark-row")
    process.start()
    sender.close()
    try:
        ok, value = receiver.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"the measuring process died with exit code {process.exitcode}") from None
    finally:
        receiver.close()
    process.join()
    if not ok:
        raise RuntimeError(f"measuring in a child process failed:\n{value}")
    return value


def interleaved_rates(run_epochs, rounds, min_seconds):
    """Time ``run_epochs`` (name -> callable returning samples) in turn, ``rounds`` times; return name -> rates.

    NOTE [interleaved rates]: this VM's speed drifts by up to a third over
    seconds (the same loader measured 75k and 110k img/s a few seconds
    apart, in one process), so two rates measured minutes apart give a
    ratio that is mostly drift. Passes of each method taken in turn, a
    fraction of a second each, see the same machine; the ratio of a round's
    rates is then the comparison. Each method is warmed up once first.
    """
    epochs = {}
    for name, run_epoch in run_epochs.items():
        run_epoch()  # warm-up
        started = time.perf_counter()
        run_epoch()
        epochs[name] = max(1, math.ceil(min_seconds / max(time.perf_counter() - started, 1e-9)))
    rates = {name: [] for name in run_epochs}
    for _ in range(rounds):
        for name, run_epoch in run_epochs.items():
            started = time.perf_counter()
            samples = sum(run_epoch() for _ in range(epochs[name]))
            rates[name].append(samples / (time.perf_counter() - started))
    return rates


def _run_child(sender, start_method, fn, args):
    multiprocessing.set_start_method(start_method, force=True)  # spawn passed down "spawn"
    try:
        result = (True, fn(*args))
    except BaseException:  # reported to the parent, which raises
        result = (False, traceback.format_exc())
    sender.send(result)
    sender.close()


def busy_percent(seconds=1.0):
    """Return the machine's CPU use in percent over ``seconds`` while this process sleeps.

    Anything well above 0 is other processes competing with the benchmark.
    Returns None without psutil.
    """
    try:
        import psutil
    except ImportError:
        return None
    return psutil.cpu_percent(interval=seconds)


def wait_until_quiet(max_seconds, threshold=15.0):
    """Wait up to ``max_seconds`` for CPU use below ``threshold`` percent; return the last reading."""
    deadline = time.monotonic() + max_seconds
    busy = busy_percent()
    while busy is not None and busy >= threshold and time.monotonic() < deadline:
        busy = busy_percent(2.0)
    return busy
