"""Packed layout in Apache Arrow IPC: one record batch, read zero-copy from a memory map.

Columns: ``sample`` (fixed_size_binary for fixed samples, large_binary for
ragged bytes, large_list<uint*> for ragged token ids) and ``label`` (int64).
The whole table is one record batch so that every column is a single
contiguous buffer in the file, which numpy can view without copying.
"""

import os

import numpy as np
import pyarrow as pa

from fastdata.errors import FormatError, NotFoundError
from fastdata.formats.layout import (
    COLUMN_ALIGNMENT,
    METADATA_KEY,
    Columns,
    check_columns,
    check_values,
    checksum_arrays,
    checksum_columns,
    decode_metadata,
    encode_metadata,
)
from fastdata.formats.records import (
    RECORDS_KIND,
    FieldColumn,
    check_record_columns,
    refuse_records,
    sample_records,
    schema_of_metadata,
    stored_record_columns,
)

_CHECKSUMS = METADATA_KEY + ".checksums."  # + column name: little-endian uint32 bytes (see NOTE [checksums])
_PADDING = METADATA_KEY + ".padding"  # spaces that start the record batch's body on COLUMN_ALIGNMENT
_MAGIC_BYTES = 8  # "ARROW1" and its padding, before the schema message


def write_arrow(path, columns, metadata):
    """Write ``columns``, ``metadata`` and the columns' chunk checksums to a new Arrow IPC file at ``path``."""
    columns = Columns(
        columns.samples,
        np.ascontiguousarray(columns.labels, dtype=np.int64),
        None if columns.offsets is None else np.ascontiguousarray(columns.offsets, dtype=np.int64),
    )
    info, checksums = checksum_columns(columns)
    samples = _sample_array(columns)
    labels = pa.array(columns.labels)
    schema_metadata = {METADATA_KEY: encode_metadata(metadata, info)}
    schema_metadata.update({_CHECKSUMS + name: sums.astype("<u4").tobytes() for name, sums in checksums.items()})
    batch = _aligned_batch(samples, labels, schema_metadata)
    schema = batch.schema
    with pa.OSFile(os.fspath(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


def _aligned_batch(samples, labels, schema_metadata):
    """Return the record batch of ``samples`` and ``labels`` whose body (the samples first) starts aligned.

    The body follows the magic, the schema message and the batch's own
    message; the schema's padding entry grows the schema by the bytes
    missing (multiples of 8, as Arrow keeps every offset). See NOTE
    [aligned columns] in layout.py.
    """
    padding = b""
    for _ in range(2):  # the second pass only confirms
        schema = pa.schema([("sample", samples.type), ("label", pa.int64())],
                           metadata={**schema_metadata, _PADDING: padding})
        batch = pa.record_batch([samples, labels], schema=schema)
        body = sum(-(-buffer.size // 8) * 8 for column in batch.columns for buffer in column.buffers()
                   if buffer is not None)
        start = _MAGIC_BYTES + len(schema.serialize()) + pa.ipc.get_record_batch_size(batch) - body
        missing = -start % COLUMN_ALIGNMENT
        if not missing or not samples.nbytes:
            return batch
        padding += b" " * missing
    return batch


def arrow_column_offsets(path):
    """Return ``(samples, labels)``: the byte offsets of the values of the sample and label columns (0: empty)."""
    with pa.memory_map(os.fspath(path), "r") as source:
        whole = source.read_buffer()
        batch = pa.ipc.open_file(whole).get_batch(0)
        values = batch.column("sample").buffers()[-1]  # fixed size binary's values; ragged samples' too
        labels = batch.column("label").buffers()[1]
        return tuple(0 if buffer is None or not buffer.size else buffer.address - whole.address
                     for buffer in (values, labels))


def arrow_field_offset(path, name):
    """Return the byte offset of the values of the ragged field ``name`` of a record file (0: none stored)."""
    with pa.memory_map(os.fspath(path), "r") as source:
        whole = source.read_buffer()
        array = pa.ipc.open_file(whole).get_batch(0).column(name)
        if pa.types.is_large_list(array.type):
            array = array.values
        buffer = array.buffers()[-1]  # a list's primitive values; a string's or binary's bytes
        return 0 if buffer is None or not buffer.size else buffer.address - whole.address


def _sample_array(columns):
    n = columns.num_samples
    values = pa.py_buffer(np.ascontiguousarray(columns.samples))
    if not columns.ragged:
        row_bytes = columns.samples.nbytes // n if n else 0
        return pa.FixedSizeBinaryArray.from_buffers(pa.binary(row_bytes), n, [None, values])
    offsets = pa.py_buffer(columns.offsets)
    if columns.samples.dtype == np.uint8:
        return pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, offsets, values])
    child = pa.Array.from_buffers(
        pa.from_numpy_dtype(columns.samples.dtype), len(columns.samples), [None, values]
    )
    return pa.LargeListArray.from_buffers(pa.large_list(child.type), n, [None, offsets], children=[child])


def read_arrow(path, check=True):
    """Open a packed Arrow file; return ``(columns, metadata)`` viewing its memory map.

    With ``check`` the offsets and labels are checked too (``check_values``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        FormatError: the file is not a complete fastdata Arrow file.
    """
    metadata, batch = _open_batch(path)
    refuse_records(metadata, path)
    return _sample_columns(batch, metadata, path, check), metadata


def _sample_columns(batch, metadata, path, check):
    """Return the checked Columns of a (sample, label) file's record ``batch``; with ``check``, its values too."""
    if batch.schema.names != ["sample", "label"]:
        raise FormatError(f"{path!r}: unexpected columns {batch.schema.names}")
    try:
        columns = _columns(batch, metadata, path)
    except FormatError:
        raise
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise FormatError(
            f"{path!r} is damaged: its columns cannot be read ({exc}). Re-run \"fastdata convert\"."
        ) from exc
    check_columns(columns, metadata, path)
    if check:
        check_values(columns, metadata, path)
    return columns


def _open_batch(path):
    """Return ``(metadata, record batch)`` of the Arrow file at ``path``, checked as far as its structure.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        FormatError: the file is not a readable fastdata Arrow file.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise NotFoundError(f"{path!r} does not exist")
    try:
        reader = pa.ipc.open_file(pa.memory_map(path, "r"))
        schema_metadata = reader.schema.metadata or {}
        metadata = decode_metadata(schema_metadata.get(METADATA_KEY.encode()), path)
        if reader.num_record_batches != 1:
            raise FormatError(f"{path!r}: expected one record batch, found {reader.num_record_batches}")
        return metadata, reader.get_batch(0)
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(
            f"{path!r} is not a readable Arrow IPC file (truncated, corrupt or "
            f"not Arrow): {exc}. Re-run \"fastdata convert\"."
        ) from exc


def read_arrow_metadata(path):
    """Return the checked metadata of the packed Arrow file at ``path``."""
    return _open_batch(path)[0]


def read_arrow_checksums(path):
    """Return the stored ``{column name: uint32 chunk checksums}``; empty for a version 1 file."""
    path = os.fspath(path)
    try:
        with pa.memory_map(path, "r") as source:
            schema_metadata = pa.ipc.open_file(source).schema.metadata or {}
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"{path!r}: cannot read the stored checksums ({exc}); the file is damaged") from exc
    prefix = _CHECKSUMS.encode()
    stored = {}
    for key, value in schema_metadata.items():
        if key.startswith(prefix):
            name = key[len(prefix) :].decode(errors="backslashreplace")
            if len(value) % 4:
                raise FormatError(f"{path!r}: the stored checksums of column {name!r} are {len(value)} bytes, not "
                                  "whole uint32 values; the file is damaged")
            stored[name] = np.frombuffer(value, dtype="<u4").astype(np.uint32)
    return stored


def _columns(batch, metadata, path):
    samples = batch.column("sample")
    labels = batch.column("label").to_numpy(zero_copy_only=True)
    n = len(samples)
    if pa.types.is_fixed_size_binary(samples.type):
        dtype = np.dtype(metadata["sample_dtype"])
        flat = _view(samples.buffers()[1], np.uint8, n * samples.type.byte_width, "samples", path)
        return Columns(flat.view(dtype).reshape(n, *metadata["sample_shape"]), labels)
    offsets = _view(samples.buffers()[1], np.int64, n + 1, "offsets", path)
    if pa.types.is_large_binary(samples.type):  # all the stored bytes: check_values compares the last offset
        buffer = samples.buffers()[2]
        values = _view(buffer, np.uint8, 0 if buffer is None else buffer.size, "samples", path)
    else:
        values = samples.values.to_numpy(zero_copy_only=True)
    return Columns(values, labels, offsets)


def _view(buffer, dtype, count, name, path):
    """Return ``count`` items of ``dtype`` viewing ``buffer``; FormatError if it holds fewer (a damaged file)."""
    if buffer is None or count == 0:
        return np.empty(0, dtype)
    if not 0 < count <= buffer.size // np.dtype(dtype).itemsize:
        raise FormatError(
            f"{path!r} is damaged: column {name!r} should hold {count} items of {np.dtype(dtype).name} but its "
            f"buffer has {buffer.size} bytes (a damaged length). Re-run \"fastdata convert\"."
        )
    return np.frombuffer(buffer, dtype=dtype, count=count)


def write_arrow_records(path, columns, metadata, fields):
    """Write record ``columns`` (``{name: FieldColumn}`` of ``fields``), ``metadata`` and checksums to ``path``.

    One Arrow column per field, of Arrow's own types (int64, float, string,
    binary, fixed-size and large lists), so any Arrow reader sees the values;
    the schema's metadata holds fastdata's.
    """
    info, checksums = checksum_arrays(stored_record_columns(columns))
    schema_metadata = {METADATA_KEY: encode_metadata(metadata, info)}
    schema_metadata.update({_CHECKSUMS + name: sums.astype("<u4").tobytes() for name, sums in checksums.items()})
    n = metadata["num_samples"]
    arrays = [_field_array(columns[name], field, n) for name, field in fields.items()]
    schema = pa.schema([(name, array.type) for name, array in zip(fields, arrays)], metadata=schema_metadata)
    batch = pa.record_batch(arrays, schema=schema)
    with pa.OSFile(os.fspath(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


def _field_array(column, field, n):
    """Return the Arrow array of one field's ``column`` (values viewed, not copied)."""
    values = np.ascontiguousarray(column.values)
    if field.type in ("str", "json", "bytes", "image") and field.ragged:
        kind = pa.large_string() if field.type in ("str", "json") else pa.large_binary()
        return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(column.offsets), pa.py_buffer(values)])
    rows = _rows_array(values, field.row_shape)
    if not field.ragged:
        return rows
    return pa.LargeListArray.from_buffers(pa.large_list(rows.type), n, [None, pa.py_buffer(column.offsets)],
                                          children=[rows])


