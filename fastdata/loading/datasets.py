"""Map-style datasets over packed files, opened lazily in each process.

NOTE [lazy open]: a dataset keeps only its path and JSON metadata until it is
first read in a process. The memory maps are then opened in that process
(and again after a fork, detected by the pid), so the object pickles in
bytes into DataLoader workers under fork, spawn or forkserver, and no file
handle or mapping is shared across processes. All per-sample state (labels,
offsets, pixels) lives in numpy arrays over the memory map, never in Python
lists or dicts, so workers do not copy pages by touching refcounts and their
memory stays flat over an epoch. A shard folder keeps its index (shard names,
int64 sample starts and sizes) and opens each shard on first touch, a bounded
number at a time (NOTE [open shards] in store.py); its labels and lengths
are int64 arrays concatenated from the shards on first ask.

NOTE [fingerprint]: a packed file is immutable while it is read. The
dataset keeps the file's ``(size, mtime_ns, inode)`` from when it was made
(its offsets and labels checked then, see ``check_values``), and compares
it with one ``os.stat`` before every read, and before a process maps the
file: a file replaced, rewritten or truncated since raises FormatError
naming it instead of returning other data, a bare IndexError, or a SIGBUS
from touching a mapped page past the new end of the file. The stat makes
the window of a file truncated after it one batch wide; a read lease
closes that window (NOTE [read leases] in leases.py). Measured on 2 shared cores (best of 30 x 10,000 calls): one
check costs 2.8 us (os.stat 2.3 us), against 60-120 us for a read_batch of
64-256 raw 32x32 or 64x64 images (2-5%) and milliseconds for JPEG batches;
an item read alone takes ~10 us, so ds[i] pays ~25%, while DataLoader reads
through __getitems__ with one check per batch. The checks live in
ShardStore, which holds one file as a single shard; the shards of a folder
are compared less often (NOTE [shard fingerprint] in reading/fingerprints.py).
"""

import hashlib
import json
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from fastdata.errors import FormatError, OptionError
from fastdata.formats import format_of, read_metadata
from fastdata.formats.arrow import read_arrow
from fastdata.formats.hdf5 import read_hdf5
from fastdata.formats.records import RECORDS_KIND
from fastdata.formats.shards import ShardIndex, read_index
from fastdata.loading.batchreads import BatchReads
from fastdata.loading.decoders import decoder_for
from fastdata.loading.huggingface import to_hf
from fastdata.loading.localranks import share_windows
from fastdata.loading.records import RecordDataset
from fastdata.reading.kernel import check_pattern
from fastdata.reading.raggedwindows import RaggedWindowReads
from fastdata.reading.remote import open_remote_store
from fastdata.reading.sharedwindows import SharedRaggedWindowReads, SharedWindowReads
from fastdata.reading.store import ShardStore
from fastdata.reading.windows import WindowReads
from fastdata.storage.urls import is_url, read_remote_index

_WINDOW_READS = {"raw": WindowReads, "jpeg": RaggedWindowReads}  # a block order's windows, by sample storage
_SHARED_WINDOW_READS = {"raw": SharedWindowReads, "jpeg": SharedRaggedWindowReads}  # the same, the ranks' shared


