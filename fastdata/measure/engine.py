"""Measure loading throughput: the engine behind `fastdata bench`, `fastdata tune` and benchmarks/.

NOTE [whole epochs]: a loader is built once and measured over whole epochs:
one untimed warm-up epoch (worker start-up, file opening, cold pages), then
``repeats`` timed passes, each repeating epochs until it lasts
``min_seconds``; the rate is the median pass. Every epoch must yield as many
samples as the first (and ``expected`` where given), so a loader that drops
or repeats batches fails instead of looking fast.

Only the standard library, numpy and Pillow are imported at the top (torch,
h5py and the converters on first use), so benchmark scripts importing this
stay light (see NOTE [light main] in benchmarks/images.py).
"""

import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata

from fastdata._cpu import usable_cpus
from fastdata._optional import optional

# ---------------------------------------------------------------- measuring


@dataclass
class Rate:
    """Throughput of one benchmarked method: the median of timed passes.

    Attributes:
        samples_per_s: median over passes of samples consumed / wall seconds.
        pass_rates: samples/s of each timed pass, in run order.
        samples_per_pass: samples consumed by one timed pass.
        epochs_per_pass: epochs (full iterations) in one timed pass.
        warmup_seconds: wall time of the untimed warm-up epoch.
        worker_memory: with ``measure_loader(memory=True)``: ``memory_growth`` of the workers.
    """

    samples_per_s: float
    pass_rates: list = field(default_factory=list)
    samples_per_pass: int = 0
    epochs_per_pass: int = 1
    warmup_seconds: float = 0.0
    worker_memory: dict | None = None

    def to_dict(self):
        return asdict(self)


def measure_rate(run_epoch, repeats, *, min_seconds=0.2, max_seconds=None):
    """Time ``run_epoch`` (which returns the number of samples it consumed); see NOTE [whole epochs].

    Args:
        run_epoch: callable running one full epoch; returns samples consumed.
        repeats: timed passes (at least 1).
        min_seconds: target duration of one timed pass.
        max_seconds: take no further pass once this long has gone since the
            start (the warm-up included); at least one pass is always taken.

    Returns:
        Rate.

    Raises:
        RuntimeError: an epoch consumed a different number of samples.
    """
    started = time.perf_counter()
    expected = run_epoch()
    warmup = time.perf_counter() - started
    epoch_seconds = warmup
    if warmup < min_seconds:  # the warm-up may include start-up costs; time a steady epoch
        began = time.perf_counter()
        check_count(run_epoch(), expected)
        epoch_seconds = time.perf_counter() - began
    epochs = max(1, math.ceil(min_seconds / max(epoch_seconds, 1e-9)))
    rates = []
    for _ in range(max(1, repeats)):
        began = time.perf_counter()
        consumed = sum(run_epoch() for _ in range(epochs))
        seconds = time.perf_counter() - began
        check_count(consumed, expected * epochs)
        rates.append(consumed / seconds)
        if max_seconds is not None and time.perf_counter() - started >= max_seconds:
            break
    return Rate(statistics.median(rates), rates, expected * epochs, epochs, warmup)


def check_count(consumed, expected):
    """Raise RuntimeError unless a pass consumed exactly ``expected`` samples."""
    if consumed != expected:
        raise RuntimeError(f"a pass consumed {consumed} samples, expected {expected}; the benchmark is wrong")


def measure_loader(make_iterable, *, repeats=3, min_seconds=0.2, max_seconds=None, expected=None, memory=False):
    """Build a loader with ``make_iterable()`` and measure it over whole epochs (see NOTE [whole epochs]).

    Args:
        make_iterable: returns the loader: an iterable of batches whose first
            element is a tensor ``[B, ...]`` (a tensor batch works too).
        repeats, min_seconds, max_seconds: as for ``measure_rate``.
        expected: samples one epoch must yield.
        memory: also record how each worker process's memory grew over the
            timed passes in ``Rate.worker_memory`` (persistent workers only).

    Returns:
        Rate. The loader's persistent workers are stopped before returning.

    Example:
        >>> rate = measure_loader(lambda: make_loader(dataset, 256, shuffle=True), expected=len(dataset))
    """
    loader = make_iterable()
    snapshots = []

    def run_epoch():
        count = consume(loader)
        if memory and not snapshots:  # the warm-up epoch is over: every worker is up
            snapshots.append(worker_memory(loader))
        return count

    try:
        rate = measure_rate(run_epoch, repeats, min_seconds=min_seconds, max_seconds=max_seconds)
        if memory:
            rate.worker_memory = memory_growth(snapshots[0], worker_memory(loader))
    finally:
        close_loader(loader)
    if expected is not None and rate.samples_per_pass != expected * rate.epochs_per_pass:
        epoch = rate.samples_per_pass // rate.epochs_per_pass
        raise RuntimeError(f"an epoch gave {epoch} samples, expected {expected}; the loader is wrong")
    return rate


