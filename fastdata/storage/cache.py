"""A local folder of a remote dataset's shards, bounded in bytes and shared by every process of the machine.

ShardCache fetches, holds and releases shards, and makes room for a download; the folder's files (locks, the boot,
the records of verified shards, eviction) are CacheFolder's, in cachefolder.py. See NOTE [shard cache] for the
protocol.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import threading
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor

from fastdata.errors import FormatError, NotFoundError, OptionError
from fastdata.formats.shards import sync_folder
from fastdata.storage.cachefolder import PARTIAL, ROOM_LOCK, CacheFolder, close_locked, open_locked, reports_full_disk
from fastdata.storage.retry import retried
from fastdata.storage.urls import join

CHUNK_BYTES = 8 << 20  # one ranged request of a download; each is retried on its own
WAIT_SECONDS = 0.0  # how long a fetch waits for room before going over the limit; see NOTE [no waiting on readers]
_POLL_SECONDS = 0.05


# NOTE [shard cache]: one folder per remote dataset, ``cache_root()/<key>``, the key a hash of the URL
# and of every shard's name, size and crc32, so a dataset converted again never reuses stale files.
# Processes (ranks, workers, two trainings) share it with nothing but files and flock(2):
# - a complete file under its index name is always verified: a download goes to
#   ``.<name>.<pid>-<random>.partial`` (crc32 and size computed as the bytes arrive), is
#   compared with the index, and renamed; a mismatch downloads once more, then raises. It is not
#   fsynced where the boot is known: see NOTE [unsynced shards] in cachefolder.py.
# - ``.<name>.lock``, held LOCK_EX while downloading, makes one process download a shard while
#   the others wait for it and then find it present. Lock files stay on disk: a flock dies with its
#   process (kill -9 included), so nothing is ever stale, and no process id is ever trusted.
# - a reader holds a shard while it has it open: LOCK_SH on a descriptor of the complete file.
#   Eviction takes LOCK_EX|LOCK_NB on the file and deletes it only then, so a held shard is never
#   deleted; a reader that locked a file just deleted sees st_nlink == 0 and fetches again.
# - ``.room.lock`` (LOCK_EX, held for a scandir and a few unlinks) makes "is there room, else
#   evict, then create the partial file" one step: the used bytes are the complete files plus each
#   partial file at its final (index) size, so two downloads starting together cannot both fit in
#   the same room. Eviction deletes least recently used (the oldest mtime of their records, which
#   fetch and hold touch: NOTE [verified shards] in cachefolder.py) complete shards nobody holds until the incoming
#   shard fits. Partial files whose writer is dead (their shard's lock is free) are deleted there too.
# - with no room and nothing evictable (every shard held), a fetch asks this process's readers to
#   close the shards they do not read now (``on_full``), and then goes over the limit by this one
#   shard: NOTE [no waiting on readers].
# NOTE [no waiting on readers]: a reader holds the shards it has open; those of the batch it reads, and
# those it read last until it opens another (a store of a short cache closes its idle shards then:
# NOTE [cache room] in reading/sources.py). An idle reader (a DataLoader worker that made its batches
# ahead, another training between steps) never releases, and nothing of another process can ask it to,
# so a fetch that waited for room waited on readers that were waiting too: a 3-shard limit with 2
# workers read 300 samples in 33-61 s, two processes sharing it in 31 s each, two processes of 2 workers
# in 96-153 s, against 0.8-1.2 s with room (1-7 "all held by readers" waits of 30 s; /tmp/p27/repro_wait.py).
# So a fetch that finds every shard held, after ``on_full``, goes over the limit by its shard at once:
# the folder exceeds the limit by at most the shards readers hold beyond it at that moment (each
# reader's current batch, and its last one while it is idle), and comes back under it as they are
# released and evicted. ``over_limit()`` counts them; ``wait_seconds`` > 0 restores a wait (polling, with a
# warning when it runs out) for whoever prefers a late shard to a fuller disk.
# NOTE [room for read-ahead]: a fetch without ``wait`` (the prefetcher's) that finds no room calls
# ``on_full`` once and looks again. Readers keep the shards they read open (held) until they need
# room themselves, so in a full cache the prefetcher found nothing to evict and skipped every
# shard, and the reader then fetched each new one itself, one round trip at a time. Measured on
# 6,000 224 px jpeg images in 64 shards through a 20 ms proxy (make_loader defaults, epochs 1-3):
# a 16-shard cache read 2,308 / 1,639 / 1,640 img/s, the unbounded cache's first epoch 2,447.
# Lock order: a shard's lock, then the room lock; the room lock is held only around non-blocking
# work, so no two locks are ever waited for in a cycle. flock rather than a lock server or shared
# memory: the kernel drops every lock of a killed process, which is the whole crash story.


def cache_root(cache_dir=None):
    """Return the folder of every fastdata cache: ``cache_dir``, else $FASTDATA_CACHE, else the user's cache."""
    if cache_dir is not None:
        return os.fspath(cache_dir)
    if os.environ.get("FASTDATA_CACHE"):
        return os.environ["FASTDATA_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastdata")


