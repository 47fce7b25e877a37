"""Packed layout in HDF5: contiguous, uncompressed datasets read through memmaps.

NOTE [hdf5 memmap]: h5py fancy indexing costs a library call per selection and
runs at tens of thousands of rows per second. Our datasets are contiguous and
uncompressed, so their bytes sit at a fixed file offset: after reading the
offsets once with h5py we close the file and map the bytes with numpy, which
copies a sorted batch at memory speed and holds no HDF5 handle across fork.
"""

import errno
import os

import h5py
import numpy as np

from fastdata.errors import FormatError, NotFoundError
from fastdata.formats.layout import (
    COLUMN_ALIGNMENT,
    METADATA_KEY,
    Columns,
    check_columns,
    check_values,
    checked_checksums,
    checksum_arrays,
    checksum_columns,
    decode_metadata,
    encode_metadata,
    stored_columns,
)
from fastdata.formats.records import (
    OFFSETS_SUFFIX,
    RECORDS_KIND,
    FieldColumn,
    check_record_columns,
    refuse_records,
    sample_records,
    schema_of_metadata,
    stored_record_columns,
)

_COPY_BYTES = 64 << 20  # write memmapped columns in slices of this many bytes
_CHECKSUMS = "checksums"  # group of uint32 datasets, one per stored column (see NOTE [checksums])
_HDF5_SLACK = 64 << 10  # room asked for besides the data: HDF5's headers (see NOTE [hdf5 full disk])
# What h5py raises reading damaged HDF5 metadata: a byte flipped in an object header gave KeyError ("unable to
# determine object type") or RuntimeError ("bad heap free list"), an object of the wrong kind TypeError.
_DAMAGED = (OSError, RuntimeError, KeyError, TypeError, ValueError)


def write_hdf5(path, columns, metadata):
    """Write ``columns``, ``metadata`` and the columns' chunk checksums to a new HDF5 file at ``path``.

    Raises:
        OSError: ENOSPC when the disk has no room for the file (see NOTE [hdf5 full disk]).
    """
    info, checksums = checksum_columns(columns)
    text = encode_metadata(metadata, info)
    _check_room(path, sum(a.nbytes for a in (*stored_columns(columns).values(), *checksums.values())) + len(text))
    # NOTE [aligned columns]: objects of the samples column's size or more start aligned (the samples among them);
    # a lower threshold aligned every small object too, and tripled a small shard (24,968 -> 81,924 bytes)
    threshold = max(1, min(COLUMN_ALIGNMENT, columns.samples.nbytes))
    with h5py.File(path, "w", libver="earliest", alignment_threshold=threshold,
                   alignment_interval=COLUMN_ALIGNMENT) as f:
        f.attrs[METADATA_KEY] = text
        for name, array in stored_columns(columns).items():
            _write_dataset(f, name, array)
        group = f.create_group(_CHECKSUMS)
        for name, sums in checksums.items():
            group.create_dataset(name, data=sums)


def write_hdf5_records(path, columns, metadata):
    """Write record ``columns`` (``{field name: FieldColumn}``), ``metadata`` and their checksums to ``path``.

    Each column is a contiguous dataset named as in records.py (``caption``,
    ``caption.offsets``), mapped by readers as the sample columns are.

    Raises:
        OSError: ENOSPC when the disk has no room for the file (see NOTE [hdf5 full disk]).
    """
    stored = stored_record_columns(columns)
    info, checksums = checksum_arrays(stored)
    text = encode_metadata(metadata, info)
    _check_room(path, sum(a.nbytes for a in (*stored.values(), *checksums.values())) + len(text))
    with h5py.File(path, "w", libver="earliest") as f:
        f.attrs[METADATA_KEY] = text
        for name, array in stored.items():
            _write_dataset(f, name, array)
        group = f.create_group(_CHECKSUMS)
        for name, sums in checksums.items():
            group.create_dataset(name, data=sums)


def read_hdf5_records(path):
    """Open a record HDF5 file; return ``({field name: FieldColumn}, {field name: Field}, metadata)`` as memmaps.

    A (sample, label) file reads as the records of its implied schema (NOTE [samples as records] in records.py).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        FormatError: the file is not a complete fastdata record file, or (sample, label) file.
    """
    path = os.fspath(path)
    fields = {}

    def names_of(f, metadata):
        if metadata["kind"] != RECORDS_KIND:
            return _sample_names(f)
        fields.update(schema_of_metadata(metadata, path))
        return [name + suffix for name, field in fields.items()
                for suffix in ("", *([OFFSETS_SUFFIX] if field.ragged else []))]

    metadata, layouts = _read_layouts(path, names_of)
    arrays = _mapped(path, layouts)
    if metadata["kind"] != RECORDS_KIND:
        return sample_records(_sample_columns(arrays, metadata, path, check=True), metadata, path)
    columns = {name: FieldColumn(arrays[name], arrays.get(name + OFFSETS_SUFFIX)) for name in fields}
    check_record_columns(columns, fields, metadata["num_samples"], path)
    return columns, fields, metadata


def read_hdf5_metadata(path):
    """Return the checked metadata of the packed HDF5 file at ``path`` (its arrays unread)."""
    return _read_layouts(path, lambda f, metadata: [])[0]


