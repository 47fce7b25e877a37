"""A packed dataset as a Hugging Face ``datasets.Dataset``, built over its files' memory maps (``to_hf``).

NOTE [hf files]: Hugging Face does not open fastdata's files itself, and
the formats stay as they are. ``Dataset.from_file`` reads the Arrow IPC
*stream* format; fastdata writes the IPC *file* format (a footer locating
its one record batch, for random access), whose leading magic the stream
reader takes for a length ("Expected to read 1330795073 metadata bytes").
``load_dataset("hdf5", ...)`` reads every HDF5 dataset of a file as a
column of one length, and fastdata's ``checksums/`` group holds one entry
per 256 KiB chunk (a ragged file's ``offsets`` one more than its samples).

NOTE [hf columns]: each Arrow column Hugging Face is given views its file
through a pyarrow memory map (no copy; no file descriptor held, where an
HDF5 shard's numpy maps hold one per column: a folder of many shards would
pass the descriptor limit), cut into chunks of at most ``_CHUNK_ROWS``
rows and ``_CHUNK_BYTES`` bytes of samples. What Hugging Face's types need
and the files do not hold is made:

* raw images -> ``Array3D`` (uint8 ``[3, H, W]``): Hugging Face stores
  it as lists of lists with int32 offsets at each level, the same for
  every chunk of a length, so one set for the longest chunk serves all;
* JPEG images -> ``Image()``: the bytes with int32 offsets (4 bytes a
  sample) and a null ``path`` (one null column, shared);
* token ids -> ``List(Value(<stored dtype>))`` named ``input_ids``, int32
  offsets (4 bytes a sample);
* labels -> ``ClassLabel(names=classes)`` (``Value("int64")`` without class
  names): the label column itself.

Measured on this 2-core machine (numpy's allocations under tracemalloc and
pyarrow's allocator, around ``to_hf`` of one file): raw images keep only
the shared offsets, whatever the number of samples: 1.1 MB at 64 px
(20,000 samples, 246 MB; chunks of 1,365 rows), 2.2 MB at 32 px (100,000
samples), 0.33 MB at 224 px; 20,000 JPEGs 0.18 MB (9 bytes a sample: the
offsets and the null column, which stops growing at 65,536 rows); 10,000
texts 0.06 MB (6 bytes a sample). Each took 6-64 ms. A pickled copy
(``map(num_proc=...)``, DataLoader workers under spawn) carries every
byte of the table: Hugging Face pickles an in-memory table whole.
"""

import os

import numpy as np
import pyarrow as pa

from fastdata._optional import require
from fastdata.formats import column_offsets

_CHUNK_ROWS = 1 << 16  # see NOTE [hf columns]
_CHUNK_BYTES = 16 << 20  # bounds the shared offsets of raw images (NOTE [hf columns])
_SAMPLE_COLUMN = {"image": "image", "text": "input_ids"}


def to_hf(store, metadata, fingerprint):
    """Return a ``datasets.Dataset`` of the samples and labels of ``store``'s local shards (see NOTE [hf columns]).

    Args:
        store: the ShardStore of a local file or shard folder.
        metadata: the dataset's metadata (kind, storage, sample shape and dtype, classes).
        fingerprint: the dataset's fingerprint, Hugging Face's too (it would otherwise hash every byte).

    Raises:
        MissingDependencyError: ``datasets`` is not installed.
        FormatError: a file is damaged, or changed since the dataset was opened.
    """
    datasets = require("datasets", "integrations", "to_hf()")
    features = _features(datasets, metadata)
    sample_type = features.arrow_schema.field(0).type
    make = _chunk_maker(metadata, sample_type, store.index.num_samples)
    samples, labels = [], []
    for shard in range(store.index.num_shards):  # one shard's Columns (an HDF5 shard's descriptors) at a time
        columns, sample_bytes, label_bytes = _mapped(store, shard)
        for start, stop in _chunks(columns, metadata):
            samples.append(make(columns, sample_bytes, start, stop))
            labels.append(pa.Array.from_buffers(pa.int64(), stop - start,
                                                [None, label_bytes.slice(8 * start, 8 * (stop - start))]))
    table = pa.Table.from_arrays([pa.chunked_array(samples, sample_type), pa.chunked_array(labels, pa.int64())],
                                 schema=features.arrow_schema)
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint=fingerprint)


def _features(datasets, metadata):
    """Return the Features of a file's samples and labels: the types a Hugging Face user expects."""
    kind, storage, dtype = metadata["kind"], metadata.get("storage"), metadata["sample_dtype"]
    if kind == "text":
        sample = datasets.Sequence(datasets.Value(dtype))  # List(...) in datasets 4+
    elif storage == "jpeg":
        sample = datasets.Image()
    else:
        sample = datasets.Array3D(shape=tuple(metadata["sample_shape"]), dtype=dtype)
    classes = metadata.get("classes")
    label = datasets.ClassLabel(names=[str(name) for name in classes]) if classes else datasets.Value("int64")
    return datasets.Features({_SAMPLE_COLUMN[kind]: sample, "label": label})


