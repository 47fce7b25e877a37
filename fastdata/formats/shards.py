"""A sharded dataset: a folder of packed files (shards) and ``index.json`` that ties them together.

Each shard is an ordinary packed file (``shard-00000.h5`` or ``.arrow``) of
consecutive samples; its metadata holds the dataset's per-sample facts
(kind, storage, sample shape and dtype, classes, tokenizer) and its place
(``shard``: the conversion's id, its number and the inputs it was made
from; NOTE [shard identity]). The index, written last, is one JSON object
(never pickle)::

    {"format": "fastdata", "format_version": 2, "layout": "shards",
     "container": "hdf5", "num_samples": N, "conversion": "5f0c9e2a41b7d3e8",
     "settings": {...},          # what the conversion was asked to do
     "metadata": {...},          # the dataset: classes and counts, mean/std, skipped inputs...
     "shards": [{"name": "shard-00000.h5", "start": 0, "num_samples": n,
                 "bytes": b, "crc32": "89abcdef", "number": 0, "inputs": [0, n]}, ...],
     "columns": {"labels": {"name": "labels.npy", "bytes": b, "crc32": "..."},
                 "lengths": {...}}}   # optional: see NOTE [column files]

NOTE [column files]: ``dataset.labels`` (and ``lengths`` of text) are
every shard's label column (offsets) concatenated, which for a folder at a
URL meant downloading every shard before a class-balanced or bucketed
sampler could start. So the index lists copies of them beside the shards:
``labels.npy`` (and ``lengths.npy``), int64 ``[N]`` in .npy format, with
their size and crc32, written before the index and uploaded before it. A
reader takes them in one request each, checked against the index; an index
without them (older folders, or records written before them) reads the
shards, as before. ``fastdata verify`` compares them with the shards.

NOTE [shard identity]: equal-size shards swapped on disk, a shard copied
from another conversion, or index entries reordered or listed twice were
read as other samples without a word (only ``fastdata verify``, reading
every byte, noticed). So a shard is identified by what its own metadata and
its index record both hold, compared when a reader opens it, from the
metadata it parses anyway (no byte more is read): the ``conversion`` id all
shards of one conversion share, the shard's ``number`` and the ``inputs`` it
was made from; and the index must list numbers in increasing order, each
once. The id is a digest of what the conversion planned (images: its plan;
text: its settings and dataset metadata): the same inputs and settings give
the same id and the same shards, parts that plan at once agree, a resumed
conversion keeps it, and a folder converts byte-identical whatever the
number of workers. A folder written before these fields is checked for what
it has: the number its shard names carry. A reader also refuses an index
whose container is not the one its shard files are named for (an edited
``container``), and one listing fewer classes than it counts. Cost, on the
loaded 2-core VM (load 5-6; 1,000 one-sample 8 px raw shards converted by
convert_imagefolder; first opens, each checked in full; CPU time, best of 5,
3 interleaved rounds against the tree before): HDF5 379-435 shards opened a
second before, 346-605 after; Arrow 1,226-1,555 before, 1,406-1,505 after:
within the noise, as the parts say: shard_mismatch takes 6.5-8.7 us a shard
and shard_differences, classes now among them, 3.7-6.5 us (timeit), of an
open of 0.7-2.9 ms.
parse_index of 100,000 records: 411-451 ms CPU before, 475-502 after.

A folder without ``index.json`` is not a dataset (yet): a conversion that
has not finished, or whose parts are still running.
"""

import hashlib
import io
import json
import os
import re
import zlib
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import numpy as np

from fastdata.errors import FormatError, NotFoundError
from fastdata.formats.layout import FORMAT_NAME, FORMAT_VERSION
from fastdata.formats.records import RECORDS_KIND
from fastdata.formats.schema import check_index_fields

INDEX_NAME = "index.json"
COLUMN_FILES = {"labels": "labels.npy", "lengths": "lengths.npy"}  # see NOTE [column files]
LAYOUT = "shards"
CONTAINER_EXTENSIONS = {"hdf5": ".h5", "arrow": ".arrow"}
_READ_BYTES = 4 << 20  # file checksums read this many bytes at a time
_SAME_IN_EVERY_SHARD = ("kind", "storage", "sample_shape", "sample_dtype")  # what a reader needs alike
_NUMBERED = re.compile(r"shard-(\d+)\.(?:h5|arrow)")  # shard_name's names: a number where the index has none
_PLACE_KEYS = ("number", "inputs")  # what an index record and a shard's own ``shard`` metadata both hold


def shard_name(number, container):
    """Return the file name of shard ``number``: ``shard-00042.h5`` (the index, not the name, gives the order)."""
    return f"shard-{number:05d}{CONTAINER_EXTENSIONS[container]}"


