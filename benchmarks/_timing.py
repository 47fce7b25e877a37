"""Timing helpers shared by the benchmark scripts: timed passes, machine facts, tables.

Only the standard library is imported here (psutil on first use), so that
processes started from a benchmark script (which re-import ``__main__``
under forkserver or spawn) stay light.
"""

import datetime
import importlib.util
import math
import multiprocessing
import os
import platform
import statistics
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass, field
from importlib import metadata


@dataclass
class Rate:
    """Throughput of one benchmarked method: the median of timed passes.

    Attributes:
        samples_per_s: median over passes of samples consumed / wall seconds.
        pass_rates: samples/s of each timed pass, in run order.
        samples_per_pass: samples consumed by one timed pass.
        epochs_per_pass: epochs (full iterations) in one timed pass.
        warmup_seconds: wall time of the untimed warm-up epoch.
    """

    samples_per_s: float
    pass_rates: list = field(default_factory=list)
    samples_per_pass: int = 0
    epochs_per_pass: int = 1
    warmup_seconds: float = 0.0

    def to_dict(self):
        return asdict(self)


def measure_rate(run_epoch, repeats, *, min_seconds=0.2):
    """Time ``run_epoch`` (which returns the number of samples it consumed).

    One warm-up epoch runs first and is not counted. A pass repeats the epoch
    until it lasts about ``min_seconds`` (fast methods would otherwise be
    timed over a few milliseconds); the result is the median pass rate.

    Args:
        run_epoch: callable running one full epoch; returns samples consumed.
        repeats: timed passes (at least 1).
        min_seconds: target duration of one timed pass.

    Returns:
        Rate.
    """
    started = time.perf_counter()
    expected = run_epoch()
    warmup = time.perf_counter() - started
    epoch_seconds = warmup
    if warmup < min_seconds:  # the warm-up may include start-up costs; time a steady epoch
        started = time.perf_counter()
        _check_count(run_epoch(), expected)
        epoch_seconds = time.perf_counter() - started
    epochs = max(1, math.ceil(min_seconds / max(epoch_seconds, 1e-9)))
    rates = []
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        consumed = sum(run_epoch() for _ in range(epochs))
        seconds = time.perf_counter() - started
        _check_count(consumed, expected * epochs)
        rates.append(consumed / seconds)
    return Rate(statistics.median(rates), rates, expected * epochs, epochs, warmup)


def _check_count(consumed, expected):
    if consumed != expected:
        raise RuntimeError(f"a pass consumed {consumed} samples, expected {expected}; the benchmark is wrong")


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


def machine_info():
    """Describe this machine and the software versions, for the results file."""
    fastdata_file = _origin("fastdata")
    package = os.path.dirname(fastdata_file) if fastdata_file else None
    commit = _git(package, "rev-parse", "HEAD")  # of the checkout fastdata is imported from
    changes = _git(package, "status", "--porcelain", "--untracked-files=no", "--", ".")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_bytes": _ram_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("fastdata", "torch", "numpy", "pillow", "h5py", "pyarrow")},
        "fastdata_file": fastdata_file,
        "fastdata_git_commit": commit,
        "fastdata_git_dirty": None if commit is None else bool(changes),
    }


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _ram_bytes():
    try:
        import psutil

        return psutil.virtual_memory().total
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024  # "MemTotal: N kB"
    except (OSError, ValueError, IndexError):
        return None


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _origin(name):
    spec = importlib.util.find_spec(name)  # where it would be imported from, without importing it
    return spec.origin if spec else None


def _git(folder, *args):
    if folder is None:
        return None
    try:
        done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def markdown_table(headers, rows, align=None):
    """Return a Markdown table; ``align`` is a string of "l"/"r" per column."""
    align = align or "l" * len(headers)
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]

    def line(values):
        padded = [v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(values, widths, align)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line([str(h) for h in headers]), rule, *(line(row) for row in cells)])