def _mapped(store, shard):
    """Return ``(columns, samples, labels)`` of ``shard``: its checked Columns and its columns' bytes (pa.Buffer).

    The bytes are slices of one pyarrow map of the file, compared with the
    file the Columns were checked on once it is mapped (NOTE [fingerprint] in datasets.py).
    """
    columns = store.read_apart(shard)
    path = store.index.path(shard)
    samples_at, labels_at = column_offsets(path)
    whole = pa.memory_map(path, "r").read_buffer()
    store.check_unchanged(shard, os.stat(path))
    return columns, whole.slice(samples_at, columns.samples.nbytes), whole.slice(labels_at, 8 * columns.num_samples)


def _chunks(columns, metadata):
    """Yield the ``(start, stop)`` rows of each chunk: at most _CHUNK_ROWS rows and _CHUNK_BYTES bytes, or one row."""
    n, itemsize = columns.num_samples, np.dtype(metadata["sample_dtype"]).itemsize
    if not columns.ragged:
        step = _fixed_chunk_rows(metadata)
        yield from ((start, min(start + step, n)) for start in range(0, n, step))
        return
    offsets, start = columns.offsets, 0
    while start < n:
        within = int(np.searchsorted(offsets, offsets[start] + _CHUNK_BYTES // itemsize, side="right")) - 1
        stop = max(start + 1, min(start + _CHUNK_ROWS, within, n))
        yield start, stop
        start = stop


def _fixed_chunk_rows(metadata):
    row_bytes = int(np.prod(metadata["sample_shape"])) * np.dtype(metadata["sample_dtype"]).itemsize
    return max(1, min(_CHUNK_ROWS, _CHUNK_BYTES // max(1, row_bytes)))


def _chunk_maker(metadata, sample_type, num_samples):
    """Return ``make(columns, values, start, stop)``: rows ``start:stop`` as an Arrow array of ``sample_type``.

    ``values`` is the pa.Buffer of the shard's sample column (``_mapped``).
    """
    value_type = pa.from_numpy_dtype(np.dtype(metadata["sample_dtype"]))
    if metadata["kind"] == "text":
        def make(columns, values, start, stop):
            count, data = _ragged_values(columns, values, value_type.byte_width, start, stop)
            tokens = pa.Array.from_buffers(value_type, count, [None, data])
            return pa.ListArray.from_buffers(sample_type, stop - start, [None, _relative_offsets(columns, start, stop)],
                                             children=[tokens])
    elif metadata.get("storage") == "jpeg":
        paths = pa.nulls(min(num_samples, _CHUNK_ROWS), pa.string())  # no file behind the bytes: one null column

        def make(columns, values, start, stop):
            _, data = _ragged_values(columns, values, 1, start, stop)
            encoded = pa.Array.from_buffers(pa.binary(), stop - start,
                                            [None, _relative_offsets(columns, start, stop), data])
            return pa.StructArray.from_arrays([encoded, paths.slice(0, stop - start)], fields=list(sample_type))
    else:
        make = _raw_maker(metadata["sample_shape"], value_type, sample_type,
                          min(num_samples, _fixed_chunk_rows(metadata)))
    return make


def _raw_maker(shape, value_type, sample_type, longest):
    """Return ``make`` (as _chunk_maker) of Array3D's nested lists, their offsets shared by every chunk."""
    per_row = int(np.prod(shape))
    counts = np.cumprod([1, *shape[:-1]])  # lists per row at each level, outermost first
    shared = [pa.py_buffer(np.arange(longest * count + 1, dtype=np.int32) * size)
              for count, size in zip(counts, shape)]

    def make(columns, values, start, stop):
        rows = stop - start
        array = pa.Array.from_buffers(value_type, rows * per_row,
                                      [None, values.slice(start * per_row * value_type.byte_width,
                                                          rows * per_row * value_type.byte_width)])
        for count, offsets in zip(counts[::-1], shared[::-1]):
            array = pa.ListArray.from_buffers(pa.list_(array.type), rows * int(count), [None, offsets],
                                              children=[array])
        return pa.ExtensionArray.from_storage(sample_type, array)

    return make


def _relative_offsets(columns, start, stop):
    """Return int32 offsets of rows ``start:stop`` from their first value (a copy: 4 bytes a row)."""
    offsets = np.asarray(columns.offsets[start : stop + 1])
    return pa.py_buffer((offsets - offsets[0]).astype(np.int32))


def _ragged_values(columns, values, width, start, stop):
    """Return ``(count, buffer)``: the values of rows ``start:stop`` of a ragged column, a slice of ``values``."""
    first, last = int(columns.offsets[start]), int(columns.offsets[stop])
    return last - first, values.slice(first * width, (last - first) * width)
