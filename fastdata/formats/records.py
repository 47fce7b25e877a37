"""Records of named fields: the schema, and the columns each field type is stored as.

A record file holds ``num_samples`` records, each a value per field. A field's
type decides how it is stored and batched:

==========  ====================================  ==========================================
type        value                                 stored as (``name``, ``name.offsets``)
==========  ====================================  ==========================================
``image``   RGB (or grey) pixels, one size        raw: uint8 ``[N, C, H, W]``; jpeg, png:
                                                  encoded bytes + offsets
``tokens``  integer ids, any length (0 too)       ``dtype`` values + offsets
``int``     one integer                           int64 ``[N]``
``float``   one number                            ``dtype`` (float64, float32) ``[N]``
``array``   an array of one ``shape``             ``dtype`` ``[N, *shape]``
``ragged``  rows of one inner shape: ``[n, *s]``  ``dtype`` ``[rows, *s]`` + offsets (in rows)
``str``     text                                  UTF-8 bytes + offsets
``bytes``   bytes                                 bytes + offsets
``json``    any JSON value                        its UTF-8 JSON text + offsets
==========  ====================================  ==========================================

Offsets are int64 ``[N + 1]``: record ``i`` is ``values[offsets[i]:offsets[i + 1]]``.
The schema is a list of field objects (``{"name", "type", ...}``) in the
file's JSON metadata, under ``fields``; both containers store every column
named as above, with chunk checksums (NOTE [checksums] in layout.py).
A (sample, label) file of the image or text converter reads as records too,
of the schema its metadata implies (NOTE [samples as records]).
"""

import re
from dataclasses import dataclass

import numpy as np

from fastdata.errors import FormatError, OptionError
from fastdata.formats.layout import bad_offset_samples, format_samples, longest_sample

RECORDS_KIND = "records"
LABEL_FIELD = "label"  # a (sample, label) file's labels, read as records: NOTE [samples as records]
SAMPLE_FIELDS = {"image": "image", "text": "tokens"}  # its samples' field, by the file's kind
FIELD_TYPES = ("image", "tokens", "int", "float", "array", "ragged", "str", "bytes", "json")
IMAGE_STORAGES = ("raw", "jpeg", "png")
IMAGE_MODES = ("RGB", "L")  # 3 channels, or 1 (grey)
RESIZE_MODES = ("crop", "pad", "stretch")  # codecs.images.RESIZE_MODES: formats/ imports no codec
OFFSETS_SUFFIX = ".offsets"
LENGTHS_SUFFIX = "_lengths"  # a ragged field's lengths in a batch: ``batch["boxes_lengths"]``
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DEFAULT_DTYPES = {"tokens": "int32", "int": "int64", "float": "float64", "array": "float32", "ragged": "float32"}
_BYTE_TYPES = ("str", "bytes", "json")
_OPTIONS = {"image": {"size", "storage", "quality", "resize", "mode"}, "tokens": {"dtype"}, "int": {"dtype", "names"},
            "float": {"dtype"}, "array": {"dtype", "shape"}, "ragged": {"dtype", "shape", "boxes"}}  # each type's


@dataclass(frozen=True)
class Field:
    """One field of a record schema: its type and how it is stored.

    Args:
        type: one of FIELD_TYPES.
        dtype: numeric dtype of ``tokens`` (default int32), ``float`` (float64),
            ``array`` and ``ragged`` (float32); ``int`` is int64.
        shape: ``array``: the fixed shape of each value; ``ragged``: the
            shape of each row (``(4,)`` for boxes ``[n, 4]``; default ``()``).
        size: ``image``: ``(height, width)`` every image is brought to.
        storage: ``image``: "raw" (decoded pixels, the fastest to load),
            "jpeg" or "png" (encoded, decoded per batch).
        quality: ``image`` with ``storage="jpeg"``: the JPEG quality.
        resize: ``image``: "crop", "pad" or "stretch" (see codecs.images.ImageSpec).
        mode: ``image``: "RGB" (default: 3 channels) or "L" (grey: 1 channel, the luma of an RGB source).
        names: ``int``: the class names its values index (a ClassLabel's), kept in the file.
        boxes: ``ragged`` of shape (4,): the image field whose boxes (x, y, width, height in its
            pixels) these are, so that a loader's augmentation moves them with their image.

    Example:
        >>> schema = {"image": Field("image", size=(64, 64), storage="jpeg"), "caption": "str", "label": "int"}
    """

    type: str
    dtype: str | None = None
    shape: tuple | None = None
    size: tuple | None = None
    storage: str | None = None
    quality: int | None = None
    resize: str | None = None
    names: tuple | None = None
    boxes: str | None = None
    mode: str | None = None  # an image's; None for RGB, which files written before it hold

    def to_dict(self, name):
        """Return the field's JSON object, as the file's metadata stores it."""
        return {"name": name, **{key: list(value) if isinstance(value, tuple) else value
                                 for key, value in vars(self).items() if value is not None}}

    @property
    def ragged(self):
        """Whether each value has its own length (stored as values + offsets)."""
        return self.type in ("tokens", "ragged", *_BYTE_TYPES) or (self.type == "image" and self.storage != "raw")

    @property
    def row_shape(self):
        """The shape of one stored row of the values column: a record's value (fixed) or one row of it (ragged)."""
        if self.type == "image":
            return (self.channels, *self.size) if self.storage == "raw" else ()
        return tuple(self.shape or ())

    @property
    def channels(self):
        """An image's channels: 1 for mode "L", else 3."""
        return 1 if self.mode == "L" else 3

    @property
    def stored_dtype(self):
        """The numpy dtype of the values column."""
        if self.type in ("image", *_BYTE_TYPES):
            return np.dtype(np.uint8)
        return np.dtype(self.dtype)


