"""Measure loading throughput: the engine behind `fastdata bench`, `fastdata tune` and benchmarks/.

NOTE [whole epochs]: a loader is built once and measured over whole epochs:
one untimed warm-up epoch (worker start-up, file opening, cold pages), then
``repeats`` timed passes, each repeating epochs until it lasts
``min_seconds``; the rate is the median pass. Every epoch must yield as many
samples as the first (and ``expected`` where given), so a loader that drops
or repeats batches fails instead of looking fast.

Only the standard library, numpy and Pillow are imported at the top (torch,
h5py and the converters on first use), so benchmark scripts importing this
stay light (see NOTE [light main] in benchmarks/sections/images.py).
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


def measure_rate(run_epoch, repeats, *, min_seconds=0.2, max_seconds=None, expected=None):
    """Time ``run_epoch`` (which returns the number of samples it consumed); see NOTE [whole epochs].

    Args:
        run_epoch: callable running one full epoch; returns samples consumed.
        repeats: timed passes (at least 1).
        min_seconds: target duration of one timed pass.
        max_seconds: take no further pass once this long has gone since the
            start (the warm-up included); at least one pass is always taken.
        expected: samples one epoch must yield.

    Returns:
        Rate.

    Raises:
        RuntimeError: an epoch consumed a different number of samples (than the first, or ``expected``).
    """
    started = time.perf_counter()
    per_epoch = run_epoch()
    warmup = time.perf_counter() - started
    if expected is not None and per_epoch != expected:
        raise RuntimeError(f"an epoch gave {per_epoch} samples, expected {expected}; the loader is wrong")
    epochs = _epochs_per_pass(run_epoch, per_epoch, min_seconds, warmup)
    rates = []
    for _ in range(max(1, repeats)):
        rates.append(_timed_pass(run_epoch, epochs, per_epoch))
        if max_seconds is not None and time.perf_counter() - started >= max_seconds:
            break
    return Rate(statistics.median(rates), rates, per_epoch * epochs, epochs, warmup)


def interleaved_rates(run_epochs, rounds, min_seconds):
    """Time ``run_epochs`` (name -> epoch function) in turn, ``rounds`` times; return name -> samples/s per round.

    NOTE [interleaved rates]: this VM's speed drifts by up to a third over
    seconds (the same loader measured 75k and 110k img/s a few seconds
    apart, in one process), so two rates measured minutes apart give a
    ratio that is mostly drift. Passes of each method taken in turn, a
    fraction of a second each, see the same machine; the ratio of a round's
    rates is then the comparison. Each method is warmed up once first.
    """
    passes = {}
    for name, run_epoch in run_epochs.items():
        per_epoch = run_epoch()  # warm-up
        passes[name] = (_epochs_per_pass(run_epoch, per_epoch, min_seconds, warmup=0.0), per_epoch)
    rates = {name: [] for name in run_epochs}
    for _ in range(rounds):
        for name, run_epoch in run_epochs.items():
            rates[name].append(_timed_pass(run_epoch, *passes[name]))
    return rates


def _epochs_per_pass(run_epoch, per_epoch, min_seconds, warmup):
    """Return how many epochs make a pass of ``min_seconds``, timing a steady epoch unless the warm-up was long."""
    seconds = warmup
    if warmup < min_seconds:  # the warm-up may include start-up costs; time a steady epoch
        began = time.perf_counter()
        check_count(run_epoch(), per_epoch)
        seconds = time.perf_counter() - began
    return max(1, math.ceil(min_seconds / max(seconds, 1e-9)))


def _timed_pass(run_epoch, epochs, per_epoch):
    """Run ``epochs`` epochs; return their samples/s, checking that each pass consumed ``per_epoch`` per epoch."""
    began = time.perf_counter()
    consumed = sum(run_epoch() for _ in range(epochs))
    seconds = time.perf_counter() - began
    check_count(consumed, per_epoch * epochs)
    return consumed / seconds


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
    probe = MemoryProbe(lambda: worker_pids(loader), _MEMORY_KEYS)
    run_epoch = probe.wrap(lambda: consume(loader)) if memory else lambda: consume(loader)
    try:
        rate = measure_rate(run_epoch, repeats, min_seconds=min_seconds, max_seconds=max_seconds, expected=expected)
        if memory:
            rate.worker_memory = probe.growth()
    finally:
        close_loader(loader)
    return rate


def consume(loader, key=None):
    """Iterate one epoch as a training loop does, touching every batch; return the samples seen.

    Each batch stays alive until the next one arrives, as in ``for images, labels in loader``.
    The samples are ``batch[key]`` where ``key`` is given (a dict batch), else the first tensor.
    """
    count = 0
    for batch in loader:
        first = batch[key] if key is not None else batch[0] if isinstance(batch, (tuple, list)) else batch
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
    from fastdata.loading.loader import close_workers  # torch is loaded already: ``loader`` is a DataLoader

    close_workers(loader)


# ---------------------------------------------------------------- memory per worker

# NOTE [worker memory]: a worker's USS (private pages) grows for two
# different reasons. Copy-on-write copies of the parent's heap (Python
# objects whose reference counts the worker touches) and new allocations are
# private *dirty* pages: memory the worker really costs. Pages of a memory-
# mapped file that only this worker has touched are private *clean* pages:
# the page cache, shared with the kernel, dropped under memory pressure at no
# cost. So a reading records USS and PSS as usual, and also private dirty
# (``Private_Dirty`` of /proc/PID/smaps_rollup) and the file-backed share of
# PSS (``pss_file``).

_SMAPS_FIELDS = {  # smaps_rollup line -> key
    "Rss": "rss",
    "Pss": "pss",
    "Pss_Anon": "pss_anon",
    "Pss_File": "pss_file",
    "Pss_Shmem": "pss_shmem",
    "Private_Clean": "private_clean",
    "Private_Dirty": "private_dirty",
    "Swap": "swap",
}
_MEMORY_KEYS = ("uss", "pss", "rss", "private_dirty")
_HELPERS = ("resource_tracker", "forkserver")  # multiprocessing's own processes, not workers


def process_memory(pid):
    """Return the memory of process ``pid`` in bytes (see NOTE [worker memory]), or None where it cannot be read.

    Keys: ``uss`` (pages only this process maps: private clean + private
    dirty), ``pss`` (each shared page split among the processes mapping it),
    ``rss``, ``private_dirty`` (the pages it wrote: what a worker really
    costs), and where the kernel gives them ``private_clean``, ``pss_anon``,
    ``pss_file``, ``pss_shmem`` and ``swap``. Read from
    ``/proc/<pid>/smaps_rollup`` (Linux 4.14+), else with psutil
    (``private_dirty`` None).
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()[1:]  # the first line names the address range
    except OSError:
        return _psutil_memory(pid)
    found = dict.fromkeys(("rss", "pss", "private_clean", "private_dirty"))
    for line in lines:
        name, _, rest = line.partition(":")
        if name in _SMAPS_FIELDS:
            found[_SMAPS_FIELDS[name]] = int(rest.split()[0]) * 1024  # "Rss:  1764 kB"
    clean, dirty = found["private_clean"], found["private_dirty"]
    return {**found, "uss": None if None in (clean, dirty) else clean + dirty}


