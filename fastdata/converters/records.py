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
import pickle
import time
import warnings
from functools import partial

import numpy as np

from fastdata.converters.fieldvalues import Mismatch, encode, infer_field
from fastdata.converters.parallel import ordered_map, run_tasks
from fastdata.converters.report import ON_ERROR, ConversionReport, check_choice
from fastdata.converters.shards import DEFAULT_SHARD_BYTES, container_of, is_folder_output
from fastdata.converters.staging import check_output, staged_output
from fastdata.errors import OptionError, SampleError
from fastdata.formats import write_records
from fastdata.formats.records import RECORDS_KIND, FieldColumn, make_schema, schema_to_json
from fastdata.formats.shards import conversion_id, file_checksum, shard_name, write_index

_INFERRED_FROM = 64  # records looked at for the type of a field whose first values are None or empty
_TASK_RECORDS = 256  # inputs per task on an executor: see NOTE [records on workers]


def write(records, out, schema=None, *, fn=None, workers=1, executor=None, on_error="raise", overwrite=False,
          progress=False, source=None, shard_size=None, format=None):
    """Write ``records`` (an iterable of dicts) to the packed file ``out`` (.h5, .hdf5 or .arrow).

    Args:
        records: dicts of field name -> value, one per record, every one with the same fields; with
            ``fn``, the inputs ``fn`` makes them from.
        out: the file to write, its extension picking the container; or, without such an extension, a
            shard folder: record files of about ``shard_size`` bytes (default 64 MiB) and index.json.
        schema: ``{name: type}``, a type being one of "int", "float", "str", "bytes", "json",
            "tokens" or a ``fastdata.Field`` (images, arrays, ragged rows, dtypes); default: from the
            first records (see fieldvalues.infer_field).
        fn: a function of one input returning its record, run where the records are encoded (a
            top-level function, to run on workers); an input it raises on is a record that does not fit.
        workers: processes that run ``fn`` and encode the records (decode, resize, compress images).
            The file is the same, byte for byte, for any number of workers or executor.
        executor: a ``dask.distributed.Client`` or ``concurrent.futures`` executor to encode on
            instead of local workers.
        on_error: a record that does not fit the schema: "raise" (SampleError naming the record and
            field), "warn" or "skip" (left out, listed in the report and the file's metadata).
        overwrite: replace an existing ``out``.
        progress: show a progress bar.
        source: a JSON object describing where the records came from, kept in the file's metadata.
        shard_size: a shard folder's bytes per shard (see NOTE [record shards]).
        format: a shard folder's container, "hdf5" (default) or "arrow".

    Returns:
        ConversionReport: the records written and every record left out, with why.

    Raises:
        OptionError: a bad schema, or the first records' types cannot be told (pass a schema).
        SampleError: with ``on_error="raise"``, the first record that does not fit.

    Example:
        >>> fastdata.write(({"image": path, "caption": text, "label": y} for path, text, y in rows), "pairs.h5",
        ...                schema={"image": Field("image", size=(64, 64), storage="jpeg"), "caption": "str",
        ...                        "label": "int"})
        >>> fastdata.write(paths, "photos.arrow", fn=load_record, workers=8)  # load_record(path) -> dict
    """
    check_choice("on_error", on_error, ON_ERROR)
    folder = is_folder_output(out)
    container = container_of(out, format)  # a bad format or an existing output fails before any work
    check_output(os.path.abspath(os.fspath(out)), overwrite or (folder and os.path.isdir(out) and not os.listdir(out)),
                 folder)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise OptionError(f"workers should be a positive integer, got workers={workers!r}")
    if workers > 1 or executor is not None:
        _check_picklable(fn)
    started = time.perf_counter()
    inputs = iter(records)
    head = list(itertools.islice(inputs, _INFERRED_FROM))  # made here: they tell the schema
    made = [_made(fn, item) for item in head]
    fields = make_schema(schema) if schema is not None else _told_schema(made)
    encoded = _all_encoded(fields, fn, made, inputs, workers, executor, progress)
    kept, skipped = _kept(encoded, on_error)
    metadata = {"kind": RECORDS_KIND, "num_samples": 0, "fields": schema_to_json(fields), "skipped": skipped,
                **({"source": source} if source is not None else {})}
    if folder:
        with staged_output(out, overwrite, folder=True) as (_, staged_root):
            count = _write_shards(staged_root, kept, fields, metadata, container, shard_size or DEFAULT_SHARD_BYTES)
    else:
        columns = _Columns(fields)
        for _, values in kept:
            columns.add(values)
        count = metadata["num_samples"] = columns.num_samples
        metadata["longest"] = columns.longest
        with staged_output(out, overwrite) as (_, staged_path):
            write_records(staged_path, columns.finish(), metadata, fields)
    return ConversionReport(os.fspath(out), count, [(item["path"], item["reason"]) for item in skipped],
                            time.perf_counter() - started, "record")


def _kept(encoded, on_error):
    """Return ``(an iterator of (input index, encoded values) of the records kept, the list of those left out)``.

    The list fills as the iterator is consumed: each record left out is applied ``on_error`` to then.
    """
    skipped = []

    def kept():
        for index, values in enumerate(encoded):
            if isinstance(values, Mismatch):
                _bad_record(index, str(values), on_error)
                skipped.append({"path": f"record {index}", "reason": str(values)})
            else:
                yield index, values

    return kept(), skipped


