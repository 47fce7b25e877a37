"""The machine around a run: other processes' CPU use, the CUDA device, the page cache.

Only the standard library is imported at module level (psutil and torch on
first use, see NOTE [light main] in sections/images.py). Process memory is read by
fastdata.measure.memory (see NOTE [worker memory] there).
"""

import os
import socket
import subprocess
import sys
import time

BUSY_PERCENT = 15.0  # CPU use by other processes above which figures are low and noisy


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


def wait_until_quiet(max_seconds, threshold=BUSY_PERCENT):
    """Wait up to ``max_seconds`` for CPU use below ``threshold`` percent; return the last reading."""
    deadline = time.monotonic() + max_seconds
    busy = busy_percent()
    while busy is not None and busy >= threshold and time.monotonic() < deadline:
        busy = busy_percent(2.0)
    return busy


def warn_if_busy(busy, when):
    """Print a warning when other processes used the CPUs ``when`` (e.g. "before the run")."""
    if busy is not None and busy >= BUSY_PERCENT:
        print(f"WARNING: other processes used {busy:.0f}% of the CPUs {when}; figures will be low and noisy "
              "(see --wait-quiet)", file=sys.stderr, flush=True)


def cuda_device():
    """Return the name of the CUDA device torch sees, or None (imports torch: call it in a fresh process)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


# ---------------------------------------------------------------- page cache


def page_residency(path):
    """Return the fraction of ``path``'s pages in the page cache (mincore), or None where it cannot tell."""
    from fastdata.reading.kernel import resident_pages

    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        return float(resident_pages(path).mean())
    except OSError:
        return _fincore_fraction(path, size)


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


def free_port():
    """Return a TCP port on 127.0.0.1 that nothing listens on now (for a gloo group's MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
