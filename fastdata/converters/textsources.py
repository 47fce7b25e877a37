"""Reading text sources for convert_text: folders of .txt files, CSV/TSV, JSON Lines (or a .json array), Parquet,
Hugging Face dataset folders (save_to_disk), plain lines.

Each reader returns an ``_Inputs``: one entry per input sample, with its name
for messages, its text (or the path to read it from), its raw label, and the
reason it cannot be used when that is already known while reading (a bad
JSON line, a missing field, a bad label). Labels are resolved to class
indices only after tokenizing, from the samples that were kept.
"""

import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from fastdata.converters.recordsources import HF_INFO, read_hf_dataset
from fastdata.converters.tables import read_rows
from fastdata.errors import NotFoundError, OptionError, SourceError
from fastdata.formats.records import Field

SOURCE_FORMATS = ("folder", "csv", "tsv", "jsonl", "parquet", "hf", "lines")
UNLABELED_FOLDER = "unsup"
_EXTENSION_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl",
                      ".json": "jsonl", ".parquet": "parquet"}
_PARQUET_BATCH = 4096  # rows of a Parquet file turned into Python values at a time
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")  # a CSV label read as an integer
_MISSING = object()  # a field absent from a record (or a short CSV row)
_SPARSE_LIMIT = 1024  # integer labels below this are always kept as class indices
_UTF16_32_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
                  b"\xfe\xff": "UTF-16"}
