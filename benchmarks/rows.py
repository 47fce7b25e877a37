"""One row of a section measured in this process: fastdata.measure's timed epochs, and the worker memory beside them."""

import os
import statistics

from fastdata.measure.engine import measure_rate
from fastdata.measure.memory import MemoryProbe, process_memory


def measure_row(row, setup, **more):
    """Measure ``row`` (a fastdata.measure.tables.Row) here; return its line of results.

    ``row.build(setup, **row.options)`` is a context manager yielding the
    epoch function; every epoch must cover ``setup["num_samples"]``. With
    ``row.memory``, the memory of this process's children (workers, decode
    processes) is read after the warm-up and at the end (see NOTE [worker
    memory] in fastdata/measure/memory.py) into ``memory``.
    """
    print(f"  {row.method} [{row.workers}] ...", end="", flush=True)
    probe = MemoryProbe()
    with row.build(setup, **row.options) as run_epoch:
        rate = measure_rate(probe.wrap(run_epoch) if row.memory else run_epoch, setup["repeats"],
                            min_seconds=setup["min_seconds"], expected=setup["num_samples"])
        if row.memory:
            workers = probe.growth(keys=("uss", "pss", "private_dirty"))["workers"]
            more["memory"] = {"workers": len(workers), "per_worker": workers, "main": process_memory(os.getpid())}
    print(f" {rate.samples_per_s:,.0f} samples/s", flush=True)
    return row.result(rate, **more)


def worker_mb(row):
    """Return "USS (private dirty)" in MB, averaged over a row's worker processes, or "-" without workers."""
    workers = (row.get("memory") or {}).get("per_worker") or []
    if not workers:
        return "-"
    uss = statistics.mean(w["uss"] for w in workers) / 1e6
    return f"{uss:,.0f} ({statistics.mean(w.get('private_dirty') or 0 for w in workers) / 1e6:,.0f})"
