"""Packed file formats: the container is picked by the file's extension."""

import os

from fastdata.errors import FormatError
from fastdata.formats.arrow import (
    arrow_column_offsets,
    arrow_field_offset,
    read_arrow,
    read_arrow_checksums,
    read_arrow_metadata,
    read_arrow_records,
    write_arrow,
    write_arrow_records,
)
from fastdata.formats.hdf5 import (
    hdf5_column_offsets,
    hdf5_field_offset,
    read_hdf5,
    read_hdf5_checksums,
    read_hdf5_metadata,
    read_hdf5_records,
    write_hdf5,
    write_hdf5_records,
)
from fastdata.formats.layout import FORMAT_VERSION, Columns

_HDF5 = ("hdf5", write_hdf5, read_hdf5, read_hdf5_checksums, hdf5_column_offsets, read_hdf5_metadata,
         read_hdf5_records, lambda path, columns, metadata, fields: write_hdf5_records(path, columns, metadata),
         hdf5_field_offset)
_FORMATS = {
    ".h5": _HDF5,
    ".hdf5": _HDF5,
    ".arrow": ("arrow", write_arrow, read_arrow, read_arrow_checksums, arrow_column_offsets, read_arrow_metadata,
               read_arrow_records, write_arrow_records, arrow_field_offset),
}


def format_of(path):
    """Return "hdf5" or "arrow" for ``path``'s extension; raise FormatError otherwise."""
    return _lookup(path)[0]


def write_packed(path, columns, metadata):
    """Write a packed file in the format named by ``path``'s extension."""
    _lookup(path)[1](path, columns, metadata)


def read_packed(path, check=True):
    """Open a packed file of either format; return ``(columns, metadata)``.

    With ``check`` the offsets and labels are checked as well as the structure
    (a few numpy passes, see ``check_values``); FormatError names the file.
    """
    return _lookup(path)[2](path, check)


def read_checksums(path):
    """Return the file's stored ``{column name: uint32 chunk checksums}``; empty for format version 1."""
    return _lookup(path)[3](path)


def column_offsets(path):
    """Return ``(samples, labels)``: where the file's sample values and labels start, in bytes."""
    return _lookup(path)[4](path)


def field_offset(path, name):
    """Return where the values of the ragged field ``name`` of the record file at ``path`` start, in bytes."""
    return _lookup(path)[8](path, name)


def read_metadata(path):
    """Return the checked metadata of the packed file at ``path``, its arrays unread: what kind of file it is."""
    return _lookup(path)[5](path)


def read_records(path):
    """Open a record file of either format; return ``({field name: FieldColumn}, {field name: Field}, metadata)``.

    A (sample, label) file reads as the records of its implied schema (NOTE [samples as records] in records.py).

    Raises:
        FormatError: the file is not a complete record file or (sample, label) file (a damaged one), naming it.
    """
    return _lookup(path)[6](path)


def write_records(path, columns, metadata, fields):
    """Write record ``columns`` of ``fields`` in the format named by ``path``'s extension."""
    _lookup(path)[7](path, columns, metadata, fields)


def _lookup(path):
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in _FORMATS:
        raise FormatError(
            f"{os.fspath(path)!r}: unknown extension {ext!r}; use .h5, .hdf5 or .arrow"
        )
    return _FORMATS[ext]


__all__ = ["FORMAT_VERSION", "Columns", "column_offsets", "field_offset", "format_of", "read_checksums",
           "read_metadata", "read_packed", "read_records", "write_packed", "write_records"]
