"""Check a file of records of named fields for damage, naming the damaged records: `fastdata verify` on one."""

import io
import json

import numpy as np
from PIL import Image

from fastdata.codecs.images import decode_jpeg
from fastdata.errors import FormatError
from fastdata.formats import read_checksums, read_records
from fastdata.formats.layout import format_samples, sample_ranges
from fastdata.formats.records import OFFSETS_SUFFIX, stored_record_columns
from fastdata.formats.schema import check_dataset_fields
from fastdata.verifyreport import Problem, VerifyReport, count_of, mismatched_chunks


def verify_records(path, quick=False):
    """Check the record file at ``path``: structure and offsets, checksums, and (unless ``quick``) every value.

    Images stored encoded must decode to their field's size, ``str`` values
    must be UTF-8 and ``json`` values JSON. Returns a VerifyReport whose
    samples are record indices.
    """
    report = VerifyReport(path, quick)
    try:
        columns, fields, metadata = read_records(path)  # offsets checked: a damaged one is a structure problem
        check_dataset_fields(metadata, path)
    except FormatError as exc:
        report.problems.append(Problem("structure", str(exc)))
        return report
    report.format_version, report.num_samples = metadata["format_version"], metadata["num_samples"]
    report.checked.append("structure and offsets")
    try:
        stored = read_checksums(path)
    except FormatError as exc:
        report.problems.append(Problem("checksum", str(exc)))
    else:
        _check_checksums(report, columns, metadata, stored)
    if not quick:
        for name, field in fields.items():
            _check_values(report, name, field, columns[name])
    return report


def _check_checksums(report, columns, metadata, stored):
    arrays = stored_record_columns(columns)
    for name, chunks, chunk_bytes in mismatched_chunks(report, metadata, arrays, stored):
        byte_ranges = [(start * chunk_bytes, min(stop * chunk_bytes, arrays[name].nbytes))
                       for start, stop in sample_ranges(chunks)]
        records = np.unique(np.concatenate([_records_in(name, start, stop, columns, report.num_samples)
                                            for start, stop in byte_ranges]))
        where = ", ".join(f"{start}-{stop - 1}" for start, stop in byte_ranges[:8])
        report.problems.append(Problem("checksum", f"column {name!r}: checksum mismatch in "
                                                   f"{count_of(len(chunks), 'chunk')} (bytes {where}): "
                                                   f"{format_samples(records)}", records))


def _records_in(name, start, stop, columns, num_samples):
    """Return the records whose stored bytes of column ``name`` overlap bytes ``start:stop``."""
    if name.endswith(OFFSETS_SUFFIX):  # offsets[i] bounds records i - 1 and i
        return np.arange(max(start // 8 - 1, 0), min(-(-stop // 8), num_samples))
    column = columns[name]
    row_bytes = max(1, column.values.nbytes // max(1, len(column.values)))
    first_row, stop_row = start // row_bytes, -(-stop // row_bytes)
    if column.offsets is None:
        return np.arange(first_row, min(stop_row, num_samples))
    first = np.searchsorted(column.offsets, first_row, side="right") - 1
    last = np.searchsorted(column.offsets, stop_row, side="left")
    return np.arange(max(first, 0), min(last, num_samples))


def _check_values(report, name, field, column):
    """Decode every value of a field stored encoded (images, text, JSON); report those that do not."""
    if field.type == "image" and field.storage != "raw":
        shape = (*field.size, field.channels)
        check, what = (lambda data: _image_shape(data, field.storage, field.mode or "RGB") == shape), \
            f"{field.storage} images decode to {field.size[0]}x{field.size[1]} {field.mode or 'RGB'}"
    elif field.type in ("str", "json"):
        check, what = (lambda data: _parses(data, field.type)), "UTF-8 text" if field.type == "str" else "JSON"
    else:
        return
    offsets, bad = column.offsets, []
    for index in range(len(offsets) - 1):
        try:
            ok = check(column.values[offsets[index] : offsets[index + 1]])
        except Exception:  # any decoder failure means the stored bytes are damaged
            ok = False
        if not ok:
            bad.append(index)
    report.checked.append(f"field {name!r}: {what}")
    if bad:
        bad = np.asarray(bad, np.int64)
        report.problems.append(Problem("values", f"field {name!r}: {format_samples(bad)}: not {what}", bad))


def _image_shape(data, storage, mode):
    """Return ``(height, width, channels)`` stored ``data`` decodes to; a stored image of another mode is damage."""
    if storage == "jpeg":
        return decode_jpeg(data, grey=mode == "L").shape
    with Image.open(io.BytesIO(bytes(data))) as img:
        img.load()
        return img.height, img.width, len(img.getbands()) if img.mode == mode else 0


def _parses(data, kind):
    text = bytes(data).decode("utf-8")
    if kind == "json":
        json.loads(text)
    return True
