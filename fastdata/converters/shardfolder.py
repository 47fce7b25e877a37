"""The shard folder a sharded conversion writes, in its driver: locked, checked against what it records, cleared.

A ShardFolder is opened (``open_shard_folder``) once per conversion or part: OUT's lock is taken (NOTE [one
writer]), a recorded plan or index is continued only with ``resume`` and the same settings, or cleared with
``overwrite``, and stale partial files are removed. The files it holds, and the tasks and records written into it,
are shards.py's.
"""

import fcntl
import json
import os
import re
from contextlib import contextmanager

from fastdata.converters.shards import (
    PLAN_NAME,
    STATE_FOLDER,
    damaged_files,
    describe_damage,
    disk_full,
    file_damage,
    read_json,
    record_path,
    remote_damaged_files,
    remove_path,
)
from fastdata.errors import FastdataError, NotFoundError, OptionError, OutputExistsError
from fastdata.formats.shards import COLUMN_FILES, INDEX_NAME, read_index, sync_folder, write_json_atomically

_PARTIAL = re.compile(r"\.shard-(\d+)\.[0-9a-f]{8}-\d+-\d+\.partial\.(h5|arrow)")  # see write_shard
_PARTIAL_RECORD = re.compile(r"shard-(\d+)\.json\.\d+\.partial")  # see write_json_atomically
_PARTIAL_COLUMN = re.compile(r"\.(labels|lengths)\.npy\.\d+\.partial")  # see write_column
_SHARD = re.compile(r"shard-\d+\.(h5|arrow)")


