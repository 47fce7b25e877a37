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
from fastdata.formats import Columns
from fastdata.formats.shards import ShardIndex, read_index
from fastdata.reading import sources
from fastdata.reading.fingerprints import RECHECK_SECONDS, ShardChecks
from fastdata.reading.kernel import advise_column
from fastdata.reading.leases import Leases
from fastdata.reading.parts import Parts, label_bases
from fastdata.reading.readpaths import BY_SHARD, ONE_FILE, STITCHED, WINDOWS, ReadPaths
from fastdata.reading.shardcolumns import ShardColumns
from fastdata.reading.sources import LocalShards
from fastdata.reading.stitch import StitchedRows

_RESETTING = threading.Lock()  # held while a store makes this process's own state: NOTE [reset once]
os.register_at_fork(after_in_child=lambda: globals().update(_RESETTING=threading.Lock()))  # held by no thread here
_OPEN_SHARDS_RANGE = (128, 4096)  # the default bound's least and most; see NOTE [open shards]


class ShardStore(ShardChecks, ShardColumns):
    """The shards of one dataset, opened on first touch in each process (see NOTE [open shards]).

    Pickles without its open shards, so it travels cheaply into DataLoader workers.

    Args:
        index: the shards: names, sample ranges and sizes.
        read: ``read_hdf5`` or ``read_arrow``.
        max_open_shards: the most shards kept open between batches; None: ``default_max_open_shards()``.
        recheck_seconds: how long an open shard is read before its fingerprint is compared again (NOTE [shard
            fingerprint] in fingerprints.py).
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
        self._lock = threading.Lock()
        self._leases = Leases(self._paths)  # see NOTE [read leases] in leases.py
        self._pid = os.getpid()  # last: another thread takes the store as made from here on (NOTE [reset once])

    def _this_process(self):
        """Make this process's open shards, arrays and lock once, whichever of its threads asks first.

        NOTE [reset once]: a forked child (the auto helper, a worker) inherits
        the store of its parent and makes its own on first use; its placing
        thread (window reads) and its reading thread both asked at once, so
        both reset it, and a shard opened under the first reset kept its
        fresh check time in the second one's arrays while its label address
        there stayed 0: the next batch gathered labels from address 0 and
        the helper died of SIGSEGV (tests/reading/test_windows.py, the
        windows-let-go test: 2 of 30 runs at ae9e609 under a busy core; the
        core dump's gather read the address-space view at 0).
        """
        if self._pid != os.getpid():
            with _RESETTING:
                if self._pid != os.getpid():
                    self._reset()

    def enter(self):
        """Begin a read of the open shards' maps (FormatError if a file is being changed); ``leave`` after it."""
        self._this_process()  # see NOTE [lazy open] in datasets.py
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
        self._this_process()
        return self._leases.unguarded

    def parts(self, indices, batches=1):
        """Return the Parts of sorted or unsorted global int64 ``indices`` (checked): one per run in one shard.

        The read counts as ``batches`` batches in ``read_paths`` (NOTE [grouped reads] in batchloader.py).
        """
        if self.windows is not None:  # see NOTE [window reads] in windows.py
            if (parts := self.windows.parts(indices)) is not None:
                self.read_paths.count(WINDOWS, batches)
                return parts
            if not self.windows.padded():  # a padded step's wrapped samples are expected outside the windows
                self.read_paths.fall_back("window miss", (
                    f"a batch of {self.index.root!r} lies outside the block order's windows read whole (the one read "
                    "now and the next): it is read from the files, as is any other such batch (two loaders, or a "
                    "loader and a walk of its sampler, over one dataset at once do this)"))
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
        self._this_process()  # see NOTE [lazy open] in datasets.py
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
        self._this_process()
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
                # never the shard just opened: with a bound under a batch's shards, all of them tie, and the
                # set's order had closed the one being read while an earlier one stayed open
                held = np.fromiter(self._held - {shard}, np.int64, len(self._held) - 1)
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
            return _plain(self._checked(shard, path))
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
