"""fastdata.write(): any iterable of dicts -> one packed file of records of named fields, or a shard folder.

The schema is given (``{name: type name | Field}``) or taken from the first
record (fieldvalues.infer_field). Each record is checked against it whole
before any of its values is kept: a record that lacks a field, has one the
schema does not, or holds a value that does not fit is reported by its index
and the field's name (``on_error``), never stored in part. The file appears
only once complete (staging.py); a shard folder is recordshards.py's.
"""

import itertools
import os
import pickle
import time
import warnings
from functools import partial

from fastdata.converters.fieldvalues import Mismatch, infer_field
from fastdata.converters.parallel import ProgressBar, streamed_tasks
from fastdata.converters.recordshards import write_record_shards
from fastdata.converters.recordvalues import TASK_RECORDS, RecordColumns, encoded_or_mismatch, made_record
from fastdata.converters.report import ON_ERROR, ConversionReport, check_choice
from fastdata.converters.shards import container_of, is_folder_output
from fastdata.converters.staging import check_output, staged_output
from fastdata.converters.upload import remote_output
from fastdata.errors import OptionError, SampleError
from fastdata.formats import write_records
from fastdata.formats.records import RECORDS_KIND, make_schema, schema_to_json

_INFERRED_FROM = 64  # records looked at for the type of a field whose first values are None or empty


def write(records, out, schema=None, *, fn=None, workers=1, executor=None, on_error="raise", overwrite=False,
          progress=False, source=None, shard_size=None, format=None, resume=False, part=None,
          storage_options=None):
    """Write ``records`` (an iterable of dicts) to the packed file ``out`` (.h5, .hdf5 or .arrow), or shard folder.

    Args:
        records: dicts of field name -> value, one per record, every one with the same fields; with
            ``fn``, the inputs ``fn`` makes them from.
        out: the file to write, its extension picking the container; or, without such an extension, a
            shard folder: record files of about ``shard_size`` bytes (default 64 MiB) and index.json; or
            the URL of a shard folder (``s3://bucket/train/``, any fsspec URL), each shard uploaded as it
            is written, index.json last.
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
        resume: a shard folder: finish an interrupted conversion of the same records, keeping its intact
            shards; on a finished folder, redo the files missing or damaged.
        part: a shard folder: ``(i, n)`` writes only the shards ``k`` with ``k % n == i``, so n processes
            (or machines sharing the folder) convert one set together, each reading every record but
            encoding only its own; the last part to finish writes the index (or ``fastdata index OUT``).
        storage_options: a URL ``out``'s fsspec options (credentials, endpoint).

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
        >>> fastdata.write(paths, "photos/", fn=load_record, part=(0, 4), resume=True)  # one of 4 machines
    """
    check_choice("on_error", on_error, ON_ERROR)
    folder = is_folder_output(out)
    container = container_of(out, format)  # a bad format or an existing output fails before any work
    if not folder and (resume or part is not None):
        raise OptionError(f"resume and part need a shard folder, not the file {os.fspath(out)!r}; give a folder "
                          "name (without .h5, .hdf5 or .arrow) to write shards")
    remote = remote_output(out, storage_options, folder)
    if not folder:
        check_output(os.path.abspath(os.fspath(out)), overwrite)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise OptionError(f"workers should be a positive integer, got workers={workers!r}")
    if workers > 1 or executor is not None:
        _check_picklable(fn)
    started = time.perf_counter()
    inputs = iter(records)
    head = list(itertools.islice(inputs, _INFERRED_FROM))  # made here: they tell the schema
    made = [made_record(fn, item) for item in head]
    fields = make_schema(schema) if schema is not None else _told_schema(made)
    metadata = {"kind": RECORDS_KIND, "fields": schema_to_json(fields),
                **({"source": source} if source is not None else {})}
    total = len(records) if hasattr(records, "__len__") else None
    if folder:
        written = write_record_shards(
            out, inputs, head, made, fields, metadata, fn=fn, container=container, shard_size=shard_size,
            overwrite=overwrite, resume=resume, part=part, workers=workers, executor=executor,
            progress=progress, total=total, warn=partial(_bad_record, on_error=on_error), remote=remote)
        return ConversionReport(os.fspath(out), written.metadata["num_samples"],
                                [(item["path"], item["reason"]) for item in written.metadata["skipped"]],
                                time.perf_counter() - started, "record", finished=written.finished,
                                redone=list(written.redone))
    skipped = []
    columns = RecordColumns(fields)
    for index, values in enumerate(_all_encoded(fields, fn, made, inputs, workers, executor, progress, total)):
        if isinstance(values, Mismatch):
            _bad_record(index, str(values), on_error)
            skipped.append({"path": f"record {index}", "reason": str(values)})
        else:
            columns.add(values)
    metadata.update(num_samples=columns.num_samples, skipped=skipped, longest=columns.longest)
    with staged_output(out, overwrite) as (_, staged_path):
        write_records(staged_path, columns.finish(), metadata, fields)
    return ConversionReport(os.fspath(out), columns.num_samples, [(item["path"], item["reason"]) for item in skipped],
                            time.perf_counter() - started, "record")


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


def _all_encoded(fields, fn, made, inputs, workers, executor, progress, total):
    """Yield each record's encoded values (or its Mismatch), in input order: the first ones here, the rest in tasks.

    NOTE [records on workers]: a record's encoding (decoding, resizing and
    compressing its images) depends on the record alone, so it runs on any
    process and the results are put back in input order: the file is the
    same for any ``workers`` or executor. The inputs go out in tasks of
    TASK_RECORDS, a few in flight per worker (converters.parallel.streamed_tasks),
    so neither the inputs nor their values are ever all held before the file is
    written. A shard folder's tasks are whole shards instead (NOTE [record shards]).
    """
    yield from (encoded_or_mismatch(record, fields) for record in made)
    chunks = iter(lambda: list(itertools.islice(inputs, TASK_RECORDS)), [])
    with ProgressBar(total=total, initial=len(made), unit="record", disable=None if progress else True,
                     dynamic_ncols=True) as bar:
        for encoded in streamed_tasks(partial(_encode_chunk, fn, fields), chunks, executor=executor,
                                      workers=workers):
            yield from encoded
            bar.update(len(encoded))


def _encode_chunk(fn, fields, items):
    return [encoded_or_mismatch(made_record(fn, item), fields) for item in items]


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