def _psutil_memory(pid):
    psutil = optional("psutil")
    if psutil is None:
        return None
    try:
        info = psutil.Process(pid).memory_full_info()
    except (psutil.Error, OSError):
        return None
    return {"uss": info.uss, "pss": getattr(info, "pss", None), "rss": info.rss, "private_dirty": None,
            "swap": getattr(info, "swap", None)}


def worker_pids(loader):
    """Return the pids of a DataLoader's live worker processes (persistent workers only, else [])."""
    from fastdata.loading import loader as loading  # torch is loaded already: ``loader`` is a DataLoader

    return loading.worker_pids(loader)


def child_pids():
    """Return the pids of this process's direct children, leaving out multiprocessing's helpers."""
    psutil = optional("psutil")
    if psutil is None:
        return _child_pids_proc()
    pids = []
    for child in psutil.Process().children():
        try:
            if not any(helper in " ".join(child.cmdline()) for helper in _HELPERS):
                pids.append(child.pid)
        except psutil.Error:
            continue
    return pids


def _child_pids_proc():
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4, after "(comm)"
            except (OSError, ValueError, IndexError):
                continue
            if parent == me:
                pids.append(int(entry))
    return pids


def memory_snapshot(pids, keys=None):
    """Return ``[{"pid", **process_memory(pid)}]`` of the processes of ``pids`` that can be read (only ``keys``)."""
    snapshot = []
    for pid in pids:
        reading = process_memory(pid)
        if reading is not None:  # else gone, or unreadable
            snapshot.append({"pid": pid, **(reading if keys is None else {key: reading.get(key) for key in keys})})
    return snapshot


