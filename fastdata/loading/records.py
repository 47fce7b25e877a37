"""RecordDataset: a file (or shard folder) of records of named fields, read as dicts and as dict batches.

A (sample, label) file of the image or text converter opens as records too:
``image`` (or ``tokens``) and ``label``, read from its own columns by the
decoders its pairs are read with (NOTE [samples as records] in formats/records.py).

A batch is one dict: fixed fields stacked (``int`` int64 ``[B]``, ``float``
``[B]``, ``array`` ``[B, *shape]``, images uint8 ``[B, C, H, W]`` (C 3, or 1 grey), decoded
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
import pickle

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided
from PIL import Image
from torch.utils.data import Dataset

from fastdata.errors import FormatError, OptionError
from fastdata.formats import Columns, field_offset, format_of, read_checksums, read_records
from fastdata.formats.records import LENGTHS_SUFFIX, longest_values, schema_of_metadata
from fastdata.formats.shards import read_index, shard_differences, shard_mismatch
from fastdata.loading.batchreads import checked_indices
from fastdata.loading.decoders import JpegImageDecoder, RawImageDecoder
from fastdata.loading.slots import ALIGN
from fastdata.reading.kernel import advise_column, check_pattern, hint_spans, sharded_spans
from fastdata.reading.remote import cached_shards, check_prefetch
from fastdata.storage.urls import is_url, read_remote_index

_NO_LABELS = np.empty(0, np.int64)  # the image decoders read Columns' samples and offsets only
_GATHER_WIDTH = 256  # ragged rows up to this long are gathered at once: NOTE [short rows at once]
_WIDENED = ("uint16", "uint32", "uint64")  # read as int64: torch computes on these dtypes poorly
_OPEN_AT_URL = 8  # shards a process keeps mapped of a folder at a URL: NOTE [records at a URL]


class RecordDataset(Dataset):
    """Map-style view of a record file written by ``fastdata.write``: items are dicts.

    A file (or shard folder) of (image, label) or (tokens, label) pairs written by ``fastdata convert``
    reads as records of ``image`` (or ``tokens``) and ``label`` (NOTE [samples as records]).

    Args:
        path: a .h5, .hdf5 or .arrow record file, or a shard folder of them (NOTE [record shards]), or
            the URL of such a folder (NOTE [records at a URL]).
        fields: the names of the fields to read (default: all); the others are never touched.
        storage_options, cache_dir, cache_limit, prefetch: a URL's, as PackedDataset's.

    Raises:
        FormatError: the file is not a complete record file or (sample, label) file.
        OptionError: ``fields`` names a field the file does not have.
    """

    kind = "records"
    read_options = ("threads",)  # the image fields' copies and decodes

    def __init__(self, path, fields=None, index=None, *, storage_options=None, cache_dir=None, cache_limit=None,
                 prefetch=None):
        self.path = os.fspath(path)
        self.is_remote, self.prefetch = is_url(self.path), prefetch
        self._source = None  # a URL's CachedShards: see NOTE [records at a URL]
        if self.is_remote:
            check_prefetch(prefetch)
            self._index = index if index is not None else read_remote_index(self.path, storage_options)
            self._source = cached_shards(self._index, storage_options, cache_dir, cache_limit)
        elif (storage_options, cache_dir, cache_limit, prefetch) != (None,) * 4:
            raise OptionError(f"storage_options, cache_dir, cache_limit and prefetch apply to URLs, not {self.path!r}")
        if self.is_remote or os.path.isdir(self.path):  # a shard folder (NOTE [record shards])
            self._index = index if index is not None else self._index if self.is_remote else read_index(self.path)
            self.format, self.metadata = self._index.container, self._index.metadata
            self.schema = schema_of_metadata(self.metadata, self.path)
            self._files = [self._index.path(shard) for shard in range(self._index.num_shards)]  # a URL's: remote
            self._starts = self._index.starts
        else:
            self._index, self.format = None, format_of(self.path)
            _, self.schema, self.metadata = read_records(self.path)  # checked once, here
            self._files, self._starts = [self.path], np.array([0, self.metadata["num_samples"]], np.int64)
        self.fields = _picked(fields, self.schema, self.path)
        self._num_samples = self.metadata["num_samples"]
        self._identities = None if self.is_remote else [_identity(path) for path in self._files]
        self._recent = []  # a URL's open shards, least recently opened first
        self.fingerprint = _fingerprint(self.path, self.metadata, self._index)
        self._shards, self._decoders, self._pid = None, None, None
        self._advice = None  # (tokens field, access pattern) set on every shard mapped: see ``TokenField.advise``

    def __repr__(self):
        described = ", ".join(_described(name, self.schema[name]) for name in self.fields)
        name = os.path.basename(os.path.normpath(self.path))
        return f"<RecordDataset {name!r} {self.format}: {self._num_samples} records, {described}>"

    def __len__(self):
        return self._num_samples

    def changed_files(self):
        """Return ``{path: what changed}`` of this dataset's local files that are no longer the ones it opened."""
        changed = {}
        for path, opened in zip(self._files, self._identities or ()):
            try:
                now = _identity(path)
            except FileNotFoundError:
                changed[path] = "was deleted"
                continue
            if now != opened:
                changed[path] = "changed (its size, modification time or inode)"
        return changed

    @property
    def shard_index(self):
        """The ShardIndex of a shard folder (None for one file)."""
        return self._index

    @property
    def shard_paths(self):
        """Paths of the record files behind the dataset, in record order: ``[path]`` for a file."""
        return list(self._files)

    @property
    def shard_starts(self):
        """int64 ``[S + 1]``: the first record of each shard, then the number of records."""
        return self._starts

    @property
    def shard_source(self):
        """A URL's CachedShards (reading/sources.py); None for local files."""
        return self._source

    def __getstate__(self):
        return {**self.__dict__, "_shards": None, "_decoders": None, "_pid": None, "_recent": []}

    def _open(self, shard):
        """Return the picked columns of ``shard``, mapped in this process, checked against the file and the index.

        Raises:
            FormatError: the file changed since the dataset was made, or is not the shard the index lists.
        """
        path = self._files[shard]
        if self._identities is not None and _identity(path) != self._identities[shard]:
            raise FormatError(f"{path!r} changed since it was opened (size, modification time or inode); a "
                              "packed file must not change while it is read: open it again (open_dataset)")
        if self._shards is None or self._pid != os.getpid():
            self._shards, self._pid, self._recent = [None] * len(self._files), os.getpid(), []
            self._decoders = _image_decoders(self.schema, self.fields, self.path)
            if self.is_remote:  # a forked worker: fsspec's async file systems are not fork-safe
                self._source.cache.fs = pickle.loads(pickle.dumps(self._source.cache.fs))
        if self._shards[shard] is None:
            columns, _, metadata = self._fetched(shard) if self.is_remote else read_records(path)
            if self._index is not None:
                mismatch = shard_mismatch(self._index, shard, metadata)
                differ = shard_differences(metadata, self.metadata)
                if mismatch is None and differ:
                    mismatch = f"differs from the dataset in {', '.join(differ)}"
                if mismatch is not None:
                    raise FormatError(f"{path!r} {mismatch}; restore the folder, or write it again")
            self._shards[shard] = {name: columns[name] for name in self.fields}
            if self._advice is not None:
                advise_column(np.asarray(columns[self._advice[0]].values), self._advice[1])
        return self._shards[shard]

    def _fetched(self, shard):
        """Return ``read_records`` of ``shard``'s verified copy in the cache, mapped; see NOTE [records at a URL].

        NOTE [records at a URL]: a shard of a record folder at a URL is
        fetched into the local ShardCache on first touch (verified against
        the index), held while it is mapped, then released: its mapping
        stays valid where the cache later evicts (unlinks) the copy, and the
        bytes are the index's. At most _OPEN_AT_URL shards stay mapped per
        process, least recently opened closed first, so the disk held by
        evicted copies stays bounded. A loader fetches the shards its order
        reads next and chooses a block order that fits the cache, as for
        (sample, label) folders (NOTE [remote read-ahead] and NOTE [remote
        shuffle] in reading/remote.py).
        """
        path = self._source.cache.hold(shard)
        try:
            found = read_records(path)
        finally:
            self._source.cache.release(shard)
        self._recent.append(shard)
        if len(self._recent) > _OPEN_AT_URL:
            self._shards[self._recent.pop(0)] = None
        return found

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
        if len(self._files) == 1:
            batch = self._read_part(0, indices, threads)
        else:
            shards = np.searchsorted(self._starts, indices, side="right") - 1
            parts = [(np.flatnonzero(shards == shard), shard) for shard in np.unique(shards).tolist()]
            batch = _merged([(rows, self._read_part(shard, indices[rows] - self._starts[shard], threads))
                             for rows, shard in parts], len(indices), self._picked_schema())
        if pin_memory:
            batch = {name: value.pin_memory() if isinstance(value, torch.Tensor) else value
                     for name, value in batch.items()}
        return batch

    def token_field(self, name):
        """Return the TokenField of the tokens field ``name``: its values seen as a text dataset's documents."""
        return TokenField(self, name)

    def _read_part(self, shard, indices, threads):
        """Return the dict batch of rows ``indices`` (checked, in range) of ``shard``."""
        columns, path = self._open(shard), self._files[shard]
        batch = {}
        for name, field in self._picked_schema().items():
            column = columns[name]
            if field.type == "image":
                batch[name] = self._images(name, field, column, indices, threads, path)
            elif field.type in ("tokens", "ragged"):
                batch[name], batch[name + LENGTHS_SUFFIX] = _padded(column, indices, field)
            elif field.type in ("str", "bytes", "json"):
                batch[name] = _byte_values(column, indices, field.type, name, path)
            else:
                values = np.take(np.asarray(column.values), indices, axis=0)
                batch[name] = torch.from_numpy(values.astype(np.int64) if values.dtype.name in _WIDENED else values)
        return batch

    def _images(self, name, field, column, indices, threads, path):
        decoder = self._decoders.get(name)
        if decoder is None:  # PNG: Pillow, one image at a time
            return _png_images(column, indices, field, name, path)
        (images,) = decoder.batch(Columns(column.values, _NO_LABELS, column.offsets), indices, threads=threads)
        return images

    def max_batch_bytes(self, batch_size, **options):
        """Return the most bytes of the tensors of a batch of ``batch_size`` (each aligned as a slot stores it).

        Ragged fields are bounded by their longest value, which the writer records (``longest``; a text file of
        pairs: ``lengths``); a file without it returns None: its batches cross processes as torch pickles them.
        Text and JSON (lists) travel beside the slot and count nothing.
        """
        longest, total = longest_values(self.metadata), 0
        for name, field in self._picked_schema().items():
            if field.type in ("str", "bytes", "json"):
                continue
            if field.type == "image":
                row = field.channels * field.size[0] * field.size[1]
            elif field.type in ("tokens", "ragged"):
                if longest is None or name not in longest:
                    return None
                itemsize = 8 if field.type == "tokens" or field.dtype in _WIDENED else np.dtype(field.dtype).itemsize
                row = longest[name] * int(np.prod(field.row_shape, dtype=np.int64)) * itemsize
                total += batch_size * 8 + ALIGN  # its lengths
            else:
                row = int(np.prod(field.row_shape, dtype=np.int64)) * (8 if field.dtype in _WIDENED else
                                                                      field.stored_dtype.itemsize)
            total += batch_size * row + ALIGN
        return total


