"""The containers people have, each read as records for fastdata.write: tables, Hugging Face datasets, WebDataset tars.

Every reader returns ``(schema, records, described)``: the fields the
source's own types say (Arrow and Hugging Face features; a WebDataset
member's extension; CSV text only where every value reads back as written),
an iterator of dicts, and what to record about the source. Images are the
columns named as such (``image=``) or typed so (a Hugging Face ``Image``).
"""

import csv
import dataclasses
import json
import os
import tarfile
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from fastdata.converters.fieldvalues import infer_field
from fastdata.converters.records import write
from fastdata.errors import OptionError, SourceError
from fastdata.formats.records import Field

TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")
_INT_EXTENSIONS = ("cls", "cls2", "index", "id")
_TEXT_EXTENSIONS = ("txt", "text", "caption")
HF_INFO = "dataset_info.json"


class ImageOptions:
    """How the image fields of a source are stored: ``Field("image", size, storage, quality, resize, mode)``."""

    def __init__(self, size=(64, 64), storage="raw", quality=None, resize=None, mode=None):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.storage, self.quality, self.resize, self.mode = storage, quality, resize, mode

    def field(self):
        return Field("image", size=self.size, storage=self.storage, quality=self.quality, resize=self.resize,
                     mode=self.mode)


# ---------------------------------------------------------------- tables: CSV, TSV, JSON Lines, Parquet


def read_table(src, images=(), image_options=None):
    """Read the manifest ``src`` (CSV/TSV/JSONL/Parquet); columns ``images`` hold image paths or bytes.

    A relative image path is relative to the manifest's folder. CSV and TSV
    values are text; a column whose every value is an integer (or a number)
    written as Python writes it (``7``, ``0.5``, not ``007`` or ``1e3``) is
    stored as one. Parquet columns keep their Arrow types (and a Hugging Face
    file's features, from its schema metadata).

    Raises:
        SourceError: an unknown extension, a file that cannot be read, or an image column it does not have.
    """
    kind = TABLE_FORMATS.get(os.path.splitext(os.fspath(src))[1].lower())
    if kind is None:
        raise SourceError(f"{os.fspath(src)!r}: a table is .csv, .tsv, .jsonl or .parquet")
    root = os.path.dirname(os.path.abspath(src))
    if kind == "parquet":
        return _read_parquet(src, images, image_options or ImageOptions(), root)
    rows = _csv_rows(src, kind) if kind in ("csv", "tsv") else _jsonl_rows(src)
    if not rows:
        raise SourceError(f"{os.fspath(src)!r} holds no rows")
    columns = list(rows[0])
    _check_columns(src, columns, images)
    schema = {name: (image_options or ImageOptions()).field() if name in images else
              _told(name, [row.get(name) for row in rows], kind) for name in columns}
    if kind in ("csv", "tsv"):
        rows = [_typed(row, schema) for row in rows]
    return schema, (_with_paths(row, images, root) for row in rows), {"table": os.path.basename(src)}


def _csv_rows(src, kind):
    try:
        with open(src, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f, delimiter="," if kind == "csv" else "\t", strict=True)
            rows = list(reader)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise SourceError(f"{os.fspath(src)!r} cannot be read as {kind.upper()} ({exc})") from exc
    short = next((number for number, row in enumerate(rows) if None in row.values() or None in row), None)
    if short is not None:
        raise SourceError(f"{os.fspath(src)!r}: row {short + 1} has {'more' if None in rows[short] else 'fewer'} "
                          "fields than the header; fix the file")
    return rows


