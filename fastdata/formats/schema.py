"""The fields of a shard index and of a dataset's metadata, checked once where they are parsed.

Readers, ``fastdata info`` and ``fastdata verify`` index into these JSON
objects freely; a damaged or hand-edited ``index.json`` or packed file's
metadata (a key dropped, a list where a number goes) made them fail deep
inside with a bare KeyError, TypeError or AttributeError that named no file.
Each field is checked here instead, and a bad one is a FormatError naming the
file, the field (as a path: ``metadata.skipped[2].path``), what it should be
and what to do. An index is checked whole when it is parsed; a packed file's
present fields when it is opened, and whole by ``info`` and ``verify``.
"""

import numpy as np

from fastdata.errors import FormatError

_ADVICE = ('restore it, run "fastdata index" on its folder (a folder that still holds .fastdata/), '
           'or re-run "fastdata convert"')
_FILE_ADVICE = 'the file is damaged: restore it, or re-run "fastdata convert"'


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _integer(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dtype(value):
    try:
        return isinstance(value, str) and np.dtype(value).kind in "biuf"
    except (TypeError, ValueError):  # numpy raises either, by how the text fails to parse ("0\x1b": ValueError)
        return False


def _crc32(value):
    return isinstance(value, str) and len(value) == 8 and all(c in "0123456789abcdef" for c in value)


def _list_of(test):
    return lambda value: isinstance(value, list) and all(test(item) for item in value)


def _optional(test):
    return lambda value: value is None or test(value)


def _is(kind):
    return lambda value: isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


# field -> (test, what it should be, required); a dict of fields in place of the test: an object holding them.
# The kinds of dataset add their own required fields below.
_INDEX = {
    "format_version": (_count, "an integer", True),
    "container": (_is(str), "a container name", True),
    "num_samples": (_count, "a non-negative integer", True),
    "conversion": (_is(str), "a conversion id (text)", False),
    "settings": (_is(dict), "an object", True),
    "metadata": (_is(dict), "an object", True),
    "shards": (_list_of(_is(dict)), "a list of shard objects", True),
    "columns": (_is(dict), "an object", False),
}
_SHARD = {
    "name": (_is(str), "a file name", True),
    "start": (_count, "a non-negative integer", True),
    "num_samples": (_count, "a non-negative integer", True),
    "bytes": (_count, "a non-negative integer", True),
    "crc32": (_crc32, "8 lower-case hex digits", True),
    "number": (_count, "a non-negative integer", False),
    "inputs": (lambda v: _list_of(_count)(v) and len(v) == 2, "[first input, last input + 1]", False),
}
_SKIPPED = {"path": (_is(str), "text", True), "reason": (_is(str), "text", True)}
_DATASET = {
    "kind": (lambda v: v in ("image", "text"), '"image", "text" or "records"', True),
    "num_samples": (_count, "a non-negative integer", True),
    "sample_shape": (_list_of(_optional(lambda v: _count(v) and v > 0)), "a list of positive integers (or null)",
                     True),
    "sample_dtype": (_dtype, "a numeric dtype name (uint8, int32...)", True),
    "storage": (_is(str), "a storage name (raw, jpeg, tokens)", True),
    "classes": (_list_of(_is(str)), "a list of class names", False),
    "class_counts": (_list_of(_count), "a list of non-negative integers", False),
    "mean": (_optional(_list_of(_number)), "a list of numbers (or null)", False),
    "std": (_optional(_list_of(_number)), "a list of numbers (or null)", False),
    "source": ({"ignored": (lambda v: isinstance(v, dict) and all(map(_count, v.values())),
                            "an object of counts", False)}, "an object", False),
    "preprocessing": (_is(dict), "an object", False),
    "skipped": (_list_of(_is(dict)), 'a list of {"path": text, "reason": text}', False),
    "num_unlabeled": (_count, "a non-negative integer", False),
    "unk_fraction": (_number, "a number", False),
}
_TOKENIZER = {
    "kind": (_is(str), "a tokenizer kind", True),
    "vocab_size": (_count, "a non-negative integer", True),
    "pad_id": (_optional(_integer), "an integer or null", True),
    "unk_id": (_optional(_integer), "an integer or null", True),
    "lowercase": (_is(bool), "true or false", True),
    "strip_html": (_is(bool), "true or false", True),
    "max_length": (_optional(_count), "a non-negative integer or null", True),
}
_LENGTHS = {key: (_number, "a number", True)
            for key in ("min", "max", "mean", "p50", "p90", "p95", "p99", "num_tokens", "truncated")}
_OF_KIND = {  # what `fastdata info`, the loaders and verify read of each kind
    "image": {"sample_shape": (lambda v: isinstance(v, list) and len(v) == 3 and all(map(_count, v)),
                               "[channels, height, width]", True),
              **{key: (*_DATASET[key][:2], True) for key in ("classes", "class_counts", "mean", "std")}},
    "text": {"tokenizer": (_TOKENIZER, "a tokenizer object", True),
             "lengths": (_LENGTHS, "an object of length statistics", True),
             **{key: (*_DATASET[key][:2], True) for key in ("classes", "class_counts", "num_unlabeled",
                                                             "unk_fraction")}},
}


_RECORDS = {  # a file of records of named fields (records.py): its fields are checked by schema_of_metadata
    "kind": (lambda v: v == "records", '"records"', True),
    "num_samples": _DATASET["num_samples"],
    "fields": (_list_of(lambda v: isinstance(v, dict) and isinstance(v.get("name"), str)),
               "a list of field objects with names", True),
    "source": (_is(dict), "an object", False),
    "skipped": _DATASET["skipped"],
    "longest": (lambda v: isinstance(v, dict) and all(map(_count, v.values())),
                "an object of counts (each ragged field's longest value)", False),
}
_CONTAINER_KEYS = ("kind", "sample_shape", "sample_dtype")


def check_index_fields(index, where):
    """Check every field of the parsed shard index ``index`` (a dict, format and version already checked).

    Raises:
        FormatError: a field is missing or of the wrong type, naming ``where`` and the field.
    """
    _check(index, _INDEX, where, "")
    for number, shard in enumerate(index["shards"]):
        _check(shard, _SHARD, where, f"shards[{number}].")
    check_dataset_fields(index["metadata"], where, "metadata.")


def check_dataset_fields(metadata, where, prefix="", complete=True):
    """Check the fields of the dataset ``metadata`` of an index or a packed file.

    ``complete``: every field the dataset's kind holds must be there (an index, one packed file described or
    verified); else only the fields present are checked (a file opened to read: a shard holds a few).

    Raises:
        FormatError: a field is missing or of the wrong type, naming ``where`` and the field.
    """
    advice = _ADVICE if prefix else _FILE_ADVICE  # an index's metadata, or a packed file's
    if metadata.get("kind") == "records":
        _check(metadata, _RECORDS if complete else _present(_RECORDS), where, prefix, advice)
    elif complete:
        _check(metadata, _DATASET, where, prefix, advice)
        _check(metadata, _OF_KIND[metadata["kind"]], where, prefix, advice)
    else:  # the container checks the shape and dtype against its arrays; any kind may be stored
        _check(metadata, _present({k: v for k, v in _DATASET.items() if k not in _CONTAINER_KEYS}), where, prefix,
               advice)
        _check(metadata, _present(_OF_KIND.get(metadata["kind"], {})), where, prefix, advice)
    for number, entry in enumerate(metadata.get("skipped", [])):
        _check(entry, _SKIPPED, where, f"{prefix}skipped[{number}].", advice)


def _present(fields):
    """Return ``fields`` none of which is required, nested objects checked as objects only."""
    return {key: (_is(dict) if isinstance(test, dict) else test, what, False) for key, (test, what, _) in
            fields.items()}


def _check(value, fields, where, prefix, advice=_ADVICE):
    bad = _first_bad(value, fields)
    if bad is None:
        return
    key, problem = bad
    raise FormatError(f"{where!r}: field {prefix}{key} {problem}; {advice}")


def _first_bad(value, fields):
    """Return ``(key, "is missing" | "should be ..., got ...")`` of the first bad field of dict ``value``, or None.

    The key of a nested object's field is dotted: ``tokenizer.vocab_size``.
    """
    for key, (test, what, required) in fields.items():
        if key not in value:
            if required:
                return key, "is missing"
            continue
        if isinstance(test, dict):
            if not isinstance(value[key], dict):
                return key, f"should be {what}, got {_shown(value[key])}"
            bad = _first_bad(value[key], test)
            if bad is not None:
                return f"{key}.{bad[0]}", bad[1]
        elif not test(value[key]):
            return key, f"should be {what}, got {_shown(value[key])}"
    return None


def _shown(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