class TokenField:
    """A RecordDataset's tokens field seen as a text dataset's documents (one value, one document): what
    TokenSequences asks of either (``lengths``, ``nbytes``, ``read_token_ranges``, ``advise``, ``will_need``,
    ``done_with``), and what its window reads ask of a field (``values``, ``file_offsets``)."""

    def __init__(self, dataset, name):
        self.dataset, self.name = dataset, name

    @property
    def lengths(self):
        """int64 ``[N]``: the length of every value (its offsets, every shard)."""
        dataset = self.dataset
        return np.concatenate([np.diff(np.asarray(dataset._open(shard)[self.name].offsets))
                               for shard in range(len(dataset._files))]).astype(np.int64)

    @property
    def nbytes(self):
        """Bytes of the stored ids (what decides a block order); None at a URL, whose shards are fetched as its
        index says."""
        dataset = self.dataset
        if dataset.is_remote:
            return None
        ids = sum(int(offsets[-1] - offsets[0]) for offsets in
                  (np.asarray(dataset._open(shard)[self.name].offsets) for shard in range(len(dataset._files))))
        return ids * dataset.schema[self.name].stored_dtype.itemsize

    def values(self):
        """Yield ``(first value, ids)`` of each shard: the index of its first value, and its values' ids back to back
        (a view of the mapped column)."""
        dataset = self.dataset
        for shard in range(len(dataset._files)):
            column = dataset._open(shard)[self.name]
            offsets = np.asarray(column.offsets)
            yield int(dataset._starts[shard]), np.asarray(column.values)[offsets[0] : offsets[-1]]

    def file_offsets(self):
        """Return where each shard's first stored id lies in its file, in bytes."""
        dataset = self.dataset
        itemsize = dataset.schema[self.name].stored_dtype.itemsize
        return [field_offset(path, self.name) + int(dataset._open(shard)[self.name].offsets[0]) * itemsize
                for shard, path in enumerate(dataset._files)]

    def advise(self, pattern):
        """Set the access ``pattern`` ("random" or "normal") of the ids in every shard: those mapped in this process
        and those mapped later (here or in workers the dataset is pickled into)."""
        check_pattern(pattern)
        dataset = self.dataset
        dataset._advice = (self.name, pattern)
        if dataset._shards is not None and dataset._pid == os.getpid():
            for columns in dataset._shards:
                if columns is not None:
                    advise_column(np.asarray(columns[self.name].values), pattern)

    def will_need(self, ranges, give=None):
        """Ask the kernel to read the ids of values ``[start, stop)`` of ``ranges`` now; see PackedDataset's."""
        return self.hint(ranges, "will_need", give)

    def done_with(self, ranges, drop=False):
        """Tell the kernel the ids of the values of ``ranges`` are not read again soon; see PackedDataset's."""
        self.hint(ranges, "drop" if drop else "done")

    def hint(self, ranges, hint, give=None):
        """Give the kernel a ``hint`` ("will_need", "done", "drop": reading/kernel.hint_spans) on the ids of values
        ``[start, stop)`` (int64 ``[K, 2]``, clipped to the dataset); return whether it was asked. ``give`` runs
        the kernel call, as PackedDataset.will_need's."""
        dataset = self.dataset
        ranges = np.clip(np.asarray(ranges, np.int64).reshape(-1, 2), 0, dataset._num_samples)
        ranges = ranges[ranges[:, 1] > ranges[:, 0]]
        if not len(ranges):
            return False
        starts, stops = sharded_spans(ranges, dataset._starts, lambda shards: (
            (np.asarray(column.values), np.asarray(column.offsets))
            for column in (dataset._open(shard)[self.name] for shard in shards)))
        return hint_spans(starts, stops, hint, give)

    def read_token_ranges(self, documents, starts, stops):
        """Return the ids ``starts[p]:stops[p]`` of value ``documents[p]`` for each piece ``p`` (int64 ``[P]`` each,
        in range), joined: int64 ``[sum(stops - starts)]``; a slice per piece."""
        dataset = self.dataset
        shards = np.searchsorted(dataset._starts, documents, side="right") - 1
        pieces = [None] * len(documents)
        for shard in np.unique(shards).tolist():
            column = dataset._open(shard)[self.name]
            values, offsets = np.asarray(column.values), np.asarray(column.offsets)
            mine = np.flatnonzero(shards == shard)
            bases = offsets[documents[mine] - dataset._starts[shard]]
            for piece, base, start, stop in zip(mine.tolist(), bases.tolist(), starts[mine].tolist(),
                                                stops[mine].tolist()):
                pieces[piece] = values[base + start : base + stop]
        return np.concatenate(pieces).astype(np.int64) if pieces else np.empty(0, np.int64)


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