def _write_shards(root, kept, fields, metadata, container, shard_bytes):
    """Write the records of ``kept`` into shards of about ``shard_bytes`` in ``root``, then index.json; return how many.

    NOTE [record shards]: a shard is cut once its encoded values reach
    ``shard_bytes``, in input order, so the shards are the same for any
    number of workers; only one shard's values are held at a time (besides
    the chunks local workers have in flight; an executor's results are
    gathered first: NOTE [records on workers]). Each shard is a record file whose ``shard`` records the conversion id (a
    digest of the schema, container and shard size), its number and its
    inputs (NOTE [shard identity] in formats/shards.py).
    """
    settings = {"fields": metadata["fields"], "container": container, "shard_size": shard_bytes}
    conversion = conversion_id(settings)
    shards, columns, first, count, longest = [], _Columns(fields), 0, 0, {}

    def flush(stop):
        number = len(shards)
        name = shard_name(number, container)
        own = {**metadata, "num_samples": columns.num_samples, "skipped": [], "longest": dict(columns.longest),
               "shard": {"conversion": conversion, "number": number, "inputs": [first, stop]}}
        longest.update({key: max(longest.get(key, 0), value) for key, value in columns.longest.items()})
        path = os.path.join(root, name)
        write_records(path, columns.finish(), own, fields)
        shards.append({"name": name, "num_samples": own["num_samples"], "bytes": os.path.getsize(path),
                       "crc32": file_checksum(path), "number": number, "inputs": [first, stop]})

    index = -1
    for index, values in kept:
        columns.add(values)
        count += 1
        if columns.nbytes >= shard_bytes:
            flush(index + 1)
            columns, first = _Columns(fields), index + 1
    if columns.num_samples or not shards:
        flush(index + 1 if index >= 0 else 0)
    metadata.update(num_samples=count, longest=longest)
    write_index(root, container, metadata, settings, shards, conversion=conversion)
    return count


def _made(fn, item):
    """Return ``fn(item)`` (``item`` itself without ``fn``); a Mismatch where ``fn`` raises."""
    if fn is None:
        return item
    try:
        return fn(item)
    except Exception as exc:  # an input fn cannot use is a record that does not fit: on_error decides
        return Mismatch(f"fn raised {type(exc).__name__}: {exc}")


def _told_schema(head):
    """Return the schema the first records ``head`` tell (a field's first value that is not None or empty)."""
    records = [record for record in head if isinstance(record, dict)]
    if not head:
        raise OptionError("records is empty and no schema was given: pass schema= to write an empty file")
    if not records or not isinstance(head[0], dict):
        first = head[0]
        raise OptionError(f"records should be dicts of field name -> value; record 0 is "
                          f"{first if isinstance(first, Mismatch) else type(first).__name__}")
    fields = {}
    for name, value in records[0].items():
        told = next((record[name] for record in records if _tells(record.get(name))), value)
        fields[name] = infer_field(told, name)
    return make_schema(fields)


def _all_encoded(fields, fn, made, inputs, workers, executor, progress):
    """Yield each record's encoded values (or its Mismatch), in input order: the first ones here, the rest on workers.

    NOTE [records on workers]: a record's encoding (decoding, resizing and
    compressing its images) depends on the record alone, so it runs on any
    process and the results are put back in input order: the file is the
    same for any ``workers`` or executor. Local workers stream them in
    order (converters.parallel.ordered_map: a few chunks in flight per
    worker), so a shard folder holds one shard's values at a time; an
    executor (Dask) runs tasks of _TASK_RECORDS inputs and its results are
    gathered whole before they are written.
    """
    yield from (_encoded_or_mismatch(record, fields) for record in made)
    if workers == 1 and executor is None:
        yield from (_encode_one(fn, fields, item) for item in inputs)
        return
    rest = list(inputs)
    if executor is None:
        yield from ordered_map(partial(_encode_one, fn, fields), rest, workers=workers, progress=progress,
                               unit="record")
        return
    tasks = [(fn, fields, rest[start : start + _TASK_RECORDS]) for start in range(0, len(rest), _TASK_RECORDS)]
    results = run_tasks(_encode_task, [(number, task) for number, task in enumerate(tasks)],
                        [len(task[2]) for task in tasks], executor=executor, workers=workers, progress=progress,
                        unit="record")
    for _, encoded in sorted(results, key=lambda result: result[0]):
        yield from encoded


def _encode_task(numbered):
    number, (fn, fields, items) = numbered
    return number, [_encode_one(fn, fields, item) for item in items]


def _encode_one(fn, fields, item):
    return _encoded_or_mismatch(_made(fn, item), fields)


def _encoded_or_mismatch(record, fields):
    if isinstance(record, Mismatch):
        return record
    try:
        return _encoded(record, fields)
    except Mismatch as exc:
        return exc


def _check_picklable(fn):
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise OptionError(f"fn should be a top-level function to run on workers ({type(exc).__name__}: {exc}); "
                          "define it at a module's top level, or pass workers=1") from exc


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
