"""One record -> the values its fields store (or the Mismatch saying why it does not fit); records -> columns.

Shared by the two ways fastdata.write lays records out: one file (records.py)
and a shard folder of independent tasks (recordshards.py).
"""

import numpy as np

from fastdata.converters.fieldvalues import Mismatch, encode
from fastdata.formats.records import FieldColumn

OFFSET_BYTES = 8  # a ragged field's int64 offset per record, besides its values
# Inputs per task on workers: small enough that every worker has work to the end. 3,000 64 px JPEG records
# into one file (workers=2, this 2-core VM, alternating fresh processes): 1,360-1,480 records/s in tasks of
# 256 against 1,455-1,557 for the ordered map's 64-record chunks before them; tasks of 64, 1,384-1,495
# against 1,174-1,458. A shard folder, tasks of 64: 1,321-1,569 against 1,070-1,526 before.
TASK_RECORDS = 64


def made_record(fn, item):
    """Return ``fn(item)`` (``item`` itself without ``fn``); a Mismatch where ``fn`` raises."""
    if fn is None:
        return item
    try:
        return fn(item)
    except Exception as exc:  # an input fn cannot use is a record that does not fit: on_error decides
        return Mismatch(f"fn raised {type(exc).__name__}: {exc}")


def encoded_or_mismatch(record, fields):
    """Return ``{name: stored value}`` of ``record`` (a dict, or the Mismatch ``made_record`` returned), or the
    Mismatch naming the field that does not fit."""
    if isinstance(record, Mismatch):
        return record
    try:
        return _encoded(record, fields)
    except Mismatch as exc:
        return exc


def stored_bytes(encoded, fields):
    """Return the bytes the encoded values of one record take in a file, offsets included."""
    return sum(value.nbytes for value in encoded.values()) + OFFSET_BYTES * sum(
        field.ragged for field in fields.values())


def _encoded(record, fields):
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


class RecordColumns:
    """The stored values of every field, gathered record by record, joined into FieldColumns at the end."""

    def __init__(self, fields):
        self.fields = fields
        self.values = {name: [] for name in fields}
        self.num_samples = self.nbytes = 0
        self.longest = {name: 0 for name, field in fields.items() if field.ragged}  # rows of the longest value

    def add(self, encoded):
        for name, value in encoded.items():
            self.values[name].append(value)
            self.nbytes += value.nbytes
        for name in self.longest:
            self.longest[name] = max(self.longest[name], len(encoded[name]))
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
