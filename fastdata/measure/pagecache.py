"""The page cache and the disk under a measurement: a memory cgroup bounding the cache, disk counters, disk limits.

NOTE [bounded page cache]: a dataset is "bigger than the page cache" when
the cache a reader may fill is smaller than the data, not only when the file
is bigger than RAM. A cgroup v1 memory controller charges the page cache a
process faults in to the process's group, and reclaims within the group at
its ``memory.limit_in_bytes``: a reader in a group of 2 GB on a machine of
24 GB sees a 2 GB page cache, whatever else the machine holds. Pages cached
before (charged to another group) stay where they are, so the files are
evicted first (``posix_fadvise(DONTNEED)``). Bytes read from the disk come
from the device's line in ``/proc/diskstats`` (every process, the workers
included; other processes' reads too, so the figure is an upper bound) and
from ``/proc/<pid>/io`` ``read_bytes`` (the process and its threads only).
"""

import os
import subprocess
import threading
import time

import numpy as np

from fastdata.errors import FastdataError

CGROUP_MEMORY = "/sys/fs/cgroup/memory"
_SECTOR = 512  # /proc/diskstats counts 512-byte sectors whatever the device's block size
_READ_BLOCK = 4 << 20  # sequential reads: bytes per read call
RANDOM_READ_THREADS = 32  # random reads in flight: the depth at which this machine's disk serves the most


class CgroupError(FastdataError, OSError):
    """A memory cgroup could not be made or used."""


def cgroup_problem(root=CGROUP_MEMORY):
    """Return why a memory cgroup cannot be made here (a sentence), or None when it can."""
    if not os.path.isfile(os.path.join(root, "memory.limit_in_bytes")):
        return f"no cgroup v1 memory controller at {root!r}"
    parent = _own_group(root)
    if not os.access(parent, os.W_OK):
        return f"{parent!r} is not writable (run as root to bound the page cache)"
    return None


def _own_group(root):
    """Return the folder of this process's memory cgroup under ``root``."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return os.path.join(root, path.lstrip("/"))
    return root


class MemoryCgroup:
    """A child of this process's memory cgroup with ``limit_bytes`` of memory, page cache included.

    See NOTE [bounded page cache]. Use as a context manager: on exit its
    processes go back to the parent group and the group is removed.

    Args:
        limit_bytes: ``memory.limit_in_bytes``: RSS plus page cache of its processes.
        name: the group's folder name; default ``fastdata-<pid>``.
        root: where the memory controller is mounted.

    Raises:
        CgroupError: the group cannot be made (no controller, not root).
    """

    def __init__(self, limit_bytes, name=None, root=CGROUP_MEMORY):
        problem = cgroup_problem(root)
        if problem:
            raise CgroupError(f"cannot bound the page cache: {problem}")
        self.parent = _own_group(root)
        self.path = os.path.join(self.parent, name or f"fastdata-{os.getpid()}")
        self.limit_bytes = int(limit_bytes)
        try:
            os.makedirs(self.path, exist_ok=True)
            self._write("memory.limit_in_bytes", self.limit_bytes)
        except OSError as exc:
            raise CgroupError(f"cannot make the memory cgroup {self.path!r}: {exc}") from exc

    def _write(self, name, value, folder=None):
        with open(os.path.join(folder or self.path, name), "w") as f:
            f.write(f"{value}\n")

    def add(self, pid):
        """Move process ``pid`` (and its threads) into the group; its children are born in it."""
        self._write("cgroup.procs", pid)

    def pids(self):
        """Return the ids of the processes in the group."""
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]

    def stat(self):
        """Return ``memory.stat`` as a dict of ints, with ``usage``, ``max_usage``, ``limit`` and ``failcnt``."""
        with open(os.path.join(self.path, "memory.stat")) as f:
            found = {name: int(value) for name, value in (line.split() for line in f)}
        for key, name in (("usage", "usage_in_bytes"), ("max_usage", "max_usage_in_bytes"),
                          ("limit", "limit_in_bytes"), ("failcnt", "failcnt")):
            with open(os.path.join(self.path, f"memory.{name}")) as f:
                found[key] = int(f.read())
        return found

    def run(self, argv, timeout=None, **kwargs):
        """Run ``argv`` inside the group (it joins before exec); return the CompletedProcess, output as text."""
        procs = os.path.join(self.path, "cgroup.procs")

        def join():  # in the child, before exec: nothing it does is charged elsewhere
            with open(procs, "w") as f:
                f.write(f"{os.getpid()}\n")

        return subprocess.run(argv, preexec_fn=join, capture_output=True, text=True, timeout=timeout, **kwargs)

    def close(self):
        """Move any process left back to the parent group and remove the group (its charges go to the parent)."""
        if not os.path.isdir(self.path):
            return
        for pid in self.pids():
            try:
                self._write("cgroup.procs", pid, self.parent)
            except OSError:  # it ended meanwhile
                pass
        for _ in range(50):  # rmdir fails while the kernel still counts an exiting task
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)
        raise CgroupError(f"cannot remove the memory cgroup {self.path!r}; remove it by hand (rmdir)")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def device_of(path):
    """Return the name of the block device that holds ``path``, as /proc/diskstats lists it, or None."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    for fields in _diskstats():
        if (int(fields[0]), int(fields[1])) == (major, minor):
            return fields[2]
    return None


