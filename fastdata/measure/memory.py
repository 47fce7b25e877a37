"""Memory of processes: what a loader's workers cost (USS, PSS, private dirty), read from /proc or psutil."""

import os
import statistics

from fastdata._optional import optional

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
MEMORY_KEYS = ("uss", "pss", "rss", "private_dirty")
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
    from fastdata.loading import workers  # torch is loaded already: ``loader`` is a DataLoader

    return workers.worker_pids(loader)


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

    def growth(self, keys=MEMORY_KEYS):
        """Return ``memory_growth`` over ``keys`` of the processes still running, over the timed passes."""
        return memory_growth(self._before or [], memory_snapshot(self._pids, self._keys), keys)


def memory_growth(before, after, keys=MEMORY_KEYS):
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
