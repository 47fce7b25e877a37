"""Sharded conversion: a plan of independent tasks "inputs [a, b) -> shard k", run on any engine, resumable.

While it is written, a shard folder holds besides its finished shards::

    OUT/.fastdata/plan.json         what is converted, with which settings, how many inputs per shard
    OUT/.fastdata/shard-00003.json  the record of a finished task (see NOTE [shard records])
    OUT/.fastdata/lock              flock'd by the conversion writing OUT (see NOTE [one writer] in shardfolder.py)
    OUT/.shard-00003.<owner>.partial.h5  a shard being written

and gets ``OUT/index.json`` last, once every task has its record. The
converters build the tasks and say what a shard holds; this module owns the
tasks, the shards and records they write, the index and the checks of a finished
folder against it; shardfolder.py owns the folder the driver opens (its lock, plan,
resume and overwrite), converters.parallel runs the tasks. OUT may be a URL
(``remote=``, a converters.upload.RemoteFolder): the same folder is kept in a
local staging folder and mirrored to the URL shard by shard (NOTE [remote write]).
"""

import errno
import hashlib
import json
import os
import shutil

import numpy as np

from fastdata.converters.staging import DISK_FULL_ERRNOS, process_owner
from fastdata.errors import FastdataError, NotFoundError, OptionError
from fastdata.formats import format_of, write_packed, write_records
from fastdata.formats.shards import (
    CONTAINER_EXTENSIONS,
    INDEX_NAME,
    file_checksum,
    parse_index,
    read_index,
    shard_name,
    sync_folder,
    write_column,
    write_index,
    write_json_atomically,
)
from fastdata.storage.urls import join

# NOTE [default shard size]: 64 MiB, as Mosaic Streaming and LitData use.
# The size barely changes the work: 4000 varied ~500x375 JPEGs to 64 px raw,
# workers=2, two interleaved rounds on this 2-core VM while others ran (load
# 5-7): CPU seconds (all processes) 7.4/9.2 at 16 MiB (3 shards), 7.4/10.0 at
# 64 MiB (1 shard), 8.3/9.9 at 256 MiB (1 shard), 9.3/10.6 for one .h5 file;
# wall 10.4/25.3, 11.2/21.8, 14.6/21.7 and 20.0/19.4 s, noise beyond the
# differences. What the size does decide is parallelism: boundaries may not
# depend on the workers, so a set of fewer shards than workers converts on
# fewer processes (pass a smaller shard_size for small sets), and a worker
# holds one shard in memory.
DEFAULT_SHARD_BYTES = 64 << 20
STATE_FOLDER = ".fastdata"
PLAN_NAME = "plan.json"


def is_folder_output(out):
    """Return whether ``out`` names a shard folder: any path without a packed-file extension."""
    try:
        format_of(out)
    except FastdataError:
        return True
    return False


def container_of(out, format):
    """Return the container ("hdf5", "arrow") of output ``out`` given ``format`` (None: by extension, or hdf5)."""
    if not is_folder_output(out):
        found = format_of(out)
        if format not in (None, found):
            raise OptionError(f"format={format!r} disagrees with the extension of {os.fspath(out)!r} ({found})")
        return found
    if format not in (None, *CONTAINER_EXTENSIONS):
        raise OptionError(f"format should be one of {tuple(CONTAINER_EXTENSIONS)}, got format={format!r}")
    return format or "hdf5"


def samples_per_shard(shard_size, sample_bytes):
    """Return how many samples of about ``sample_bytes`` fill ``shard_size`` bytes (at least 1)."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise OptionError(f"shard_size should be a positive number of bytes, got shard_size={shard_size!r}")
    return max(1, shard_size // max(1, int(sample_bytes)))


def task_bounds(num_inputs, per_shard):
    """Return int64 ``[S + 1]``: task ``k`` converts sorted inputs ``bounds[k]:bounds[k + 1]``."""
    return np.append(np.arange(0, num_inputs, per_shard, dtype=np.int64), np.int64(num_inputs))


def check_part(part, overwrite):
    """Refuse a bad ``part`` (see part_tasks), and ``overwrite`` with a part."""
    part_tasks(0, part)
    if part is not None and overwrite:
        raise OptionError("overwrite would remove the shards of the other parts as they run; empty the folder "
                          "once, then start the parts without --overwrite")


def part_tasks(num_tasks, part):
    """Return the task numbers that ``part=(i, n)`` runs: each ``k`` with ``k % n == i`` (all for None)."""
    if part is None:
        return list(range(num_tasks))
    i, n = part
    if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n):
        raise OptionError(f"part should be (i, n) with 0 <= i < n, got part={part!r}")
    return list(range(i, num_tasks, n))


# ---------------------------------------------------------------- in a worker: one shard, written straight


def write_shard(root, number, container, columns, metadata, fields=None):
    """Write shard ``number`` of ``root`` under a hidden name, flush it to disk, rename it; return its facts.

    ``columns``: the Columns of (sample, label) pairs, or with ``fields`` (a record schema) the record
    columns ``{name: FieldColumn}``.

    Returns:
        ``{"name", "bytes", "crc32"}`` of the finished file.
    """
    name = shard_name(number, container)
    ext = CONTAINER_EXTENSIONS[container]
    host, pid, start = process_owner(os.getpid())
    partial = os.path.join(root, f".{name[: -len(ext)]}.{host}-{pid}-{start}.partial{ext}")
    try:
        if fields is None:
            write_packed(partial, columns, metadata)
        else:
            write_records(partial, columns, metadata, fields)
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        facts = {"name": name, "bytes": os.path.getsize(partial), "crc32": file_checksum(partial)}
        os.replace(partial, os.path.join(root, name))
        sync_folder(root)
    except BaseException:
        remove_path(partial)
        raise
    return facts


def label_runs(labels):
    """Return int ``labels`` as runs ``[[label, count], ...]``: a record's labels, short for class-sorted inputs."""
    labels = np.asarray(labels, dtype=np.int64)
    if not len(labels):
        return []
    starts = np.flatnonzero(np.concatenate(([True], labels[1:] != labels[:-1])))
    counts = np.diff(np.append(starts, len(labels)))
    return np.stack([labels[starts], counts], axis=1).tolist()