# Files a text source is never read as: (offset, signature, what it is, what to do). Each signature starts with a
# byte no UTF-8 text starts with (a control or an invalid byte), or holds a NUL, except Parquet's and Arrow's,
# which the file must also end with.
_BINARY_FILES = (
    (0, b"PAR1", "a Parquet file", "read it as one with --source-format parquet (source_format='parquet')"),
    (0, b"ARROW1", "an Arrow IPC file", "write its text and label columns as Parquet, JSON Lines or CSV"),
    (0, b"\x89HDF\r\n\x1a\n", "an HDF5 file", "if fastdata wrote it, `fastdata info` describes it"),
    (0, b"\x1f\x8b", "gzip-compressed", "decompress it first"),
    (0, b"\xfd7zXZ\x00", "xz-compressed", "decompress it first"),
    (0, b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first"),
    (0, b"PK\x03\x04", "a zip archive", "unpack it and convert the text inside"),
    (257, b"ustar\x00", "a tar archive", "unpack it and convert the text inside"),
    (257, b"ustar  \x00", "a tar archive", "unpack it and convert the text inside"),
    (0, b"\xff\xd8\xff", "a JPEG image", "`fastdata convert imagefolder` converts images"),
    (0, b"\x89PNG\r\n\x1a\n", "a PNG image", "`fastdata convert imagefolder` converts images"),
)
_ENDS_TOO = {b"PAR1", b"ARROW1"}
_BINARY_SHARE = 0.1  # of a file's first characters, bytes that are not UTF-8, past which it is not text: NOTE [binary]


@dataclass
class _Inputs:
    """What a source holds, before tokenizing: one entry per input sample."""

    format: str
    names: list = field(default_factory=list)  # for messages: "pos/12_7.txt", "reviews.csv:14"
    payloads: list = field(default_factory=list)  # the text, or the path of a .txt file to read
    labels: list = field(default_factory=list)  # folder: class index or -1; files: int, bool, str; None: unlabeled
    reasons: dict = field(default_factory=dict)  # input index -> why it cannot be used
    classes: list | None = None  # known up front for folders only

    def add(self, name, payload, label, reason=None):
        if reason is not None:
            self.reasons[len(self.names)] = reason
        self.names.append(name)
        self.payloads.append(payload)
        self.labels.append(label)


def source_format_of(src, source_format):
    """Return how to read ``src``: ``source_format`` checked against it, or detected."""
    if not os.path.exists(src):
        raise NotFoundError(f"{src!r} does not exist")
    if source_format is not None:
        if source_format not in SOURCE_FORMATS:
            raise OptionError(f"source_format should be one of {SOURCE_FORMATS}, got source_format={source_format!r}")
    if os.path.isdir(src):
        detected = "hf" if os.path.exists(os.path.join(src, HF_INFO)) else "folder"
    else:
        detected = _EXTENSION_FORMATS.get(os.path.splitext(src)[1].lower(), "lines")
    if source_format is None:
        return detected
    if (source_format in ("folder", "hf")) != (detected in ("folder", "hf")):
        raise OptionError(f"source_format={source_format!r} does not fit {src!r}, which is a "
                         f"{'folder' if detected == 'folder' else 'file'}")
    return source_format


def read_source(src, source_format, text_field, label_field, include_unsup):
    """Return the ``_Inputs`` of ``src`` read as ``source_format``."""
    if source_format == "folder":
        return _read_folder(src, include_unsup)
    if source_format == "parquet":
        return _read_parquet(src, text_field, label_field)
    if source_format == "hf":
        return _read_hf(src, text_field, label_field)
    _check_encoding(src)
    if source_format == "lines":
        return _read_lines(src)
    if source_format == "jsonl":
        return _read_jsonl(src, text_field, label_field)
    return _read_table(src, "\t" if source_format == "tsv" else ",", text_field, label_field)


def find_texts(root, include_unsup=False):
    """List the ``.txt`` files of a labeled text folder (``root/<label>/<name>.txt``).

    Returns:
        ``(classes, paths, labels)``: sorted label folder names (``unsup``
        left out), paths relative to ``root`` (sorted per folder) and int64
        labels ``[N]`` (-1 for ``unsup`` files, listed when ``include_unsup``).

    Raises:
        SourceError: ``root`` has no label folder, a folder has no ``.txt``
            file, or ``root`` holds splits (``train/``, ``test/``) instead.
    """
    root = os.fspath(root)
    folders = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    classes = [name for name in folders if name != UNLABELED_FOLDER]
    if not classes and not (include_unsup and UNLABELED_FOLDER in folders):
        hint = " (only 'unsup'; pass include_unsup=True / --unsup to store it unlabeled)" if folders else ""
        raise SourceError(f"{root!r} has no label folders{hint}; expected {root}/<label>/<sample>.txt")
    paths, labels = [], []
    for name in folders:
        if name == UNLABELED_FOLDER and not include_unsup:
            continue
        folder = os.path.join(root, name)
        entries = [e for e in os.scandir(folder) if not e.name.startswith(".")]
        found = sorted(e.name for e in entries if e.is_file() and e.name.lower().endswith(".txt"))
        if not found:
            raise SourceError(_empty_folder_message(root, name, folders, any(e.is_dir() for e in entries)))
        paths += [os.path.join(name, path) for path in found]
        labels += [-1 if name == UNLABELED_FOLDER else classes.index(name)] * len(found)
    return classes, paths, np.asarray(labels, dtype=np.int64)


def _empty_folder_message(root, name, folders, has_subfolders):
    if has_subfolders:
        return (f"{root!r} looks like a corpus root holding splits {folders}, not label folders; "
                f"pass one split folder such as {os.path.join(root, name)!r}")
    return f"label folder {name!r} in {root!r} has no .txt files; add some or remove the folder"


def _read_folder(root, include_unsup):
    classes, paths, labels = find_texts(root, include_unsup)
    inputs = _Inputs("folder", classes=classes)
    for path, label in zip(paths, labels.tolist()):
        inputs.add(path, os.path.join(root, path), label)
    return inputs


# NOTE [binary]: a text source read as lines takes whatever decodes: a
# Parquet file given to ``convert text`` (its pages compressed, so under a
# tenth NUL) became 131 samples of garbage, 2,267 lines skipped, exit 0,
# and ``fastdata verify`` passed the result. So a source is refused whole,
# before any line is read, when it is a container by its signature
# (_BINARY_FILES), when a tenth of its first 4,096 bytes are NUL, or when
# more than _BINARY_SHARE of the characters they hold are bytes that are
# not UTF-8: compressed or encoded data has about half (4,096 random
# bytes: 1,746 of 3,954 characters), text in a legacy encoding (Latin-1 accents) a few
# per cent, whose lines are then reported one by one as not UTF-8. Control
# characters count as text: they are valid UTF-8, and a line may hold them.
def _check_encoding(path):
    """Raise SourceError for a file that is UTF-16/32 text or not text at all (see NOTE [binary])."""
    with open(path, "rb") as f:
        start = f.read(4096)
        f.seek(max(0, os.fstat(f.fileno()).st_size - 8))
        end = f.read()
    for bom, encoding in _UTF16_32_BOMS.items():
        if start.startswith(bom):
            raise SourceError(f"{path!r} is {encoding} text (it starts with a {encoding} byte order mark); "
                              "save it as UTF-8 and convert again")
    for offset, signature, what, advice in _BINARY_FILES:
        if start[offset:offset + len(signature)] == signature and (signature not in _ENDS_TOO
                                                                   or end.endswith(signature)):
            raise SourceError(f"{path!r} is {what}, not text: convert text reads UTF-8 lines, CSV, TSV or JSON "
                              f"Lines; {advice}")
    if start.count(0) > len(start) // 10:  # UTF-8 text has no NUL bytes, or a stray few
        raise SourceError(f"{path!r} is not UTF-8 text: {start.count(0)} of its first {len(start)} bytes are NUL "
                          "(UTF-16/32 text without a byte order mark, or a binary file); save it as UTF-8")
    text = start.decode("utf-8", errors="surrogateescape")  # a byte that is not UTF-8: one of U+DC80..U+DCFF
    invalid = sum(1 for char in text if "\udc80" <= char <= "\udcff")
    if invalid > _BINARY_SHARE * len(text):
        raise SourceError(f"{path!r} is not text: {invalid} of the first {len(text)} characters of its first "
                          f"{len(start)} bytes are bytes that are not UTF-8 (a binary or compressed file?); "
                          "convert text reads UTF-8 lines, CSV, TSV or JSON Lines")


def _numbered_lines(f):
    """Yield ``(number, line)`` of a binary file, lines ending in ``\\n``, ``\\r\\n`` or a lone ``\\r``."""
    number = 0
    for raw in f:
        body = raw[:-1] if raw.endswith(b"\n") else raw
        body = body[:-1] if body.endswith(b"\r") else body
        for line in body.split(b"\r"):  # old Mac files end lines with \r alone
            number += 1
            yield number, line


def _read_lines(path):
    inputs, name = _Inputs("lines"), os.path.basename(path)
    with open(path, "rb") as f:
        for number, raw in _numbered_lines(f):
            text, reason = _decode_line(raw, first=number == 1)
            if reason is None and not text.strip():
                reason = "empty line"
            inputs.add(f"{name}:{number}", text, None, reason)
    return _non_empty(inputs, path)


def _read_jsonl(path, text_field, label_field):
    if path.lower().endswith(".json") and _is_json_array(path):
        return _read_json_array(path, text_field, label_field)
    inputs, name = _Inputs("jsonl"), os.path.basename(path)
    with open(path, "rb") as f:
        for number, raw in _numbered_lines(f):
            line, reason = _decode_line(raw, first=number == 1)
            record = None
            if reason is None and not line.strip():
                reason = "empty line"
            elif reason is None:
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    reason = f"invalid JSON: {exc}"
                else:
                    if not isinstance(record, dict):
                        record, reason = None, f"expected a JSON object, got {_json_type(record)}"
            text, label, reason = _fields(record, text_field, label_field, reason)
            inputs.add(f"{name}:{number}", text, label, reason)
    return _non_empty(inputs, path)


def _read_parquet(path, text_field, label_field):
    """Read the text and label columns of a Parquet file, rows named ``file.parquet[index]``."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's ArrowInvalid and OSError name no file
        raise SourceError(f"{path!r} is not a Parquet file pyarrow reads ({exc})") from exc
    columns = [name for name in (text_field, label_field) if name is not None]
    missing = [name for name in columns if name not in table.schema_arrow.names]
    if missing:
        raise SourceError(f"{path!r} has no column {' or '.join(map(repr, missing))}; its columns are "
                          f"{table.schema_arrow.names}: pass --text-field / --label-field (text_field, label_field)")
    inputs, name, row = _Inputs("parquet"), os.path.basename(path), 0
    for batch in table.iter_batches(_PARQUET_BATCH, columns=columns):
        for record in batch.to_pylist():
            text, label, reason = _fields(record, text_field, label_field, None)
            inputs.add(f"{name}[{row}]", text, label, reason)
            row += 1
    return _non_empty(inputs, path)


def _read_hf(root, text_field, label_field):
    """Read the text and label columns of a datasets save_to_disk folder, rows named ``folder[index]``.

    A ClassLabel label keeps its class indices and names (-1: no label); other labels are resolved as a
    table's are (see NOTE [integer labels]).
    """
    schema, rows, _ = read_hf_dataset(root)
    columns = [name for name in (text_field, label_field) if name is not None]
    missing = [name for name in columns if name not in schema]
    if missing:
        raise SourceError(f"{root!r} has no column {' or '.join(map(repr, missing))}; its columns are "
                          f"{list(schema)}: pass --text-field / --label-field (text_field, label_field)")
    inputs, name = _Inputs("hf"), os.path.basename(os.path.normpath(root))
    label = schema.get(label_field)
    inputs.classes = list(label.names) if isinstance(label, Field) and label.names else None
    for row, record in enumerate(rows):
        inputs.add(f"{name}[{row}]", *_fields({key: record[key] for key in columns}, text_field, label_field, None))
    return _non_empty(inputs, root)


def _is_json_array(path):
    with open(path, "rb") as f:
        start = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    return start.startswith(b"[")


def _read_json_array(path, text_field, label_field):
    """Read a ``.json`` file holding one array of objects, named ``file.json[index]``."""
    inputs, name = _Inputs("jsonl"), os.path.basename(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            records = json.load(f)
    except ValueError as exc:  # bad JSON or bad UTF-8: nothing in the array can be trusted
        raise SourceError(f"{path!r} is not a valid JSON array: {exc}; fix it, or write one object per "
                          "line (JSON Lines, .jsonl) so that a bad line costs only that line") from exc
    for index, record in enumerate(records):
        reason = None if isinstance(record, dict) else f"expected a JSON object, got {_json_type(record)}"
        text, label, reason = _fields(record if reason is None else None, text_field, label_field, reason)
        inputs.add(f"{name}[{index}]", text, label, reason)
    return _non_empty(inputs, path)


def _read_table(path, delimiter, text_field, label_field):
    inputs, name = _Inputs("tsv" if delimiter == "\t" else "csv"), os.path.basename(path)
    for line, record, reason in read_rows(path, delimiter, text_field, label_field):
        text, label, reason = _fields(record, text_field, label_field, reason)
        inputs.add(f"{name}:{line}", text, label, reason)
    return _non_empty(inputs, path)


def _has_bad_bytes(text):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # surrogates: bytes surrogateescape kept apart, or JSON "\\ud800"
        return True
    return False


def _decode_line(raw, first):
    if first and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
        raw = raw[3:]
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"


def _fields(record, text_field, label_field, reason):
    """Return ``(text, raw label, reason)`` from a parsed record (a dict, or None after ``reason``)."""
    if reason is not None:
        return None, None, reason
    text = record.get(text_field, _MISSING)
    if text is _MISSING:
        return None, None, f"missing field {text_field!r}"
    if not isinstance(text, str):
        return None, None, f"field {text_field!r} is {_json_type(text)}, expected a string"
    if _has_bad_bytes(text):
        return None, None, "not valid UTF-8 (undecodable bytes or unpaired surrogates)"
    if label_field is None:
        return text, None, None
    value = record.get(label_field, _MISSING)
    if value is _MISSING:
        return None, None, f"missing field {label_field!r}"
    label, reason = _check_label(value)
    return (None if reason else text), label, reason


def _json_type(value):
    return "null" if value is None else type(value).__name__


def _check_label(value):
    """Return ``(label, None)`` for a usable raw label (an integral float as int), or ``(None, reason)``."""
    if isinstance(value, float) and value.is_integer():
        return int(value), None
    if not isinstance(value, (bool, int, str)):
        shown = "null" if value is None else f"{value!r} ({type(value).__name__})"
        return None, f"bad label {shown}; labels should be integers, booleans or strings"
    if isinstance(value, str) and not value.strip():
        return None, "empty label"
    if isinstance(value, str) and _has_bad_bytes(value):
        return None, "label is not valid UTF-8"
    return value, None


def _non_empty(inputs, path):
    if not inputs.names:
        raise SourceError(f"{path!r} holds no samples")
    return inputs


# NOTE [integer labels]: integer labels that are class indices 0..K-1 are stored as they are, so splits
# converted apart agree: always below 1,024, above that while at least half of 0..max occurs. Other
# integers (ids such as 99999999999, -1/1 sentiment, values beyond int64) would need one class per value
# (a label of 99999999999 once grew the process to 24 GB), so their distinct values are numbered in
# sorted order as string labels are (as sklearn's LabelEncoder and HF datasets' class_encode_column do).
# Either way classes[stored label] == str(label in the source).
def resolve_labels(inputs, kept, src, skipped):
    """Return ``(labels int64 [N], class names)`` for the kept inputs (see NOTE [integer labels])."""
    raw = [inputs.labels[index] for index in kept]
    if inputs.classes is not None:  # folder: classes are the folder names
        labels = np.asarray(raw, dtype=np.int64)
        counts = np.bincount(labels[labels >= 0], minlength=len(inputs.classes))
        empty = [name for name, count in zip(inputs.classes, counts) if count == 0]
        if empty and inputs.format == "folder":  # a ClassLabel's class may be absent from a split
            raise SourceError(f"label folder(s) {empty} in {src!r} have no usable text ({len(skipped)} "
                              f"inputs skipped, first: {skipped[0][0]}: {skipped[0][1]}); fix or remove them")
        return labels, list(inputs.classes)
    if all(label is None for label in raw):  # unlabeled source
        return np.full(len(raw), -1, dtype=np.int64), []
    if inputs.format in ("csv", "tsv") and all(_INTEGER.fullmatch(label) for label in raw):
        raw = [int(label) for label in raw]
    kind = _label_kind(raw, [inputs.names[index] for index in kept], src)
    if kind is bool:
        return np.asarray(raw, dtype=np.int64), ["false", "true"]
    if kind is int and _are_indices(raw):
        labels = np.asarray(raw, dtype=np.int64)
        return labels, [str(i) for i in range(int(labels.max()) + 1)]
    classes = sorted(set(raw))
    position = {label: i for i, label in enumerate(classes)}
    return np.asarray([position[label] for label in raw], dtype=np.int64), [str(label) for label in classes]


def _label_kind(raw, names, src):
    """Return the one type of the labels (int, bool or str); raise SourceError when they mix."""
    first = {}
    for label, name in zip(raw, names):
        first.setdefault(type(label), f"{_KIND_NAMES[type(label)]} ({name}: {json.dumps(label)})")
    if len(first) > 1:
        raise SourceError(f"labels in {src!r} mix {' and '.join(first.values())}; use one kind")
    return next(iter(first))


_KIND_NAMES = {int: "integers", bool: "booleans", str: "strings"}


def _are_indices(raw):
    """Whether integer labels can be kept as class indices (see NOTE [integer labels])."""
    low, high = min(raw), max(raw)
    return low >= 0 and (high < _SPARSE_LIMIT or 2 * len(set(raw)) > high)
