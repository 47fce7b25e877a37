"""RecordDataset: a file of records of named fields, read as dicts and as dict batches.

A batch is one dict: fixed fields stacked (``int`` int64 ``[B]``, ``float``
``[B]``, ``array`` ``[B, *shape]``, images uint8 ``[B, 3, H, W]``, decoded
per batch where stored encoded), ``tokens`` and ``ragged`` fields padded with
zeros to the batch's longest (``[B, T]``, ``[B, T, *shape]``) beside their
lengths (``batch["tokens_lengths"]``, int64 ``[B]``), and ``str``, ``bytes``
and ``json`` fields as lists. Only the fields asked for (``fields=``) are
ever read. The file is opened lazily in each process and checked against
its fingerprint before every read, as PackedDataset's (NOTE [lazy open] and
NOTE [fingerprint] in datasets.py).
"""

import hashlib
import io
import json
import os

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from fastdata.errors import FormatError, OptionError
from fastdata.formats import Columns, format_of, read_checksums, read_records
from fastdata.formats.records import LENGTHS_SUFFIX
from fastdata.loading.batchreads import checked_indices
from fastdata.loading.decoders import JpegImageDecoder, RawImageDecoder

_NO_LABELS = np.empty(0, np.int64)  # the image decoders read Columns' samples and offsets only
_WIDENED = ("uint16", "uint32", "uint64")  # read as int64: torch computes on these dtypes poorly


class RecordDataset(Dataset):
    """Map-style view of a record file written by ``fastdata.write``: items are dicts.

    Args:
        path: a .h5, .hdf5 or .arrow record file.
        fields: the names of the fields to read (default: all); the others are never touched.

    Raises:
        FormatError: the file is not a complete record file.
        OptionError: ``fields`` names a field the file does not have.
    """

    kind = "records"
    is_remote = False
    read_options = ("threads",)  # the image fields' copies and decodes

    def __init__(self, path, fields=None):
        self.path = os.fspath(path)
        self.format = format_of(self.path)
        _, self.schema, self.metadata = read_records(self.path)  # checked once, here
        self.fields = _picked(fields, self.schema, self.path)
        self._num_samples = self.metadata["num_samples"]
        self._identity = _identity(self.path)
        self.fingerprint = _fingerprint(self.path, self.metadata)
        self._columns, self._decoders, self._pid = None, None, None

    def __repr__(self):
        described = ", ".join(_described(name, self.schema[name]) for name in self.fields)
        name = os.path.basename(self.path)
        return f"<RecordDataset {name!r} {self.format}: {self._num_samples} records, {described}>"

    def __len__(self):
        return self._num_samples

    def __getstate__(self):
        return {**self.__dict__, "_columns": None, "_decoders": None, "_pid": None}

    def _open(self):
        """Return the columns, mapped in this process; FormatError if the file changed since the dataset was made."""
        if _identity(self.path) != self._identity:
            raise FormatError(f"{self.path!r} changed since it was opened (size, modification time or inode); a "
                              "packed file must not change while it is read: open it again (open_dataset)")
        if self._columns is None or self._pid != os.getpid():
            columns, _, _ = read_records(self.path)
            self._columns = {name: columns[name] for name in self.fields}
            self._decoders, self._pid = _image_decoders(self.schema, self.fields, self.path), os.getpid()
        return self._columns

    def __getitem__(self, index):
        """Return record ``index`` as a dict: tensors for numbers, arrays and images; str, bytes or JSON values."""
        batch = self.read_batch(np.array([index], np.int64))
        return {name: _unbatched(batch, name, field) for name, field in self._picked_schema().items()}

    def __getitems__(self, indices):
        return [self[index] for index in indices]

    def _picked_schema(self):
        return {name: self.schema[name] for name in self.fields}

    def read_batch(self, indices, pin_memory=False, threads=None):
        """Return the records at ``indices`` as one dict batch (see the module's docstring)."""
        indices = checked_indices(np.asarray(indices, dtype=np.int64), self._num_samples, self.path)
        columns = self._open()
        batch = {}
        for name, field in self._picked_schema().items():
            column = columns[name]
            if field.type == "image":
                batch[name] = self._images(name, field, column, indices, threads)
            elif field.type in ("tokens", "ragged"):
                batch[name], batch[name + LENGTHS_SUFFIX] = _padded(column, indices, field)
            elif field.type in ("str", "bytes", "json"):
                batch[name] = _byte_values(column, indices, field.type, name, self.path)
            else:
                values = np.take(np.asarray(column.values), indices, axis=0)
                batch[name] = torch.from_numpy(values.astype(np.int64) if values.dtype.name in _WIDENED else values)
        if pin_memory:
            batch = {name: value.pin_memory() if isinstance(value, torch.Tensor) else value
                     for name, value in batch.items()}
        return batch

    def _images(self, name, field, column, indices, threads):
        decoder = self._decoders.get(name)
        if decoder is None:  # PNG: Pillow, one image at a time
            return _png_images(column, indices, field, name, self.path)
        (images,) = decoder.batch(Columns(column.values, _NO_LABELS, column.offsets), indices, threads=threads)
        return images

    def max_batch_bytes(self, batch_size, **options):
        """None: a record batch crosses processes as torch pickles it (its ragged fields have no bound)."""
        return None