def is_shard_folder(path):
    """Return whether ``path`` is a folder holding a shard index."""
    return os.path.isfile(os.path.join(os.fspath(path), INDEX_NAME))


def shard_differences(shard_metadata, dataset_metadata):
    """Return the keys a reader needs alike (kind, storage, sample shape and dtype, classes) where a shard differs.

    Classes are compared where the shard records them (NOTE [shard identity]); a record dataset's shards
    compare their kind and fields.
    """
    if dataset_metadata.get("kind") == RECORDS_KIND:
        keys = ["kind", "fields"]
    else:
        keys = [*_SAME_IN_EVERY_SHARD, *(["classes"] if "classes" in shard_metadata else [])]
    return [key for key in keys if shard_metadata.get(key) != dataset_metadata.get(key)]


def conversion_id(plan):
    """Return a conversion's id, 16 hex digits: a digest of the JSON ``plan`` (see NOTE [shard identity])."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def shard_mismatch(index, shard, metadata):
    """Return how the place ``metadata`` of a shard file records differs from ``index``'s record of ``shard``.

    Returns:
        ``"is shard 4 (inputs 12-15) of conversion 5f0c..., where the index lists shard 1 (...)"``,
        or None where they agree in all that both record (NOTE [shard identity]).
    """
    if not index.numbers:  # one packed file: no index record
        return None
    own = metadata.get("shard") if isinstance(metadata.get("shard"), dict) else {}
    listed = {"number": index.numbers[shard], "inputs": index.inputs[shard], "conversion": index.conversion}
    keys = [key for key in _PLACE_KEYS if listed.get(key) is not None and own.get(key) is not None]
    keys += ["conversion"] if listed["conversion"] is not None else []  # an index with an id: every shard has it
    if all(own.get(key) == listed[key] for key in keys):
        return None
    return (f"is {_place_text(own, keys)}, where {INDEX_NAME} lists {_place_text(listed, keys)} (a shard swapped, "
            "listed twice or copied from another conversion, or the index edited)")


def _place_text(place, keys):
    """Return ``"shard 4 (inputs 12-15) of conversion 5f0c9e2a41b7d3e8"`` of what ``place`` holds of ``keys``."""
    number, inputs, conversion = (place.get(key) for key in ("number", "inputs", "conversion"))
    text = "shard ?" if number is None or "number" not in keys else f"shard {number}"
    if "inputs" in keys and isinstance(inputs, list) and len(inputs) == 2:
        text += f" (inputs {inputs[0]}-{inputs[1] - 1})"
    if "conversion" in keys:
        text += " of no conversion id" if conversion is None else f" of conversion {conversion}"
    return text


def file_checksum(path):
    """Return the crc32 of the whole file at ``path`` as 8 hex digits (see NOTE [checksums] in layout)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_BYTES):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


@dataclass(frozen=True)
class ShardIndex:
    """A shard folder's index, as read from ``index.json``.

    Attributes:
        root: the shard folder.
        container: "hdf5" or "arrow".
        metadata: the dataset's metadata, as a single packed file holds it.
        settings: the conversion settings the shards were written with.
        names: shard file names, in sample order.
        starts: int64 ``[S + 1]``: shard ``k`` holds samples ``starts[k]:starts[k + 1]``.
        sizes: int64 ``[S]`` file sizes in bytes.
        checksums: the crc32 of each shard file, 8 hex digits.
        columns: ``{"labels" | "lengths": {"name", "bytes", "crc32"}}``: the column files listed (NOTE [column files]).
        conversion: the id every shard of the conversion records; None in a folder written before ids.
        numbers: each shard's number as its record holds it (else as its name does; else None); empty for
            one packed file. See NOTE [shard identity].
        inputs: each shard's ``[first input, last input + 1]`` as its record holds it, else None.
    """

    root: str
    container: str
    metadata: dict
    settings: dict
    names: list
    starts: np.ndarray
    sizes: np.ndarray
    checksums: list
    columns: dict = field(default_factory=dict)
    conversion: str | None = None
    numbers: list = field(default_factory=list)
    inputs: list = field(default_factory=list)

    @property
    def num_samples(self):
        return int(self.starts[-1])

    @property
    def num_shards(self):
        return len(self.names)

    def path(self, shard):
        """Return the path of shard number ``shard``."""
        return os.path.join(self.root, self.names[shard])

    def shard_of(self, indices):
        """Return int64 shard numbers of the global sample ``indices`` (in range, checked by the caller)."""
        return np.searchsorted(self.starts, indices, side="right") - 1