def disk_read_bytes(device):
    """Return the bytes read from ``device`` since boot (sectors read in /proc/diskstats, times 512)."""
    for fields in _diskstats():
        if fields[2] == device:
            return int(fields[5]) * _SECTOR
    raise CgroupError(f"no device {device!r} in /proc/diskstats")


def _diskstats():
    with open("/proc/diskstats") as f:
        return [line.split() for line in f]


def process_read_bytes(pid="self"):
    """Return ``read_bytes`` of /proc/<pid>/io: what the process (all its threads) had fetched from storage."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == "read_bytes":
                return int(value)
    raise CgroupError(f"/proc/{pid}/io has no read_bytes")


class ReadCounter:
    """Bytes read from a file's disk between ``start()`` and ``stop()``: device-wide and by this process."""

    def __init__(self, path):
        self.device = device_of(path)
        if self.device is None:
            raise CgroupError(f"the device holding {path!r} is not in /proc/diskstats")
        self.disk_bytes = self.process_bytes = 0

    def start(self):
        self._disk, self._process = disk_read_bytes(self.device), process_read_bytes()
        return self

    def stop(self):
        """Return ``(disk_bytes, process_bytes)`` read since ``start()``."""
        self.disk_bytes = disk_read_bytes(self.device) - self._disk
        self.process_bytes = process_read_bytes() - self._process
        return self.disk_bytes, self.process_bytes


def sequential_read(paths, max_bytes=None, max_seconds=None):
    """Read ``paths`` in order, 4 MiB per call, into one buffer; return ``(bytes, seconds)``.

    The rate at which the disk gives these files, when they are not cached:
    the limit of any loader that reads them once. Stops after ``max_bytes`` or
    ``max_seconds`` (checked between reads).
    """
    buffer = bytearray(_READ_BLOCK)
    done, started = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while (count := f.readinto(buffer)) > 0:
                done += count
                if (max_bytes and done >= max_bytes) or (max_seconds and time.perf_counter() - started >= max_seconds):
                    return done, time.perf_counter() - started
    return done, time.perf_counter() - started


def random_read(paths, read_bytes, max_seconds, threads=RANDOM_READ_THREADS, seed=0):
    """Read ``read_bytes`` at random offsets of ``paths`` on ``threads`` threads for ``max_seconds``.

    The rate at which the disk gives scattered samples of these files when
    they are not cached: a uniform shuffle's limit, one read per sample.
    Offsets are uniform over the files' bytes (a file by its size). Returns
    ``(reads, seconds)``.
    """
    sizes = np.array([os.path.getsize(path) for path in paths], dtype=np.int64)
    ends = np.cumsum(np.maximum(sizes - read_bytes, 0))
    if not len(ends) or not ends[-1]:
        raise ValueError(f"random_read: no file of {len(paths)} is longer than a read of {read_bytes} bytes")
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    counts, started = [0] * threads, time.perf_counter()

    def reader(k):
        rng = np.random.default_rng([seed, k])
        while time.perf_counter() - started < max_seconds:
            for at in rng.integers(0, ends[-1], 64).tolist():  # 64 offsets per draw: few Python calls per read
                shard = int(np.searchsorted(ends, at, side="right"))
                os.pread(fds[shard], read_bytes, at - int(ends[shard - 1] if shard else 0))
            counts[k] += 64

    try:
        workers = [threading.Thread(target=reader, args=(k,)) for k in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        for fd in fds:
            os.close(fd)
    return sum(counts), time.perf_counter() - started
