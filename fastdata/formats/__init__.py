"""Packed file formats: the container is picked by the file's extension."""

import os

from fastdata.errors import FormatError
from fastdata.formats.arrow import arrow_column_offsets, read_arrow, read_arrow_checksums, write_arrow
from fastdata.formats.hdf5 import hdf5_column_offsets, read_hdf5, read_hdf5_checksums, write_hdf5
from fastdata.formats.layout import FORMAT_VERSION, Columns

_FORMATS = {
    ".h5": ("hdf5", write_hdf5, read_hdf5, read_hdf5_checksums, hdf5_column_offsets),
    ".hdf5": ("hdf5", write_hdf5, read_hdf5, read_hdf5_checksums, hdf5_column_offsets),
    ".arrow": ("arrow", write_arrow, read_arrow, read_arrow_checksums, arrow_column_offsets),
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


def _lookup(path):
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in _FORMATS:
        raise FormatError(
            f"{os.fspath(path)!r}: unknown extension {ext!r}; use .h5, .hdf5 or .arrow"
        )
    return _FORMATS[ext]


__all__ = ["FORMAT_VERSION", "Columns", "column_offsets", "format_of", "read_checksums", "read_packed", "write_packed"]