def make_field(spec, name):
    """Return the complete Field of ``spec`` (a type name, a Field or a field's JSON object), defaults filled in.

    Raises:
        OptionError: an unknown type, a bad option, or an option its type does not take, naming the field.
    """
    if isinstance(spec, str):
        spec = Field(spec)
    elif isinstance(spec, dict):
        spec = _field_of_json(spec, name)
    elif not isinstance(spec, Field):
        raise OptionError(f"field {name!r} should be a type name {FIELD_TYPES} or a fastdata.Field, got "
                          f"{type(spec).__name__}")
    if spec.type not in FIELD_TYPES:
        raise OptionError(f"field {name!r} has type {spec.type!r}; use one of {FIELD_TYPES}")
    return _complete(spec, name)


def _complete(spec, name):
    given = {key for key, value in vars(spec).items() if value is not None and key != "type"}
    takes = _OPTIONS.get(spec.type, set())
    if given - takes:
        raise OptionError(f"field {name!r} of type {spec.type!r} takes no {', '.join(sorted(given - takes))}"
                          + (f"; it takes {', '.join(sorted(takes))}" if takes else ""))
    if spec.type == "image":
        return _image_field(spec, name)
    dtype = _numeric_dtype(spec, name) if spec.type in _DEFAULT_DTYPES else None
    shape = None
    if spec.type in ("array", "ragged"):
        shape = _shape(spec.shape if spec.shape is not None else (None if spec.type == "array" else ()), name)
    names = None
    if spec.names is not None:
        names = tuple(spec.names) if isinstance(spec.names, (list, tuple)) else None
        if names is None or not all(isinstance(item, str) for item in names):
            raise OptionError(f"field {name!r}: names should be a list of class names (str), got {spec.names!r}")
    if spec.boxes is not None and (not isinstance(spec.boxes, str) or shape != (4,)):
        raise OptionError(f"field {name!r}: boxes names the image field these boxes belong to, on a ragged field of "
                          f"shape (4,): (x, y, width, height); got boxes={spec.boxes!r}, shape={shape}")
    return Field(spec.type, dtype=dtype, shape=shape, names=names, boxes=spec.boxes)


def _image_field(spec, name):
    if spec.size is None:
        raise OptionError(f"image field {name!r} needs size=(height, width): every image of a field is stored at "
                          "one size")
    size = _shape(spec.size, name, "size")
    if len(size) != 2 or 0 in size:
        raise OptionError(f"image field {name!r}: size should be (height, width) of positive integers, got "
                          f"{spec.size!r}")
    if spec.resize not in (None, *RESIZE_MODES):
        raise OptionError(f"image field {name!r}: resize should be one of {RESIZE_MODES}, got {spec.resize!r}")
    storage = spec.storage or "raw"
    if storage not in IMAGE_STORAGES:
        raise OptionError(f"image field {name!r}: storage should be one of {IMAGE_STORAGES}, got {storage!r}")
    quality = None
    if storage == "jpeg":
        quality = 90 if spec.quality is None else spec.quality
        if not isinstance(quality, int) or isinstance(quality, bool) or not 1 <= quality <= 100:
            raise OptionError(f"image field {name!r}: quality should be an integer 1..100, got {quality!r}")
    elif spec.quality is not None:
        raise OptionError(f"image field {name!r}: quality applies to storage='jpeg' only")
    if spec.mode not in (None, *IMAGE_MODES):
        raise OptionError(f"image field {name!r}: mode should be one of {IMAGE_MODES}, got {spec.mode!r}")
    return Field("image", size=size, storage=storage, quality=quality, resize=spec.resize or "crop",
                 mode="L" if spec.mode == "L" else None)