def consume(loader):
    """Iterate one epoch as a training loop does, touching every batch; return the samples seen.

    Each batch stays alive until the next one arrives, as in ``for images, labels in loader``.
    """
    count = 0
    for batch in loader:
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        count += len(first)
        touch(first)
    return count


def touch(tensor):
    """Read the last element of ``tensor``, as a step that uses the batch would; copy nothing.

    (``tensor.reshape(-1)`` would copy a whole channels_last JPEG batch.)
    """
    return int(tensor[(-1,) * tensor.dim()])


def close_loader(loader):
    """Stop a DataLoader's persistent workers now rather than at some later garbage collection."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None


# ---------------------------------------------------------------- memory per worker


_SMAPS_FIELDS = {"Rss": "rss", "Pss": "pss", "Private_Clean": "private_clean", "Private_Dirty": "private_dirty"}
_MEMORY_KEYS = ("uss", "pss", "rss", "private_dirty")


def process_memory(pid):
    """Return the memory of process ``pid`` in bytes, or None where it cannot be read.

    Keys: ``uss`` (pages only this process maps), ``pss`` (each shared page
    split among the processes mapping it), ``rss`` and ``private_dirty``:
    the private pages it wrote (copy-on-write copies, allocations), what a
    worker really costs; its private clean pages are page cache of memory-
    mapped files, dropped under pressure. Read from ``/proc/<pid>/smaps_rollup``
    (Linux 4.14+), else with psutil (``private_dirty`` None).
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()[1:]  # the first line names the address range
    except OSError:
        return _psutil_memory(pid)
    found = dict.fromkeys(_SMAPS_FIELDS.values())
    for line in lines:
        name, _, rest = line.partition(":")
        if name in _SMAPS_FIELDS:
            found[_SMAPS_FIELDS[name]] = int(rest.split()[0]) * 1024  # "Rss:  1764 kB"
    clean, dirty = found.pop("private_clean"), found["private_dirty"]
    return {"uss": None if None in (clean, dirty) else clean + dirty, **found}


def _psutil_memory(pid):
    psutil = optional("psutil")
    if psutil is None:
        return None
    try:
        info = psutil.Process(pid).memory_full_info()
    except (psutil.Error, OSError):
        return None
    return {"uss": info.uss, "pss": getattr(info, "pss", None), "rss": info.rss, "private_dirty": None}


def worker_pids(loader):
    """Return the pids of a DataLoader's live worker processes (persistent workers only, else [])."""
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None) or []
    return [worker.pid for worker in workers if worker.is_alive()]


def worker_memory(loader):
    """Return ``[{"pid", "uss", "pss", "rss", "private_dirty"}]`` of each live worker of ``loader`` (bytes)."""
    unknown = dict.fromkeys(_MEMORY_KEYS)
    return [{"pid": pid, **(process_memory(pid) or unknown)} for pid in worker_pids(loader)]


def memory_growth(before, after):
    """Compare two ``worker_memory`` snapshots of the same workers.

    Returns:
        dict: ``workers``, per worker its ``pid``, the ``after`` values and
        their growth (``uss_growth``, ...); and the mean over workers of each
        value and growth (``mean_uss``, ``mean_uss_growth``, ...; None where
        unknown or with no workers).
    """
    start = {entry["pid"]: entry for entry in before}
    workers = []
    for entry in after:
        first = start.get(entry["pid"], {})
        workers.append({**entry, **{f"{k}_growth": _minus(entry[k], first.get(k)) for k in _MEMORY_KEYS}})
    keys = [*_MEMORY_KEYS, *(f"{key}_growth" for key in _MEMORY_KEYS)]
    return {"workers": workers, **{f"mean_{key}": _mean(w[key] for w in workers) for key in keys}}


def _minus(a, b):
    return None if a is None or b is None else a - b


def _mean(values):
    values = list(values)
    return None if not values or None in values else statistics.fmean(values)


# ---------------------------------------------------------------- the machine


def available_memory():
    """Return the bytes of memory available to new allocations, or None where unknown."""
    psutil = optional("psutil")
    if psutil is not None:
        return psutil.virtual_memory().available
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def describe_machine():
    """Describe this machine and the software versions, for a results file."""
    fastdata_file = _origin("fastdata")
    package = os.path.dirname(fastdata_file) if fastdata_file else None
    commit = _git(package, "rev-parse", "HEAD")  # of the checkout fastdata is imported from
    changes = _git(package, "status", "--porcelain", "--untracked-files=no", "--", ".")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
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
    psutil = optional("psutil")
    if psutil is not None:
        return psutil.virtual_memory().total
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


# ---------------------------------------------------------------- reporting


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


def write_json(data, path):
    """Write ``data`` as indented JSON to ``path`` (replacing it); return ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return os.fspath(path)