class MemoryProbe:
    """Read the memory of some processes after the warm-up epoch of ``wrap``'s function, and again at the end.

    ``wrap(run_epoch)`` returns an epoch function for ``measure_rate`` whose
    first call (the warm-up, which starts persistent workers) is followed by
    a reading of the processes ``pids()`` names; ``growth()`` reads the same
    processes again and compares (see NOTE [worker memory]).

    Args:
        pids: returns the pids to read; by default this process's children
            (for epoch functions that hide their loader, or start processes
            of their own).
        keys: the keys kept of each reading (all where None).
    """

    def __init__(self, pids=None, keys=None):
        self._find, self._keys = pids or child_pids, keys
        self._pids, self._before = [], None

    def wrap(self, run_epoch):
        def epoch():
            count = run_epoch()
            if self._before is None:  # the warm-up epoch is over: every worker is up
                self._pids = self._find()
                self._before = memory_snapshot(self._pids, self._keys)
            return count

        return epoch

    def growth(self, keys=_MEMORY_KEYS):
        """Return ``memory_growth`` over ``keys`` of the processes still running, over the timed passes."""
        return memory_growth(self._before or [], memory_snapshot(self._pids, self._keys), keys)


def memory_growth(before, after, keys=_MEMORY_KEYS):
    """Compare two ``memory_snapshot`` readings of the same processes over ``keys``.

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
        workers.append({**entry, **{f"{k}_growth": _minus(entry.get(k), first.get(k)) for k in keys}})
    keys = [*keys, *(f"{key}_growth" for key in keys)]
    return {"workers": workers, **{f"mean_{key}": _mean(w.get(key) for w in workers) for key in keys}}


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


_VERSIONS = ("fastdata", "torch", "numpy", "pillow", "h5py", "pyarrow")


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
        "versions": {name: installed_version(name) for name in _VERSIONS},
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


def installed_version(name):
    """Return the installed version of package ``name``, or None."""
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


@dataclass
class Row:
    """One measured method: its key, what it is, its workers as shown, and how to build it.

    ``build`` is the caller's: a loader factory in `fastdata bench`, a
    module-level factory of epoch functions called with ``options`` in
    benchmarks/ (rows travel to fresh processes there). ``kind`` groups rows
    a caller treats alike.
    """

    key: str
    method: str
    workers: str  # as shown: "0 (defaults)", "2 (persistent)", "2 threads"
    build: object = None
    options: dict = field(default_factory=dict)
    kind: str = ""
    memory: bool = False  # record the memory of the worker processes
    limit: bool = False  # a limit row (see limits.py), not a loader

    def result(self, rate, **more):
        """Return this row's line of results: key, method, workers, ``more``, then the Rate's fields."""
        return {"key": self.key, "method": self.method, "workers": self.workers, **more, **rate.to_dict()}


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
