"""Map-style datasets over packed files, opened lazily in each process.

NOTE [lazy open]: a dataset keeps only its path and JSON metadata until it is
first read in a process. The memory maps are then opened in that process
(and again after a fork, detected by the pid), so the object pickles in
bytes into DataLoader workers under fork, spawn or forkserver, and no file
handle or mapping is shared across processes. All per-sample state (labels,
offsets, pixels) lives in numpy arrays over the memory map, never in Python
lists or dicts, so workers do not copy pages by touching refcounts and their
memory stays flat over an epoch.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from fastdata.converters._parallel import default_workers
from fastdata.formats import format_of
from fastdata.formats.arrow import read_arrow
from fastdata.formats.hdf5 import read_hdf5
from fastdata.images import decode_jpeg


class PackedDataset(Dataset):
    """Map-style view of a file written by a fastdata converter.

    Items are ``(image, label)``: image a uint8 tensor ``[3, H, W]``, label an
    int. ``transform``, if given, is applied to each image tensor.
    """

    format = None  # "hdf5" or "arrow", set by subclasses

    def __init__(self, path, transform=None):
        self.path = os.fspath(path)
        _, self.metadata = self._read(self.path)  # validate once, keep no handle
        self.transform = transform
        self.kind = self.metadata["kind"]
        self.storage = self.metadata.get("storage")
        self.sample_shape = tuple(self.metadata["sample_shape"])
        self._num_samples = self.metadata["num_samples"]
        self._columns, self._pid, self._threads = None, None, None

    @staticmethod
    def _read(path):
        raise NotImplementedError

    def _open(self):  # see NOTE [lazy open]
        if self._columns is None or self._pid != os.getpid():
            self._columns, _ = self._read(self.path)
            self._pid, self._threads = os.getpid(), None
        return self._columns

    @property
    def classes(self):
        """Class names; label ``i`` is ``classes[i]``."""
        return self.metadata.get("classes", [])

    @property
    def labels(self):
        """int64 labels ``[N]``, memory-mapped from the file."""
        return self._open().labels

    def __len__(self):
        return self._num_samples

    def __getitem__(self, index):
        """Return ``(image uint8 [3, H, W], label int)`` read on its own."""
        index = self._check_index(index)
        columns = self._open()
        if self.storage == "jpeg":
            start, stop = columns.offsets[index], columns.offsets[index + 1]
            image = torch.from_numpy(decode_jpeg(columns.samples[start:stop].tobytes()).transpose(2, 0, 1).copy())
        else:
            image = torch.from_numpy(np.array(columns.samples[index]))
        if self.transform is not None:
            image = self.transform(image)
        return image, int(columns.labels[index])

    def __getitems__(self, indices):
        """Return a list of ``(image, label)`` items, read as one sorted batch."""
        indices = np.asarray(indices, dtype=np.int64)
        order = np.argsort(indices, kind="stable")
        images, labels = self.read_batch(indices[order])
        caller = np.empty_like(order)
        caller[order] = np.arange(len(order))
        return [(images[i], int(labels[i])) for i in caller]

    def read_batch(self, indices, pin_memory=False):
        """Read a batch in one pass; return ``(images uint8 [B, 3, H, W], labels int64 [B])``.

        ``indices`` should be sorted for a single forward pass over the file;
        any order is read correctly. With ``pin_memory`` the images are
        written straight into page-locked memory.

        Raises:
            IndexError: an index is out of range.
        """
        indices = self._check_indices(np.asarray(indices, dtype=np.int64))
        columns = self._open()
        images = torch.empty((len(indices), *self.sample_shape), dtype=torch.uint8, pin_memory=pin_memory)
        if self.storage == "jpeg":
            self._decode_into(columns, indices, images.numpy())
        else:
            np.take(columns.samples, indices, axis=0, out=images.numpy())
        if self.transform is not None:
            images = torch.stack([self.transform(image) for image in images])
        return images, torch.from_numpy(columns.labels[indices])

    def _decode_into(self, columns, indices, out):
        # Pillow releases the GIL while decoding, so threads use every core.
        starts, stops = columns.offsets[indices], columns.offsets[indices + 1]
        values = columns.samples

        def decode(rows):
            for row in rows:
                decode_jpeg(values[starts[row] : stops[row]].tobytes(), out[row])

        threads = self._decode_threads()
        if threads == 1 or len(indices) < 2:
            decode(range(len(indices)))
            return
        if self._threads is None:
            self._threads = ThreadPoolExecutor(threads, thread_name_prefix="fastdata-decode")
        list(self._threads.map(decode, np.array_split(np.arange(len(indices)), threads)))

    def _decode_threads(self):
        # Inside DataLoader workers the processes already use the cores.
        return 1 if get_worker_info() is not None else default_workers()

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
        return {**self.__dict__, "_columns": None, "_pid": None, "_threads": None}

    def __repr__(self):
        shape = ",".join(map(str, self.sample_shape))
        return (
            f"<{type(self).__name__} {os.path.basename(self.path)!r} {self.format}: "
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


def open_dataset(path, transform=None):
    """Return the HDF5Dataset or ArrowDataset for ``path``, chosen by extension."""
    cls = HDF5Dataset if format_of(path) == "hdf5" else ArrowDataset
    return cls(path, transform=transform)