def _fingerprint(path, metadata, index):
    """A 16-hex-digit digest of the metadata and the files' checksums: equal for copies, as NOTE [fingerprint]."""
    if index is not None:  # a folder: its index lists every shard's size and crc32
        described = {"metadata": metadata, "starts": index.starts.tolist(), "sizes": index.sizes.tolist(),
                     "checksums": list(index.checksums)}
    else:
        sums = {name: hashlib.sha256(values.tobytes()).hexdigest() for name, values in read_checksums(path).items()}
        described = {"metadata": metadata, "checksums": sums, "size": os.path.getsize(path)}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _merged(parts, count, fields):
    """Return one dict batch of ``count`` rows from the batches of ``parts``: ``[(batch rows, part batch)]``."""
    merged = {}
    for name in parts[0][1]:
        values = [(rows, part[name]) for rows, part in parts]
        if not isinstance(values[0][1], torch.Tensor):  # str, bytes, json: lists
            out = [None] * count
            for rows, items in values:
                for row, item in zip(rows.tolist(), items):
                    out[row] = item
            merged[name] = out
            continue
        first = values[0][1]
        shape = list(first.shape)
        if name in fields and fields[name].type in ("tokens", "ragged"):  # padded to each part's longest
            shape[1] = max(int(tensor.shape[1]) for _, tensor in values)
        out = torch.zeros((count, *shape[1:]), dtype=first.dtype)
        for rows, tensor in values:
            if tensor.dim() == 1:
                out[torch.from_numpy(rows)] = tensor
            else:
                out[torch.from_numpy(rows), : tensor.shape[1]] = tensor
        merged[name] = out
    return merged