class PackedDataset(BatchReads, Dataset):
    """Map-style view of a file, or a shard folder, written by a fastdata converter.

    Items are ``(image, label)``: image a uint8 tensor ``[3, H, W]``, label an
    int; for text ``(tokens, label)`` with tokens int64 ``[L]``. A shard
    folder reads as one dataset: global sample ``i`` is row ``i - start`` of
    the shard whose range holds it, and batches span shards.
    ``transform``, if given, is applied to each image tensor. Batches are read
    as BatchReads (batchreads.py) reads them.

    A URL (``s3://bucket/train/``, ``gs://``, ``https://``, any fsspec URL)
    reads a shard folder from object storage: its index at once, its shards
    into a local cache as they are needed, and ahead of the order that
    make_loader reads (see NOTE [remote read-ahead] in remote.py).

    Args:
        path: a packed file, a folder with ``index.json`` and shards of this class's container, or its URL.
        transform: applied to each sample tensor.
        max_open_shards: the most shards of a folder one process keeps open; default: from the
            process's descriptor limit, 128 to 4,096 (see NOTE [open shards]).
        storage_options: a URL's fsspec options (credentials, ``endpoint_url``...); default: fsspec's own.
        cache_dir: where a URL's shards are cached; default ``$FASTDATA_CACHE``, else the user's cache folder.
        cache_limit: bytes of a URL's cached shards; default: half the cache's free disk.
        prefetch: shards a loader fetches ahead of the one it reads (URLs only); default 16, 0: none.
        index: the folder's index when the caller has read it already (open_dataset does, to pick the class):
            a URL's index is then not fetched a second time.
    """

    format = None  # "hdf5" or "arrow", set by subclasses

    def __init__(self, path: str | os.PathLike, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 *, max_open_shards: int | None = None, storage_options: dict | None = None,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | None = None,
                 prefetch: int | None = None, index: ShardIndex | None = None):
        self.path = os.fspath(path)
        self.prefetch = prefetch
        if is_url(self.path):
            self._store = open_remote_store(self.path, self._read, max_open_shards=max_open_shards,
                                            storage_options=storage_options, cache_dir=cache_dir,
                                            cache_limit=cache_limit, prefetch=prefetch, index=index)  # no shard fetched
            self._check_container(self._store.index.container)
        elif (storage_options, cache_dir, cache_limit, prefetch) != (None,) * 4:
            raise OptionError(f"storage_options, cache_dir, cache_limit and prefetch apply to URLs, not {self.path!r}")
        elif os.path.isdir(self.path):
            self._store = ShardStore.of_folder(self.path, self._read, max_open_shards, index)  # no shard opened
            self._check_container(self._store.index.container)
        else:
            self._store = ShardStore.of_file(self.path, self.format, self._read)  # see NOTE [fingerprint]
        self.metadata = self._store.index.metadata
        self.transform = transform
        self.kind = self.metadata["kind"]
        self.storage = self.metadata.get("storage")
        self.sample_shape = tuple(self.metadata["sample_shape"])
        self._num_samples = self._store.index.num_samples
        self._pid, self._decoder = None, None

    @staticmethod
    def _read(path, check=True):
        raise NotImplementedError

    def _check_container(self, container):
        if container != self.format:
            right = {"hdf5": "HDF5Dataset", "arrow": "ArrowDataset"}[container]
            raise FormatError(
                f"{self.path!r} is a folder of {container} shards, not {self.format}: open it with {right} "
                "or open_dataset"
            )

    def _open(self):  # see NOTE [lazy open]
        if self._decoder is None or self._pid != os.getpid():
            self._pid, self._decoder = os.getpid(), decoder_for(self.metadata, self.path)
        return self._decoder

    @property
    def is_remote(self):
        """Whether the dataset is read from a URL, its shards through a local cache."""
        return self._store.is_remote

    @property
    def shard_index(self):
        """The ShardIndex of the files behind the dataset (one entry for a file)."""
        return self._store.index

    @property
    def shard_source(self):
        """Where the store's files come from: LocalShards, or a URL's CachedShards (reading/sources.py)."""
        return self._store.source

    @property
    def num_shards(self):
        """Number of packed files behind the dataset: 1 for a file."""
        return self._store.index.num_shards

    @property
    def shard_paths(self):
        """Paths of the packed files behind the dataset, in sample order: ``[path]`` for a file."""
        return [self._store.index.path(shard) for shard in range(self.num_shards)]

    @property
    def shard_starts(self):
        """int64 ``[S + 1]``: the first sample of each shard, then the number of samples (as RecordDataset's)."""
        return self._store.index.starts

    @property
    def nbytes(self):
        """Bytes of the packed files behind the dataset, as the index or the file's size gives them."""
        return int(self._store.index.sizes.sum())

    @property
    def fingerprint(self):
        """A 16-hex-digit digest of the dataset's metadata and its files' sizes and checksums.

        Equal for copies of one dataset (renamed, moved, synced to another
        machine), different for another conversion of other data or settings;
        a loader's resumable state carries it.
        """
        index = self._store.index
        described = {"metadata": self.metadata, "starts": index.starts.tolist(), "sizes": index.sizes.tolist(),
                     "checksums": list(index.checksums)}
        return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def classes(self):
        """Class names; label ``i`` is ``classes[i]``."""
        return self.metadata.get("classes", [])

    @property
    def labels(self):
        """int64 labels ``[N]``: memory-mapped from a file, concatenated once from a folder's shards."""
        return self._store.labels()

    @property
    def lengths(self):
        """int64 stored lengths ``[N]`` of ragged samples (tokens of a text file), from the offsets."""
        lengths = self._store.lengths()
        if lengths is None:
            raise TypeError(f"{self.path!r} holds fixed-size {self.kind} samples; lengths are for ragged ones")
        return lengths

    def read_token_ranges(self, documents, starts, stops):
        """Return the stored ids ``starts[p]:stops[p]`` of document ``documents[p]`` for each piece ``p`` (int64
        ``[P]`` each, in range), joined: int64 ``[sum(stops - starts)]``. Text only; one read of the files the
        documents lie in, a slice per piece (a lease held through it)."""
        if self.kind != "text":
            raise TypeError(f"{self.path!r} holds {self.kind} samples; token ids are read from text files")
        unique, inverse = np.unique(documents, return_inverse=True)
        pieces = [None] * len(documents)
        self._store.enter()  # see NOTE [read leases] in leases.py
        try:
            parts = self._store.parts(unique)
            try:
                part_of, firsts, values = _token_columns(parts, len(unique))
                bases = firsts[inverse] + starts
                for piece, (owner, base, stop) in enumerate(zip(inverse.tolist(), bases.tolist(),
                                                                (firsts[inverse] + stops).tolist())):
                    pieces[piece] = values[part_of[owner]][base:stop]
                joined = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
            finally:
                parts.release()
        finally:
            self._store.leave()
        return joined.astype(np.int64, copy=False)

    def read_token_spans(self, first_documents, begins, last_documents, ends, dtype=np.int64):
        """Return the stored ids of each span, joined (in ``dtype``), or None where a span's documents lie in two
        files.

        Span ``j`` runs from position ``begins[j]`` of document ``first_documents[j]`` to position ``ends[j]``
        (exclusive) of document ``last_documents[j]``, the documents between whole: a file stores its documents
        back to back, so a span is one slice (TokenSequences' concat rows, NOTE [concat rows]). Text only.
        """
        if self.kind != "text":
            raise TypeError(f"{self.path!r} holds {self.kind} samples; token ids are read from text files")
        spans = len(first_documents)
        # Sorted and unique: a part is a run of one shard, so two documents of one shard share a part.
        unique, inverse = np.unique(np.concatenate([first_documents, last_documents]), return_inverse=True)
        self._store.enter()  # see NOTE [read leases] in leases.py
        try:
            parts = self._store.parts(unique)
            try:
                part_of, firsts, values = _token_columns(parts, len(unique))
                first, last = inverse[:spans], inverse[spans:]
                if (part_of[first] != part_of[last]).any():
                    return None
                joined = np.concatenate([values[part][low:high] for part, low, high in zip(
                    part_of[first].tolist(), (firsts[first] + begins).tolist(), (firsts[last] + ends).tolist())])
            finally:
                parts.release()
        finally:
            self._store.leave()
        return joined.astype(dtype, copy=False)

    def __len__(self):
        return self._num_samples

    def __getitem__(self, index):
        """Return ``(sample, label int)`` read on its own."""
        index = self._check_index(index)
        self._store.enter()  # see NOTE [read leases] in leases.py
        try:
            columns, row, path, release = self._store.locate(index)
            try:
                sample = self._open().item(columns, row, path)
                label = int(columns.labels[row])
            finally:
                release()
        finally:
            self._store.leave()
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, label

    def __getitems__(self, indices):
        """Return a list of ``(sample, label)`` items, read as one sorted batch."""
        indices = np.asarray(indices, dtype=np.int64)
        order = np.argsort(indices, kind="stable")
        *samples, labels = self.read_batch(indices[order])
        caller = np.empty_like(order)
        caller[order] = np.arange(len(order))
        items = self._open().unbatch(*samples)  # e.g. text: padded [B, T] -> 1-D items
        return [(items[i], int(labels[i])) for i in caller]

    def advise(self, pattern: str) -> None:
        """Tell the kernel how the samples will be read: "random" (one page per fault) or "normal" (read-around).

        Applies to the maps open in this process and to shards opened later,
        here or in workers this dataset is pickled into (see NOTE [read ahead] in readahead.py).
        """
        check_pattern(pattern)
        self._store.advise(pattern)

    def will_need(self, ranges: np.ndarray, give=None) -> bool:
        """Ask the kernel to read the stored bytes of samples ``[start, stop)`` now, in the background.

        Cheap, and changes no result; skipped when a sample of the ranges is in
        the page cache already (see NOTE [resident hints] in readahead.py).

        Args:
            ranges: int64 ``[K, 2]`` sample ranges, clipped to the dataset; any order, may overlap or span shards.
            give: ``give(call, *args)`` runs the kernel call (e.g. on a thread); default: here, now.

        Returns:
            Whether the kernel was asked.
        """
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        return self._store.hint(np.clip(ranges, 0, self._num_samples), "will_need", give)

    def done_with(self, ranges: np.ndarray, drop: bool = False) -> None:
        """Tell the kernel that samples ``[start, stop)`` (int64 ``[K, 2]``) read here are not read again soon.

        Their pages are reclaimed before others, or with ``drop`` at once; only
        pages this process has mapped (see NOTE [window hints] in readahead.py).
        Changes no result.
        """
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        self._store.hint(np.clip(ranges, 0, self._num_samples), "drop" if drop else "done")

    def read_windows(self, order):
        """Take batches from ``order``'s windows read whole (direct I/O) from now on; return the WindowReads, or None.

        For a block order over data bigger than the page cache, read by one
        process (see NOTE [window reads] in windows.py): local files of raw
        or JPEG images (HDF5 or Arrow; NOTE [ragged windows] in
        raggedwindows.py); None (and no change) elsewhere, with a
        FastPathWarning where the files or the disk stand in the way. Tell
        the WindowReads which windows to read (``want``); batches outside
        them are read from the files as before.
        """
        if self.storage not in _WINDOW_READS or self.is_remote:
            return None
        reads, why = _WINDOW_READS[self.storage].of(self._store, order)
        if reads is None:
            self._store.read_paths.fall_back("window", (
                f"the block order's windows of {self.path!r} are not read whole with direct I/O: {why}. Its batches "
                "are read through the memory map with kernel hints (0.7 of the disk's rate measured, against 1.0)"))
        else:
            self._store.windows = reads
        return reads

    def share_windows(self, order, wanted):
        """Take batches from ``order``'s windows read once by the ranks of this machine together; return the
        SharedWindowReads, or None. A collective of the process group (NOTE [shared windows] in
        reading/sharedwindows.py): every rank calls it for the same order; ``wanted``: this rank would read
        windows (one reader, data bigger than the page cache). None (and no change) where the ranks of this
        machine cannot all share them, with a FastPathWarning saying why where this rank wanted to.
        """
        reads_type = _SHARED_WINDOW_READS.get(self.storage)
        reads, why = share_windows(self._store, order, wanted and reads_type is not None, reads_type)
        if reads is not None:
            self._store.windows = reads
        elif why:
            self._store.read_paths.fall_back("shared windows", (
                f"the ranks of this machine do not share the block order's windows of {self.path!r}: {why}. Its "
                "batches are read through the memory map with kernel hints (0.36 of the disk's rate measured for "
                "2 ranks, against 1.0)"))
        return reads

    def drop_windows(self) -> None:
        """Read batches from the files again, not from the WindowReads of ``read_windows``: its threads end, and its
        memory goes once no read holds it (a helper process reads the windows instead: NOTE [auto helper])."""
        if self._store.windows is not None:
            self._store.windows.close()
            self._store.windows = None

    def read_paths(self) -> dict[str, int]:
        """Return how many batches were read for this process by each path (windows, stitched, by shard, one
        file), here or by its loaders' helper processes.

        See NOTE [no silent fallbacks] in readpaths.py; the fast paths that could not apply were warned about
        (FastPathWarning).
        """
        return self._store.read_paths.totals()

    @property
    def read_path_log(self):
        """The ReadPaths behind ``read_paths()`` and ``fallbacks()``: a helper process adds to it what it reads."""
        return self._store.read_paths

    def fallbacks(self) -> dict[str, str]:
        """Return the fast paths that could not apply in this process (a key each) and what was warned about them."""
        return dict(self._store.read_paths.fallbacks)

    def changed_files(self) -> dict[str, str]:
        """Return ``{path: what changed}`` of this dataset's local files that are no longer the ones it opened."""
        return self._store.changed_files()

    def to_hf(self):
        """Return the stored samples and labels as a Hugging Face ``datasets.Dataset``, over the files' memory maps.

        Columns: ``image`` (raw: ``Array3D`` uint8 ``[3, H, W]``; JPEG: ``Image()``, decoded to PIL by Hugging
        Face) or ``input_ids`` (the stored token ids), and ``label`` (``ClassLabel`` of ``classes``). Samples
        are as stored: ``transform`` is not applied. Hugging Face's numpy and torch formats give integers as
        int64 unless asked otherwise (``with_format("torch", dtype=torch.uint8)``). What is copied: NOTE
        [hf columns] in huggingface.py; why Hugging Face does not open the files itself: NOTE [hf files].

        Raises:
            MissingDependencyError: ``datasets`` is not installed (``pip install 'fastdata[integrations]'``).
            OptionError: the dataset is read from a URL.
            FormatError: a file is damaged, or changed since the dataset was opened.

        Example:
            >>> hf = open_dataset("train.h5").to_hf()
            >>> hf.features["label"].names == open_dataset("train.h5").classes
            True
        """
        if self.is_remote:
            raise OptionError(
                f"to_hf() reads local files, and {self.path!r} is a URL: copy the folder to a local disk (e.g. "
                "fsspec's get(url, local, recursive=True)) and call open_dataset(local).to_hf()"
            )
        return to_hf(self._store, self.metadata, self.fingerprint)

    def _check_index(self, index):
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"index should be an integer, got {type(index).__name__}")
        if not -self._num_samples <= index < self._num_samples:
            raise IndexError(f"index {index} is out of range for {self._num_samples} samples in {self.path!r}")
        return int(index) % self._num_samples

    def __getstate__(self):
        return {**self.__dict__, "_pid": None, "_decoder": None}

    def __repr__(self):
        shape = ",".join(map(str, self.sample_shape))
        where = self.format if os.path.isfile(self.path) else f"{self.format}, {self.num_shards} shards"
        name = self.path.rstrip("/") if self.is_remote else os.path.basename(self.path.rstrip(os.sep))
        return (
            f"<{type(self).__name__} {name!r} {where}: "
            f"{self._num_samples} samples, {self.kind} {self.metadata['sample_dtype']}[{shape}] "
            f"{self.storage}, {len(self.classes)} classes>"
        )


