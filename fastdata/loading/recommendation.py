"""The settings `fastdata tune` saved beside a packed file, read back by ``make_loader(num_workers="auto")``."""

import json
import os
import warnings

from fastdata.formats.shards import INDEX_NAME

TUNE_SUFFIX = ".tune.json"


def tune_json_path(path):
    """Return where ``tune_loader``'s result for ``path`` is saved by default: ``path + ".tune.json"``.

    For a shard folder ``OUT/`` that is ``OUT.tune.json``, beside the folder.
    """
    return os.path.normpath(os.fspath(path)) + TUNE_SUFFIX


def file_identity(path, dataset=None):
    """Return what identifies a packed file's contents: ``path``, ``size``, ``mtime_ns`` (and its shape).

    A shard folder is identified by its index, which a conversion writes last.
    """
    stat = os.stat(os.path.join(path, INDEX_NAME) if os.path.isdir(path) else path)
    identity = {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if dataset is not None:
        identity.update(num_samples=len(dataset), format=dataset.format, kind=dataset.kind,
                        storage=getattr(dataset, "storage", None))  # a record file has a storage per field
    return identity


def read_recommendation(path):
    """Return the settings saved by `fastdata tune` for the packed file ``path``, or None.

    Reads ``path + ".tune.json"``. Returns None where it does not exist; where
    it was recorded for different contents (another size or modification
    time: the file was replaced, copied or re-converted) or cannot be read,
    warns and returns None, so a recommendation never applies to another file.

    Returns:
        dict with ``batch_size``, ``num_workers``, ``prefetch_factor``, ``pin_memory``; or None.
    """
    tune_path = tune_json_path(path)
    if not os.path.exists(tune_path):
        return None
    try:
        with open(tune_path, encoding="utf-8") as f:
            saved = json.load(f)
        recorded, recommended = saved["file"], saved["recommended"]
        current = file_identity(path)
        same = all(recorded.get(key) == current[key] for key in ("size", "mtime_ns"))
        valid = all(_is_count(recommended.get(key)) for key in ("num_workers", "prefetch_factor"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(f"ignoring {tune_path!r}: cannot read it ({exc}); re-run \"fastdata tune\"", stacklevel=4)
        return None
    if not same:
        warnings.warn(f"ignoring {tune_path!r}: it was recorded for a different {os.path.basename(path)!r} "
                      "(size or modification time differ); re-run \"fastdata tune\"", stacklevel=4)
        return None
    if not valid:
        warnings.warn(f"ignoring {tune_path!r}: num_workers and prefetch_factor should be non-negative integers; "
                      "re-run \"fastdata tune\"", stacklevel=4)
        return None
    return recommended


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
