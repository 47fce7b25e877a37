"""The Linux-only kernel calls, made through one libc: page hints, page-cache residency, mapping at an address.

Off Linux ``available()`` is False: hints are no-ops, residency raises
OSError, and nothing is mapped at an address (reads go through plain maps).
See NOTE [read ahead] and NOTE [resident hints] in readahead.py for the
hints, NOTE [stitched rows] in stitch.py for the reserved address range.
"""

import ctypes
import ctypes.util
import mmap
import os
import sys

import numpy as np

from fastdata.errors import OptionError

PAGE = mmap.PAGESIZE
_ADVICE = {"normal": 0, "random": 1}  # MADV_NORMAL, MADV_RANDOM
_HINTS = {"will_need": 3, "done": 20, "drop": 21}  # MADV_WILLNEED, MADV_COLD, MADV_PAGEOUT
_SYS_PROCESS_MADVISE = 440  # the same number on every architecture Linux added it to (5.10)
_IOV_MAX = 1024  # ranges one process_madvise call takes (UIO_MAXIOV)
HINT_PROBES = 8  # ranges of a hint checked with mincore first; see NOTE [resident hints] in readahead.py
_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE = 0, 0x10, 0x4000  # Linux values (x86-64 and arm64)
_RESERVE_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | _MAP_NORESERVE


def _load_libc():
    """Return libc with the calls used here typed, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.syscall.restype = ctypes.c_long
    return libc


_LIBC = _load_libc()
_PIDFD = {}  # pid -> a pidfd of this process, for process_madvise; False where the call is missing
_FAILED = ctypes.c_void_p(-1).value  # what mmap returns on failure


def advise_column(samples: np.ndarray, pattern: str) -> None:
    """Set the access ``pattern`` ("random" or "normal") on the pages of a mapped column ``samples``.

    A no-op off Linux and for an empty column.
    """
    if _LIBC is None or not samples.nbytes:
        return
    start = samples.ctypes.data // PAGE * PAGE
    stop = -(-(samples.ctypes.data + samples.nbytes) // PAGE) * PAGE
    if _LIBC.madvise(start, stop - start, _ADVICE[pattern]):
        raise OSError(ctypes.get_errno(), f"madvise({pattern}) failed on a mapped column")


def hint_spans(starts: np.ndarray, stops: np.ndarray, hint: str = "will_need", give=None) -> bool:
    """Give the kernel a ``hint`` about the mapped bytes at addresses ``[starts, stops)`` (uint64 ``[K]``).

    "will_need": read them now, in the background; skipped when a sample of
    them is all in the page cache already (see NOTE [resident hints]).
    "done": they will not be read again soon; reclaim them before others
    (MADV_COLD). "drop": reclaim them now (MADV_PAGEOUT). Both act on the
    pages this process has mapped and no other (see NOTE [window hints]).
    The ranges are widened to pages and merged first. ``give(call, *args)``
    runs the kernel call (e.g. ``_HintThread.submit``), by default here.
    Returns whether the kernel was asked; a no-op (False) off Linux.
    """
    if _LIBC is None or not len(starts):
        return False
    spans = _page_spans(starts, stops)
    probes = np.linspace(0, len(spans) - 1, min(len(spans), HINT_PROBES)).astype(int)
    if hint == "will_need" and _resident(spans[probes]):
        return False
    if give is None:
        _advise(spans, _HINTS[hint])
    else:
        give(_advise, spans, _HINTS[hint])
    return True


def _advise(spans, advice):
    """Give ``advice`` (an MADV_ value) on the mapped ``spans`` (uint64 ``[K, 2]`` address, length)."""
    pidfd = _pidfd()
    for first in range(0, len(spans), _IOV_MAX):
        chunk = spans[first:first + _IOV_MAX]
        if pidfd is False or _LIBC.syscall(ctypes.c_long(_SYS_PROCESS_MADVISE), ctypes.c_int(pidfd),
                                           ctypes.c_void_p(chunk.ctypes.data), ctypes.c_size_t(len(chunk)),
                                           ctypes.c_int(advice), ctypes.c_uint(0)) < 0:
            for address, length in chunk.tolist():  # an older kernel: one call per range
                _LIBC.madvise(address, length, advice)


def _resident(spans):
    """Return whether every page of the mapped ``spans`` (uint64 ``[K, 2]`` address, length) is in the page cache."""
    vector = np.zeros(int(spans[:, 1].max()) // PAGE, np.uint8)
    for address, length in spans.tolist():
        if _LIBC.mincore(address, length, vector.ctypes.data) or not (vector[:length // PAGE] & 1).all():
            return False
    return True


def _page_spans(starts, stops):
    """Return uint64 ``[K, 2]`` (address, length) of the pages under ``[starts, stops)``, sorted and merged."""
    order = np.argsort(starts, kind="stable")
    first = starts[order] // PAGE * PAGE
    last = (stops[order] + (PAGE - 1)) // PAGE * PAGE
    reach = np.maximum.accumulate(last)
    new = np.ones(len(first), bool)
    new[1:] = first[1:] > reach[:-1]  # a span that starts past every page before it opens a new run
    heads = np.flatnonzero(new)
    ends = np.append(heads[1:], len(first)) - 1
    begin = first[heads]
    return np.ascontiguousarray(np.stack([begin, reach[ends] - begin], axis=1), dtype=np.uint64)


def _pidfd():
    """Return a pidfd of this process for process_madvise, or False where the kernel has none."""
    pid = os.getpid()
    if pid not in _PIDFD:
        try:
            _PIDFD[pid] = os.pidfd_open(pid)
        except (AttributeError, OSError):
            _PIDFD[pid] = False
    return _PIDFD[pid]


def column_spans(samples: np.ndarray, offsets: np.ndarray | None, ranges: np.ndarray):
    """Return the uint64 addresses ``(starts, stops)`` of rows ``[start, stop)`` of a mapped column.

    Args:
        samples: the column: ``[n, ...]`` fixed-size rows, or the flat values of ragged ones.
        offsets: int64 ``[n + 1]`` value offsets of ragged rows, or None.
        ranges: int64 ``[K, 2]`` row ranges of this column.
    """
    base = np.uint64(samples.ctypes.data)
    if offsets is None:
        unit = samples.strides[0] if samples.ndim else samples.itemsize
        bounds = ranges * unit
    else:
        unit = samples.itemsize
        bounds = np.asarray(offsets)[ranges] * unit
    return base + bounds[:, 0].astype(np.uint64), base + bounds[:, 1].astype(np.uint64)


def sharded_spans(ranges: np.ndarray, shard_starts: np.ndarray, columns):
    """Return the uint64 addresses ``(starts, stops)`` of global rows ``[start, stop)`` over shards, each range cut
    at the shards' bounds (``column_spans`` per shard).

    Args:
        ranges: int64 ``[K, 2]`` global row ranges, non-empty and in range.
        shard_starts: int64 ``[S + 1]``: each shard's first global row, then the rows' count.
        columns: called with the shard numbers the ranges touch (ascending), returns each one's mapped
            ``(samples, offsets)`` (see ``column_spans``), in that order.
    """
    first = np.searchsorted(shard_starts, ranges[:, 0], side="right") - 1
    last = np.searchsorted(shard_starts, ranges[:, 1] - 1, side="right") - 1
    if (first != last).any():  # a range over shards: cut it at their starts
        cuts = [[start, *shard_starts[shard + 1 : end + 1].tolist(), stop]
                for (start, stop), shard, end in zip(ranges.tolist(), first.tolist(), last.tolist())]
        ranges = np.array([(a, b) for bounds in cuts for a, b in zip(bounds, bounds[1:])], dtype=np.int64)
        first = np.searchsorted(shard_starts, ranges[:, 0], side="right") - 1
    shards, where = np.unique(first, return_inverse=True)
    spans = [column_spans(samples, offsets, ranges[where == k] - shard_starts[shard])
             for k, (shard, (samples, offsets)) in enumerate(zip(shards.tolist(), columns(shards.tolist())))]
    return np.concatenate([begin for begin, _ in spans]), np.concatenate([end for _, end in spans])


def resident_pages(path: str | os.PathLike) -> np.ndarray:
    """Return bool ``[pages]``: which pages of the file at ``path`` are in the page cache now (mincore).

    Maps the file afresh (nothing is read). Linux only: raises OSError elsewhere.
    """
    size = os.path.getsize(path)
    if _LIBC is None:
        raise OSError("mincore needs Linux")
    if not size:
        return np.zeros(0, bool)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        vector = np.zeros(-(-size // PAGE), np.uint8)
        failed = _LIBC.mincore(view.ctypes.data, size, vector.ctypes.data)
        del view  # the map cannot close while a view exports it
    if failed:
        raise OSError(ctypes.get_errno(), f"mincore failed on {os.fspath(path)!r}")
    return (vector & 1).astype(bool)


def evict(path: str | os.PathLike) -> None:
    """Drop the file's clean pages from the page cache (written back first); pages mapped by a process stay.

    For tests and benchmarks: the next reads come from the disk. A no-op where posix_fadvise is missing.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_pattern(pattern):
    """Raise OptionError unless ``pattern`` is an access pattern ``advise`` takes."""
    if pattern not in _ADVICE:
        raise OptionError(f"pattern should be one of {', '.join(map(repr, _ADVICE))}; got pattern={pattern!r}")


