"""Map-style datasets over packed files, opened lazily in each process.

NOTE [lazy open]: a dataset keeps only its path and JSON metadata until it is
first read in a process. The memory maps are then opened in that process
(and again after a fork, detected by the pid), so the object pickles in
bytes into DataLoader workers under fork, spawn or forkserver, and no file
handle or mapping is shared across processes. All per-sample state (labels,
offsets, pixels) lives in numpy arrays over the memory map, never in Python
lists or dicts, so workers do not copy pages by touching refcounts and their
memory stays flat over an epoch.

NOTE [fingerprint]: a packed file is immutable while it is read. The
dataset keeps the file's ``(size, mtime_ns, inode)`` from when it was made
(its offsets and labels checked then, see ``check_values``), and compares
it with one ``os.stat`` before every read, and before a process maps the
file: a file replaced, rewritten or truncated since raises FormatError
naming it instead of returning other data, a bare IndexError, or a SIGBUS
from touching a mapped page past the new end of the file. A file truncated
between that stat and the copy can still fault; the stat makes the window
one batch wide. Measured on 2 shared cores (best of 30 x 10,000 calls): one
check costs 2.8 us (os.stat 2.3 us), against 60-120 us for a read_batch of
64-256 raw 32x32 or 64x64 images (2-5%) and milliseconds for JPEG batches;
an item read alone takes ~10 us, so ds[i] pays ~25%, while DataLoader reads
through __getitems__ with one check per batch.
"""

import os
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from fastdata.errors import FormatError
from fastdata.formats import format_of
from fastdata.formats.arrow import read_arrow
from fastdata.formats.hdf5 import read_hdf5
from fastdata.loading.decoders import decoder_for


