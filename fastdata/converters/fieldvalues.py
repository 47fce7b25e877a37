"""One record's value of a field -> the array it is stored as; a field's type guessed from a first value.

Every encoder either returns the stored form of a value (fixed fields: an
array of the field's row shape; ragged ones: ``[n, *row_shape]``) or raises
Mismatch saying what differs, which the writer reports with the record's
index and the field's name. Nothing is converted into what it is not: a
float is never cut to an int, an integer never wrapped into a smaller
dtype, an image of another size never resized unless its field says how.
"""

import io
import json
import operator
import os

import numpy as np
from PIL import Image

from fastdata.codecs.images import ImageSpec, encode_jpeg, load_image, load_image_bytes, prepare_pixels
from fastdata.errors import OptionError
from fastdata.formats.records import Field, make_field


class Mismatch(ValueError):
    """A value does not fit its field; the message says what differs."""


def encode(field, value):
    """Return ``value`` as ``field`` stores it; raise Mismatch where it does not fit."""
    return _ENCODERS[field.type](field, value)


def _int(field, value):
    if isinstance(value, (float, np.floating)) or not hasattr(value, "__index__"):
        raise Mismatch(f"should be an integer, got {_kind(value)}")
    number = operator.index(value)
    if not -(1 << 63) <= number < 1 << 63:
        raise Mismatch(f"{number} does not fit int64")
    if field.names is not None and not -1 <= number < len(field.names):
        raise Mismatch(f"{number} names none of its {len(field.names)} classes (-1: no label)")
    return np.int64(number)


def _float(field, value):
    if isinstance(value, (str, bytes)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise Mismatch(f"should be a number, got {_kind(value)}")
    return np.asarray(value, dtype=field.dtype)


def _numbers(value, dtype, what):
    """Return ``value`` as an array of ``dtype``; Mismatch where a value would change (a float cut, an int wrapped)."""
    if isinstance(value, (str, bytes, dict)):
        raise Mismatch(f"should be {what}, got {_kind(value)}")
    try:
        array = np.asarray(value)
    except ValueError as exc:  # lists of uneven lengths
        raise Mismatch(f"should be {what}, got {_kind(value)} that is not an array ({exc})") from exc
    dtype = np.dtype(dtype)
    if array.size == 0:
        return array.astype(dtype)
    if array.dtype.kind not in "biuf":
        raise Mismatch(f"should be {what}, got values of {array.dtype}")
    if dtype.kind in "iu":
        if array.dtype.kind == "f":
            raise Mismatch(f"should hold integers ({dtype}), got floats")
        info = np.iinfo(dtype)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            raise Mismatch(f"holds {low}..{high}, outside {dtype} ({info.min}..{info.max}): declare a wider dtype")
    return array.astype(dtype, copy=False)


def _tokens(field, value):
    array = _numbers(value, field.dtype, "a list of token ids")
    if array.ndim != 1:
        raise Mismatch(f"should be a 1-D list of token ids, got shape {list(array.shape)}")
    return array


def _array(field, value):
    array = _numbers(value, field.dtype, f"an array of shape {list(field.shape)}")
    if array.shape != field.shape:
        raise Mismatch(f"should have shape {list(field.shape)}, got {list(array.shape)}; a field whose values "
                       "differ in length is a Field('ragged', ...)")
    return array


def _ragged(field, value):
    array = _numbers(value, field.dtype, f"rows of shape {list(field.shape)}")
    if array.size == 0 and array.ndim <= 1:
        array = array.reshape(0, *field.shape)
    if array.ndim != 1 + len(field.shape) or array.shape[1:] != field.shape:
        raise Mismatch(f"should be rows [n, {', '.join(map(str, field.shape))}], got shape {list(array.shape)}"
                       .replace("[n, ]", "[n]"))
    return array


def _str(field, value):
    if not isinstance(value, str):
        raise Mismatch(f"should be text (str), got {_kind(value)}")
    try:
        return np.frombuffer(value.encode("utf-8"), np.uint8)
    except UnicodeEncodeError as exc:
        raise Mismatch(f"text cannot be stored as UTF-8 ({exc.reason} at character {exc.start})") from exc


def _bytes(field, value):
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise Mismatch(f"should be bytes, got {_kind(value)}")
    return np.frombuffer(bytes(value), np.uint8)


def _json(field, value):
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise Mismatch(f"is not JSON ({exc})") from exc
    return np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)