def labels_of_runs(runs_of_records):
    """Return the int64 labels of every record's ``label_runs``, in order."""
    runs = np.array([run for runs in runs_of_records for run in runs], dtype=np.int64).reshape(-1, 2)
    return np.repeat(runs[:, 0], runs[:, 1])


# NOTE [shard records]: a task's record (``.fastdata/shard-00003.json``)
# holds its input range, sample count, shard file name, size and crc32,
# and what the index needs from it (class counts, pixel sums, skipped
# inputs, its labels as runs for the labels file: NOTE [column files] in
# formats/shards.py). It is written after the shard is renamed into place, so a
# record always names a complete file; a shard without a record (killed
# between the two) is redone. Resume keeps a shard whose record matches the
# plan and whose file has the recorded size and crc32.
def save_record(root, number, record, remote=None):
    """Write task ``number``'s record (NOTE [shard records]), after its shard; return the record.

    With ``remote``, the shard and then the record are uploaded, and their local copies removed.
    """
    write_json_atomically(record_path(root, number), record)
    if remote is not None:
        remote.upload_task(root, number, record)
    return record


def record_name(number):
    """Return the file name of task ``number``'s record in the state folder: ``shard-00003.json``."""
    return f"shard-{number:05d}.json"


def record_path(root, number):
    """Return the path of task ``number``'s record in the state folder of ``root``."""
    return os.path.join(root, STATE_FOLDER, record_name(number))


def source_digest(src, names):
    """Return ``"N:<sha256>"`` of the sorted inputs ``names`` (relative to ``src``): their names, sizes, mtimes."""
    digest = hashlib.sha256()
    for name in names:
        stat = os.stat(os.path.join(src, name))
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode(errors="surrogateescape"))
    return f"{len(names)}:{digest.hexdigest()}"


# NOTE [resume checks what it keeps]: --resume on a finished folder used to
# report it done from its index alone, so a shard deleted or damaged since
# stayed so ("wrote 800 samples", exit 0). A resume now checks every file the
# index lists, cheaply (its size, then its whole-file crc32 against the index:
# no decoding, one read of each file), and redoes what is missing or damaged
# from the recorded plan and records, saying which; an intact folder is
# reported as finished, nothing rewritten. Cost: the crc32 pass, 256 MiB in 8
# shards checked in 1.1-1.2 s from the page cache and 1.5 s after dropping it
# (this 2-core VM while tests ran beside it): a fraction of converting them.
def damaged_files(root):
    """Return ``[(file name, what is wrong)]``: the files of the finished shard folder ``root`` unlike its index.

    Each shard and column file the index lists is checked by its size and whole-file crc32; an index that
    does not parse is itself listed (NOTE [resume checks what it keeps]).
    """
    try:
        index = read_index(root)
    except FastdataError as exc:
        return [_index_damage(exc, os.path.join(root, INDEX_NAME))]
    listed = list(zip(index.names, index.sizes.tolist(), index.checksums))
    listed += [(entry["name"], entry["bytes"], entry["crc32"]) for entry in index.columns.values()]
    found = [(name, file_damage(os.path.join(root, name), size, crc32)) for name, size, crc32 in listed]
    return [(name, why) for name, why in found if why is not None]


def remote_damaged_files(url, index, sizes):
    """Return ``[(file name, what is wrong)]`` of the finished folder at ``url``: ``index`` its index.json (a dict),
    ``sizes`` its listing's ``{file name: bytes}``. Files are compared by size only: each crc32 was checked
    before the upload (NOTE [remote write] in upload)."""
    where = join(url, INDEX_NAME)
    try:
        index = parse_index(json.dumps(index).encode(), where, url)
    except FastdataError as exc:
        return [_index_damage(exc, where)]
    listed = list(zip(index.names, index.sizes.tolist()))
    listed += [(entry["name"], entry["bytes"]) for entry in index.columns.values()]
    return [(name, "missing" if name not in sizes else f"{sizes[name]} bytes, the index says {size}")
            for name, size in listed if sizes.get(name) != size]


