"""Shard folders at a URL: the store over a local cache, the shuffle that fits it, and fetching in the order's order.

NOTE [remote read-ahead]: a shard at a URL costs a round trip and a whole
transfer before its first sample is read, so the loader fetches the
shards its order reads next before the reader asks for them.
make_loader gives its loader a ShardReadAhead (as a ReadAhead for local
data; NOTE [one read-ahead] in loading/state.py): it turns this rank's
upcoming steps into the sequence of shards in the order they are first
read (order.step_positions, then the samples, then index.shard_of) and
keeps the shards of the step being read and the next ``ahead`` after
them fetched by a Prefetcher (``threads`` parallel requests). It runs
where the loader's step cursor runs, the main process: workers read what
it fetched from the shared cache, or fetch a shard on demand (once per
machine: the cache locks it) when it did not come in time. A block
order asks for the shards of each window (order.window_ranges) when the
window starts; a uniform one for the shards of a few of each step's
samples (_PROBES), since nearly every step reads from every shard anyway.
Measured on moto's S3 server on loopback through fastdata.measure.throttle
(2 shared, busy cores; 15 shards of 4 MiB, 64 px raw, batches of 256, an
empty cache, best of 3): opening took 0.05 / 0.14 / 0.25 s at 0 / 20 / 50
ms added latency (two reads of index.json, 4 requests; 1 since NOTE [one
index request] in storage/urls.py), the first batch 0.48-1.40 /
0.50-0.69 / 0.59-0.63 s with the default window of 8 shards and 0.16-0.22 /
0.26-0.32 / 0.37-0.43 s with a 4-shard cache (window 2); the first epoch
ran at 5,800 / 5,500 / 4,700 img/s where 4 threads fetching every shard
moved 68 / 75 / 50 MB/s (5,500 / 6,100 / 4,000 img/s): as fast as the server
sends. The second epoch, every shard cached, 178,000-246,000 img/s (the
local folder in block order 141,000 in the same run); with the 4-shard
cache it fetches again, 5,000-6,200 img/s.
"""

import os

import numpy as np

from fastdata.errors import OptionError
from fastdata.reading.sources import CachedShards
from fastdata.reading.store import ShardStore
from fastdata.storage.cache import ShardCache
from fastdata.storage.prefetch import Prefetcher
from fastdata.storage.urls import filesystem, read_remote_index

# Shards fetched ahead of the step being read (see NOTE [remote read-ahead]); within the cache's room.
# 16, not 4: through a 20 ms proxy (benchmarks/sections/streaming.py, 6,000 images in 64 shards, windows
# of 8 shards) the first epoch went from 2,345 to 3,841 img/s (224 px jpeg) and from 2,941 to 5,456 (64 px
# raw) when 16 shards were fetched ahead instead of 4: more requests in flight cover the latency.
PREFETCH_SHARDS = 16
# Parallel requests of the prefetcher. 8, not 4: through a 20 ms proxy (the streaming section's 64 px raw
# folder, 64 shards of 1.15 MB, an empty cache, 3 runs, timed
# as the section times epoch 1) epoch 1 from opening moved 74-82
# MB/s against 56-71 on 4 threads; 224 px jpeg stayed at 34-38 MB/s through a 50 ms proxy, bound by decoding
# on the cores that serve the link (NOTE [link on one machine] in benchmarks/sections/streaming.py).
PREFETCH_THREADS = 8
WINDOW_SHARDS = 8  # the most blocks (about a shard each) of a default remote window; see NOTE [remote shuffle]
_PROBES = 64  # samples of a uniform step whose shards are asked for ahead


def open_remote_store(url, read, *, max_open_shards=None, storage_options=None, cache_dir=None, cache_limit=None,
                      prefetch=None, index=None):
    """Return the ShardStore of the shard folder at ``url``: its ``index`` read now unless given, its shards cached
    on first touch.

    Raises:
        NotFoundError: no index at ``url``.
        OptionError: a bad ``prefetch`` or ``cache_limit``.
        RemoteError: the storage kept failing.
    """
    check_prefetch(prefetch)
    index = read_remote_index(url, storage_options) if index is None else index
    source = cached_shards(index, storage_options, cache_dir, cache_limit)
    return ShardStore(index, read, max_open_shards, source=source)


def cached_shards(index, storage_options=None, cache_dir=None, cache_limit=None):
    """Return the CachedShards of the shard folder at a URL whose ``index`` was read: its copies in a ShardCache."""
    fs, _ = filesystem(index.root, storage_options)
    return CachedShards(ShardCache(index, fs, cache_dir=cache_dir, cache_limit=cache_limit))


def check_prefetch(prefetch):
    """Refuse a ``prefetch`` (shards fetched ahead) that is not None or a non-negative integer."""
    if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
        raise OptionError(f"prefetch should be a non-negative integer (shards), got prefetch={prefetch!r}")