def _picked(fields, schema, path):
    if fields is None:
        return tuple(schema)
    if isinstance(fields, str):
        fields = (fields,)
    unknown = [name for name in fields if name not in schema]
    if unknown or not fields:
        raise OptionError(f"fields={fields!r}: {path!r} has fields {', '.join(schema)}"
                          + (f", not {', '.join(map(repr, unknown))}" if unknown else ""))
    return tuple(dict.fromkeys(fields))


def _identity(path):
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


def _fingerprint(path, metadata):
    """A 16-hex-digit digest of the file's metadata and column checksums: equal for copies, as NOTE [fingerprint]."""
    sums = {name: hashlib.sha256(values.tobytes()).hexdigest() for name, values in read_checksums(path).items()}
    described = json.dumps({"metadata": metadata, "checksums": sums, "size": os.path.getsize(path)}, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def _described(name, field):
    if field.type == "image":
        return f"{name} image uint8[3,{field.size[0]},{field.size[1]}] {field.storage}"
    if field.type in ("array", "ragged", "tokens", "float"):
        dims = (["n"] if field.type == "ragged" else []) + [str(side) for side in field.shape or ()]
        return f"{name} {field.type} {field.dtype}" + (f"[{','.join(dims)}]" if dims else "")
    return f"{name} {field.type}"


def _image_decoders(schema, fields, path):
    decoders = {}
    for name in fields:
        field = schema[name]
        if field.type == "image" and field.storage in ("raw", "jpeg"):
            metadata = {"sample_shape": [3, *field.size]}
            decoders[name] = (RawImageDecoder if field.storage == "raw" else JpegImageDecoder)(metadata, path)
    return decoders


def _padded(column, indices, field):
    """Return ``(values [B, T, *shape] zero-padded, lengths int64 [B])``; see NOTE [token padding] in decoders.py."""
    offsets, values = np.asarray(column.offsets), np.asarray(column.values)  # plain views: see NOTE [token padding]
    starts = offsets[indices]
    lengths = offsets[indices + 1] - starts
    dtype = np.int64 if field.type == "tokens" or values.dtype.name in _WIDENED else values.dtype
    out = np.zeros((len(indices), int(lengths.max(initial=0)), *field.row_shape), dtype)
    for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        out[row, :length] = values[start : start + length]
    return torch.from_numpy(out), torch.from_numpy(lengths)


def _byte_values(column, indices, kind, name, path):
    """Return the values at ``indices`` of a str, bytes or json field as a list (one slice of a memoryview each)."""
    offsets, data = np.asarray(column.offsets), memoryview(np.asarray(column.values))
    bounds = zip(offsets[indices].tolist(), offsets[indices + 1].tolist())
    if kind == "bytes":
        return [data[start:stop].tobytes() for start, stop in bounds]
    try:
        texts = [str(data[start:stop], "utf-8") for start, stop in bounds]
        return texts if kind == "str" else [json.loads(text) for text in texts]
    except ValueError as exc:
        what = "JSON" if kind == "json" else "text"
        raise FormatError(f"{path!r}: a stored value of field {name!r} is not UTF-8 {what} ({exc}); the file is "
                          'damaged: run "fastdata verify" on it') from exc


def _png_images(column, indices, field, name, path):
    out = np.empty((len(indices), *field.size, 3), np.uint8)
    offsets = column.offsets
    for row, index in enumerate(indices.tolist()):
        data = column.values[offsets[index] : offsets[index + 1]]
        try:
            with Image.open(io.BytesIO(data)) as img:
                out[row] = np.asarray(img.convert("RGB"))
        except (OSError, ValueError) as exc:
            raise FormatError(f"{path!r}: the stored PNG of field {name!r}, record {index}, does not decode "
                              f"({type(exc).__name__}: {exc}); the file is damaged: write it again") from exc
    return torch.from_numpy(out).permute(0, 3, 1, 2)  # see NOTE [channels last] in decoders.py


def _unbatched(batch, name, field):
    value = batch[name]
    if field.type in ("tokens", "ragged"):
        return value[0, : int(batch[name + LENGTHS_SUFFIX][0])]
    if field.type in ("int", "float"):
        return value[0].item()
    return value[0]