def _jsonl_rows(src):
    rows = []
    with open(src, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise SourceError(f"{os.fspath(src)!r}: line {number} is not JSON ({exc})") from exc
            if not isinstance(row, dict):
                raise SourceError(f"{os.fspath(src)!r}: line {number} is not a JSON object")
            rows.append(row)
    return rows


def _check_columns(src, columns, images):
    missing = [name for name in images if name not in columns]
    if missing:
        raise SourceError(f"{os.fspath(src)!r} has no column {', '.join(map(repr, missing))} (it has "
                          f"{', '.join(map(repr, columns))}): name the image columns with --image")


def _told(name, values, kind):
    """Return the field of a column's ``values``: CSV text as int or float only where each reads back as written."""
    if kind in ("csv", "tsv"):
        for number, kind_name in ((int, "int"), (float, "float")):
            if values and all(_reads_back(value, number) for value in values):
                return kind_name
        return "str"
    told = next((value for value in values if value is not None and value != []), values[0])
    return infer_field(told, name)


def _reads_back(text, number):
    try:
        return repr(number(text)) == text
    except ValueError:
        return False


def _typed(row, schema):
    return {name: int(value) if schema[name] == "int" else float(value) if schema[name] == "float" else value
            for name, value in row.items()}


def _with_paths(row, images, root):
    """Return ``row`` with each image column's relative path made absolute (bytes stay bytes)."""
    for name in images:
        value = row[name]
        if isinstance(value, dict):  # Hugging Face's Image: {"bytes": ..., "path": ...}
            value = value.get("bytes") or value.get("path")
        if isinstance(value, str) and value and not os.path.isabs(value):
            value = os.path.join(root, value)
        row = {**row, name: value}
    return row


def _read_parquet(src, images, image_options, root):
    try:
        parquet = pq.ParquetFile(src)
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{os.fspath(src)!r} cannot be read as Parquet ({exc})") from exc
    arrow_schema = parquet.schema_arrow
    features = _hf_features(arrow_schema.metadata)
    _check_columns(src, arrow_schema.names, images)
    schema, images = _schema_of(arrow_schema, features, images, image_options)

    def rows():
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield _with_paths(row, images, root)

    return schema, rows(), {"table": os.path.basename(src)}


def _hf_features(metadata):
    """Return the Hugging Face features JSON in Arrow schema ``metadata`` (``{"huggingface": ...}``), or {}."""
    text = (metadata or {}).get(b"huggingface")
    try:
        return json.loads(text)["info"]["features"] if text else {}
    except (ValueError, KeyError, TypeError):
        return {}


def _schema_of(arrow_schema, features, images, image_options):
    """Return ``(schema, image columns)`` of Arrow columns, a Hugging Face feature deciding where one is given."""
    schema, images = {}, list(images)
    for column in arrow_schema:
        feature = features.get(column.name, {})
        if column.name in images or feature.get("_type") == "Image":
            field = image_options.field()
            if image_options.mode is None and feature.get("mode") == "L":  # Image(mode="L"): kept grey
                field = dataclasses.replace(field, mode="L")
            schema[column.name] = field
            if column.name not in images:
                images.append(column.name)
        elif feature.get("_type") == "ClassLabel":
            schema[column.name] = Field("int", names=tuple(feature.get("names", ())) or None)
        else:
            schema[column.name] = _arrow_field(column.type)
    return schema, images


def _arrow_field(kind):
    """Return the field type of Arrow type ``kind``: the numbers, text and lists it holds; JSON otherwise."""
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return "int"
    if pa.types.is_floating(kind):
        return Field("float", dtype="float32" if kind.bit_width <= 32 else "float64")
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "str"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return "bytes"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        inner = kind.value_type
        if pa.types.is_integer(inner):
            return Field("tokens", dtype=inner.to_pandas_dtype().__name__ if inner.bit_width > 8 else "int32")
        if pa.types.is_floating(inner):
            return Field("ragged", dtype="float32" if inner.bit_width <= 32 else "float64")
        if pa.types.is_fixed_size_list(inner) and pa.types.is_floating(inner.value_type):
            return Field("ragged", dtype="float32", shape=(inner.list_size,))
    if pa.types.is_fixed_size_list(kind) and (pa.types.is_floating(kind.value_type)
                                              or pa.types.is_integer(kind.value_type)):
        return Field("array", dtype=kind.value_type.to_pandas_dtype().__name__, shape=(kind.list_size,))
    return "json"


# ---------------------------------------------------------------- Hugging Face datasets saved with save_to_disk


def read_hf_dataset(root, images=(), image_options=None):
    """Read a dataset folder written by ``datasets.Dataset.save_to_disk``: its Arrow files, typed by its features.

    Raises:
        SourceError: the folder is not such a dataset (a DatasetDict names its splits), or cannot be read.
    """
    root = os.fspath(root)
    if os.path.exists(os.path.join(root, "dataset_dict.json")):
        with open(os.path.join(root, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        raise SourceError(f"{root!r} holds the splits {', '.join(map(repr, splits))} (a DatasetDict): convert one "
                          f"split's folder, e.g. {os.path.join(root, splits[0] if splits else 'train')!r}")
    try:
        with open(os.path.join(root, HF_INFO)) as f:
            features = json.load(f)["features"]
        with open(os.path.join(root, "state.json")) as f:
            files = [os.path.join(root, item["filename"]) for item in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{root!r} is not a dataset folder saved by datasets' save_to_disk (no readable "
                          f"{HF_INFO} and state.json: {exc})") from exc
    streams = [_open_stream(path) for path in files]
    arrow_schema = streams[0].schema if streams else pa.schema([])
    _check_columns(root, arrow_schema.names, images)
    schema, images = _schema_of(arrow_schema, features, images, image_options or ImageOptions())

    def rows():
        for stream in streams:
            for batch in stream:
                for row in batch.to_pylist():
                    yield _with_paths(row, images, root)

    return schema, rows(), {"huggingface": os.path.basename(os.path.normpath(root))}


def _open_stream(path):
    try:
        return pa.ipc.open_stream(pa.memory_map(path, "r"))
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{path!r} cannot be read as an Arrow stream ({exc}); the dataset folder is damaged") \
            from exc


# ---------------------------------------------------------------- WebDataset tar shards


def read_webdataset(paths, image_options=None):
    """Read WebDataset ``.tar`` shards: a sample per key (``dir/name`` before the first dot), a field per extension.

    Images (jpg, png, webp...) are image fields; cls, cls2, index and id are
    ints; txt and text are str; json is JSON; any other extension is bytes.
    Every sample must have the fields of the first.

    Raises:
        SourceError: no shard, a shard that is not a tar file, or a key whose members are not together.
    """
    paths = [os.fspath(path) for path in paths]
    if not paths:
        raise SourceError("no WebDataset shards given")
    first = next(_tar_samples(paths[0]), None)
    if first is None:
        raise SourceError(f"{paths[0]!r} holds no samples")
    options = image_options or ImageOptions()
    schema = {_field_name(ext): _extension_field(ext, options) for ext in first[1]}

    def rows():
        for path in paths:
            for key, members in _tar_samples(path):
                yield {"__key__": key, **{_field_name(ext): _member_value(ext, data) for ext, data in members.items()}}

    return {"__key__": "str", **schema}, rows(), {"webdataset": [os.path.basename(path) for path in paths]}


def _tar_samples(path) -> Iterator:
    """Yield ``(key, {extension: bytes})`` of the tar at ``path``, in file order."""
    seen, key, members = set(), None, {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                name = member.name
                stem, _, ext = os.path.basename(name).partition(".")
                sample_key = os.path.join(os.path.dirname(name), stem)
                if sample_key != key:
                    if key is not None:
                        yield key, members
                    if sample_key in seen:
                        raise SourceError(f"{path!r}: the members of sample {sample_key!r} are not together (a "
                                          "WebDataset writes each sample's files in a row)")
                    seen.add(sample_key)
                    key, members = sample_key, {}
                members[ext.lower()] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError) as exc:
        raise SourceError(f"{path!r} cannot be read as a tar file ({exc})") from exc
    if key is not None:
        yield key, members


def _field_name(ext):
    return ext.replace(".", "_").replace("-", "_")


def _extension_field(ext, options):
    last = ext.rsplit(".", 1)[-1]
    if last in _IMAGE_EXTENSIONS:
        return options.field()
    if last in _INT_EXTENSIONS:
        return "int"
    if last in _TEXT_EXTENSIONS:
        return "str"
    if last == "json":
        return "json"
    return "bytes"


def _member_value(ext, data):
    """Return a member's value as its extension says; bytes that do not read so are returned as they are, and
    the field's type then names the sample that holds them."""
    last = ext.rsplit(".", 1)[-1]
    try:
        if last in _INT_EXTENSIONS:
            return int(data.decode("ascii").strip())
        if last in _TEXT_EXTENSIONS:
            return data.decode("utf-8")
        if last == "json":
            return json.loads(data)
    except ValueError:
        return data
    return data


def check_images(images):
    """Return the image column names ``images`` (a name or names) as a tuple."""
    if isinstance(images, str):
        return (images,)
    if not all(isinstance(name, str) for name in images):
        raise OptionError(f"image should name columns (str), got {images!r}")
    return tuple(images)



# ---------------------------------------------------------------- conversions: a reader, then fastdata.write


def convert_table(src, out, *, image=(), size=64, storage="raw", quality=None, resize=None, mode=None,
                  **options):
    """Convert the CSV/TSV/JSONL/Parquet manifest ``src`` into the record file ``out`` (see read_table).

    ``image``: the column(s) holding image paths or bytes, stored at ``size`` (N or (H, W)) as ``storage``
    (raw, jpeg, png), in ``mode`` (RGB, or L: grey). ``options``: fastdata.write's (workers, executor,
    on_error, overwrite, progress).
    """
    image_options = ImageOptions(size, storage, quality, resize, mode)
    schema, records, described = read_table(src, check_images(image), image_options)
    return write(records, out, schema, source=described, **options)


def convert_hf(src, out, *, image=(), size=64, storage="raw", quality=None, resize=None, mode=None, **options):
    """Convert a dataset folder saved by ``datasets``' save_to_disk into the record file ``out``.

    Its features decide the fields: Image -> image, ClassLabel -> int with its names, Value -> int,
    float or str, Sequence -> tokens or ragged; others -> json. Options as convert_table's.
    """
    schema, records, described = read_hf_dataset(src, check_images(image),
                                                 ImageOptions(size, storage, quality, resize, mode))
    return write(records, out, schema, source=described, **options)


def convert_webdataset(srcs, out, *, size=64, storage="raw", quality=None, resize=None, mode=None, **options):
    """Convert WebDataset ``.tar`` shards ``srcs`` into the record file ``out`` (see read_webdataset)."""
    schema, records, described = read_webdataset(srcs, ImageOptions(size, storage, quality, resize, mode))
    return write(records, out, schema, source=described, **options)