def _numeric_dtype(spec, name):
    if spec.type == "int":
        if spec.dtype not in (None, "int64"):
            raise OptionError(f"field {name!r} of type 'int' is stored as int64, got dtype {spec.dtype!r}; an array "
                              "of another integer dtype is Field('array', dtype=..., shape=())")
        return "int64"
    try:
        dtype = np.dtype(spec.dtype or _DEFAULT_DTYPES[spec.type])
    except TypeError as exc:
        raise OptionError(f"field {name!r}: dtype {spec.dtype!r} is not a numpy dtype") from exc
    kinds = {"tokens": "iu", "float": "f"}.get(spec.type, "biuf")
    if dtype.kind not in kinds or dtype.byteorder == ">":
        wanted = {"iu": "an integer", "f": "a floating"}.get(kinds, "a numeric")
        raise OptionError(f"field {name!r} of type {spec.type!r} takes {wanted} dtype, got {dtype}")
    return dtype.name


def _shape(shape, name, option="shape"):
    if shape is None:
        raise OptionError(f"array field {name!r} needs shape=(...): every value of it has that shape")
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                       for d in shape):
        raise OptionError(f"field {name!r}: {option} should be a tuple of non-negative integers, got {shape!r}")
    return tuple(shape)


def _field_of_json(spec, name):
    keys = set(Field.__dataclass_fields__) | {"name"}
    if "type" not in spec or set(spec) - keys:
        raise OptionError(f"field {name!r}: a field object holds type and some of {sorted(keys - {'type'})}, got "
                          f"{sorted(spec)}")
    return Field(**{key: tuple(value) if isinstance(value, list) else value for key, value in spec.items()
                    if key != "name"})


def make_schema(schema):
    """Return ``{name: Field}`` of ``schema`` (``{name: type name | Field}``), every field complete.

    Raises:
        OptionError: a name that is not an identifier, two fields whose batch keys collide, or a bad field.
    """
    if not isinstance(schema, dict) or not schema:
        raise OptionError(f"schema should be a non-empty dict of field name -> type, got {schema!r}")
    fields = {}
    for name, spec in schema.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise OptionError(f"field name {name!r} should be an identifier (letters, digits, _): it names the "
                              "file's columns and the batch's keys")
        fields[name] = make_field(spec, name)
    for name, field in fields.items():
        if field.boxes is not None and getattr(fields.get(field.boxes), "type", None) != "image":
            raise OptionError(f"field {name!r} holds the boxes of {field.boxes!r}, which is not an image field of "
                              f"this schema (its fields: {', '.join(fields)})")
        if field.ragged and field.type in ("tokens", "ragged") and name + LENGTHS_SUFFIX in fields:
            raise OptionError(f"fields {name!r} and {name + LENGTHS_SUFFIX!r}: a batch holds the lengths of "
                              f"{name!r} under {name + LENGTHS_SUFFIX!r}; rename one")
    return fields


def schema_to_json(fields):
    """Return the metadata's ``fields`` list of ``{name: Field}``."""
    return [field.to_dict(name) for name, field in fields.items()]


def schema_of_metadata(metadata, path):
    """Return ``{name: Field}`` of a file's ``metadata``: a record file's stored schema, or the implied one.

    A (sample, label) file's schema is implied by its kind (NOTE [samples as records]).

    Raises:
        FormatError: the stored fields are not a valid schema, or the samples have no record view, naming ``path``.
    """
    if metadata.get("kind") != RECORDS_KIND:
        return _implied_schema(metadata, path)
    stored = metadata.get("fields")
    if not isinstance(stored, list) or not all(isinstance(item, dict) and isinstance(item.get("name"), str)
                                               for item in stored):
        raise FormatError(f"{path!r}: field fields should be a list of field objects with names; the file is "
                          "damaged: re-write it")
    try:
        return make_schema({item["name"]: item for item in stored})
    except OptionError as exc:
        raise FormatError(f"{path!r}: its stored schema is not valid ({exc}); the file is damaged: re-write it") \
            from exc


