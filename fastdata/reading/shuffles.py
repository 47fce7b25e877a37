"""The shuffle that fits: whether a dataset can stay in the page cache, and a block shuffle's default settings."""

import os

BLOCK_BYTES = 256 << 10  # stored bytes per block of a block shuffle; see NOTE [block settings]
WINDOW_BLOCKS = 1024  # blocks per window of a block shuffle; see NOTE [block settings]
CACHE_SHARE = 0.8  # the share of available memory a dataset may fill and still count as cached; NOTE [auto shuffle]


# NOTE [block settings]: a block is BLOCK_BYTES of stored samples (21 of
# 64 px raw, about 10 of 224 px JPEG), a window WINDOW_BLOCKS blocks: each
# read is one sorted run of at least 64 pages, and a batch draws from 1,024
# blocks, which kept >= 90% of a uniform shuffle's classes per batch on 100
# classes (tests/reading/test_order.py). ReadAhead keeps the current window
# and the next in the page cache, or a process reading alone in two slots
# of its memory (NOTE [window reads] in windows.py): 2 x 256 MiB. Measured as in NOTE [read
# ahead] (4.9 GB in a 1.5 GB cgroup): blocks of 64 KiB 14,800 img/s, 1.11x;
# 256 KiB 16,100 img/s, 1.10x; 1 MiB 3,400-3,800 img/s, 2.8-2.9x (windows of
# 1 GiB: two do not fit in the cache, hinted pages are evicted unread). The
# settings come from the dataset alone, never from this machine's memory,
# so that every rank and every resumed run computes the same order.


def block_settings(dataset) -> tuple[int, int]:
    """Return the default ``(block_size, window)`` of a block shuffle: samples per block, blocks per window.

    A block holds about BLOCK_BYTES of stored samples (at least one); a
    window holds WINDOW_BLOCKS blocks. Both come from the dataset alone, so
    every rank computes the same order (see NOTE [block settings]).
    """
    per_sample = dataset.nbytes / max(len(dataset), 1)
    return max(1, round(BLOCK_BYTES / max(per_sample, 1))), WINDOW_BLOCKS


# NOTE [auto shuffle]: shuffle=True reads uniformly while the dataset can
# stay in the page cache, and in blocks when it cannot: its files' bytes
# against CACHE_SHARE (80%) of the memory this process could fill with
# cache, the least of /proc/meminfo's MemAvailable (free memory plus cache
# that can be dropped, this dataset's cached pages included) and its memory
# cgroup's limit less what the cgroup holds outside the page cache (a cgroup
# charges page cache to its limit; MemAvailable does not see the limit).
# The other 20% is left to the training process's own growth. A dataset
# that fits is read from disk once in a uniform order (at the disk's random
# read rate, NOTE [read ahead]) and from memory after; one that does not
# would be read from disk every epoch at that rate.


def choose_shuffle(dataset, available_bytes: int | None = None) -> tuple[str, str]:
    """Return ``("uniform" | "block", reason)``: block when the dataset cannot stay in the page cache.

    See NOTE [auto shuffle]. ``available_bytes`` overrides the memory this
    process could fill with cache (MemAvailable, or its cgroup's room).
    """
    where = "given"
    if available_bytes is None:
        available_bytes, where = available_memory()
    fits = dataset.nbytes <= CACHE_SHARE * available_bytes
    reason = (f"{dataset.nbytes / 1e9:.2f} GB of data {'fit' if fits else 'do not fit'} in "
              f"{CACHE_SHARE:.0%} of {available_bytes / 1e9:.2f} GB of memory available ({where})")
    return ("uniform" if fits else "block"), reason


def available_memory() -> tuple[int, str]:
    """Return ``(bytes, where)``: the memory this process can fill with page cache (the system's or its cgroup's).

    Off Linux, ``(2**63 - 1, "unknown")``: everything fits.
    """
    found = [(2**63 - 1, "unknown")]
    try:
        with open("/proc/meminfo") as f:
            meminfo = dict(line.split(":", 1) for line in f)
        found.append((int(meminfo["MemAvailable"].split()[0]) * 1024, "MemAvailable"))
    except (OSError, KeyError, ValueError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append((room, "cgroup limit"))
    return min(found)


def _cgroup_room():
    """Return this process's memory cgroup limit less the memory it holds outside the page cache, or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):  # cgroup v1
            return _room("/sys/fs/cgroup/memory" + path, "memory.limit_in_bytes", "memory.usage_in_bytes", "cache")
    for _, controllers, path in lines:
        if controllers == "":  # cgroup v2
            return _room("/sys/fs/cgroup" + path, "memory.max", "memory.current", "file")
    return None


def _room(folder, limit_name, usage_name, cache_key):
    try:
        with open(os.path.join(folder, limit_name)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 2**62:
            return None
        with open(os.path.join(folder, usage_name)) as f:
            usage = int(f.read())
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = dict(line.split() for line in f)
        return max(int(limit) - usage + int(stat.get(cache_key, 0)), 0)
    except (OSError, ValueError):
        return None
