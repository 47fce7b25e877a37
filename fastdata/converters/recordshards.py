"""fastdata.write into a shard folder: the plan, the task that writes one shard of records, and the index metadata.

NOTE [record shards]: the plan fixes how many inputs a shard holds, from
the bytes the first records encode to (those the schema was told from,
encoded in the driver: the same for any workers, part or run), so shard
``k`` holds inputs ``[k * n, (k + 1) * n)`` whatever else happens: a part
(``part=(i, m)``) writes the shards with ``k % m == i``; a resumed
conversion keeps each shard whose record and file are intact (NOTE
[shard records] in shards.py) and writes the rest. The driver reads the
inputs once, in order; the inputs of the shards it writes go out in tasks
of at most TASK_RECORDS (never across a shard's end) to the local pool or
Dask, a few in flight per worker, and come back encoded in order
(converters.parallel.streamed_tasks), so every worker has work however
few shards there are; the driver writes each shard once its last task is
back, holding one shard's values. The shards are thus the same bytes for
any workers or engine. Tasks of whole shards run on workers instead (as
the image converter's) left a folder of one 64 MiB shard on one process:
3,000 64 px JPEG records converted at 541-742 records/s against
1,378-1,546 for tasks of 64 records (workers=2, this 2-core VM). The
inputs may be any iterable: their count is known once they are read, and
the plan records it then, before the index is written (by the last part
to finish). Each shard file records the conversion id, its number and
its inputs (NOTE [shard identity] in formats/shards.py).
"""

import hashlib
import itertools
import pickle
from dataclasses import dataclass
from functools import partial

from fastdata.converters.fieldvalues import Mismatch
from fastdata.converters.parallel import ProgressBar, streamed_tasks
from fastdata.converters.recordvalues import (
    TASK_RECORDS,
    RecordColumns,
    encoded_or_mismatch,
    made_record,
    stored_bytes,
)
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
class FolderWritten:
    """What write_record_shards did: the folder's index metadata (this part's counts while other parts run),
    whether the folder was already finished, and the files it redid."""

    metadata: dict
    finished: bool = False
    redone: tuple = ()


def write_record_shards(out, inputs, head, made, fields, metadata, *, fn, container, shard_size, overwrite, resume,
                        part, workers, executor, progress, total=None, warn=None, remote=None):
    """Write the records of ``head`` + ``inputs`` into the shard folder ``out``; return a FolderWritten.

    Args:
        remote: the RemoteFolder of a URL ``out``: each shard is uploaded once written, then its record, the
            index last (NOTE [remote write] in upload.py).
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
                           part=part, remote=remote) as folder:
        damaged = folder.damaged_files() if folder.done else []  # see NOTE [resume checks what it keeps]
        if folder.done and not damaged:
            return FolderWritten(folder.finished_metadata(), finished=True)
        if damaged:
            folder.reopen(damaged)
        if folder.plan is None:
            folder.write_plan(_plan(settings, made, fields, metadata))
        per_shard = folder.plan["samples_per_shard"]
        counted, started = _Counted(itertools.chain(made, inputs)), []
        tasks = _task_inputs(counted, per_shard, folder, part, started)
        encode = partial(_encode_task, fn, fields, len(made))
        records, shard = [], None
        with folder.writing(started), ProgressBar(total=total, unit="record", disable=None if progress else True,
                                                  dynamic_ncols=True) as bar:
            for number, start, last, encoded in streamed_tasks(encode, tasks, executor=executor, workers=workers):
                shard = shard or _Shard(fields, number, start)
                shard.add(encoded, warn)
                bar.update(len(encoded))
                if last:
                    records.append(shard.write(folder.root, container, folder.plan, remote))
                    shard = None
        folder.write_plan({**folder.plan, "num_inputs": counted.count})
        written = index_shards(folder.root, record_folder_metadata, missing_ok=part is not None, remote=remote)
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


def _task_inputs(inputs, per_shard, folder, part, started):
    """Yield ``(shard number, first input's index, items, whether the shard ends here)`` of each task this run
    sends: the inputs of its part's shards, less those a resume keeps, in tasks of at most TASK_RECORDS; each
    shard's number is added to ``started`` as its first task is yielded."""
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
        for offset in range(0, max(len(items), 1), TASK_RECORDS):
            yield number, start + offset, items[offset : offset + TASK_RECORDS], offset + TASK_RECORDS >= len(items)
        if not items:
            return


def _encode_task(fn, fields, made, task):
    """Return ``(number, start, last, [each item's encoded values or Mismatch])`` of a ``_task_inputs`` task; the
    inputs before index ``made`` are records already (the first ones, which told the schema)."""
    number, start, items, last = task
    return number, start, last, [encoded_or_mismatch(item if start + position < made else made_record(fn, item),
                                                     fields) for position, item in enumerate(items)]


class _Shard:
    """One shard's encoded records, gathered in the driver as its tasks come back; then its file and record."""

    def __init__(self, fields, number, start):
        self.fields, self.number, self.start = fields, number, start
        self.columns, self.skipped, self.stop = RecordColumns(fields), [], start

    def add(self, encoded, warn):
        """Keep the encoded records of a task; apply ``warn`` (on_error) to each that does not fit."""
        for values in encoded:
            if isinstance(values, Mismatch):
                warn(self.stop, str(values))
                self.skipped.append([self.stop, str(values)])
            else:
                self.columns.add(values)
            self.stop += 1

    def write(self, root, container, plan, remote=None):
        """Write the shard (none for a shard of no record) and its record, and upload them to ``remote`` if given;
        return the record."""
        record = {"inputs": [self.start, self.stop], "num_samples": self.columns.num_samples, "name": None,
                  "bytes": 0, "crc32": None, "skipped": self.skipped, "longest": dict(self.columns.longest)}
        if self.columns.num_samples:
            place = {"conversion": plan["conversion"], "number": self.number, "inputs": [self.start, self.stop]}
            metadata = {**plan["metadata"], "num_samples": self.columns.num_samples, "skipped": [],
                        "longest": dict(self.columns.longest), "shard": place}
            record.update(write_shard(root, self.number, container, self.columns.finish(), metadata,
                                      fields=self.fields))
        return save_record(root, self.number, record, remote)