def _read_layouts(path, names_of):
    """Return ``(metadata, {name: dataset layout})`` of the datasets ``names_of(file, metadata)`` names.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        FormatError: the file is not a readable fastdata HDF5 file, or a dataset named is missing.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise NotFoundError(f"{path!r} does not exist")
    try:
        with h5py.File(path, "r") as f:
            metadata = decode_metadata(f.attrs.get(METADATA_KEY), path)
            return metadata, {name: _dataset_layout(f, name, path) for name in names_of(f, metadata)}
    except FormatError:
        raise
    except _DAMAGED as exc:
        raise FormatError(
            f"{path!r} is not a readable HDF5 file (truncated, corrupt or not "
            f"HDF5): {exc}. Re-run \"fastdata convert\"."
        ) from exc


def _check_room(path, data_bytes):
    """Raise ENOSPC unless the disk of ``path`` has room for a file of ``data_bytes`` and HDF5's own.

    NOTE [hdf5 full disk]: when the disk fills while HDF5 flushes its
    metadata at close, h5py raises RuntimeError ("Disable slist on flush
    dest failure failed ... errno = 28"), not OSError, and then often
    crashes the process with SIGSEGV freeing the file's ids: 4 of 17 disk
    sizes (300-700 KiB tmpfs, text shards of 32 KiB) crashed, 3 more raised
    RuntimeError. Arrow raised OSError at every size. So the room is checked
    before HDF5 writes anything; HDF5's own bytes were 4-8 KiB (measured
    for 1 to 10,000 samples), _HDF5_SLACK covers them. Another process
    filling the disk meanwhile can still hit the crash.
    """
    stat = os.statvfs(os.path.dirname(os.path.abspath(path)))
    free, needed = stat.f_bavail * stat.f_frsize, data_bytes + _HDF5_SLACK
    if free < needed:
        raise OSError(errno.ENOSPC, f"{needed} bytes needed, {free} free", os.fspath(path))


def _write_dataset(f, name, array):
    # Contiguous and uncompressed so that readers can memory-map it.
    dset = f.create_dataset(name, shape=array.shape, dtype=array.dtype)
    if array.size == 0:
        return
    row_bytes = max(1, array.nbytes // len(array))
    step = max(1, _COPY_BYTES // row_bytes)
    for start in range(0, len(array), step):
        dset[start : start + step] = array[start : start + step]


def read_hdf5(path, check=True):
    """Open a packed HDF5 file; return ``(columns, metadata)`` as memmaps.

    With ``check`` the offsets and labels are checked too (``check_values``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        FormatError: the file is not a complete fastdata HDF5 file.
    """
    path = os.fspath(path)

    def names_of(f, metadata):
        refuse_records(metadata, path)
        return _sample_names(f)

    metadata, layouts = _read_layouts(path, names_of)
    return _sample_columns(_mapped(path, layouts), metadata, path, check), metadata


def _sample_names(f):
    """Return the datasets of a (sample, label) file ``f``: samples, labels, and offsets where samples are ragged."""
    return ["samples", "labels"] + (["offsets"] if "offsets" in f else [])


def _mapped(path, layouts):
    """Return ``{name: memmap}`` of the dataset ``layouts`` of the file at ``path``."""
    file_size = os.path.getsize(path)
    return {name: _map(path, file_size, *layout) for name, layout in layouts.items()}


def _sample_columns(arrays, metadata, path, check):
    """Return the checked Columns of a (sample, label) file's mapped ``arrays``; with ``check``, its values too."""
    columns = Columns(arrays["samples"], arrays["labels"], arrays.get("offsets"))
    check_columns(columns, metadata, path)
    if check:
        check_values(columns, metadata, path)
    return columns


def read_hdf5_checksums(path):
    """Return the stored ``{column name: uint32 chunk checksums}``; empty for a version 1 file.

    Raises:
        FormatError: the checksum group is damaged (h5py's own errors name no file: see read_checksums).
    """
    path = os.fspath(path)
    try:
        with h5py.File(path, "r") as f:
            group = f.get(_CHECKSUMS)
            if group is None:
                return {}
            if not isinstance(group, h5py.Group):
                raise FormatError(f"{path!r}: its {_CHECKSUMS!r} object is not a group of checksums; the file is "
                                  "damaged")
            return {name: checked_checksums(_dataset_values(group, name, path), name, path) for name in group}
    except FormatError:
        raise
    except _DAMAGED as exc:
        raise FormatError(f"{path!r}: cannot read the stored checksums ({type(exc).__name__}: {exc}); the file "
                          "is damaged") from exc


def _dataset_values(group, name, path):
    item = group.get(name)
    if not isinstance(item, h5py.Dataset):
        raise FormatError(f"{path!r}: the stored checksums of column {name!r} are not a dataset; the file is damaged")
    return item[()]


def hdf5_column_offsets(path):
    """Return ``(samples, labels)``: the byte offsets of the file's sample and label columns."""
    with h5py.File(os.fspath(path), "r") as f:
        return int(f["samples"].id.get_offset() or 0), int(f["labels"].id.get_offset() or 0)


def hdf5_field_offset(path, name):
    """Return the byte offset of the values of the ragged field ``name`` of a record file (0: none stored)."""
    with h5py.File(os.fspath(path), "r") as f:
        return int(_dataset_layout(f, name, os.fspath(path))[0] or 0)


def _dataset_layout(f, name, path):
    dset = f.get(name)
    if not isinstance(dset, h5py.Dataset):
        raise FormatError(f"{path!r}: dataset {name!r} is missing" if dset is None else
                          f"{path!r}: {name!r} is not a dataset; the file is damaged")
    offset = dset.id.get_offset()
    if dset.chunks is not None or (offset is None and dset.size > 0):
        raise FormatError(f"{path!r}: dataset {name!r} is not contiguous; re-convert it")
    return offset, dset.dtype, dset.shape


def _map(path, file_size, offset, dtype, shape):
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    if offset + nbytes > file_size:
        raise FormatError(
            f"{path!r} is truncated ({file_size} bytes, data runs to "
            f"{offset + nbytes}). Re-run \"fastdata convert\"."
        )
    return np.memmap(path, mode="r", dtype=dtype, offset=offset, shape=shape)
