"""fastdata.write into a shard folder: the plan, the task that writes one shard of records, and the index metadata.

NOTE [record shards]: the plan fixes how many inputs a shard holds, from
the bytes the first records encode to (those the schema was told from,
encoded in the driver: the same for any workers, part or run), so shard
``k`` holds inputs ``[k * n, (k + 1) * n)`` whatever else happens: any
engine writes it, the same bytes for 1 or 8 workers or Dask; a part
(``part=(i, m)``) writes the shards with ``k % m == i``; a resumed
conversion keeps each shard whose record and file are intact (NOTE
[shard records] in shards.py) and writes the rest. The driver reads the
inputs once, in order, handing each shard's inputs to a task (a few in
flight per worker), so it never holds them all; a shard's values live in
its task. The inputs may be any iterable: their count is known once they
are read, and the plan records it then, before the index is written (by
the last part to finish). Each shard file records the conversion id, its
number and its inputs (NOTE [shard identity] in formats/shards.py).
"""

import hashlib
import itertools
import pickle
from dataclasses import dataclass

from fastdata.converters.fieldvalues import Mismatch
from fastdata.converters.parallel import ProgressBar, streamed_tasks
from fastdata.converters.recordvalues import RecordColumns, encoded_or_mismatch, made_record, stored_bytes
from fastdata.converters.shardfolder import open_shard_folder
from fastdata.converters.shards import (
    DEFAULT_SHARD_BYTES,
    check_part,
    index_shards,
    samples_per_shard,
    save_record,
    write_shard,
)
from fastdata.errors import OptionError
from fastdata.formats.records import RECORDS_KIND
from fastdata.formats.shards import conversion_id


@dataclass(frozen=True)
class _RecordTask:
    """Inputs ``[start, start + len(items))`` -> shard ``number`` of ``root`` (picklable, for any engine)."""

    root: str
    number: int
    start: int
    items: list
    made: int  # leading items already made into records (the first records, which told the schema)
    fn: object
    fields: dict
    container: str
    on_error: str
    metadata: dict  # what every shard's metadata holds besides its own counts and place
    conversion: str


@dataclass(frozen=True)
class FolderWritten:
    """What write_record_shards did: the folder's index metadata (this part's counts while other parts run),
    whether the folder was already finished, and the files it redid."""

    metadata: dict
    finished: bool = False
    redone: tuple = ()


def write_record_shards(out, inputs, head, made, fields, metadata, *, fn, container, shard_size, on_error,
                        overwrite, resume, part, workers, executor, progress, total=None, warn=None):
    """Write the records of ``head`` + ``inputs`` into the shard folder ``out``; return a FolderWritten.

    Args:
        inputs: an iterator of the inputs after ``head``.
        head: the first inputs; ``made``: their records (``fn`` applied), which told the schema.
        fields: the schema; ``metadata``: the dataset metadata besides the counts (kind, fields, source).
        total: the number of inputs, if known (for the progress bar).
        warn: ``(index, reason) -> None``, applying ``on_error`` "raise" or "warn" to a record left out.

    Raises:
        OptionError: a bad ``shard_size`` or ``part``, or ``resume``/``part`` with inputs that cannot be
            pickled (their digest tells a resumed conversion it continues the same inputs).
    """
    shard_size = DEFAULT_SHARD_BYTES if shard_size is None else shard_size
    samples_per_shard(shard_size, 1)  # check both before any work
    check_part(part, overwrite)
    settings = {"kind": RECORDS_KIND, "fields": metadata["fields"], "container": container,
                "shard_size": shard_size, "first_inputs": _digest(head, resume or part is not None)}
    with open_shard_folder(out, settings, container=container, resume=resume, overwrite=overwrite,
                           part=part) as folder:
        damaged = folder.damaged_files() if folder.done else []  # see NOTE [resume checks what it keeps]
        if folder.done and not damaged:
            return FolderWritten(folder.finished_metadata(), finished=True)
        if damaged:
            folder.reopen(damaged)
        if folder.plan is None:
            folder.write_plan(_plan(settings, made, fields, metadata))
        per_shard = folder.plan["samples_per_shard"]
        counted, started = _Counted(itertools.chain(made, inputs)), []
        tasks = (_RecordTask(folder.root, number, start, items, max(0, min(len(made) - start, len(items))), fn,
                             fields, container, on_error, folder.plan["metadata"], folder.plan["conversion"])
                 for number, start, items in _shard_inputs(counted, per_shard, folder, part, started))
        records = []
        with folder.writing(started), ProgressBar(total=total, unit="record", disable=None if progress else True,
                                                  dynamic_ncols=True) as bar:
            for record in streamed_tasks(_write_record_shard, tasks, executor=executor, workers=workers):
                for index, reason in record["skipped"]:
                    warn(index, reason)
                records.append(record)
                bar.update(record["inputs"][1] - record["inputs"][0])
        folder.write_plan({**folder.plan, "num_inputs": counted.count})
        written = index_shards(folder.root, record_folder_metadata, missing_ok=part is not None)
    return FolderWritten(written or _part_metadata(records, metadata), redone=tuple(damaged))