class PackedDataset(Dataset):
    """Map-style view of a file written by a fastdata converter.

    Items are ``(image, label)``: image a uint8 tensor ``[3, H, W]``, label an
    int; for a text file ``(tokens, label)`` with tokens int64 ``[L]``.
    ``transform``, if given, is applied to each image tensor.
    """

    format = None  # "hdf5" or "arrow", set by subclasses

    def __init__(self, path: str | os.PathLike, transform: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.path = os.fspath(path)
        _, self.metadata = self._read(self.path)  # structure, offsets and labels checked once; no handle kept
        self._fingerprint = _fingerprint(self.path)  # see NOTE [fingerprint]
        self.transform = transform
        self.kind = self.metadata["kind"]
        self.storage = self.metadata.get("storage")
        self.sample_shape = tuple(self.metadata["sample_shape"])
        self._num_samples = self.metadata["num_samples"]
        self._columns, self._pid, self._decoder = None, None, None

    @staticmethod
    def _read(path, check=True):
        raise NotImplementedError

    def _open(self):  # see NOTE [lazy open]
        self._check_unchanged()
        if self._columns is None or self._pid != os.getpid():
            self._columns, _ = self._read(self.path, check=False)  # checked at construction, unchanged since
            self._pid, self._decoder = os.getpid(), decoder_for(self.metadata, self.path)
        return self._columns

    @property
    def classes(self):
        """Class names; label ``i`` is ``classes[i]``."""
        return self.metadata.get("classes", [])

    @property
    def labels(self):
        """int64 labels ``[N]``, memory-mapped from the file."""
        return self._open().labels

    @property
    def lengths(self):
        """int64 stored lengths ``[N]`` of ragged samples (tokens of a text file), from the offsets."""
        offsets = self._open().offsets
        if offsets is None:
            raise TypeError(f"{self.path!r} holds fixed-size {self.kind} samples; lengths are for ragged ones")
        return np.diff(offsets)

    def __len__(self):
        return self._num_samples

    def __getitem__(self, index):
        """Return ``(sample, label int)`` read on its own."""
        index = self._check_index(index)
        columns = self._open()
        sample = self._decoder.item(columns, index)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, int(columns.labels[index])

    def __getitems__(self, indices):
        """Return a list of ``(sample, label)`` items, read as one sorted batch."""
        indices = np.asarray(indices, dtype=np.int64)
        order = np.argsort(indices, kind="stable")
        *samples, labels = self.read_batch(indices[order])
        caller = np.empty_like(order)
        caller[order] = np.arange(len(order))
        items = self._decoder.unbatch(*samples)  # e.g. text: padded [B, T] -> 1-D items
        return [(items[i], int(labels[i])) for i in caller]

    def read_batch(self, indices, pin_memory=False, **options):
        """Read a batch in one pass; return ``(*samples, labels int64 [B])``.

        For images ``samples`` is ``images uint8 [B, 3, H, W]``; for text it
        is ``tokens int64 [B, T], lengths int64 [B]``, padded with the stored
        pad id to the longest sample or to ``options["pad_to"]``. ``indices``
        should be sorted for a single forward pass over the file; any order
        is read correctly. With ``pin_memory`` the batch is written straight
        into page-locked memory.

        Raises:
            IndexError: an index is out of range.
        """
        indices = self._check_indices(np.asarray(indices, dtype=np.int64))
        columns = self._open()
        samples = self._decoder.batch(columns, indices, pin_memory, **options)
        if self.transform is not None:
            samples = (torch.stack([self.transform(sample) for sample in samples[0]]), *samples[1:])
        return (*samples, torch.from_numpy(columns.labels[indices]))

    @property
    def read_options(self):
        """Names of the keyword options ``read_batch`` takes for this file, e.g. ``("pad_to",)``."""
        return decoder_for(self.metadata, self.path).read_options

    def max_batch_bytes(self, batch_size, **options):
        """Return the most bytes of a ``read_batch`` of ``batch_size`` samples with ``options`` (labels included)."""
        return decoder_for(self.metadata, self.path).max_batch_bytes(batch_size, **options) + 8 * batch_size

    def _check_unchanged(self):
        """Raise FormatError if the file is not the one this dataset was made from (see NOTE [fingerprint])."""
        try:
            now = _fingerprint(self.path)
        except FileNotFoundError:
            now = None
        if now != self._fingerprint:
            raise FormatError(
                f"{self.path!r} {_change(self._fingerprint, now)} after this dataset was opened; a packed file must "
                "not change while it is read. Open it again (open_dataset) to read the new file, or put the old one "
                "back."
            )

    def _check_index(self, index):
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"index should be an integer, got {type(index).__name__}")
        if not -self._num_samples <= index < self._num_samples:
            raise IndexError(f"index {index} is out of range for {self._num_samples} samples in {self.path!r}")
        return int(index) % self._num_samples

    def _check_indices(self, indices):
        if indices.ndim != 1:
            raise ValueError(f"indices should be 1-D, got shape {indices.shape}")
        if len(indices) and (indices.min() < -self._num_samples or indices.max() >= self._num_samples):
            bad = indices[(indices < -self._num_samples) | (indices >= self._num_samples)][0]
            raise IndexError(f"index {bad} is out of range for {self._num_samples} samples in {self.path!r}")
        return np.where(indices < 0, indices + self._num_samples, indices)

    def __getstate__(self):
        return {**self.__dict__, "_columns": None, "_pid": None, "_decoder": None}

    def __repr__(self):
        shape = ",".join(map(str, self.sample_shape))
        return (
            f"<{type(self).__name__} {os.path.basename(self.path)!r} {self.format}: "
            f"{self._num_samples} samples, {self.kind} {self.metadata['sample_dtype']}[{shape}] "
            f"{self.storage}, {len(self.classes)} classes>"
        )


def _fingerprint(path):
    """Return ``(size, mtime_ns, inode)`` of ``path``: what changes when a file is rewritten or replaced."""
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


def _change(before, now):
    if now is None:
        return "was deleted"
    if now[2] != before[2]:
        return "was replaced by another file"
    if now[0] != before[0]:
        return f"changed size from {before[0]} to {now[0]} bytes"
    return "was modified"


class HDF5Dataset(PackedDataset):
    """A packed ``.h5`` file; reads go through a numpy memmap (see NOTE [hdf5 memmap])."""

    format = "hdf5"
    _read = staticmethod(read_hdf5)


class ArrowDataset(PackedDataset):
    """A packed ``.arrow`` file, read zero-copy from a memory map."""

    format = "arrow"
    _read = staticmethod(read_arrow)


def open_dataset(
    path: str | os.PathLike, transform: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> HDF5Dataset | ArrowDataset:
    """Return the HDF5Dataset or ArrowDataset for ``path``, chosen by extension."""
    cls = HDF5Dataset if format_of(path) == "hdf5" else ArrowDataset
    return cls(path, transform=transform)
