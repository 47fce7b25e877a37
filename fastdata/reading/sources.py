"""Where a store's shards come from: local files, or the local copies of a URL's shards in a cache.

Both are one contract, which ShardStore calls and tests/reading/test_sources.py
checks on each: ``acquire(shard)`` returns the path to open (held until
``release(shard)``), ``fits(nbytes)`` whether shards of that many bytes can be
held together, ``fingerprint(path)`` what changes when a file is rewritten,
``read_file(name)`` a file beside the shards (a column file), ``is_short(shard)``
whether the store should release its idle shards before acquiring one more,
and ``attach(store)`` is called in every process that reads.
"""

import os
import pickle
import weakref

from fastdata.errors import FormatError


def fingerprint(path):
    """Return ``(size, mtime_ns, inode)`` of ``path``: what changes when a file is rewritten or replaced."""
    return fingerprint_of(os.stat(path))


def fingerprint_of(stat):
    """Return the ``fingerprint`` of a file from its ``os.stat_result``."""
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


class LocalShards:
    """The shards of a local folder (or one file): each acquired as its own path, nothing fetched or held."""

    keeps_fingerprints = True  # the same file at every open: compared, not checked again in full
    limit = None

    def __init__(self, index):
        self.root = index.root
        self.local_paths = [index.path(shard) for shard in range(index.num_shards)]

    def attach(self, store):
        """Nothing to do: local files need no per-process state."""

    def acquire(self, shard):
        """Return the path of ``shard``."""
        return self.local_paths[shard]

    def release(self, shard):
        """Nothing to do: a local file is not held."""

    def is_short(self, shard):
        """Never: local files take no room."""
        return False

    def fits(self, nbytes):
        """Always: local files take no room."""
        return True

    def read_file(self, name):
        """Return the bytes of the folder's file ``name`` (FormatError, naming it, where it is missing)."""
        where = os.path.join(self.root, name)
        try:
            with open(where, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise FormatError(f"{where!r} is missing: {self.root!r}'s index lists it. Restore it, or "
                              "convert again") from None

    def damage_advice(self):
        """Return what to do about a shard that does not match the folder's index."""
        return f'Run "fastdata verify {self.root}" for details, and convert the source again.'

    fingerprint = staticmethod(fingerprint)


# NOTE [cache room]: a ShardCache short of room evicts shards no process
# holds, else waits up to 30 s for one to be released (then goes over the
# limit by a shard, with a warning). A store holds the shards it has open,
# up to max_open_shards of them, most no longer read: with several readers
# (workers, ranks) their stale holds would fill a small cache, and a reader
# waiting for room would wait for readers that do not need room. So whenever
# a store opens a shard while the cache lacks room for one more of the
# largest shards, it first closes (releases) its open shards that the batch
# being read does not: in a block order, those of the windows it has left
# (a batch of B samples from a window of W shards reads them all when B is
# several times W; a smaller batch may close and reopen a shard of its
# window, 0.3-1.6 ms, only while the cache is short). While a fetch waits
# for room, the cache's ``on_full`` does the same for every store of this
# process not opening shards at that moment. A store that is collected
# releases what it holds.
_STORES = weakref.WeakSet()  # this process's cached ShardStores; see NOTE [cache room]


class CachedShards:
    """The shards of a URL, read from their local copies in a ShardCache (see NOTE [cached shards] in store.py).

    A copy is fetched (verified) on first touch and held while acquired, so
    that no process evicts it. A copy may be another file at each acquire
    and in each process, so a store forgets its fingerprint when it
    releases the shard. Pickles with its ShardCache, which reopens in each
    process (see NOTE [cache room]).
    """

    keeps_fingerprints = False

    def __init__(self, cache):
        self.cache = cache
        self.limit = cache.cache_limit
        self._largest = int(cache.index.sizes.max(initial=0))
        self._roomy = self.fits(int(cache.index.sizes.sum()) + self._largest)  # never short: see is_short
        self._pid, self._fs_pid = None, os.getpid()
        self.local_paths = None  # nothing is read without a fetch

    def attach(self, store):
        """Let the cache's waits release ``store``'s idle shards; release its holds when it is collected."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            weakref.finalize(self, _release_all, self.cache, self._pid)
        if self._fs_pid != os.getpid():  # a forked worker: fsspec's async file systems are not fork-safe
            self.cache.fs, self._fs_pid = pickle.loads(pickle.dumps(self.cache.fs)), os.getpid()
        self.cache.on_full = _release_idle
        _STORES.add(store)

    def acquire(self, shard):
        """Return the local path of ``shard``'s complete, verified copy, fetched unless present, and hold it."""
        return self.cache.hold(shard)

    def release(self, shard):
        """Let ``shard``'s copy be evicted again."""
        self.cache.release(shard)

    def read_file(self, name):
        """Return the bytes of the folder's file ``name`` (not a shard: a column file), one request, retried."""
        return self.cache.read_file(name)

    def fits(self, nbytes):
        """Return whether ``nbytes`` of shards fit the cache together."""
        return nbytes <= self.limit

    def damage_advice(self):
        """Return what to do about a shard that does not match the folder's index."""
        return "Convert the source again, or restore the shard."

    def is_short(self, shard):
        """Return whether the cache, with ``shard`` in it, lacks room for one more of the largest shards.

        A limit that holds every shard and one more is never short, and the folder is not scanned:
        a scan stats every file of the folder, for each shard a reader opens (0.8 ms at 64 shards).
        """
        if self._roomy:
            return False
        cache = self.cache
        incoming = 0 if cache.is_present(shard) else int(cache.index.sizes[shard])
        return cache.used_bytes() + incoming + self._largest > self.limit

    fingerprint = staticmethod(fingerprint)  # a copy rewritten under its reader is noticed: see NOTE [verified
    # shards] in storage/cachefolder.py (the cache no longer touches a shard's mtime)

    def __getstate__(self):
        return {**self.__dict__, "_pid": None, "_fs_pid": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _fs_pid=os.getpid())  # the file system was unpickled: made in this process


def _release_idle():
    """Close the idle open shards of every cached store of this process (see NOTE [cache room])."""
    for store in list(_STORES):
        store.release_idle()


def _release_all(cache, pid):
    """Release every shard this process holds in ``cache`` (its store was collected)."""
    if os.getpid() == pid:
        for shard in cache.held():
            while shard in cache.held():
                cache.release(shard)