def _image(field, value):
    spec = ImageSpec(*field.size, resize=field.resize)
    try:
        if isinstance(value, (bytes, bytearray, memoryview)):
            pixels = load_image_bytes(bytes(value), spec)
        elif isinstance(value, (str, os.PathLike)):
            pixels = load_image(os.fspath(value), spec)
        elif isinstance(value, Image.Image):
            pixels = prepare_pixels(value, spec)
        elif isinstance(value, np.ndarray):
            pixels = prepare_pixels(_array_image(value), spec)
        else:
            raise Mismatch(f"should be an image (encoded bytes, a file path, a PIL image or uint8 [H, W, 3]), got "
                           f"{_kind(value)}")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        if isinstance(exc, Mismatch):
            raise
        raise Mismatch(f"is not a usable image ({type(exc).__name__}: {exc})") from exc
    if field.mode == "L":  # the luma of the prepared RGB pixels: a grey source's own values (R = G = B)
        pixels = np.asarray(Image.fromarray(pixels, "RGB").convert("L"))
    if field.storage == "raw":
        return np.ascontiguousarray(pixels.transpose(2, 0, 1) if pixels.ndim == 3 else pixels[None])
    if field.storage == "jpeg":
        return np.frombuffer(encode_jpeg(pixels, field.quality), np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return np.frombuffer(buffer.getvalue(), np.uint8)


def _array_image(array):
    if array.dtype != np.uint8 or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3, 4))):
        raise Mismatch(f"should be uint8 pixels [H, W], [H, W, 3] or [H, W, 4], got {array.dtype}"
                       f"{list(array.shape)}")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(array))  # L, RGB or RGBA by its shape


_ENCODERS = {"int": _int, "float": _float, "tokens": _tokens, "array": _array, "ragged": _ragged, "str": _str,
             "bytes": _bytes, "json": _json, "image": _image}


def _kind(value):
    if isinstance(value, np.ndarray):
        return f"an array {value.dtype}{list(value.shape)}"
    return f"{type(value).__name__} {_shown(value)}"


def _shown(value):
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def infer_field(value, name):
    """Return the Field a first record's ``value`` suggests for field ``name``.

    ints -> int, floats -> float, str -> str, bytes -> bytes, a PIL image ->
    raw image of its size, an ndarray -> array of its shape and dtype, a list
    of ints -> tokens, a list of numbers -> ragged, a list of equal-length
    number lists -> ragged rows (boxes), dicts and other lists -> json.

    Raises:
        OptionError: None, an empty list or another value whose type cannot be told: pass a schema.
    """
    if isinstance(value, (bool, int, np.integer)):
        return make_field("int", name)
    if isinstance(value, (float, np.floating)):
        return make_field("float", name)
    if isinstance(value, str):
        return make_field("str", name)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return make_field("bytes", name)
    if isinstance(value, Image.Image):
        return make_field(Field("image", size=(value.height, value.width)), name)
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return make_field(Field("array", dtype=value.dtype.name, shape=value.shape), name)
    if isinstance(value, (list, tuple)) and value:
        return _infer_list(value, name)
    if isinstance(value, (dict, list, tuple)):
        return make_field("json", name) if value else _cannot_infer(value, name)
    return _cannot_infer(value, name)


def _infer_list(value, name):
    if all(isinstance(item, (int, np.integer)) and not isinstance(item, bool) for item in value):
        wide = max(value) > np.iinfo(np.int32).max or min(value) < np.iinfo(np.int32).min
        return make_field(Field("tokens", dtype="int64" if wide else None), name)
    if all(isinstance(item, (int, float, np.number)) and not isinstance(item, bool) for item in value):
        return make_field(Field("ragged", dtype="float64"), name)
    rows = [np.asarray(item) if isinstance(item, (list, tuple)) else None for item in value]
    if all(row is not None and row.ndim == 1 and row.dtype.kind in "iuf" for row in rows) \
            and len({len(row) for row in rows}) == 1:
        return make_field(Field("ragged", dtype="float64", shape=(len(rows[0]),)), name)
    return make_field("json", name)


def _cannot_infer(value, name):
    raise OptionError(f"cannot tell the type of field {name!r} from the first record's value {_shown(value)}: pass "
                      f"schema={{{name!r}: ...}} (one of int, float, str, bytes, json, tokens, or a fastdata.Field)")