def record_folder_metadata(plan, records):
    """Return the index metadata of a record shard folder from its plan and every task's record."""
    longest = {}
    for record in records:
        for name, rows in record["longest"].items():
            longest[name] = max(longest.get(name, 0), rows)
    return {**_part_metadata(records, plan["metadata"]), "longest": longest}


def _part_metadata(records, metadata):
    """The metadata of what ``records`` hold: the whole folder's, or one part's while other parts run."""
    skipped = [{"path": f"record {index}", "reason": reason} for r in records for index, reason in r["skipped"]]
    return {**metadata, "num_samples": sum(r["num_samples"] for r in records), "skipped": skipped}


def _plan(settings, made, fields, metadata):
    """Return the plan: inputs per shard from the bytes the first records encode to (NOTE [record shards])."""
    encoded = [encoded_or_mismatch(record, fields) for record in made]
    sizes = [stored_bytes(values, fields) for values in encoded if not isinstance(values, Mismatch)]
    plan = {
        "kind": RECORDS_KIND,
        "container": settings["container"],
        "settings": settings,
        "samples_per_shard": samples_per_shard(settings["shard_size"], sum(sizes) / len(sizes) if sizes else 1),
        "metadata": metadata,
    }
    return {**plan, "conversion": conversion_id(plan)}  # see NOTE [shard identity] in formats/shards.py


def _digest(head, needed):
    """Return a digest of the first inputs ``head``, which a resumed conversion or another part must share.

    Raises:
        OptionError: ``needed`` (resume or a part) and ``head`` cannot be pickled.
    """
    try:
        return hashlib.sha256(pickle.dumps(head, protocol=4)).hexdigest()[:16]
    except Exception as exc:
        if not needed:
            return None
        raise OptionError(f"resume and part need inputs that can be pickled, to tell that a conversion continues "
                          f"the same inputs ({type(exc).__name__}: {exc}); pass paths or plain values, and make "
                          "the records with fn") from exc


class _Counted:
    """An iterator that counts the items it has given."""

    def __init__(self, items):
        self.items, self.count = items, 0

    def __iter__(self):
        for item in self.items:
            self.count += 1
            yield item


def _shard_inputs(inputs, per_shard, folder, part, started):
    """Yield ``(number, start, items)`` of each shard this run writes: its part's, less those a resume keeps;
    each ``number`` is added to ``started`` as it is yielded."""
    stream = iter(inputs)
    for number in itertools.count():
        items = list(itertools.islice(stream, per_shard))
        if not items and number:
            return
        start = number * per_shard
        if part is not None and number % part[1] != part[0]:
            continue
        if folder.kept_record(number, start, start + len(items)) is not None:
            continue
        if part is not None:
            folder.remove_partials([number])
        started.append(number)
        yield number, start, items
        if not items:
            return


def _write_record_shard(task):
    """Encode a task's records, write its shard and its record; return the record (NOTE [shard records]).

    With on_error "raise", the first record that does not fit ends the task: nothing is written, and the
    record returned (not saved) names it.
    """
    columns, skipped = RecordColumns(task.fields), []
    for position, item in enumerate(task.items):
        record = item if position < task.made else made_record(task.fn, item)
        encoded = encoded_or_mismatch(record, task.fields)
        if isinstance(encoded, Mismatch):
            skipped.append([task.start + position, str(encoded)])
            if task.on_error == "raise":
                break
            continue
        columns.add(encoded)
    stop = task.start + len(task.items)
    record = {"inputs": [task.start, stop], "num_samples": columns.num_samples, "name": None, "bytes": 0,
              "crc32": None, "skipped": skipped, "longest": dict(columns.longest)}
    if skipped and task.on_error == "raise":
        return record
    if columns.num_samples:
        place = {"conversion": task.conversion, "number": task.number, "inputs": [task.start, stop]}
        metadata = {**task.metadata, "num_samples": columns.num_samples, "skipped": [],
                    "longest": dict(columns.longest), "shard": place}
        record.update(write_shard(task.root, task.number, task.container, columns.finish(), metadata,
                                  fields=task.fields))
    return save_record(task.root, task.number, record)