class HDF5Dataset(PackedDataset):
    """A packed ``.h5`` file; reads go through a numpy memmap (see NOTE [hdf5 memmap])."""

    format = "hdf5"
    _read = staticmethod(read_hdf5)


class ArrowDataset(PackedDataset):
    """A packed ``.arrow`` file, read zero-copy from a memory map."""

    format = "arrow"
    _read = staticmethod(read_arrow)


def _token_columns(parts, count):
    """Return ``(part_of, firsts, values)`` of ``count`` documents read as ``parts``: each one's part, its first
    id's offset in that part's file, and each part's ids (a text file's flat samples)."""
    part_of, firsts, values = np.empty(count, np.int64), np.empty(count, np.int64), []
    for part, (columns, rows, start, stop) in enumerate(zip(parts.columns, _split(parts.indices, parts.bounds),
                                                            parts.bounds, parts.bounds[1:])):
        part_of[start:stop] = part
        firsts[start:stop] = np.asarray(columns.offsets)[rows]
        values.append(np.asarray(columns.samples))
    return part_of, firsts, values


def _split(indices, bounds):
    """Return ``indices[bounds[j]:bounds[j + 1]]`` for each part ``j``."""
    return [indices[start:stop] for start, stop in zip(bounds, bounds[1:])]


def open_dataset(
    path: str | os.PathLike, transform: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
    max_open_shards: int | None = None, storage_options: dict | None = None,
    cache_dir: str | os.PathLike | None = None, cache_limit: int | None = None, prefetch: int | None = None,
    fields: Sequence[str] | None = None,
) -> HDF5Dataset | ArrowDataset | RecordDataset:
    """Return the HDF5Dataset or ArrowDataset for ``path``: a file by its extension, a shard folder by its index.

    A file of records written by ``fastdata.write`` gives a RecordDataset, whose
    items and batches are dicts; ``fields`` picks the fields it reads (default: all).
    ``RecordDataset(path)`` reads a file of (sample, label) pairs as such records too.

    ``path`` may be the URL of a shard folder (``s3://...``, any fsspec URL):
    see PackedDataset for ``storage_options``, ``cache_dir``, ``cache_limit``
    and ``prefetch``. ``max_open_shards`` bounds the shards of a folder one
    process keeps open (default: see NOTE [open shards]).

    Example:
        >>> dataset = open_dataset("train/")  # a shard folder: index.json, shard-00000.h5, ...
        >>> dataset = open_dataset("s3://bucket/train/", cache_limit=20 << 30)
    """
    if not is_url(path) and not os.path.isdir(path) and read_metadata(path)["kind"] == RECORDS_KIND:
        return _record_dataset(path, fields, transform)
    remote = {"storage_options": storage_options, "cache_dir": cache_dir, "cache_limit": cache_limit,
              "prefetch": prefetch}
    index = None  # a folder's, read once: a URL's costs round trips (NOTE [one index request] in storage/urls.py)
    if is_url(path):
        index = read_remote_index(path, storage_options)
        if index.metadata.get("kind") == RECORDS_KIND:
            return _record_dataset(path, fields, transform, index, **remote)
    elif os.path.isdir(path):
        index = read_index(path)
        if index.metadata.get("kind") == RECORDS_KIND:
            return _record_dataset(path, fields, transform, index)
    if fields is not None:
        raise OptionError(f"fields= picks the fields of a record file (fastdata.write); {os.fspath(path)!r} holds "
                          f"(sample, label) pairs: read them as records with "
                          f"fastdata.RecordDataset({os.fspath(path)!r}, fields=...)")
    container = format_of(path) if index is None else index.container
    cls = HDF5Dataset if container == "hdf5" else ArrowDataset
    return cls(path, transform=transform, max_open_shards=max_open_shards, index=index, **remote)


def _record_dataset(path, fields, transform, index=None, **remote):
    if transform is not None:
        raise OptionError(f"transform applies to (sample, label) items; {os.fspath(path)!r} holds records of named "
                          "fields: transform the dicts it gives")
    return RecordDataset(path, fields=fields, index=index, **remote)
