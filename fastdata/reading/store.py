"""The packed files behind a dataset: one file, or the shards of a folder, opened lazily in each process.

NOTE [open shards]: a shard is opened on its first touch in a process and
kept in a least-recently-used cache of ``max_open_shards`` shards; the
oldest is closed (its maps dropped) when one more is opened. An open HDF5
shard holds a map and a file descriptor per column (2 raw, 3 with offsets:
numpy memmaps keep a descriptor each), an Arrow shard one map and no
descriptor (counted in /proc/self), and each one more descriptor for its
read lease (NOTE [read leases] in leases.py), so 100,000 open shards would pass the
usual limit of 1,024 descriptors and Linux's 65,530 maps per process. A
batch keeps the shards it touches open until it is read, on top of the
cache. Measured on 2 shared cores (best of 20, 64 px shards of one sample
each): reopening a shard that was checked before costs 1.1 ms (HDF5 raw),
1.6 ms (HDF5 JPEG), 0.3 ms (Arrow raw) and 0.7 ms (Arrow JPEG), against
5 us to copy 8 rows of 64x64 from an open shard: a cache smaller than the
shards a shuffled epoch touches makes reading 100x slower. So the default
bound is as large as the process's descriptor limit allows: an eighth of
the soft ``RLIMIT_NOFILE`` (at most half of it held by HDF5 shards, the rest
left to DataLoader pipes and shared memory), at least 128 and at most 4,096
(12,288 maps). At the usual 1,024 that is 128 shards (8 GiB of 64 MiB
shards); ImageNet-1k as 224 px JPEG (20-60 GB, 300-900 shards) wants a
limit of 8,192 (``ulimit -n``) or an explicit ``max_open_shards``.

NOTE [shard fingerprint]: as for one file (NOTE [fingerprint] in
datasets.py), a shard's ``(size, mtime_ns, inode)`` is taken when it is
first opened and checked (its size against the index, its structure, offsets
and labels), and compared again when it is reopened. While a shard stays
open it is compared at most once every RECHECK_SECONDS, not before every
batch: a sorted batch of shuffled samples touches many shards, and one
``os.stat`` per shard per batch cost a quarter to a third of the rate.
Measured on 2 shared cores, read_batch of sorted shuffled batches of 256
over 8,000 raw 64x64 images, best of 7 epochs, 3 runs: one file 555-723k
img/s; 2000-sample shards (4 parts a batch) 447-590k, with a stat per part
256-492k; 250-sample shards (32 parts) 371-432k, with a stat 299-323k;
32-sample shards (162 parts) 119-196k, with a stat 72-141k. A shard
truncated under a reader is thus reported within a second of reading it,
where the window of one file is one batch. One file is a store of one shard,
compared before every read.

NOTE [cached shards]: a store of a URL (fastdata.reading.remote) has a
CachedShards source (sources.py) over a fastdata.storage.ShardCache: a shard is opened from its local
copy, fetched (verified against the index's size and crc32) on first touch
unless a prefetcher has fetched it already, and held while open so that no
process evicts it; closing it releases it. Its local copy may be evicted and
fetched again between two opens (another inode), so a cached shard is
checked in full at every open and its fingerprint forgotten when it closes;
those checks cost 0.3-1.6 ms an open (NOTE [open shards]), against a fetch.
A store closes its stale shards when the cache runs short of room (NOTE
[cache room] in sources.py).
"""

import os
import resource
import threading
import time
from functools import partial

import numpy as np

from fastdata.errors import FormatError, OptionError
from fastdata.formats import Columns, column_offsets
from fastdata.formats.layout import bad_label_samples, format_samples, label_bounds
from fastdata.formats.shards import (
    COLUMN_FILES,
    INDEX_NAME,
    ShardIndex,
    parse_column,
    read_index,
    shard_differences,
    shard_mismatch,
)
from fastdata.reading import sources
from fastdata.reading.kernel import advise_column, column_spans, hint_spans
from fastdata.reading.leases import Leases
from fastdata.reading.parts import Parts, label_bases
from fastdata.reading.readpaths import BY_SHARD, ONE_FILE, STITCHED, WINDOWS, ReadPaths
from fastdata.reading.sources import LocalShards
from fastdata.reading.stitch import StitchedRows

