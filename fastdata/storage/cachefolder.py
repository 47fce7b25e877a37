"""The files of a shard cache's folder: flocks no forked child keeps, the boot its shards belong to, the records of
verified shards, and eviction of the least recently used.

CacheFolder is mixed into ShardCache (cache.py), whose NOTE [shard cache] is the protocol these files keep.
"""

import contextlib
import errno
import fcntl
import functools
import json
import os
import shutil

from fastdata.errors import DiskFullError
from fastdata.formats.shards import file_checksum

ROOM_LOCK = ".room.lock"
PARTIAL = ".partial"
_UNVERIFIED = ".unverified"  # a shard from an earlier boot, checked again before use; see NOTE [unsynced shards]
_RECORD = ".ok"  # ``.<name>.ok``: a verified shard's fingerprint, its mtime the last use (NOTE [verified shards])
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


# NOTE [verified shards]: the cache hands out only files that are what it verified. A download is
# verified as it arrives (size and crc32 against the index); then its fingerprint (size, inode, mtime and
# ctime in ns: any write, truncation, copy or rename over it changes one, and ctime cannot be set back)
# is written to ``.<name>.ok`` beside it. Every fetch stats the shard and compares (the record is read once
# a process, then only when the stat changes); a shard whose fingerprint differs is read back once and
# kept if its size and crc32 still match the index, else deleted and downloaded again (``rechecked()``
# counts these). Before, a shard corrupted in place, or replaced by another shard of the same size between
# two runs, was read back as wrong pixels. The LRU stamp moved from the shard's mtime to the record's, so
# that using a shard does not change its fingerprint (and a store compares an open copy's mtime: NOTE
# [cached shards] in reading/store.py). A folder cached before records were kept has none: each of its
# shards is read back once, by the first fetch, and recorded.
# NOTE [cost of verifying]: measured on 2 busy cores (load 6-8) through a file:// URL, 2,000 64 px raw images in
# 32 shards of 786 KB, 2 x 3 rounds alternating with the tree before (/tmp/p27/bench_cache.py): downloads
# 137-180 MB/s against 132-193 (a stat and a 100-byte record a shard); a fetch of a present shard 23-67k/s
# against 17-39k/s (a stat and a utime, as before), but the first in a process 5.5-24k/s against 57-102k/s
# (its record read: ~40 us a shard, once); hold + release 9-27k/s against 10-15k/s; an epoch with every
# shard cached 5,370-7,960 img/s against 3,466-8,234, through a 3-shard limit 1,845-2,788 against
# 1,829-2,936: within the noise. A shard found changed costs a read-back at 500-730 MB/s (crc32, page cache
# warm) before it is kept or downloaded again.
# NOTE [unsynced shards]: a download renamed into place survives any process's death (kill -9
# included: the page cache is the kernel's), and only a kernel crash or power loss, i.e. a reboot,
# can leave a complete-looking file whose bytes never reached the disk. So instead of an fsync per
# shard, the folder records the boot its complete shards belong to (Linux's boot_id):
# the first cache of a new boot renames every complete shard to ``.<name>.unverified`` and writes
# the new boot into the room lock's file (its lock held). No fsync is needed there either: a crash
# that loses these writes is a reboot, after which the file names an older boot whatever it holds.
# A fetch of an unverified shard reads it back, and renames it into place if its size and crc32
# match the index, else deletes it and downloads. Unverified files count
# in the limit and are evicted like complete ones. Where the boot is not known (no boot_id), each
# download is fsynced as before. Measured: the streaming section's 64 px raw folder (64 shards of
# 1.15 MB) through a 20 ms proxy, epoch 1 from an empty cache (3 + 3 runs, alternating): 0.79-0.94 of
# the link with fsyncs (file and folder), 0.88-0.94 without; the medians 0.82 and 0.92.


# NOTE [locks across fork]: a flock belongs to the open file description, which a forked child
# shares: a DataLoader worker forked while a prefetch thread downloads (or while a shard is held)
# would keep that lock until it exits, blocking every other process's fetch of the shard. Every
# descriptor that carries a lock is therefore listed here and closed in the child right after a
# fork (closing, not unlocking: the parent's lock stays), and opened O_CLOEXEC against exec.
_LOCK_FDS = set()