# ---------------------------------------------------------------- maps at an address (NOTE [stitched rows])


def available() -> bool:
    """Whether the kernel calls here can be made (Linux); elsewhere hints are no-ops and nothing is stitched."""
    return _LIBC is not None


def reserve(size: int) -> int | None:
    """Reserve ``size`` bytes of address space (no memory, no access); return its address, or None if refused."""
    base = _LIBC.mmap(None, size, _PROT_NONE, _RESERVE_FLAGS, -1, 0)
    return None if base in (None, _FAILED) else base


def release(address: int, size: int) -> None:
    """Give back an address range that ``reserve`` returned."""
    _LIBC.munmap(address, size)


def map_file_at(address: int, length: int, fd: int, offset: int) -> bool:
    """Map ``length`` bytes of file ``fd`` from ``offset`` (a page multiple), read-only, at ``address`` of a reserve."""
    return _LIBC.mmap(address, length, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, offset) == address


def memory_at(address: int, length: int) -> bool:
    """Put fresh writable memory at ``address`` of a reserve (``length`` bytes); return whether the kernel gave it."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    return _LIBC.mmap(address, length, prot, _RESERVE_FLAGS | _MAP_FIXED, -1, 0) == address


def unmap_at(address: int, length: int) -> None:
    """Return ``length`` bytes at ``address`` of a reserve to reserved space (what was mapped there goes)."""
    _LIBC.mmap(address, length, _PROT_NONE, _RESERVE_FLAGS | _MAP_FIXED, -1, 0)