def _index_damage(exc, where):
    """Return ``("index.json", "damaged: ...")``: a FormatError's message less its path and advice."""
    return INDEX_NAME, "damaged: " + str(exc).replace(f"{where!r}: ", "").split("; ")[0]


def file_damage(path, size, crc32):
    """Return what is wrong with the file at ``path`` recorded as ``size`` bytes of ``crc32``; None if nothing."""
    if not os.path.isfile(path):
        return "missing"
    actual = os.path.getsize(path)
    if actual != size:
        return f"{actual} bytes, the index says {size}"
    found = file_checksum(path)
    return None if found == crc32 else f"crc32 {found}, the index says {crc32}"


def describe_damage(damaged, shown=4):
    """Return ``"'shard-00002.h5' missing, 'labels.npy' crc32 ... and 3 more"`` for ``damaged_files``' list."""
    text = ", ".join(f"{name!r} {why}" for name, why in damaged[:shown])
    return text + (f" and {len(damaged) - shown} more" if len(damaged) > shown else "")


def disk_full(exc, root):
    """Return a FastdataError for a full disk while writing ``root``, or None if ``exc`` is something else."""
    if not isinstance(exc, OSError) or not (exc.errno in DISK_FULL_ERRNOS or f"errno = {errno.ENOSPC}" in str(exc)):
        return None
    return FastdataError(f"no space left on the device while writing {root!r}; the finished shards are kept. "
                         "Free some space and run the conversion again with --resume.")


# ---------------------------------------------------------------- the index


def index_shards(root, metadata_of, missing_ok=False, remote=None):
    """Write ``root/index.json`` from the plan and the task records; return the index's metadata.

    Args:
        root: a shard folder whose tasks have all finished (with ``remote``: its staging folder).
        metadata_of: ``(plan, records) -> dict``, the dataset metadata of the index, for the plan's kind
            (e.g. imageshards.shard_folder_metadata).
        missing_ok: return None instead of raising when some tasks have not finished.
        remote: the RemoteFolder whose listed plan, records and shards count; its index.json is
            written in ``root``, then uploaded (NOTE [remote write]).

    Raises:
        FastdataError: some shards are not finished (named), or ``root`` holds no conversion plan.
    """
    root = os.path.abspath(os.fspath(root))
    if remote is None:
        where, plan = root, read_json(os.path.join(root, STATE_FOLDER, PLAN_NAME))
        record_of = lambda number: read_json(record_path(root, number))  # noqa: E731
        complete = lambda record: _has_size(root, record)  # noqa: E731
    else:
        where, state = remote.url, remote.pull()
        plan, record_of, complete = state.plan, state.records.get, state.has_shard
    if plan is None:
        raise NotFoundError(f"{where!r} holds no conversion plan ({STATE_FOLDER}/{PLAN_NAME}); "
                            "it is not a shard folder being converted")
    records = _finished_records(where, plan, record_of, complete, missing_ok)
    if records is None:
        return None
    metadata = metadata_of(plan, records)
    shards = [{**{key: r[key] for key in ("name", "num_samples", "bytes", "crc32", "inputs")}, "number": number}
              for number, r in enumerate(records) if r["num_samples"]]  # see NOTE [shard identity]
    columns = {}
    if all("label_runs" in record for record in records):  # see NOTE [column files]; older records: none
        columns["labels"] = write_column(root, "labels", labels_of_runs([r["label_runs"] for r in records]))
    write_index(root, plan["container"], metadata, plan["settings"], shards, columns, plan.get("conversion"))
    if remote is not None:  # last: every shard is there
        for entry in columns.values():
            remote.put(os.path.join(root, entry["name"]), entry["name"])
        remote.put(os.path.join(root, INDEX_NAME), INDEX_NAME)
    return metadata


def _finished_records(where, plan, record_of, complete, missing_ok):
    """Return every task's record, in task order; None (``missing_ok``) or FastdataError if some are missing."""
    if "num_inputs" not in plan:  # a record conversion still reading its inputs (NOTE [record shards])
        if missing_ok:
            return None
        raise FastdataError(f"{where!r}: no part of its conversion has read all its inputs yet; run the "
                            "conversion (or its parts) again with --resume")
    bounds = task_bounds(plan["num_inputs"], plan["samples_per_shard"])
    records, missing = [], []
    for number in range(len(bounds) - 1):
        record = record_of(number)
        records.append(record)
        if record is None or (record["num_samples"] and not complete(record)):
            missing.append(shard_name(number, plan["container"]))
    if not missing:
        return records
    if missing_ok:
        return None
    listed = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise FastdataError(f"{where!r}: {len(missing)} of {len(bounds) - 1} shards are not finished ({listed}); "
                        "run the conversion (or its missing parts) again with --resume")


def _has_size(root, record):
    path = os.path.join(root, record["name"])
    return os.path.isfile(path) and os.path.getsize(path) == record["bytes"]


def read_json(path):
    """Return the JSON value in ``path``, or None if there is none."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):  # missing, or not a whole record: its task is redone
        return None


def remove_path(path):
    """Remove the file or folder ``path``, if there is one."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
