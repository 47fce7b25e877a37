"""fastdata.write(): any iterable of dicts -> one packed file of records of named fields.

The schema is given (``{name: type name | Field}``) or taken from the first
record (fieldvalues.infer_field). Each record is checked against it whole
before any of its values is kept: a record that lacks a field, has one the
schema does not, or holds a value that does not fit is reported by its index
and the field's name (``on_error``), never stored in part. The file appears
only once complete (staging.py).
"""

import itertools
import os
import time
import warnings

import numpy as np

from fastdata.converters.fieldvalues import Mismatch, encode, infer_field
from fastdata.converters.report import ON_ERROR, ConversionReport, check_choice
from fastdata.converters.staging import staged_output
from fastdata.errors import OptionError, SampleError
from fastdata.formats import write_records
from fastdata.formats.records import RECORDS_KIND, FieldColumn, make_schema, schema_to_json

_INFERRED_FROM = 64  # records looked at for the type of a field whose first values are None or empty


def write(records, out, schema=None, *, on_error="raise", overwrite=False):
    """Write ``records`` (an iterable of dicts) to the packed file ``out`` (.h5, .hdf5 or .arrow).

    Args:
        records: dicts of field name -> value, one per record, every one with the same fields.
        out: the file to write; its extension picks the container.
        schema: ``{name: type}``, a type being one of "int", "float", "str", "bytes", "json",
            "tokens" or a ``fastdata.Field`` (images, arrays, ragged rows, dtypes); default: from the
            first records (see fieldvalues.infer_field).
        on_error: a record that does not fit the schema: "raise" (SampleError naming the record and
            field), "warn" or "skip" (left out, listed in the report and the file's metadata).
        overwrite: replace an existing ``out``.

    Returns:
        ConversionReport: the records written and every record left out, with why.

    Raises:
        OptionError: a bad schema, or the first record's types cannot be told (pass a schema).
        SampleError: with ``on_error="raise"``, the first record that does not fit.

    Example:
        >>> fastdata.write(({"image": path, "caption": text, "label": y} for path, text, y in rows), "pairs.h5",
        ...                schema={"image": Field("image", size=(64, 64), storage="jpeg"), "caption": "str",
        ...                        "label": "int"})
    """
    check_choice("on_error", on_error, ON_ERROR)
    started = time.perf_counter()
    fields, records = _schema(schema, iter(records))
    columns = _Columns(fields)
    skipped = []
    for index, record in enumerate(records):
        try:
            columns.add(_encoded(record, fields))
        except Mismatch as exc:
            _bad_record(index, str(exc), on_error)
            skipped.append((f"record {index}", str(exc)))
    metadata = {"kind": RECORDS_KIND, "num_samples": columns.num_samples, "fields": schema_to_json(fields),
                "skipped": [{"path": name, "reason": reason} for name, reason in skipped]}
    with staged_output(out, overwrite) as (_, staged_path):
        write_records(staged_path, columns.finish(), metadata, fields)
    return ConversionReport(os.fspath(out), columns.num_samples, skipped, time.perf_counter() - started, "record")


def _schema(schema, records):
    """Return ``({name: Field}, records)``: the schema given, or one told from the first records, and all records."""
    if schema is not None:
        return make_schema(schema), records
    head = list(itertools.islice(records, _INFERRED_FROM))
    if not head:
        raise OptionError("records is empty and no schema was given: pass schema= to write an empty file")
    if not isinstance(head[0], dict):
        raise OptionError(f"records should be dicts of field name -> value; record 0 is a {type(head[0]).__name__}")
    fields = {}
    for name, value in head[0].items():  # a field's first value that tells its type: not None, not empty
        told = next((record[name] for record in head if isinstance(record, dict) and _tells(record.get(name))), value)
        fields[name] = infer_field(told, name)
    return make_schema(fields), itertools.chain(head, records)


def _bad_record(index, reason, on_error):
    """Apply ``on_error`` to record ``index``, which does not fit the schema: raise SampleError, warn, or pass."""
    if on_error == "raise":
        raise SampleError(f"record {index}: {reason}; fix the record or the schema, or pass on_error='skip' to leave "
                          "it out", index=index)
    if on_error == "warn":
        warnings.warn(f"skipped record {index}: {reason}", stacklevel=3)


def _tells(value):
    return value is not None and not (isinstance(value, (list, tuple)) and not value)


def _encoded(record, fields):
    """Return ``{name: stored value}`` of ``record``; Mismatch naming the field that does not fit."""
    if not isinstance(record, dict):
        raise Mismatch(f"should be a dict of field name -> value, got {type(record).__name__}")
    missing = [name for name in fields if name not in record]
    extra = [name for name in record if name not in fields]
    if missing or extra:
        raise Mismatch("; ".join(
            ([f"lacks field(s) {', '.join(map(repr, missing))}"] if missing else [])
            + ([f"has field(s) {', '.join(map(repr, extra))} the schema does not (add them to the schema, or "
                "leave them out of the records)"] if extra else [])))
    encoded = {}
    for name, field in fields.items():
        try:
            encoded[name] = encode(field, record[name])
        except Mismatch as exc:
            raise Mismatch(f"field {name!r} ({field.type}) {exc}") from exc
    return encoded


class _Columns:
    """The stored values of every field, gathered record by record, joined into FieldColumns at the end."""

    def __init__(self, fields):
        self.fields = fields
        self.values = {name: [] for name in fields}
        self.num_samples = 0

    def add(self, encoded):
        for name, value in encoded.items():
            self.values[name].append(value)
        self.num_samples += 1

    def finish(self):
        """Return ``{name: FieldColumn}``; the gathered values are released as each column is joined."""
        columns = {}
        for name, field in self.fields.items():
            parts, self.values[name] = self.values[name], []
            empty = np.empty((0, *field.row_shape), field.stored_dtype)
            if not field.ragged:
                columns[name] = FieldColumn(np.stack(parts) if parts else empty)
                continue
            offsets = np.zeros(len(parts) + 1, np.int64)
            np.cumsum([len(part) for part in parts], out=offsets[1:])
            values = np.concatenate(parts) if parts else empty
            columns[name] = FieldColumn(values.astype(field.stored_dtype, copy=False), offsets)
        return columns