def _rows_array(values, row_shape):
    """Return ``values`` ``[rows, *row_shape]`` as an Arrow array of rows: primitive, or fixed-size lists."""
    flat = pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), values.size, [None, pa.py_buffer(values)])
    width = int(np.prod(row_shape, dtype=np.int64))
    if not row_shape:
        return flat
    return pa.FixedSizeListArray.from_arrays(flat, width) if width else pa.FixedSizeListArray.from_buffers(
        pa.list_(flat.type, 0), len(values), [None], children=[flat])


def read_arrow_records(path):
    """Open a record Arrow file; return ``({field name: FieldColumn}, {field name: Field}, metadata)``, zero-copy.

    A (sample, label) file reads as the records of its implied schema (NOTE [samples as records] in records.py).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        FormatError: the file is not a complete fastdata record file, or (sample, label) file.
    """
    metadata, batch = _open_batch(path)
    if metadata["kind"] != RECORDS_KIND:
        return sample_records(_sample_columns(batch, metadata, path, check=True), metadata, path)
    fields = schema_of_metadata(metadata, path)
    n = metadata["num_samples"]
    columns = {}
    for name, field in fields.items():
        if name not in batch.schema.names:
            raise FormatError(f"{path!r}: the column of field {name!r} is missing; the file is damaged")
        try:
            columns[name] = _field_column(batch.column(name), field, n, name, path)
        except (pa.ArrowException, ValueError, TypeError, AttributeError, IndexError) as exc:
            raise FormatError(f"{path!r}: field {name!r} cannot be read as its schema says ({exc}); the file is "
                              "damaged") from exc
    check_record_columns(columns, fields, n, path)
    return columns, fields, metadata