def _implied_schema(metadata, path):
    """Return ``{name: Field}`` of the records a (sample, label) file holds; see NOTE [samples as records].

    NOTE [samples as records]: the image converter stores ``samples`` (raw
    uint8 ``[N, 3, H, W]``, or JPEG bytes + ``offsets``) and the text
    converter token ids + ``offsets``, beside int64 ``labels``: exactly the
    columns of an ``image`` field of the file's size and storage, of a
    ``tokens`` field of the stored dtype, and of an ``int`` field whose names
    are the classes. So such a file (format version 1 or 2) is read as records
    of ``image`` (or ``tokens``) and ``label`` from its own columns, unchanged,
    by the decoders that read its (sample, label) pairs: the same bytes, and
    the file stays what it was for open_dataset and the converters.
    """
    kind, storage = metadata.get("kind"), metadata.get("storage")
    classes = metadata.get("classes")
    label = Field("int", names=None if classes is None else tuple(classes))
    if kind == "image" and storage in ("raw", "jpeg"):
        settings = metadata.get("preprocessing") or {}
        sample = Field("image", size=tuple(metadata["sample_shape"][1:]), storage=storage,
                       quality=settings.get("quality") if storage == "jpeg" else None, resize=settings.get("resize"))
    elif kind == "text" and storage == "tokens":
        sample = Field("tokens", dtype=metadata["sample_dtype"])
    else:
        raise FormatError(f"{path!r} holds {kind!r} samples stored as {storage!r}, which this fastdata does not read "
                          "as records: upgrade fastdata, or read its (sample, label) pairs with fastdata.open_dataset")
    try:
        return make_schema({SAMPLE_FIELDS[kind]: sample, LABEL_FIELD: label})
    except OptionError as exc:
        raise FormatError(f"{path!r}: its metadata does not describe {kind} samples ({exc}); the file is damaged: "
                          'convert the source again with "fastdata convert"') from exc


def sample_records(columns, metadata, path):
    """Return ``({field name: FieldColumn}, {field name: Field}, metadata)`` of a (sample, label) file's Columns.

    The columns are the file's own (NOTE [samples as records]), checked against the implied schema.

    Raises:
        FormatError: the samples have no record view, or their columns are not of its shapes and dtypes.
    """
    fields = _implied_schema(metadata, path)
    records = {SAMPLE_FIELDS[metadata["kind"]]: FieldColumn(columns.samples, columns.offsets),
               LABEL_FIELD: FieldColumn(columns.labels)}
    check_record_columns(records, fields, metadata["num_samples"], path)
    return records, fields, metadata


def longest_values(metadata):
    """Return ``{ragged field: its longest value}`` that ``metadata`` records, or None (a file written without it)."""
    if metadata.get("kind") == "text":  # a (sample, label) file's: its longest stored sample
        longest = longest_sample(metadata)
        return None if longest is None else {SAMPLE_FIELDS["text"]: int(longest)}
    return metadata.get("longest")


@dataclass(frozen=True, eq=False)
class FieldColumn:
    """The stored arrays of one field: ``values`` (fixed: ``[N, *row_shape]``), and ``offsets`` int64 ``[N + 1]``."""

    values: np.ndarray
    offsets: np.ndarray | None = None


def stored_record_columns(columns):
    """Return ``{column name: array}`` of ``{field name: FieldColumn}``: the names the containers and checksums use."""
    stored = {}
    for name, column in columns.items():
        stored[name] = column.values
        if column.offsets is not None:
            stored[name + OFFSETS_SUFFIX] = column.offsets
    return stored


def check_record_columns(columns, fields, num_samples, path):
    """Check that the columns of every field of ``fields`` are there, of their shapes and dtypes, offsets in bounds.

    Raises:
        FormatError: a column is missing or of another shape or dtype, naming ``path`` and the field.
    """
    for name, field in fields.items():
        column = columns.get(name)
        if column is None:
            raise FormatError(f"{path!r}: the column of field {name!r} is missing; the file is damaged")
        values = column.values
        if values.dtype != field.stored_dtype or values.shape[1:] != field.row_shape:
            raise FormatError(f"{path!r}: field {name!r} is stored as {values.dtype}{list(values.shape)}, its "
                              f"schema says {field.stored_dtype}[*, {', '.join(map(str, field.row_shape))}]; the "
                              "file is damaged")
        if field.ragged:
            if column.offsets is None or column.offsets.shape != (num_samples + 1,):
                raise FormatError(f"{path!r}: field {name!r} should have {num_samples + 1} offsets; the file is "
                                  "damaged")
            bad = bad_offset_samples(column.offsets, len(values))
            if len(bad):
                raise FormatError(f"{path!r} is damaged: the offsets of field {name!r} at {format_samples(bad)} "
                                  'are out of order or out of bounds. Run "fastdata verify" on it for details, and '
                                  "write it again.")
        elif len(values) != num_samples:
            raise FormatError(f"{path!r}: field {name!r} holds {len(values)} values for {num_samples} records; "
                              "the file is damaged")


def refuse_records(metadata, path):
    """Raise FormatError where ``metadata`` is a record file's: a reader of (sample, label) files cannot read it."""
    if metadata.get("kind") == RECORDS_KIND:
        names = ", ".join(str(item.get("name")) for item in metadata.get("fields", []) if isinstance(item, dict))
        raise FormatError(f"{path!r} holds records of named fields ({names}), not (sample, label) pairs: open it "
                          "with fastdata.open_dataset, whose items and batches are dicts")