def _described(name, field):
    if field.type == "image":
        return f"{name} image uint8[{field.channels},{field.size[0]},{field.size[1]}] {field.storage}"
    if field.type in ("array", "ragged", "tokens", "float"):
        dims = (["n"] if field.type == "ragged" else []) + [str(side) for side in field.shape or ()]
        return f"{name} {field.type} {field.dtype}" + (f"[{','.join(dims)}]" if dims else "")
    return f"{name} {field.type}"


def _image_decoders(schema, fields, path):
    decoders = {}
    for name in fields:
        field = schema[name]
        if field.type == "image" and field.storage in ("raw", "jpeg"):
            metadata = {"sample_shape": [field.channels, *field.size]}
            decoders[name] = (RawImageDecoder if field.storage == "raw" else JpegImageDecoder)(metadata, path)
    return decoders


def _padded(column, indices, field):
    """Return ``(values [B, T, *shape] zero-padded, lengths int64 [B])``.

    NOTE [short rows at once]: NOTE [token padding] in decoders.py found a
    slice copy per row faster than one gather for rows of 200-311 tokens.
    Short rows turn it around: 256 rows from a memmap of uint16 ids, the
    gather of every position under a length mask against the loop (us per
    batch, best of 300, 2 cores): rows of ~10 31 against 151, ~77 134
    against 162, ~300 498 against 205. So batches whose longest row is at
    most _GATHER_WIDTH are gathered at once (boxes, labels, captions' ids),
    longer ones row by row. Since a row is one window of a strided view
    (_gathered), medians of 7 rounds in turn (masked gather / windows /
    loop, 256 rows, /tmp/p32/pad5.py): uint16 ids of ~150 269 / 185 / 347
    us, ~200 297 / 173 / 274, ~300 264 / 255 / 261; float32 boxes [0-50, 4]
    359 / 220 / 217; int64 labels of 0-5 42 / 58 / 247 (the windows' fixed
    ~15 us); so _GATHER_WIDTH went from 96 to 256.
    """
    offsets, values = np.asarray(column.offsets), np.asarray(column.values)  # plain views: see NOTE [token padding]
    starts = offsets[indices]
    lengths = offsets[indices + 1] - starts
    width = int(lengths.max(initial=0))
    dtype = np.int64 if field.type == "tokens" or values.dtype.name in _WIDENED else values.dtype
    if width <= _GATHER_WIDTH:
        return torch.from_numpy(_gathered(values, starts, lengths, width, dtype)), torch.from_numpy(lengths)
    out = np.zeros((len(indices), width, *field.row_shape), dtype)
    for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        out[row, :length] = values[start : start + length]
    return torch.from_numpy(out), torch.from_numpy(lengths)


