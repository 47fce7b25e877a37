"""Baselines that fastdata is measured against: what a user would write without it.

Raw files read and decoded per item (images, texts), the tutorial h5py
Dataset, per-sample Python objects (the memory baselines) and a plain
multiprocessing.Pool conversion. torch and h5py are imported on first use,
so benchmark scripts importing this stay light (see NOTE [light main] in
benchmarks/sections/images.py); the classes sit at module level so that spawned
DataLoader workers can unpickle them.
"""

from functools import partial

import numpy as np
from PIL import Image

from fastdata.measure.limits import ending_pool


def load_resized(path, size):
    """Decode ``path`` fully (no draft) and resize as torchvision's ``Resize(size)`` + ``CenterCrop(size)``.

    The shorter side becomes ``size`` (the longer one ``int(size * long /
    short)``), bilinear, then a centered crop with ``round((side - size) / 2)``
    offsets.

    Returns:
        uint8 ``[size, size, 3]``.
    """
    with Image.open(path) as img:
        img = img.convert("RGB")
    width, height = img.size
    if width <= height:
        new_size = (size, int(size * height / width))
    else:
        new_size = (int(size * width / height), size)
    img = img.resize(new_size, Image.Resampling.BILINEAR)
    left = int(round((new_size[0] - size) / 2.0))
    top = int(round((new_size[1] - size) / 2.0))
    return np.array(img.crop((left, top, left + size, top + size)))  # writable, as PILToTensor's copy


class RawFolderDataset:
    """Decode one image file per item with Pillow: the common ImageFolder-style baseline.

    Paths are a numpy array rather than a list, so DataLoader workers do not
    copy pages by touching refcounts. Items are ``(image uint8 [3, H, W], label int)``;
    the image is a permuted view, as torchvision's ``PILToTensor`` returns.
    """

    def __init__(self, paths, labels, size):
        self.paths = np.asarray(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.size = size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        import torch  # on first use, see the module docstring

        pixels = load_resized(str(self.paths[index]), self.size)
        return torch.from_numpy(pixels).permute(2, 0, 1), int(self.labels[index])


class RawFolderListDataset(RawFolderDataset):
    """RawFolderDataset with its paths in a Python list, as most tutorials keep them.

    Items are the same; each worker touches the reference count of every
    path it reads, which copies the pages holding those str objects.
    """

    def __init__(self, paths, labels, size):
        super().__init__(paths, labels, size)
        self.paths = [str(path) for path in paths]


def plain_pool(workers):
    """Return a ``multiprocessing.Pool`` of ``workers`` that SIGTERM ends (NOTE [forked SIGTERM] in _processes.py)."""
    return ending_pool(workers)


def pooled(pool, function, items, chunksize, ordered=True):
    """Yield ``function(item)`` of every item, computed on ``pool``; once every item is done, raise the first error.

    NOTE [pool errors at the end]: ``imap`` raises a worker's error as it
    arrives, and the ``with`` block of the pool then terminates workers that
    are still sending results. One killed while it held the result queue's
    lock left ``Pool.terminate`` waiting for that lock for good: a CI run of
    2026-11-29 hung in test_pool_decode_count_decodes_every_image until the
    test's 900 s timeout (the pool's task handler in ``outqueue.put``). So
    errors come back as values, and they are raised after the last item,
    when the workers are idle. A failed item yields nothing.
    """
    mapped = pool.imap if ordered else pool.imap_unordered
    error = None
    for failed, value in mapped(partial(_outcome, function), items, chunksize):
        if not failed:
            yield value
        elif error is None:
            error = value
    if error is not None:
        raise error


def _outcome(function, item):
    """Return ``(False, function(item))``, or ``(True, the exception it raised)``."""
    try:
        return False, function(item)
    except Exception as exc:
        return True, exc


def pool_decode(paths, size, workers):
    """Decode and resize every path on a plain ``multiprocessing.Pool``; return uint8 ``[N, size, size, 3]``.

    What a conversion script without fastdata does; Pool start-up is
    included, as such a script would pay it.
    """
    out = np.empty((len(paths), size, size, 3), np.uint8)
    chunksize = max(1, min(64, len(paths) // (workers * 8)))
    with plain_pool(workers) as pool:
        for index, pixels in enumerate(pooled(pool, partial(load_resized, size=size), paths, chunksize)):
            out[index] = pixels
    return out


class TutorialH5Dataset:
    """What most h5py tutorials show: open the file in ``__init__``, index it per item.

    Items are ``(dset[index] uint8 [3, H, W] ndarray, label int)``; the labels
    are read into memory once. Only safe with 0 workers (an open HDF5 handle
    does not survive fork).
    """

    def __init__(self, path, name="samples"):
        import h5py  # on first use, see the module docstring

        self.file = h5py.File(path, "r")
        self.samples = self.file[name]
        self.labels = self.file["labels"][:]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index], int(self.labels[index])

    def close(self):
        self.file.close()


class RawTextDataset:
    """Read and tokenize one ``.txt`` file per item: the raw-text baseline.

    Items are ``(ids int64 [L], label int)``, encoded by ``tokenizer`` (e.g.
    the one a packed file was converted with) as the converter reads them.
    """

    def __init__(self, paths, labels, tokenizer):
        self.paths = np.asarray(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        import torch  # on first use, see the module docstring

        with open(str(self.paths[index]), encoding="utf-8-sig") as f:
            ids = self.tokenizer.encode(f.read())
        return torch.from_numpy(ids), int(self.labels[index])


class PadCollate:
    """Collate ``(ids int64 [L], label)`` items into ``(ids [B, T], lengths [B], labels [B])``, padded with pad_id."""

    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, items):
        import torch
        from torch.nn.utils.rnn import pad_sequence

        ids = [item[0] for item in items]
        lengths = torch.tensor([len(i) for i in ids], dtype=torch.int64)
        labels = torch.tensor([item[1] for item in items], dtype=torch.int64)
        return pad_sequence(ids, batch_first=True, padding_value=self.pad_id), lengths, labels


class PerItem:
    """A dataset seen through ``__getitem__`` only, so a stock DataLoader reads it item by item."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]


# ---------------------------------------------------------------- memory baselines: per-sample Python objects


class PathListDataset:
    """One Python str per sample (``self.paths``), as an ImageFolder-style list keeps them.

    Items are ``(len(path), label)``: no file is read, so a pass measures
    what holding the per-sample objects costs, not decoding.
    """

    def __init__(self, paths, labels):
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        return len(self.paths[index]), int(self.labels[index])


class RecordListDataset:
    """One Python dict per sample (``{"path": str, "label": int}``), as JSON-manifest datasets keep them."""

    def __init__(self, paths, labels):
        self.records = [{"path": path, "label": int(label)} for path, label in zip(paths, labels)]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        record = self.records[index]
        return len(record["path"]), record["label"]


class PathArrayDataset:
    """The same paths in one numpy array (``np.asarray(paths)``, fixed-width str) and labels int64 ``[N]``."""

    def __init__(self, paths, labels):
        self.paths = np.asarray(paths)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        return len(str(self.paths[index])), int(self.labels[index])