_OPEN_SHARDS_RANGE = (128, 4096)  # the default bound's least and most; see NOTE [open shards]
RECHECK_SECONDS = 1.0  # see NOTE [shard fingerprint]


class ShardStore:
    """The shards of one dataset, opened on first touch in each process (see NOTE [open shards]).

    Pickles without its open shards, so it travels cheaply into DataLoader workers.

    Args:
        index: the shards: names, sample ranges and sizes.
        read: ``read_hdf5`` or ``read_arrow``.
        max_open_shards: the most shards kept open between batches; None: ``default_max_open_shards()``.
        recheck_seconds: how long an open shard is read before its fingerprint is compared again.
        source: where the shards' files come from (sources.py): None, the local files the index names; for
            shards at a URL, a CachedShards (see NOTE [cached shards]).
    """

    def __init__(self, index: ShardIndex, read, max_open_shards=None, recheck_seconds=RECHECK_SECONDS, source=None):
        max_open_shards = default_max_open_shards() if max_open_shards is None else max_open_shards
        if not isinstance(max_open_shards, int) or isinstance(max_open_shards, bool) or max_open_shards < 1:
            raise OptionError(f"max_open_shards should be a positive integer, got max_open_shards={max_open_shards!r}")
        self.index = index
        self._read = read
        self.max_open_shards = max_open_shards
        self.recheck_seconds = recheck_seconds
        self.source = LocalShards(index) if source is None else source
        self._paths = [index.path(shard) for shard in range(index.num_shards)]  # the names: URLs for a cached store
        self._fingerprints = {}  # shard -> fingerprint when checked, carried into workers
        self._cached = {}  # "labels", "lengths": int64 [N] over all shards, made on first ask
        self._advice = None  # the access pattern set on every shard's sample column as it opens; see readahead.py
        self.read_paths = ReadPaths()  # see NOTE [no silent fallbacks] in readpaths.py
        self._stitch = _stitched_rows(index, self.read_paths)  # see NOTE [stitched rows] in stitch.py
        self.windows = None  # a WindowReads that batches are taken from where it holds them (windows.py)
        self._reset()

    @classmethod
    def of_folder(cls, root, read, max_open_shards=None, index=None):
        """Return the store of a shard folder: its ``index`` read unless given, no shard opened."""
        return cls(read_index(root) if index is None else index, read, max_open_shards)

    @classmethod
    def of_file(cls, path, container, read):
        """Return the store of one packed file, a single shard checked now and before every read."""
        path = os.fspath(path)
        _, metadata = read(path)  # structure, offsets and labels checked once; no handle kept
        fingerprint = sources.fingerprint(path)
        index = ShardIndex(
            root=os.path.dirname(path), container=container, metadata=metadata, settings={},
            names=[os.path.basename(path)], starts=np.array([0, metadata["num_samples"]], dtype=np.int64),
            sizes=np.array([fingerprint[0]], dtype=np.int64), checksums=[None],
        )
        store = cls(index, read, max_open_shards=1, recheck_seconds=0.0)
        store._fingerprints[0] = fingerprint
        return store

    def _reset(self):
        shards = self.index.num_shards
        self._open = [None] * shards  # shard -> its Columns while open; see NOTE [shard cache arrays]
        self._used = np.zeros(shards, np.int64)  # shard -> the batch count when it was last read
        self._checked_at = np.full(shards, -np.inf)  # shard -> when its fingerprint was last compared
        self._label_bases = np.zeros(shards, np.int64)  # shard -> the address of its open label column
        self._batches, self._held = 0, set()  # the numbers of the open shards
        self._local = {}  # shard -> the file it was opened from, while open
        if not self.source.keeps_fingerprints:  # a forked process: its copies may be other files (NOTE [cached shards])
            self._fingerprints = {}
        self.source.attach(self)
        self._lock, self._pid = threading.Lock(), os.getpid()
        self._leases = Leases(self._paths)  # see NOTE [read leases] in leases.py

    def enter(self):
        """Begin a read of the open shards' maps (FormatError if a file is being changed); ``leave`` after it."""
        if self._pid != os.getpid():  # see NOTE [lazy open] in datasets.py
            self._reset()
        if broken := self._leases.enter():
            for shard in broken:
                if shard in self._fingerprints:
                    self._check_unchanged(shard)  # names the change, where the writer has made it
            raise FormatError(
                f"{', '.join(map(repr, broken.values()))} was opened for writing or truncated by another program "
                "while this dataset read it; a packed file must not change while it is read. Open it again "
                "(open_dataset) once it is written, or put the old one back."
            )

    def leave(self):
        """End a read begun by ``enter`` (see NOTE [read leases] in leases.py)."""
        self._leases.leave()

    def unguarded(self):
        """Return why this process holds no read leases on the files (NOTE [read leases]), or None."""
        if self._pid != os.getpid():
            self._reset()
        return self._leases.unguarded

    def parts(self, indices, batches=1):
        """Return the Parts of sorted or unsorted global int64 ``indices`` (checked): one per run in one shard.

        The read counts as ``batches`` batches in ``read_paths`` (NOTE [grouped reads] in batchloader.py).
        """
        if self.windows is not None:  # see NOTE [window reads] in windows.py
            if (parts := self.windows.parts(indices)) is not None:
                self.read_paths.count(WINDOWS, batches)
                return parts
            self.read_paths.fall_back("window miss", (
                f"a batch of {self.index.root!r} lies outside the block order's windows read whole (the one read now "
                "and the next): it is read from the files, as is any other such batch (two loaders, or a loader "
                "and a walk of its sampler, over one dataset at once do this)"))
        if self.index.num_shards == 1:
            self.read_paths.count(ONE_FILE, batches)
            return Parts([self._only()], indices, [0, len(indices)], self._paths)
        if not len(indices):
            return Parts([], indices, [0], [])
        shards = self.index.shard_of(indices)
        steady = self._steady_parts(shards, indices)
        if steady is not None:  # not `or`: a Parts' truth is its len
            self.read_paths.count(STITCHED, batches)
            return steady
        return self._parts(shards, indices, batches)

    def _parts(self, shards, indices, batches=1):
        """Return the Parts of ``indices`` of ``shards``, opening and checking the shards as needed."""
        numbers, bounds, rows = self._runs(shards, indices)
        columns, bases, stitched = self._columns_and_label_bases(numbers, lease=True)
        parts = Parts(columns, rows, bounds, [self._paths[number] for number in numbers.tolist()], bases)
        if self._stitch is not None:  # leased: no slot this batch reads is unmapped until it is released
            stitch = self._stitch
            parts.hold(stitch.release, (stitch.view, stitch.rows(shards, indices)) if stitched else None)
        self.read_paths.count(STITCHED if stitched else BY_SHARD, batches)
        return parts

    def _runs(self, shards, indices):
        """Return ``(shard numbers [P], bounds, rows [B])`` of the runs of ``indices`` that lie in one shard."""
        cuts = np.flatnonzero(shards[1:] != shards[:-1]) + 1
        numbers = shards[np.concatenate(([0], cuts))]
        return numbers, [0, *cuts.tolist(), len(indices)], indices - self.index.starts[shards]

    def _steady_parts(self, shards, indices):
        """Return the Parts of a batch of stitched shards that are all open and checked lately, else None.

        NOTE [steady batches]: once every shard of a folder is open, a
        shuffled batch needs only the stitched rows and one label address per
        row. The slow path's runs, list of open Columns and paths per part
        made parts() + labels() cost 42-43 us for a batch of 256 over 33
        shards, against 23-27 us this way (timeit, best of 5 x 2,000 calls, 2
        shared cores); through make_loader (11 interleaved rounds, raw 64 px,
        10,000 samples) the folder went from 0.61-0.64 to 0.79 of a bare copy,
        the one file's 0.73 in the same run. So such a batch reads through a
        Parts whose columns and paths are made only if a decoder asks. A shard
        closed or due for its fingerprint check (``_checked_at``: -inf once
        closed) takes the slow path. Its labels are read by address, so a
        shard closed under a leased batch keeps its Columns (their label map)
        until no lease is held (StitchedRows.retire), as its slot, and
        read_batch reads the labels before releasing.
        """
        stitch = self._stitch
        if stitch is None or self._pid != os.getpid():
            return None
        with self._lock:
            if self._checked_at[shards].min() <= time.monotonic() - self.recheck_seconds or not stitch.covers(shards):
                return None
            stitch.lease()  # until released, closed shards keep their slots and Columns (labels read by address)
            self._batches += 1
            self._used[shards] = self._batches
            labels = self._label_bases[shards] + (indices - self.index.starts[shards]) * 8
        return Parts.of_stitched_rows(stitch.view, stitch.rows(shards, indices), labels,
                                      partial(self.expand_parts, shards, indices), stitch.release)

    def expand_parts(self, shards, indices):
        """Return the columns, rows, bounds and paths of the parts of a batch read in one take (Parts.of_stitched_rows).

        ``shards`` and ``indices`` are the batch's (int64 ``[B]``); a steady batch's slots are leased.
        """
        numbers, bounds, rows = self._runs(shards, indices)
        columns, _, _ = self._columns_and_label_bases(numbers)
        return columns, rows, bounds, [self._paths[number] for number in numbers.tolist()]

    def locate(self, index):
        """Return ``(columns, row, path, release)`` of global sample ``index`` (checked, non-negative).

        Call ``release()`` once the row is read: until then its shard's rows stay mapped
        (see NOTE [stitched rows] in stitch.py).
        """
        shard = int(np.searchsorted(self.index.starts, index, side="right")) - 1
        (columns,), _, _ = self._columns_and_label_bases([shard], lease=True)
        release = _no_lease if self._stitch is None else self._stitch.release
        return columns, index - int(self.index.starts[shard]), self._paths[shard], release

    def columns(self, shards):
        """Return the open Columns of each of ``shards``, opening (and closing the least recently used) as needed.

        NOTE [shard cache arrays]: the cache is a list of open Columns and two
        arrays (batch of last use, time of last fingerprint comparison), updated
        once per batch with numpy, not an OrderedDict touched per part: for a
        sorted shuffled batch of 256 over 33 shards, columns() went from 18 to
        7.6 us (best of 5 x 20,000 calls) of a read_batch of about 430 us.
        Closing the least recently used shard is an argmin over the open ones,
        paid only when a shard is opened (0.3-1.6 ms anyway).
        """
        return self._columns_and_label_bases(shards)[0]

    def _columns_and_label_bases(self, shards, lease=False):
        """Return ``columns(shards)``, their ``label_bases`` (see Parts) and whether their rows are all stitched.

        Taken together under the lock. With ``lease``, a store's StitchedRows is leased before any
        shard opens, so that no slot the caller reads is unmapped meanwhile; the caller releases it
        once the rows are read (see NOTE [stitched rows] in stitch.py).
        """
        if self._pid != os.getpid():  # see NOTE [lazy open] in datasets.py
            self._reset()
        shards = np.asarray(shards, dtype=np.int64)
        leased = lease and self._stitch is not None
        with self._lock:
            if leased:
                self._stitch.lease()
            try:
                opened, bases = self._opened_and_checked(shards)
            except BaseException:
                if leased:
                    self._stitch.release()
                raise
            return opened, bases, leased and self._stitch.covers(shards)

    def _opened_and_checked(self, shards):
        """Return the Columns and label bases of int64 ``shards``, opened and compared as needed (under the lock)."""
        self._batches += 1
        self._used[shards] = self._batches  # before opening: this batch's shards are closed last
        opened = [self._open[shard] for shard in shards.tolist()]
        if None in opened:
            opened = [self._opened(shard) if columns is None else columns
                      for shard, columns in zip(shards.tolist(), opened)]
        now = time.monotonic()
        for shard in shards[self._checked_at[shards] <= now - self.recheck_seconds].tolist():
            self._check_unchanged(shard)
            self._checked_at[shard] = now
        return opened, self._label_bases[shards]

    def _only(self):
        """Return the Columns of a store of one shard: ``columns([0])`` without the arrays (one file: every read)."""
        if self._pid != os.getpid():
            self._reset()
        with self._lock:
            columns, now = self._open[0], time.monotonic()
            if columns is None:
                columns = self._opened(0)
            elif now - self._checked_at[0] >= self.recheck_seconds:
                self._check_unchanged(0)
                self._checked_at[0] = now
        return columns

    def _opened(self, shard):
        """Open ``shard`` into the cache; close the least recently used past the bound (this batch's last)."""
        columns = self._open[shard]
        if columns is None:  # not opened by an earlier part of this batch
            columns = self._open[shard] = self._open_shard(shard)
            if self._stitch is not None:  # its rows read from their slot from now on (NOTE [stitched rows])
                columns = self._open[shard] = self._stitch.place(shard, columns, self._path(shard),
                                                                 self.usual_remainder)
            self._label_bases[shard] = label_bases([columns])[0]
            if self._advice is not None:
                advise_column(columns.samples, self._advice)
            self._checked_at[shard] = time.monotonic()
            self._held.add(shard)
            while len(self._held) > self.max_open_shards:  # an argmin over the open shards, not all of them
                held = np.fromiter(self._held, np.int64, len(self._held))
                self._close(int(held[np.argmin(self._used[held])]))
        return columns

    def _close(self, shard):
        """Drop ``shard``'s maps and release its file; a cached shard is checked in full when reopened."""
        columns, self._open[shard], self._checked_at[shard] = self._open[shard], None, -np.inf
        self._held.discard(shard)
        if self._stitch is not None:
            self._stitch.retire(shard, columns)
        self._leases.drop(shard)
        if not self.source.keeps_fingerprints:
            self._fingerprints.pop(shard, None)
        del self._local[shard]
        self.source.release(shard)

    def _path(self, shard):
        """Return the local file of ``shard``: the one it was opened from while open, else its path."""
        return self._local[shard] if shard in self._local else self._paths[shard]

    def _open_shard(self, shard):
        """Open ``shard`` (its file acquired from the source): checked in full the first time, compared with its
        fingerprint after that (a cached copy: in full at every open, NOTE [cached shards])."""
        self._make_room(shard)
        path = self._local[shard] = self.source.acquire(shard)  # held until closed, so that no process evicts it
        try:
            self._leases.take(shard, path)  # before the checks: a change after them breaks it
            if shard in self._fingerprints:
                self._check_unchanged(shard)
                return _plain(self._read(path, check=False)[0])
            return self._checked(shard, path)
        except BaseException:
            self._leases.drop(shard)
            del self._local[shard]
            self.source.release(shard)
            raise

    def read_apart(self, shard):
        """Return the Columns of local ``shard`` read on their own, checked as an open checks them.

        Not one of the open shards, nor placed in the stitched rows: for a reader that keeps them (to_hf), so
        no lease stays on its file (NOTE [read leases] in leases.py: a lease guards batches, not a kept table).
        """
        columns = self._open_shard(shard)
        if self._open[shard] is None:
            self._leases.drop(shard)
            del self._local[shard]
            self.source.release(shard)
        return columns

    def fits_cache(self, indices):
        """Return whether the shards of ``indices`` can be held together (local files: always)."""
        largest = int(self.index.sizes.max(initial=0))
        if self.source.fits(largest * min(self.index.num_shards, len(indices))):  # no need to look
            return True
        return self.source.fits(len(np.unique(self.index.shard_of(indices))) * largest)

    @property
    def is_remote(self):
        """Whether the shards are read from copies of a URL's (none of them is readable before it is acquired)."""
        return self.source.local_paths is None

    def _make_room(self, shard):
        """Close the open shards the current batch does not read if the cache is short of room (NOTE [cache room])."""
        if self.source.is_short(shard):
            self._close_idle()

    def _close_idle(self):
        for held in [held for held in self._held if self._used[held] < self._batches]:
            self._close(held)

    def release_idle(self):
        """Close the open shards the last batch did not read, unless a batch opens shards now (NOTE [cache room])."""
        if self._pid == os.getpid() and self._lock.acquire(blocking=False):
            try:
                self._close_idle()
            finally:
                self._lock.release()

    def _checked(self, shard, path):
        """Open the file ``path`` of ``shard`` checked in full: size, structure, samples, fingerprint."""
        try:
            fingerprint = self.source.fingerprint(path)
        except FileNotFoundError:
            raise self._damaged(shard, "is missing") from None
        if fingerprint[0] != self.index.sizes[shard]:
            raise self._damaged(shard, f"has {fingerprint[0]} bytes, the index says {self.index.sizes[shard]}")
        try:
            columns, metadata = self._read(path)
        except FormatError as exc:
            raise self._damaged(shard, f"is damaged ({exc})") from exc
        expected = int(self.index.starts[shard + 1] - self.index.starts[shard])
        differ = shard_differences(metadata, self.index.metadata)
        if metadata["num_samples"] != expected or differ:
            raise self._damaged(shard, f"holds {metadata['num_samples']} samples, the index says {expected}" if
                                not differ else f"differs from the dataset in {', '.join(differ)}")
        if (mismatch := shard_mismatch(self.index, shard, metadata)) is not None:  # see NOTE [shard identity]
            raise self._damaged(shard, mismatch)
        self._fingerprints[shard] = fingerprint
        return _plain(columns)

    def _damaged(self, shard, what):
        return FormatError(
            f"{self._paths[shard]!r} {what}: shard {shard} of {self.index.root!r} does not match its {INDEX_NAME}. "
            + self.source.damage_advice()
        )

    def column_offsets(self, shard):
        """Return ``(samples, labels)``: the byte offsets of ``shard``'s sample and label columns in its file.

        The shard is opened (and checked) first.
        """
        self.columns([shard])
        return column_offsets(self._path(shard))

    def usual_remainder(self, modulo):
        """Return the most common sample column offset modulo ``modulo`` of the first, middle and last shards.

        The byte the stitched rows and the window reads lay their views out from (NOTE [stitched rows],
        NOTE [window reads]). Read without opening the shards: a shard that cannot be read so has no say
        (it is checked, and its damage reported, when it is opened). None where no shard could be read, or
        for a cached store (its shards are not fetched for this).
        """
        paths = self.source.local_paths
        if paths is None:
            return None
        last, remainders = self.index.num_shards - 1, []
        for shard in sorted({0, last // 2, last}):
            try:
                remainders.append(column_offsets(paths[shard])[0] % modulo)
            except (OSError, ValueError, FormatError):  # pyarrow's ArrowInvalid is a ValueError
                continue
        return max(remainders, key=remainders.count) if remainders else None

    def check_unchanged(self, shard, stat):
        """Raise FormatError unless ``stat`` of ``shard``'s file matches the fingerprint it was checked with.

        ``stat``: an ``os.stat_result`` (of the descriptor the caller reads), or None where the file is gone.
        """
        self._compare_fingerprint(shard, None if stat is None else sources.fingerprint_of(stat))

    def changed_files(self):
        """Return ``{path: what changed}`` of the local shard files that are not the ones this store was opened on.

        A shard checked in this process is compared with its fingerprint, any other with its size in the index
        (one stat per shard: for explaining a failure, not for every batch). A cached store's copies: none.
        """
        if self.source.local_paths is None:
            return {}
        changed = {}
        for shard, path in enumerate(self.source.local_paths):
            try:
                now = self.source.fingerprint(path)
            except FileNotFoundError:
                now = None
            before = self._fingerprints.get(shard)
            if before is not None and now != before:
                changed[path] = _change(before, now)
            elif before is None and (now is None or now[0] != self.index.sizes[shard]):
                size = self.index.sizes[shard]
                changed[path] = "was deleted" if now is None else f"has {now[0]} bytes, the index says {size}"
        return changed

    def _check_unchanged(self, shard):
        """Raise FormatError if ``shard`` is not the file it was when first checked (see NOTE [fingerprint])."""
        try:
            now = self.source.fingerprint(self._path(shard))
        except FileNotFoundError:
            now = None
        self._compare_fingerprint(shard, now)

    def _compare_fingerprint(self, shard, now):
        before = self._fingerprints[shard]
        if now != before:
            raise FormatError(
                f"{self._paths[shard]!r} {_change(before, now)} after this dataset was opened; a packed file must "
                "not change while it is read. Open it again (open_dataset) to read the new file, or put the old one "
                "back."
            )

    def advise(self, pattern):
        """Set the access ``pattern`` ("random", "normal") of every shard's sample column: open ones and later ones."""
        self._advice = pattern
        if self._pid == os.getpid():
            with self._lock:
                for columns in self._open:
                    if columns is not None:
                        advise_column(columns.samples, pattern)

    def hint(self, ranges, hint, give=None):
        """Give the kernel a ``hint`` ("will_need", "done") on the sample bytes of int64 ``[K, 2]`` global ``ranges``.

        Returns whether it was asked (see ``hint_spans``, which ``give`` goes to); ``ranges`` are checked.
        """
        ranges = ranges[ranges[:, 1] > ranges[:, 0]]
        if not len(ranges):
            return False
        starts = self.index.starts
        first = self.index.shard_of(ranges[:, 0])
        last = self.index.shard_of(ranges[:, 1] - 1)
        if (first != last).any():  # a range over shards: cut it at their starts
            cuts = [[start, *starts[shard + 1:end + 1].tolist(), stop]
                    for (start, stop), shard, end in zip(ranges.tolist(), first.tolist(), last.tolist())]
            ranges = np.array([(a, b) for bounds in cuts for a, b in zip(bounds, bounds[1:])], dtype=np.int64)
            first = self.index.shard_of(ranges[:, 0])
        shards, where = np.unique(first, return_inverse=True)
        spans = [column_spans(columns.samples, columns.offsets, ranges[where == k] - starts[shard])
                 for k, (shard, columns) in enumerate(zip(shards.tolist(), self.columns(shards)))]
        return hint_spans(np.concatenate([s for s, _ in spans]), np.concatenate([s for _, s in spans]), hint, give)

    def labels(self):
        """Return int64 labels ``[N]``: the file's memory map, or every shard's concatenated once."""
        if self.index.num_shards == 1:
            return self.columns([0])[0].labels
        return self._concatenated("labels", lambda columns: np.asarray(columns.labels))

    def lengths(self):
        """Return int64 stored lengths ``[N]`` of ragged samples, or None for fixed-size ones."""
        if self.index.num_shards == 1:
            offsets = self.columns([0])[0].offsets
            return None if offsets is None else np.diff(offsets)
        return self._concatenated("lengths", lambda columns: None if columns.offsets is None
                                  else np.diff(columns.offsets))

    def _concatenated(self, name, column):
        """Return ``column(columns)`` of every shard, concatenated, made once: from the column file the index
        lists (NOTE [column files] in formats/shards.py), else each shard read (through the cache)."""
        if name not in self._cached:
            entry = self.index.columns.get(name)
            if entry is not None:
                self._cached[name] = self._column_file(entry)
            else:
                parts = [column(self.columns([shard])[0]) for shard in range(self.index.num_shards)]
                self._cached[name] = None if parts and parts[0] is None else np.concatenate(
                    [np.empty(0, np.int64), *parts]).astype(np.int64)
        return self._cached[name]

    def _column_file(self, entry):
        """Return the column in the file of ``entry`` beside the shards, checked against it."""
        where = os.path.join(self.index.root, entry["name"])  # a path, or a URL (as index.path)
        data = self.source.read_file(entry["name"])
        values = parse_column(data, entry, self.index.num_samples, where)
        if entry["name"] == COLUMN_FILES["labels"] and len(bad := bad_label_samples(values, self.index.metadata)):
            raise FormatError(f"{where!r} holds labels outside {label_bounds(self.index.metadata)}, the classes its "
                              f"{INDEX_NAME} lists, at {format_samples(bad)}: the index's classes are cut short or the "
                              f'labels damaged. Run "fastdata verify {self.index.root}" for details, and convert again')
        return values

    def __getstate__(self):
        state = {**self.__dict__, "_open": None, "_checked_at": None, "_label_bases": None, "_lock": None,
                 "_pid": None, "_cached": {}, "_local": None, "windows": None, "_leases": None}
        if not self.source.keeps_fingerprints:  # another process's copies may be other files: see NOTE [cached shards]
            state["_fingerprints"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()


def default_max_open_shards():
    """Return the shards a process keeps open by default: an eighth of its descriptor limit, 128 to 4,096.

    See NOTE [open shards].
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    least, most = _OPEN_SHARDS_RANGE
    return most if soft == resource.RLIM_INFINITY else min(max(soft // 8, least), most)


def _no_lease():
    """The release of a read that holds no lease."""


def _stitched_rows(index, read_paths):
    """Return the StitchedRows of a folder of fixed-size rows (raw images), else None (one file, ragged rows)."""
    metadata = index.metadata
    if index.num_shards < 2 or metadata.get("storage") != "raw":
        return None
    return StitchedRows(np.diff(index.starts), metadata["sample_shape"], metadata["sample_dtype"], read_paths)


def _plain(columns):
    """Return ``columns`` as plain ndarray views: indexing a numpy memmap costs ~12 us more per call."""
    offsets = None if columns.offsets is None else np.asarray(columns.offsets)
    return Columns(np.asarray(columns.samples), np.asarray(columns.labels), offsets)


def _change(before, now):
    if now is None:
        return "was deleted"
    if now[2] != before[2]:
        return "was replaced by another file"
    if now[0] != before[0]:
        return f"changed size from {before[0]} to {now[0]} bytes"
    return "was modified"