def write_column(root, name, values):
    """Write int64 ``values`` as the column file of ``name`` ("labels", "lengths") in ``root``; return its entry.

    Written like a shard: a hidden partial file, flushed to disk, renamed (NOTE [column files]).
    """
    path = os.path.join(root, COLUMN_FILES[name])
    partial = os.path.join(root, f".{COLUMN_FILES[name]}.{os.getpid()}.partial")
    with _removed_on_error(partial):
        with open(partial, "wb") as f:
            np.save(f, np.ascontiguousarray(values, dtype="<i8"), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        entry = {"name": COLUMN_FILES[name], "bytes": os.path.getsize(partial), "crc32": file_checksum(partial)}
        os.replace(partial, path)
    return entry


def parse_column(data, entry, num_samples, where):
    """Return the int64 ``[num_samples]`` column in ``data`` (a column file's bytes), checked against its ``entry``.

    Raises:
        FormatError: the bytes are not the file the index lists, or not such a column.
    """
    crc = f"{zlib.crc32(data):08x}"
    if len(data) != entry["bytes"] or crc != entry["crc32"]:
        raise FormatError(f"{where!r} has {len(data)} bytes and crc32 {crc}, the index says {entry['bytes']} and "
                          f"{entry['crc32']}: it is damaged; restore it, or convert again")
    try:
        values = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise FormatError(f"{where!r} is not a .npy column ({exc})") from exc
    if values.dtype != np.dtype("<i8") or values.shape != (num_samples,):
        raise FormatError(f"{where!r} holds {values.dtype}{list(values.shape)}, not int64[{num_samples}]")
    return values


def write_index(root, container, metadata, settings, shards, columns=None, conversion=None):
    """Write ``root/index.json`` atomically (a temporary file, flushed to disk, then renamed).

    Args:
        root: the shard folder.
        container: "hdf5" or "arrow".
        metadata: the dataset metadata (``num_samples`` included).
        settings: the conversion settings, compared on resume.
        shards: ``[{"name", "num_samples", "bytes", "crc32", "number", "inputs"}, ...]`` in sample order
            (``number`` and ``inputs`` as the shard's metadata records them); shards of no samples are left out.
        columns: the entries of the column files written (``write_column``), by name.
        conversion: the id the shards record (``conversion_id``; NOTE [shard identity]).
    """
    start, entries = 0, []
    for shard in shards:
        if shard["num_samples"]:
            entries.append({**shard, "start": start})
            start += shard["num_samples"]
    if start != metadata["num_samples"]:
        raise FormatError(f"{root!r}: the shards hold {start} samples, the metadata says {metadata['num_samples']}")
    index = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "layout": LAYOUT,
        "container": container,
        "num_samples": start,
        **({"conversion": conversion} if conversion else {}),
        "settings": settings,
        "metadata": metadata,
        "shards": entries,
        **({"columns": columns} if columns else {}),
    }
    write_json_atomically(os.path.join(root, INDEX_NAME), index)