def _field_column(array, field, n, name, path):
    if len(array) != n or array.null_count or array.offset:
        raise FormatError(f"{path!r}: field {name!r} holds {len(array)} values ({array.null_count} null) for {n} "
                          "records; the file is damaged")
    if not field.ragged:
        return FieldColumn(_rows_values(array, field, len(array), name, path))
    offsets = _view(array.buffers()[1], np.int64, n + 1, name + ".offsets", path)
    if pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type):
        buffer = array.buffers()[2]
        return FieldColumn(_view(buffer, np.uint8, 0 if buffer is None else buffer.size, name, path), offsets)
    if not pa.types.is_large_list(array.type):
        raise FormatError(f"{path!r}: field {name!r} is stored as {array.type}, not a large list; the file is "
                          "damaged")
    rows = int(offsets[-1]) if n else 0
    return FieldColumn(_rows_values(array.values, field, rows, name, path), offsets)


def _rows_values(array, field, rows, name, path):
    """Return the numpy view ``[rows, *row_shape]`` of a primitive or fixed-size-list Arrow ``array``."""
    shape = field.row_shape
    if shape:
        array = array.values
    dtype = field.stored_dtype
    if pa.from_numpy_dtype(dtype) != array.type:
        raise FormatError(f"{path!r}: field {name!r} holds {array.type} values, its schema says {dtype}; the file "
                          "is damaged")
    count = rows * int(np.prod(shape, dtype=np.int64))
    return _view(array.buffers()[1], dtype, count, name, path).reshape(rows, *shape)