class ShardFolder:
    """A shard folder being written: its plan, its records (NOTE [shard records] in shards.py), its stale partial
    shards."""

    def __init__(self, root, container, part, remote=None):
        self.root, self.container, self.part, self.remote = root, container, part, remote
        self.state = os.path.join(root, STATE_FOLDER)
        self.where = root if remote is None else remote.url  # what messages and reports name
        self.plan, self.done, self.recorded, self.remote_state = None, False, None, None

    def read_recorded(self):
        """Return the recorded index, else plan, else None; a remote folder is listed (``remote_state``)."""
        if self.remote is None:
            return read_json(os.path.join(self.root, INDEX_NAME)) or read_json(os.path.join(self.state, PLAN_NAME))
        self.remote_state = self.remote.pull(check=True)
        if self.part is None:  # this machine's leftovers: the URL is what counts
            self._clear_local(everything=True)
        return self.remote_state.recorded

    def finished_metadata(self):
        """Return the dataset metadata of a finished folder (``done``)."""
        return read_index(self.root).metadata if self.remote is None else self.recorded["metadata"]

    def write_plan(self, plan):
        self.plan = json.loads(json.dumps(plan))
        write_json_atomically(os.path.join(self.state, PLAN_NAME), plan)
        if self.remote is not None:
            self.remote.put(os.path.join(self.state, PLAN_NAME), f"{STATE_FOLDER}/{PLAN_NAME}")

    def kept_record(self, number, start, stop):
        """Return task ``number``'s record if its shard is complete and intact, else None."""
        if self.remote is not None:
            return self.remote_state.kept_record(number, start, stop)
        record = read_json(record_path(self.root, number))
        if record is None or record.get("inputs") != [start, stop]:
            return None
        if record["num_samples"] and file_damage(os.path.join(self.root, record["name"]), record["bytes"],
                                                 record["crc32"]):
            return None
        return record

    def damaged_files(self):
        """Return ``[(file name, what is wrong)]`` of a finished folder (``done``); see ``damaged_files``.

        At a URL, only the sizes the listing gave are compared with the index (each shard's crc32 was
        checked before its upload).
        """
        if self.remote is None:
            return damaged_files(self.root)
        return remote_damaged_files(self.remote.url, self.recorded, self.remote_state.sizes)

    def reopen(self, damaged):
        """Make the finished folder with ``damaged`` files (``damaged_files``) a conversion to finish again.

        Its index goes first, so the folder never looks finished while its shards are rewritten; the recorded
        plan is continued (NOTE [resume checks what it keeps] in shards.py).

        Raises:
            FastdataError: the folder's plan is gone, so its shards cannot be redone one by one; or it is at a
                URL, where its index is not taken down (convert again with --overwrite).
        """
        if self.remote is not None:
            raise FastdataError(f"{self.where!r} is damaged ({describe_damage(damaged)}); convert it again with "
                                "--overwrite")
        plan = read_json(os.path.join(self.state, PLAN_NAME))
        if plan is None or "samples_per_shard" not in plan:
            raise FastdataError(f"{self.where!r} is damaged ({describe_damage(damaged)}) and holds no conversion "
                                f"plan to redo them from ({STATE_FOLDER}/{PLAN_NAME}); convert it again with "
                                "--overwrite")
        remove_path(os.path.join(self.root, INDEX_NAME))
        sync_folder(self.root)
        self.plan, self.done = plan, False

    def remove_partials(self, numbers=None):
        """Remove partial shards and records: of task ``numbers``, or all of them and any partial JSON (None)."""
        wanted = None if numbers is None else set(numbers)
        for folder in (self.root, self.state):
            for name in os.listdir(folder):
                match = _PARTIAL.fullmatch(name) or _PARTIAL_RECORD.fullmatch(name)
                if (match and (wanted is None or int(match[1]) in wanted)) or (
                        wanted is None and name.endswith(".partial")):
                    remove_path(os.path.join(folder, name))

    @contextmanager
    def writing(self, numbers):
        """Run tasks ``numbers`` (a list that may grow as tasks start): if they stop with an error, their partial
        shards are removed, and a full disk is a FastdataError saying to free space and resume."""
        try:
            yield
        except BaseException as exc:
            self.remove_partials(numbers)
            full = disk_full(exc, self.root)
            if full is None:
                raise
            raise full from exc

    def _clear(self):
        """Remove a previous conversion: the index first, so nothing half-removed looks finished."""
        if self.remote is not None:
            self.remote.clear(self.remote_state)
            self.remote_state = type(self.remote_state)()
        self._clear_local()

    def _clear_local(self, everything=False):
        """Remove the index, shards and column files, partial ones too (or ``everything``), the state but its locks."""
        remove_path(os.path.join(self.root, INDEX_NAME))
        sync_folder(self.root)
        for name in os.listdir(self.root):
            if ((everything and name != STATE_FOLDER) or _SHARD.fullmatch(name) or _PARTIAL.fullmatch(name)
                    or name in COLUMN_FILES.values() or _PARTIAL_COLUMN.fullmatch(name)):
                remove_path(os.path.join(self.root, name))
        for name in os.listdir(self.state):
            if not name.endswith(".lock") and name != "lock":
                remove_path(os.path.join(self.state, name))


@contextmanager
def open_shard_folder(out, settings, *, container, resume=False, overwrite=False, part=None, remote=None):
    """Yield the ShardFolder ``out``, locked for this conversion and checked against ``settings``.

    ``folder.plan`` is the recorded plan when one is continued, ``folder.done``
    whether ``out`` is already a finished shard folder of these settings.
    A ``part`` joins a conversion of the same settings (and resumes its own tasks).
    With ``remote`` (the RemoteFolder of the URL ``out``) the folder is its staging folder
    on this machine, and what the URL holds is checked.

    Raises:
        OutputExistsError: ``out`` holds a conversion and neither ``resume`` nor ``overwrite``
            was given, holds other files, or another conversion is writing it.
        OptionError: ``resume`` (or ``part``) with settings other than the recorded ones.
        NotFoundError: the folder holding ``out`` does not exist.
    """
    root = os.path.abspath(os.fspath(out)) if remote is None else remote.staging()
    if remote is not None:
        os.makedirs(os.path.dirname(root), exist_ok=True)
    _check_folder(root)
    folder = ShardFolder(root, container, part, remote)
    settings = json.loads(json.dumps(settings))
    with locked_folder(folder):
        recorded = folder.recorded = folder.read_recorded()
        if recorded is not None and overwrite:
            folder._clear()
        elif recorded is not None:
            _check_continue(folder.where, recorded, settings, resume or part is not None)
            folder.plan = recorded if "samples_per_shard" in recorded else None
            folder.done = "shards" in recorded
        if part is None:
            folder.remove_partials()
        yield folder
        if remote is not None and part is None:
            folder._clear_local(everything=True)  # the URL holds it all now