def cache_key(index):
    """Return 16 hex digits naming ``index``'s dataset: its URL and every shard's name, size and crc32."""
    facts = [index.root.rstrip("/"), index.names, [int(size) for size in index.sizes], index.checksums]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


class ShardCache(CacheFolder):
    """The shards of a remote shard folder, downloaded on demand into a bounded local folder.

    Pickles without descriptors or locks: each process reopens its own.

    Args:
        index: the dataset's ShardIndex (``root`` its URL).
        fs: the fsspec file system of the URL.
        cache_dir: the cache root (see ``cache_root``); the dataset gets a folder in it.
        cache_limit: bytes this dataset's folder may use, but for shards readers hold at once beyond it
            (NOTE [no waiting on readers]); None: half its file system's free space (at least two of the
            largest shards).
        wait_seconds: how long a fetch waits for room before going over the limit by one shard (0: not at all).

    Raises:
        OptionError: ``cache_limit`` is smaller than the largest shard.
    """

    def __init__(self, index, fs, cache_dir=None, cache_limit=None, wait_seconds=WAIT_SECONDS):
        self.index, self.fs, self.wait_seconds = index, fs, float(wait_seconds)
        self.folder = os.path.join(cache_root(cache_dir), cache_key(index))
        os.makedirs(self.folder, exist_ok=True)
        largest = int(index.sizes.max(initial=0))
        if cache_limit is None:
            cache_limit = max(shutil.disk_usage(self.folder).free // 2, 2 * largest)
        elif not isinstance(cache_limit, int) or isinstance(cache_limit, bool) or cache_limit < largest:
            raise OptionError(
                f"cache_limit should be at least the largest shard ({largest:,} bytes, {index.root!r}), "
                f"got cache_limit={cache_limit!r}; pass a larger limit or cache_limit=None"
            )
        self.cache_limit = int(cache_limit)
        self.on_full = None  # called (no arguments) while a fetch waits for room; see NOTE [shard cache]
        self._sizes = dict(zip(index.names, (int(size) for size in index.sizes)))
        self._local, self._pid = None, None
        self._synced = not self._settle_boot()  # see NOTE [unsynced shards] in cachefolder.py

    def __repr__(self):
        return (f"<ShardCache {self.index.root!r} -> {self.folder!r}: {self.index.num_shards} shards, "
                f"limit {self.cache_limit:,} bytes>")

    def __getstate__(self):
        return {**self.__dict__, "_local": None, "_pid": None, "on_full": None}

    def _state(self):
        """This process's holds and prefetch errors (reset in a new process: see NOTE [shard cache])."""
        if self._local is None or self._pid != os.getpid():
            self._local = {"lock": threading.Lock(), "held": {}, "failed": {}, "verified": {}, "rechecked": 0,
                           "over": 0}
            self._pid = os.getpid()
        return self._local

    def url(self, shard):
        """Return the URL of shard number ``shard``."""
        return join(self.index.root, self.index.names[shard])

    def read_file(self, name):
        """Return the bytes of the folder's file ``name`` at the URL (one GET, retried); nothing is cached."""
        url = join(self.index.root, name)
        try:
            return retried(lambda: self.fs.cat_file(url, start=0), url)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{url!r} does not exist, and {self.index.root!r}'s index lists it; convert again "
                                "or restore it") from exc

    def path(self, shard):
        """Return the local path of shard number ``shard`` (present or not)."""
        return os.path.join(self.folder, self.index.names[shard])

    def is_present(self, shard):
        """Return whether the complete, verified shard is in the folder."""
        try:
            return os.stat(self.path(shard)).st_size == self._sizes[self.index.names[shard]]
        except FileNotFoundError:
            return False

    @reports_full_disk
    def fetch(self, shard, wait=True):
        """Return the local path of shard ``shard``'s complete, verified copy, downloading it unless present.

        Without ``wait``, a shard the cache has no room for now is not downloaded: None is returned.

        Raises:
            NotFoundError: the shard is missing at the URL.
            FormatError: the remote copy does not match the index (twice).
            RemoteError: the storage kept failing.
        """
        failed = self._state()["failed"].pop(shard, None)
        if failed is not None:  # a prefetch of it failed: raise that here, in the reader
            raise failed
        path = self.path(shard)
        if self._touch(shard):
            return path
        with self._locked(f".{self.index.names[shard]}.lock"):
            if (not self._touch(shard) and not self._recheck(shard) and not self._adopt(shard)
                    and not self._download(shard, wait)):
                return None
        return path

    def fetch_many(self, shards, threads=4):
        """Fetch ``shards`` with ``threads`` in parallel; return their local paths in order."""
        shards = list(shards)
        if threads <= 1 or len(shards) <= 1:
            return [self.fetch(shard) for shard in shards]
        with ThreadPoolExecutor(min(threads, len(shards)), thread_name_prefix="fastdata-fetch") as pool:
            return list(pool.map(self.fetch, shards))

    def hold(self, shard):
        """Keep shard ``shard`` from eviction until ``release`` (fetching it if needed); return its local path.

        Holds count per process: a shard held twice is released twice.
        """
        state = self._state()
        with state["lock"]:
            if shard in state["held"]:
                state["held"][shard][1] += 1
                return self.path(shard)
        while True:
            path = self.fetch(shard)
            try:
                fd = open_locked(path, fcntl.LOCK_SH)
            except FileNotFoundError:
                continue  # evicted between fetch and open
            if os.fstat(fd).st_nlink > 0:
                break
            close_locked(fd)  # evicted before our lock: fetch again
        with state["lock"]:
            entry = state["held"].setdefault(shard, [fd, 0])
            entry[1] += 1
            if entry[0] != fd:  # another thread held it meanwhile
                close_locked(fd)
        return path

    def release(self, shard):
        """Let shard ``shard`` be evicted again, once every hold of this process is released."""
        state = self._state()
        with state["lock"]:
            entry = state["held"].get(shard)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del state["held"][shard]
                close_locked(entry[0])

    def defer_error(self, shard, exc):
        """Keep ``exc``, raised while prefetching ``shard``, for this process's next ``fetch(shard)`` to raise."""
        self._state()["failed"][shard] = exc

    def held(self):
        """Return the shards this process holds, sorted."""
        return sorted(self._state()["held"])

    def used_bytes(self):
        """Return the bytes of the folder's shards: complete and unverified files, partial ones at their final size."""
        return sum(size for _, size, _ in self._scan())

    # ------------------------------------------------------------ downloading

    def _download(self, shard, wait=True):
        """Download shard ``shard`` into the folder (its lock held): reserve room, copy, verify, rename.

        Returns whether it did: without ``wait``, not when there is no room now.
        """
        name, url = self.index.names[shard], self.url(shard)
        partial = self._reserve(shard, wait)
        if partial is None:
            return False
        try:
            for attempt in (1, 2):
                size, crc = self._copy(shard, partial)
                if size == self._sizes[name] and crc == self.index.checksums[shard]:
                    break
                if attempt == 2:
                    got = f"more than {self._sizes[name]:,} bytes" if size > self._sizes[name] else f"{size:,} bytes"
                    raise FormatError(
                        f"{url!r} (shard {shard}) has {got} and crc32 {crc}, its index says "
                        f"{self._sizes[name]:,} bytes and {self.index.checksums[shard]}: the remote copy is "
                        "damaged; convert again or restore it"
                    )
            # Shared-locked across the rename until recorded: a shard without its record sorts oldest, and
            # another thread making room evicted one in between (FileNotFoundError in _record, once in a run)
            held = open_locked(partial, fcntl.LOCK_SH)
            try:
                os.rename(partial, self.path(shard))
                self._record(shard)
            finally:
                close_locked(held)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise
        if self._synced:
            sync_folder(self.folder)
        return True

    def _copy(self, shard, partial):
        """Write the remote shard to ``partial``; return ``(bytes, crc32 hex)`` of what came.

        Ranged requests of up to CHUNK_BYTES, each retried on its own (a failure costs a chunk, not
        the shard); the last asks one byte past the index's size, so a longer remote file shows.
        One GET a shard of up to CHUNK_BYTES (s3fs sends a HEAD first unless the GET is ranged).
        """
        url, expected = self.url(shard), self._sizes[self.index.names[shard]]
        crc = size = 0
        with open(partial, "wb") as out:
            while True:
                end = expected + 1 if expected - size <= CHUNK_BYTES else size + CHUNK_BYTES
                chunk = self._remote(shard, lambda a=size, b=end: self.fs.cat_file(url, start=a, end=b))
                out.write(chunk)
                crc, asked, size = zlib.crc32(chunk, crc), end - size, size + len(chunk)
                if len(chunk) < asked or size > expected:
                    break
            if self._synced:
                out.flush()
                os.fsync(out.fileno())
        return size, f"{crc:08x}"

    def _remote(self, shard, call):
        """Return ``call()`` (one request about shard ``shard``), retried; a missing shard raises NotFoundError."""
        url = self.url(shard)
        try:
            return retried(call, url)
        except FileNotFoundError as exc:
            raise NotFoundError(
                f"{url!r} (shard {shard} of {self.index.root!r}) does not exist: the remote folder lacks a "
                "shard its index names; convert again or restore it"
            ) from exc

    # ------------------------------------------------------------ room

    def _reserve(self, shard, wait=True):
        """Make room for shard ``shard`` and create its partial file; return the partial file's path.

        See NOTE [no waiting on readers]: with no room, this process's readers are asked to close idle
        shards (``on_full``), then the shard goes over the limit (after ``wait_seconds`` of asking, if set).
        Without ``wait``: None when there is no room after asking once.
        """
        name = self.index.names[shard]
        partial = os.path.join(self.folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}{PARTIAL}")
        deadline, asked = time.monotonic() + self.wait_seconds, False
        while True:
            with self._locked(ROOM_LOCK):
                fits = self._make_room(self._sizes[name])
                if fits or (wait and asked and time.monotonic() >= deadline):
                    if not fits:
                        self._go_over(shard)
                    open(partial, "wb").close()
                    return partial
                if not wait and (asked or self.on_full is None):
                    return None
            if asked:
                time.sleep(_POLL_SECONDS)
            if self.on_full is not None:
                self.on_full()
            asked = True

    def _go_over(self, shard):
        """Count a shard fetched beyond the limit; warn where the fetch waited for room first."""
        self._state()["over"] += 1
        if self.wait_seconds > 0:
            warnings.warn(self._over_message(shard), RuntimeWarning, stacklevel=5)

    def over_limit(self):
        """Return how many shards this process fetched beyond the limit (NOTE [no waiting on readers])."""
        return self._state()["over"]

    def rechecked(self):
        """Return how many present shards this process found changed since verified and checked again."""
        return self._state()["rechecked"]

    def _over_message(self, shard):
        count = sum(1 for _, _, kind in self._scan() if kind == "complete")
        return (f"the shard cache {self.folder!r} is full: cache_limit={self.cache_limit:,} bytes, {count} shards, "
                f"all held by readers for {self.wait_seconds:g} s; shard {shard} goes beyond the limit. Raise "
                "cache_limit, or read with fewer processes or fewer open shards")