def _gathered(values, starts, lengths, width, dtype):
    """Return ``values`` rows ``[start, start + length)`` zero-padded to ``width``, as ``dtype``, in one gather.

    Each row is one window of ``width`` values (a gather of a strided view
    of overlapping windows: no index per value); the positions past its
    length are zeroed after, in the stored dtype: a multiply by the mask for
    integers, a masked copy for floats (a neighbour's NaN would survive a
    multiply). 256 rows of ~77 uint16 ids: 65 against 133 us for the masked
    gather of every position (best of 7 x 300 calls, 2 cores).
    """
    if not width:
        return np.zeros((len(starts), 0, *values.shape[1:]), dtype)
    safe = np.minimum(starts, len(values) - width)  # a window past the end starts earlier: its rows move below
    windows = as_strided(values, (len(values) - width + 1, width, *values.shape[1:]),  # read only: see writeable
                         (values.strides[0], *values.strides), writeable=False)
    taken = windows[safe]  # [B, width, *row_shape]: a copy
    for row in np.flatnonzero(safe != starts).tolist():
        start, length = int(starts[row]), int(lengths[row])
        taken[row, :length] = values[start : start + length]
    inside = (np.arange(width) < np.arange(width + 1)[:, None])[lengths]  # rows of a triangle: no broadcast
    inside = inside.reshape(*inside.shape, *(1,) * (taken.ndim - 2))
    if taken.dtype.kind in "fc":
        np.copyto(taken, 0, where=~inside)
    else:
        taken *= inside
    return taken.astype(dtype, order="C", copy=False)


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
    out = np.empty((len(indices), *field.size, field.channels), np.uint8)
    offsets, mode = column.offsets, field.mode or "RGB"
    for row, index in enumerate(indices.tolist()):
        data = column.values[offsets[index] : offsets[index + 1]]
        try:
            with Image.open(io.BytesIO(data)) as img:
                out[row] = np.asarray(img.convert(mode)).reshape(out.shape[1:])
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