def check_replaceable(root):
    """Refuse a shard folder output that is a file or holds other files: overwrite never replaces those."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise OutputExistsError(f"{root!r} is a file; a shard folder needs a new or empty folder "
                                "(or give OUT an extension, .h5 or .arrow, for one file)")
    names = os.listdir(root) if os.path.isdir(root) else []
    if names and INDEX_NAME not in names and STATE_FOLDER not in names:
        raise OutputExistsError(f"{root!r} holds other files ({names[0]!r}, ...), not a fastdata shard folder; "
                                "choose a new or empty folder")


def _check_folder(root):
    """Refuse an output that is a file, holds foreign files, or whose folder does not exist."""
    parent = os.path.dirname(root)
    if not os.path.isdir(parent):
        raise NotFoundError(f"output folder {parent!r} does not exist")
    check_replaceable(root)
    try:
        os.makedirs(os.path.join(root, STATE_FOLDER), exist_ok=True)
    except OSError as exc:
        raise FastdataError(f"cannot create the shard folder {root!r} ({exc.strerror}); "
                            "make its folder writable or choose another one") from exc


@contextmanager
def locked_folder(folder):
    """Hold OUT's lock: exclusive for a whole conversion, shared (plus its own part's) for a part.

    NOTE [one writer]: two conversions into one OUT would delete each
    other's partial shards and mix their records; the second is refused.
    Parts of one conversion share the folder lock and each holds its own
    part's lock. flock is released by the kernel when the holder dies, so a
    killed conversion never leaves a stale lock.
    """
    names = ["lock"] if folder.part is None else ["lock", f"part-{folder.part[0]}-of-{folder.part[1]}.lock"]
    modes = [fcntl.LOCK_EX] if folder.part is None else [fcntl.LOCK_SH, fcntl.LOCK_EX]
    files = []
    try:
        for name, mode in zip(names, modes):
            files.append(open(os.path.join(folder.state, name), "a"))
            try:
                fcntl.flock(files[-1].fileno(), mode | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                who = "this part" if name != "lock" else "it"
                raise OutputExistsError(f"another conversion is writing {folder.where!r} right now; wait for "
                                        f"{who} to finish or stop it") from exc
        yield
    finally:
        for f in files:
            f.close()


def _check_continue(root, recorded, settings, resume):
    """Refuse to continue a recorded conversion without ``resume`` or with other settings."""
    finished = "shards" in recorded
    if not resume:
        what = "a finished shard folder" if finished else "an unfinished conversion"
        hint = "" if finished else "pass --resume (resume=True) to finish it, or "
        raise OutputExistsError(f"{root!r} is {what}; {hint}pass --overwrite (overwrite=True) to replace it")
    check_same_settings(root, recorded.get("settings", {}), settings)


def check_same_settings(root, old, settings):
    """Refuse to resume the conversion into ``root`` recorded with settings ``old`` under other ``settings``."""
    differ = list(_differences(old, settings))
    if differ:
        said = "; ".join(f"{key}: recorded {was!r}, now {now!r}" for key, was, now in differ)
        raise OptionError(f"cannot resume {root!r} with other settings ({said}); convert with the recorded "
                          "settings, or pass --overwrite (overwrite=True) to start again")


def _differences(old, new, prefix=""):
    """Yield ``(key, old value, new value)`` where two settings dicts differ; nested dicts by dotted key."""
    for key in sorted(set(old) | set(new)):
        was, now = old.get(key), new.get(key)
        if isinstance(was, dict) and isinstance(now, dict):
            yield from _differences(was, now, f"{prefix}{key}.")
        elif was != now:
            yield f"{prefix}{key}", was, now
