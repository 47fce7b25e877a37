"""What the operating system says: per-process memory, worker processes, page-cache residency.

NOTE [worker memory]: a worker's USS (private pages) grows for two
different reasons. Copy-on-write copies of the parent's heap (Python
objects whose reference counts the worker touches) and new allocations are
private *dirty* pages: memory the worker really costs. Pages of a memory-
mapped file that only this worker has touched are private *clean* pages:
the page cache, shared with the kernel, dropped under memory pressure at no
cost. So each reading records USS and PSS as usual, and also private dirty
(``Private_Dirty`` of /proc/PID/smaps_rollup) and the file-backed share of
PSS; the memory bars use private dirty growth, and the tables show both.

Only the standard library is imported at module level; psutil on first use.
"""

import ctypes
import mmap
import os
import subprocess

_FIELDS = {  # smaps_rollup line -> key
    "Rss": "rss",
    "Pss": "pss",
    "Pss_Anon": "pss_anon",
    "Pss_File": "pss_file",
    "Pss_Shmem": "pss_shmem",
    "Private_Clean": "private_clean",
    "Private_Dirty": "private_dirty",
    "Swap": "swap",
}
_HELPERS = ("resource_tracker", "forkserver")  # multiprocessing's own processes, not workers


def memory_of(pid):
    """Return the memory of process ``pid`` in bytes (see NOTE [worker memory]), or None if it is gone.

    Keys: rss, pss, pss_anon, pss_file, pss_shmem, private_clean,
    private_dirty, swap and uss (private clean + private dirty).
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()
    except OSError:
        return _memory_psutil(pid)
    found = {}
    for line in lines[1:]:
        name, _, rest = line.partition(":")
        if name in _FIELDS:
            found[_FIELDS[name]] = int(rest.split()[0]) * 1024  # "Rss:  1764 kB"
    found["uss"] = found.get("private_clean", 0) + found.get("private_dirty", 0)
    return found


def _memory_psutil(pid):
    try:
        import psutil

        info = psutil.Process(pid).memory_full_info()
    except Exception:  # no psutil, process gone, or not allowed
        return None
    return {"rss": info.rss, "pss": getattr(info, "pss", None), "uss": info.uss, "swap": getattr(info, "swap", None)}


def child_pids():
    """Return the pids of this process's direct children, leaving out multiprocessing's helpers."""
    try:
        import psutil
    except ImportError:
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


def worker_pids(loader):
    """Return the pids of a DataLoader's live worker processes (persistent workers), or of all children."""
    iterator = getattr(loader, "_iterator", None)
    workers = getattr(iterator, "_workers", None)
    if workers:
        return [worker.pid for worker in workers if worker.is_alive()]
    return child_pids()


def memory_of_all(pids):
    """Return ``[memory_of(pid), ...]`` for the pids still alive."""
    readings = [memory_of(pid) for pid in pids]
    return [reading for reading in readings if reading is not None]


class WorkerMemoryProbe:
    """Read worker memory after the first call of an epoch function and at the end.

    ``wrap(run_epoch)`` returns an epoch function for measure_rate; the first
    epoch (the warm-up, which starts persistent workers) is followed by a
    reading of every child process, and ``report()`` reads them again.
    """

    def __init__(self):
        self._pids, self._start = None, None

    def wrap(self, run_epoch):
        def epoch():
            count = run_epoch()
            if self._pids is None:
                self._pids = child_pids()
                self._start = {pid: memory_of(pid) for pid in self._pids}
            return count

        return epoch

    def report(self):
        """Return ``{"workers": n, "per_worker": [{pid, uss, pss, private_dirty, growth...}], "main": {...}}``."""
        per_worker = []
        for pid in self._pids or []:
            start, end = self._start.get(pid), memory_of(pid)
            if start is None or end is None:
                continue
            growth = {f"{key}_growth": end[key] - start[key] for key in ("uss", "pss", "private_dirty") if key in end}
            per_worker.append({"pid": pid, **end, **growth})
        return {"workers": len(per_worker), "per_worker": per_worker, "main": memory_of(os.getpid())}


def cuda_device():
    """Return the name of the CUDA device torch sees, or None (imports torch: call it in a fresh process)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


# ---------------------------------------------------------------- page cache


def page_residency(path):
    """Return the fraction of ``path``'s pages in the page cache (mincore), or None where it cannot tell."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        return _mincore_fraction(path, size)
    except (OSError, AttributeError, ValueError):
        return _fincore_fraction(path, size)


def _mincore_fraction(path, size):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        first = ctypes.c_char.from_buffer(mapped)  # private (copy-on-write) so ctypes may view it; never written
        try:
            failed = libc.mincore(ctypes.addressof(first), size, vector) != 0
        finally:
            del first  # release the buffer before the mapping closes
    if failed:
        raise OSError(ctypes.get_errno(), f"mincore failed on {path!r}")
    return sum(byte & 1 for byte in bytes(vector)) / pages


def _fincore_fraction(path, size):
    try:
        done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path],
                              capture_output=True, text=True, timeout=10, check=True)
        return int(done.stdout.split()[0]) / size
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def drop_from_page_cache(paths):
    """Try to evict ``paths`` from the page cache; return how (a dict for the results file).

    First ``posix_fadvise(DONTNEED)`` on each file after an fsync (works
    without privileges for clean pages of files no process maps); where
    pages stay resident, writing 1 to /proc/sys/vm/drop_caches (root only,
    and it empties the page cache of the whole machine). Residency is
    checked with mincore before and after.

    Returns:
        ``{"method": "fadvise" | "drop_caches" | None, "resident_before": f,
        "resident_after": f, "notes": [...]}``; ``method`` None means the
        pages could not be dropped and a "cold" figure would be warm.
    """
    before = _mean_residency(paths)
    notes = []
    for path in paths:
        _fadvise_dontneed(path, notes)
    after, method = _mean_residency(paths), "fadvise"
    if after is None or after > 0.01:
        method = _drop_caches(notes)
        after = _mean_residency(paths)
    if after is None:
        notes.append("page residency could not be read (no mincore or fincore): the drop is unchecked")
    elif after > 0.01:
        method = None
        notes.append(f"{after:.0%} of the pages stayed in the page cache: first epochs are not cold")
    return {"method": method, "resident_before": before, "resident_after": after, "notes": notes}


def _fadvise_dontneed(path, notes):
    if not hasattr(os, "posix_fadvise"):
        notes.append("os.posix_fadvise is not available on this platform")
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as exc:
        notes.append(f"posix_fadvise failed on {path!r}: {exc}")
    finally:
        os.close(fd)


def _drop_caches(notes):
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        notes.append("posix_fadvise left pages resident; wrote 1 to /proc/sys/vm/drop_caches")
        return "drop_caches"
    except OSError as exc:
        notes.append(f"writing /proc/sys/vm/drop_caches was refused: {exc}")
        return None


def _mean_residency(paths):
    """Return the resident fraction of all bytes of ``paths`` together, or None."""
    total = resident = 0
    for path in paths:
        fraction, size = page_residency(path), os.path.getsize(path)
        if fraction is None:
            return None
        total, resident = total + size, resident + fraction * size
    return resident / total if total else 1.0