def open_locked(path, flags, mode=os.O_RDONLY):
    """Open ``path`` and flock it with ``flags``; return the descriptor (BlockingIOError if LOCK_NB fails)."""
    fd = os.open(path, mode | os.O_CLOEXEC, 0o666)
    _LOCK_FDS.add(fd)
    try:
        fcntl.flock(fd, flags)
    except BaseException:
        close_locked(fd)
        raise
    return fd


def close_locked(fd):
    """Close ``fd``, a descriptor of ``open_locked``: its lock goes with it."""
    _LOCK_FDS.discard(fd)
    os.close(fd)


def _forget_inherited_locks():
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_forget_inherited_locks)


def reports_full_disk(method):
    """Raise a full disk under the cache folder (ENOSPC, EDQUOT: a bare OSError) as a DiskFullError that names the
    folder, the bytes needed and what to do; ``method``'s first argument, if any, is the shard it writes."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise DiskFullError(self._full_disk_message(args[0] if args else None)) from exc

    return wrapper


def boot_id():
    """Return this boot's id (Linux), or None where the system does not say."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


class CacheFolder:
    """The folder of ShardCache (cache.py) as files, mixed into it: its boot, its records, its locks, its room.

    Uses the cache's ``folder``, ``index``, ``_sizes`` (shard name -> bytes), ``cache_limit``, ``path(shard)``
    and ``_state()`` (this process's ``verified`` fingerprints and ``rechecked`` count).
    """

    @reports_full_disk
    def _settle_boot(self):
        """Make the folder's shards this boot's (NOTE [unsynced shards]); return whether the boot is known."""
        boot = boot_id()
        if boot is None:
            return False
        fd = open_locked(os.path.join(self.folder, ROOM_LOCK), fcntl.LOCK_EX, os.O_RDWR | os.O_CREAT)
        try:
            if os.pread(fd, 64, 0) != boot.encode():
                for path, _, kind in self._scan():
                    if kind == "complete":
                        os.replace(path, self._unverified_path(os.path.basename(path)))
                os.ftruncate(fd, 0)
                os.pwrite(fd, boot.encode(), 0)
        finally:
            close_locked(fd)
        return True

    def _unverified_path(self, name):
        return os.path.join(self.folder, f".{name}{_UNVERIFIED}")

    def _touch(self, shard):
        """Return whether shard ``shard`` is present as verified (NOTE [verified shards]); if so mark it just used."""
        try:
            now = _fingerprint(os.stat(self.path(shard)))
        except FileNotFoundError:
            return False
        verified = self._state()["verified"]
        if verified.get(shard) != now:
            if _read_record(self._record_path(shard)) != now:
                return False
            verified[shard] = now
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._record_path(shard))  # the record's mtime orders eviction
        return True

    def _record_path(self, shard):
        return os.path.join(self.folder, f".{self.index.names[shard]}{_RECORD}")

    def _record(self, shard):
        """Write the fingerprint of shard ``shard``'s file, just verified (its lock held): NOTE [verified shards]."""
        now = _fingerprint(os.stat(self.path(shard)))
        with open(self._record_path(shard), "w") as f:
            json.dump({"fingerprint": now, "crc32": self.index.checksums[shard]}, f)
        self._state()["verified"][shard] = now

    def _recheck(self, shard):
        """Check a present shard whose file is not the one verified (its lock held): keep it if its size and
        crc32 match the index, else delete it; return whether it was kept (see NOTE [verified shards])."""
        path = self.path(shard)
        try:
            size = os.path.getsize(path)
            good = size == self._sizes[self.index.names[shard]] and file_checksum(path) == self.index.checksums[shard]
        except FileNotFoundError:
            return False
        self._state()["rechecked"] += 1
        if good:
            self._record(shard)
            return True
        for gone in (self._record_path(shard), path):  # a reader holding it keeps its copy
            with contextlib.suppress(FileNotFoundError):
                os.unlink(gone)
        return False

    @contextlib.contextmanager
    def _locked(self, name, flags=fcntl.LOCK_EX):
        """Hold flock ``flags`` on ``<folder>/<name>`` (created if need be); yield whether it was taken."""
        try:
            fd = open_locked(os.path.join(self.folder, name), flags, os.O_RDWR | os.O_CREAT)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            close_locked(fd)

    def _adopt(self, shard):
        """Keep shard ``shard``'s copy from an earlier boot if it matches the index (its lock held); return whether.

        A copy that does not match is deleted (see NOTE [unsynced shards]).
        """
        name = self.index.names[shard]
        unverified = self._unverified_path(name)
        try:
            size, crc = os.path.getsize(unverified), file_checksum(unverified)
        except FileNotFoundError:
            return False
        try:
            if size == self._sizes[name] and crc == self.index.checksums[shard]:
                os.replace(unverified, self.path(shard))
                self._record(shard)
                return True
            os.unlink(unverified)
        except FileNotFoundError:  # evicted while read
            pass
        return False

    def _full_disk_message(self, shard):
        free = shutil.disk_usage(self.folder).free
        what = "cannot set up the shard cache" if shard is None else (
            f"cannot cache shard {shard} of {self.index.root!r} ({self._sizes[self.index.names[shard]]:,} bytes)")
        return (f"{what}: no space left on the device of the cache folder {self.folder!r} ({free:,} bytes free). "
                "Free space there, or give cache_dir= (or $FASTDATA_CACHE) a folder on a disk with room, or a "
                f"cache_limit= below the free space (now {self.cache_limit:,} bytes)")

    def _make_room(self, incoming):
        """Evict unheld shards, oldest first, until ``incoming`` bytes fit; return whether they do (room lock held)."""
        files = self._scan(clean=True)
        used = sum(size for _, size, _ in files)
        if used + incoming <= self.cache_limit:
            return True
        complete = sorted((_mtime(self._last_use(path, kind)), path, size) for path, size, kind in files
                          if kind != "partial")
        for _, path, size in complete:
            if self._evict(path):
                used -= size
                if used + incoming <= self.cache_limit:
                    return True
        return False

    def _last_use(self, path, kind):
        """Return the file whose mtime is the shard's last use: a complete shard's record, else the file."""
        name = os.path.basename(path)
        return os.path.join(self.folder, f".{name}{_RECORD}") if kind == "complete" else path

    def _evict(self, path):
        """Delete the complete (or unverified) shard at ``path`` unless a reader holds it; return whether it was."""
        try:
            fd = open_locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:
            return True
        except BlockingIOError:
            return False
        try:
            for gone in (os.path.join(self.folder, f".{os.path.basename(path)}{_RECORD}"), path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(gone)
            return True
        finally:
            close_locked(fd)

    def _scan(self, clean=False):
        """Return ``[(path, bytes, "complete"|"partial"|"unverified")]`` of the folder's shards; ``clean``: delete
        dead partials.

        Partial files count at their shard's final size (see NOTE [shard cache] in cache.py).
        """
        files = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name in self._sizes:
                    with contextlib.suppress(FileNotFoundError):
                        files.append((entry.path, entry.stat().st_size, "complete"))
                elif entry.name.endswith(PARTIAL):
                    name = entry.name[1:].rsplit(".", 2)[0]
                    if clean and self._writer_is_dead(name, entry.path):
                        continue
                    files.append((entry.path, self._sizes.get(name, 0), "partial"))
                elif entry.name.endswith(_UNVERIFIED):
                    with contextlib.suppress(FileNotFoundError):
                        files.append((entry.path, entry.stat().st_size, "unverified"))
        return files

    def _writer_is_dead(self, name, path):
        """Delete the partial file ``path`` if no process holds shard ``name``'s lock; return whether it did."""
        with self._locked(f".{name}.lock", fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
            if taken:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return taken


def _fingerprint(stat):
    """Return what changes when a file is written, replaced or touched: size, inode, mtime and ctime (ns)."""
    return [stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns]


def _read_record(path):
    """Return the fingerprint a shard's record holds, or None (no record, or a damaged one)."""
    try:
        with open(path) as f:
            return json.load(f)["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return 0