# NOTE [remote shuffle]: a remote dataset shuffles in blocks of a shard's
# samples (the median shard's: a block is then one shard where shards hold
# equal counts, else lies in up to ``_block_span`` shards) in windows of W
# blocks: every batch of a window draws from all of its shards, so they are
# in the cache together while the next window's are fetched, and a batch
# can straddle two windows; W is thus chosen so that two windows fit the
# cache (W = cache_limit / largest shard / (2 * span), at least 1), and the
# prefetch so that a window and the shards ahead of it fit. W is at most
# WINDOW_SHARDS: the first batch waits for a whole window (NOTE [remote
# read-ahead]: 0.5-0.6 s for 8 shards of 4 MiB, 0.2-0.4 s for 2), while a
# batch mixes the samples of W shards only (a converted image folder is in
# class order: a batch sees the classes of W shards; pass window= for more,
# at the cost of the first batch and the cache). Ranks
# and workers on one machine read the same window at a time (their slices
# of one global order), so they share its shards; readers of other orders
# (two trainings) each want their own. A uniform shuffle (shuffle="uniform")
# reads every shard every few steps: with a cache smaller than the dataset
# it fetches each shard many times an epoch. The window comes from the
# cache limit, which defaults to a share of the free disk: under
# torch.distributed rank 0's settings are used by every rank, and a state
# resumed on another machine names the window to pass (make_loader's window=).


def remote_block_settings(dataset):
    """Return ``(block_size, window)`` of a remote dataset's block shuffle (see NOTE [remote shuffle]).

    A remote dataset (a PackedDataset or RecordDataset at a URL) gives its ``shard_index``, its
    ``shard_source`` (CachedShards) and its ``prefetch``.
    """
    index = dataset.shard_index
    block_size = max(1, int(np.median(np.diff(index.starts)))) if index.num_shards else 1
    window = _cache_slots(dataset) // (2 * _block_span(index, block_size))
    return block_size, max(1, min(WINDOW_SHARDS, window))


def prefetch_shards(dataset, order):
    """Return the shards fetched ahead: ``dataset.prefetch`` (default PREFETCH_SHARDS), within the cache's room."""
    wanted = PREFETCH_SHARDS if dataset.prefetch is None else dataset.prefetch
    return max(0, min(wanted, _cache_slots(dataset) - window_shards(dataset.shard_index, order)))


def window_shards(index, order):
    """Return the most shards one window of ``order`` reads (one step's at most, outside a block order)."""
    return order.window * _block_span(index, order.block_size) if order.shuffle == "block" else 1