def write_json_atomically(path, value):
    """Write ``value`` as JSON to ``path`` by a flushed temporary file and a rename: never half-written."""
    partial = f"{path}.{os.getpid()}.partial"
    with _removed_on_error(partial):
        with open(partial, "w") as f:
            json.dump(value, f, sort_keys=True, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    sync_folder(os.path.dirname(path))


@contextmanager
def _removed_on_error(partial):
    """Remove the file ``partial`` if the block raises: an error, or a signal's exception (a conversion stopped by
    SIGTERM while it wrote its index once left ``index.json.<pid>.partial`` behind)."""
    try:
        yield
    except BaseException:
        with suppress(FileNotFoundError):
            os.remove(partial)
        raise


def sync_folder(root):
    """Flush a folder's entries (renames, new files) to disk, so they survive a power cut."""
    fd = os.open(root or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(root):
    """Read and check ``root/index.json``; return a ShardIndex.

    Raises:
        FileNotFoundError: ``root`` has no index.
        FormatError: the index is damaged, from a newer fastdata, or
            disagrees with itself.
    """
    root = os.fspath(root)
    path = os.path.join(root, INDEX_NAME)
    if not os.path.isfile(path):
        raise NotFoundError(
            f"{root!r} has no {INDEX_NAME}: not a finished shard folder. Finish the conversion "
            '(run it again with --resume), or run "fastdata index" once all its parts are done.'
        )
    with open(path, "rb") as f:
        data = f.read()
    return parse_index(data, path, root)


def parse_index(data, where, root):
    """Parse and check the bytes of an ``index.json``; return a ShardIndex rooted at ``root``.

    Args:
        data: the index file's bytes.
        where: the index file's path or URL, for messages.
        root: the shard folder (or URL) the index describes.

    Raises:
        FormatError: the index is damaged, from a newer fastdata, or disagrees with itself.
    """
    try:
        index = json.loads(data)
    except ValueError as exc:
        raise FormatError(f"{where!r} is not valid JSON; run \"fastdata index\" on its folder to rewrite it") from exc
    _check_index(index, where)
    shards = index["shards"]
    counts = np.array([shard["num_samples"] for shard in shards], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if starts[-1] != index["num_samples"] or any(s["start"] != int(b) for s, b in zip(shards, starts)):
        raise FormatError(f"{where!r}: shard sample ranges do not add up to {index['num_samples']} samples")
    numbers = [_number(shard) for shard in shards]
    _check_order(numbers, where)
    return ShardIndex(
        root=root,
        container=index["container"],
        metadata=index["metadata"],
        settings=index["settings"],
        names=[shard["name"] for shard in shards],
        starts=starts,
        sizes=np.array([shard["bytes"] for shard in shards], dtype=np.int64),
        checksums=[shard["crc32"] for shard in shards],
        columns=index.get("columns", {}),
        conversion=index.get("conversion"),
        numbers=numbers,
        inputs=[shard.get("inputs") if type(shard.get("inputs")) is list else None for shard in shards],
    )


def _number(entry):
    """Return the shard number of an index record: recorded, else the one its name carries, else None."""
    number = entry.get("number")
    if type(number) is int:  # bool is no number
        return number
    named = _NUMBERED.fullmatch(entry["name"])
    return int(named[1]) if named else None


def _check_order(numbers, where):
    """Refuse an index listing shard numbers out of order or twice (NOTE [shard identity])."""
    numbers = np.array([number for number in numbers if number is not None], dtype=np.int64)
    bad = np.flatnonzero(numbers[1:] <= numbers[:-1])
    if len(bad):
        before, after = numbers[bad[0]], numbers[bad[0] + 1]
        raise FormatError(
            f"{where!r} lists shard {after} after shard {before} (entry {bad[0] + 1}): its shards are out of "
            "order or listed twice, so samples would be read as others. Run \"fastdata index\" on its folder to "
            "rewrite it, or convert again"
        )


def _check_index(index, path):
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME or index.get("layout") != LAYOUT:
        raise FormatError(f"{path!r} is not a fastdata shard index")
    version = index.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FormatError(
            f"{path!r}: format version {version}, this fastdata reads up to {FORMAT_VERSION}. "
            'Upgrade fastdata or re-run "fastdata convert".'
        )
    check_index_fields(index, path)
    missing = [key for key in ("container", "num_samples", "settings", "metadata", "shards") if key not in index]
    if missing or index["container"] not in CONTAINER_EXTENSIONS:
        raise FormatError(f"{path!r}: shard index lacks {missing or ['a known container']}; re-run \"fastdata index\"")
    others = tuple(ext for container, ext in CONTAINER_EXTENSIONS.items() if container != index["container"])
    for shard in index["shards"]:
        name = shard.get("name") if isinstance(shard, dict) else None
        if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
            raise FormatError(f"{path!r}: shard entry {shard!r} is not a file of this folder")
        if name.endswith(others):
            raise _other_container(index["container"], name, path)
    _check_classes(index["metadata"], path)
    columns = index.get("columns", {})
    if not isinstance(columns, dict) or any(
            name not in COLUMN_FILES or not isinstance(entry, dict) or entry.get("name") != COLUMN_FILES[name]
            or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("crc32"), str)
            for name, entry in columns.items()):
        raise FormatError(f"{path!r}: its column files {columns!r} are not listed as fastdata writes them")


def _other_container(container, name, path):
    """Return the FormatError of an index whose ``container`` is not the one its shard ``name`` is named for."""
    named = next(other for other, extension in CONTAINER_EXTENSIONS.items() if name.endswith(extension))
    return FormatError(
        f"{path!r} says its shards are {container} files, but lists {name!r}, named as {named} files are: the index "
        f'was edited or damaged. Set its "container" back to "{named}", or run "fastdata index" on its folder'
    )


def _check_classes(metadata, path):
    """Refuse an index that lists fewer (or more) classes than it counts samples of (a classes list cut short)."""
    classes, counts = (metadata.get(key) if isinstance(metadata, dict) else None for key in ("classes", "class_counts"))
    if isinstance(classes, list) and isinstance(counts, list) and len(classes) != len(counts):
        raise FormatError(
            f"{path!r} lists {len(classes)} classes but counts the samples of {len(counts)}: its classes list is "
            'damaged, and labels would name no class. Run "fastdata index" on its folder to rewrite it, or convert '
            "again"
        )