def _block_span(index, block_size):
    """Return the most shards a block of ``block_size`` consecutive samples lies in.

    One where every shard but the last holds ``block_size`` samples (blocks
    and shards then start together); else one more than the fewest samples
    of a shard fit in the block.
    """
    counts = np.diff(index.starts)[:-1]  # the last shard is usually short: it ends every block it is in
    if not len(counts) or (counts == block_size).all():
        return 1
    return 1 + -(-(block_size - 1) // max(int(counts.min()), 1))


def _cache_slots(dataset):
    """Return how many of the dataset's largest shards its cache limit holds (at least 2)."""
    return max(2, int(dataset.shard_source.limit // max(int(dataset.shard_index.sizes.max(initial=1)), 1)))


class ShardReadAhead:
    """Fetch the shards an order reads next into the cache, before they are read (see NOTE [remote read-ahead]).

    A ReadsAhead (readahead.py): told ``start(epoch, step)`` when an epoch's
    batches begin and ``advance(step)`` as each step's indices are produced.

    Args:
        dataset: a remote dataset (see remote_block_settings).
        order: the EpochOrder the batches come from.
        rank: this rank; world_size: ranks sharing each global batch.
        ahead: shards kept fetched past those of the step being read.
        threads: parallel requests.
    """

    def __init__(self, dataset, order, rank=0, world_size=1, ahead=PREFETCH_SHARDS, threads=PREFETCH_THREADS):
        self.dataset, self.order, self.rank, self.world_size = dataset, order, rank, world_size
        self.index = dataset.shard_index
        self.ahead, self.threads = ahead, threads
        self._prefetcher, self._pid = None, None
        self.start(0, 0, fetch=False)

    def start(self, epoch: int, step: int, fetch: bool = True) -> None:
        """Begin ``epoch`` at ``step``: fetch the shards of its first steps."""
        self._epoch, self._next = epoch, step  # the next step whose shards are not in the sequence yet
        self._sequence, self._place = [], {}  # shards in the order first read from ``step`` on; shard -> place
        self._reach, self._first = {}, {}  # step -> length of the sequence with its shards; its first shard's place
        self._wanted, self._offset = -1, 0  # the sequence's length when the prefetcher was last given it, from where
        self._windows = None  # the shards of each window of the epoch (block order), made on first ask
        self._all_cached = fetch and self._whole_dataset_cached()
        if fetch:
            self.advance(step)

    def _whole_dataset_cached(self):
        """Whether every shard is in the cache, and the cache holds them all (so none is evicted for another).

        NOTE [cached epochs]: then nothing is left to fetch ahead, and the
        epoch skips the per-step bookkeeping of ``advance`` (~90 us a step
        of 256 samples on 2 shared cores, 64 shards: the second epoch of 64
        px raw ran at 0.61-0.77 of the local folder's rate). A shard removed
        from the cache all the same is fetched by its reader, as any missing
        shard is.
        """
        source = self.dataset.shard_source
        if not source.fits(int(self.index.sizes.sum())):
            return False
        return all(source.cache.is_present(shard) for shard in range(self.index.num_shards))

    def advance(self, step: int) -> None:
        """Note that ``step``'s indices were just produced: fetch its shards and the next ``ahead``."""
        if self._all_cached or step >= self.order.num_steps:
            return
        while self._next <= step:
            self._add(self._next)
        stop = self._reach[step] + self.ahead
        while len(self._sequence) < stop and self._next < self.order.num_steps:
            self._add(self._next)
        self._reach.pop(step - 1, None)  # steps before ``step`` are not looked up again
        self._first.pop(step - 1, None)
        fetcher, first = self._fetcher(), self._first[step]
        if self._wanted != len(self._sequence):  # from ``first`` on: want() starts at the sequence's start
            fetcher.want(self._sequence[first:], keep=self._wanted >= 0)  # the epoch's first want: anew
            self._wanted, self._offset = len(self._sequence), first
        fetcher.advance(first - self._offset)

    def _add(self, step):
        """Append the shards ``step`` reads to the sequence: each one not in it since the step before's first.

        A shard read again after the reader has moved past it (a block order whose blocks lie across two
        shards: two windows share a shard) is appended anew, so that the step's first place never goes back
        and the shard is wanted again where it may have been let go.
        """
        first, floor = len(self._sequence), self._first.get(step - 1, 0)
        for shard in self._step_shards(step).tolist():
            if self._place.get(shard, -1) < floor:
                self._place[shard] = len(self._sequence)
                self._sequence.append(shard)
            first = min(first, self._place[shard])
        self._reach[step], self._first[step] = len(self._sequence), first
        self._next = step + 1

    def _step_shards(self, step):
        """Return the shards ``step`` of this rank reads (first-read order; some of a uniform step's)."""
        start, stop = self.order.step_positions(step, self.rank, self.world_size)
        if start >= stop:
            return np.empty(0, np.int64)
        order, epoch = self.order, self._epoch
        if order.shuffle == "block":
            windows = {order.window_of(epoch, start), order.window_of(epoch, stop - 1)}
            return np.concatenate([self._window_shards(window) for window in sorted(windows)])
        positions = np.arange(start, stop, dtype=np.int64)
        if order.shuffle == "uniform" and len(positions) > _PROBES:
            positions = positions[np.linspace(0, len(positions) - 1, _PROBES).astype(np.int64)]
        shards = self.index.shard_of(order.samples(epoch, positions))
        _, first = np.unique(shards, return_index=True)
        return shards[np.sort(first)]

    def _window_shards(self, window):
        """Return the shards of ``window``'s blocks, in file order (every window's, from one pass an epoch).

        One keyed permutation of all the epoch's blocks, not one per window: each window's cost 150 us
        here, a few every step of 256 samples (see NOTE [quiet advance] in fastdata/storage/prefetch.py).
        """
        if self._windows is None:
            ranges = self.order.block_ranges(self._epoch)
            first = self.index.shard_of(ranges[:, 0]).tolist()
            last = self.index.shard_of(ranges[:, 1] - 1).tolist()
            size = self.order.window
            self._windows = [np.unique(np.concatenate([np.arange(a, b + 1) for a, b in
                                                       zip(first[slot:slot + size], last[slot:slot + size])]))
                             for slot in range(0, len(first), size)]
        return self._windows[window]

    def _fetcher(self):
        """Return this process's Prefetcher, started on first use."""
        if self._pid != os.getpid():
            span = window_shards(self.index, self.order)
            self._prefetcher = Prefetcher(self.dataset.shard_source.cache, span + self.ahead, self.threads)
            self._pid = os.getpid()
        return self._prefetcher

    def close(self) -> None:
        """Stop the prefetcher's threads (a later epoch starts them again)."""
        if self._prefetcher is not None and self._pid == os.getpid():
            self._prefetcher.close()
        self._prefetcher, self._pid = None, None

    def __getstate__(self):
        return {**self.__dict__, "_prefetcher": None, "_pid": None}
