"""A tokenized corpus -> a shard folder: its ids cut into shard files by size, then the index.

convert_text tokenizes into a staging folder as for one file (NOTE [vocabulary
in one pass] in text); this module decides the shard boundaries and writes
the shards and ``index.json``.
"""

import json
import os

import numpy as np

from fastdata.converters.shardfolder import check_replaceable, check_same_settings
from fastdata.converters.shards import (
    DEFAULT_SHARD_BYTES,
    container_of,
    damaged_files,
    is_folder_output,
    remote_damaged_files,
    write_shard,
)
from fastdata.errors import FastdataError, OptionError
from fastdata.formats import Columns
from fastdata.formats.shards import INDEX_NAME, conversion_id, parse_index, read_index, write_column, write_index
from fastdata.storage.urls import is_url, join

_SAMPLE_BYTES = 16  # besides its ids, each stored sample costs an int64 label and an int64 offset
# Per-sample facts every shard file holds (the dataset-wide ones live in the index only).
_SHARD_KEYS = ("kind", "storage", "sample_shape", "sample_dtype", "classes", "tokenizer", "preprocessing")
_PERCENTILES = (50, 90, 95, 99)


def length_stats(lengths, truncated):
    """Describe int64 sample ``lengths`` [N]; ``truncated``: bool [N], cut at max_length."""
    return {
        "min": int(lengths.min()),
        "max": int(lengths.max()),
        "mean": round(float(lengths.mean()), 3),
        **{f"p{q}": float(v) for q, v in zip(_PERCENTILES, np.percentile(lengths, _PERCENTILES))},
        "num_tokens": int(lengths.sum()),
        "truncated": int(np.count_nonzero(truncated)),
    }


def shard_options(out, format, shard_size, on_error):
    """Return the shard folder's settings, or None when ``out`` is one packed file.

    Raises:
        OutputExistsError: ``out`` is a file, or a folder of other files (never replaced, even with overwrite).
        OptionError: a bad ``format`` or ``shard_size``.
    """
    container = container_of(out, format)
    if not is_folder_output(out):
        if shard_size is not None:
            raise OptionError(f"shard_size needs a shard folder, not the file {os.fspath(out)!r}; give a folder "
                              "name (without .h5, .hdf5 or .arrow) to write shards")
        return None
    if not is_url(out):  # a URL is checked by converters.upload
        check_replaceable(os.path.abspath(os.fspath(out)))
    if shard_size is None:
        shard_size = DEFAULT_SHARD_BYTES
    if isinstance(shard_size, bool) or not isinstance(shard_size, (int, np.integer)):
        raise TypeError(f"shard_size should be a number of bytes, got {type(shard_size).__name__}")
    if shard_size < 1:
        raise OptionError(f"shard_size should be a positive number of bytes, got shard_size={shard_size}")
    return {"converter": "text", "container": container, "shard_size": int(shard_size), "on_error": on_error}


def finished_folder(out, settings, build, remote=None):
    """Return ``(metadata, [])`` of the finished shard folder ``out`` when every file is intact, else ``(None,
    [(file name, what is wrong)])``: what a resume keeps (NOTE [resume checks what it keeps] in converters/shards).

    ``settings``: what the index's settings should be; with ``build`` (a vocabulary built from the texts) its
    size is not known before tokenizing, and is not compared. No finished folder: ``(None, [])``. ``remote``:
    the RemoteFolder of a URL ``out``, whose files are compared by size.

    Raises:
        OptionError: ``out`` was converted with other settings.
    """
    if remote is None:
        root = os.path.abspath(os.fspath(out))
        if not os.path.isfile(os.path.join(root, INDEX_NAME)):
            return None, []
        read, damaged = (lambda: read_index(root)), (lambda: damaged_files(root))
    else:
        root, state = remote.url, remote.pull(check=True)
        if state.index is None:
            return None, []
        read = lambda: parse_index(json.dumps(state.index).encode(), join(root, INDEX_NAME), root)  # noqa: E731
        damaged = lambda: remote_damaged_files(root, state.index, state.sizes)  # noqa: E731
    try:
        index = read()
    except FastdataError:
        return None, damaged()  # the index, named
    recorded = index.settings
    if build and isinstance(recorded.get("preprocessing"), dict):
        vocab_size = recorded["preprocessing"].get("vocab_size")
        settings = {**settings, "preprocessing": {**settings["preprocessing"], "vocab_size": vocab_size}}
    check_same_settings(root, recorded, settings)
    found = damaged()
    return (None, found) if found else (index.metadata, [])


def _shard_bounds(sizes, shard_size):
    """Cut consecutive samples into shards of at most ``shard_size`` bytes, each as full as it can be.

    Args:
        sizes: int64 ``[N]`` stored bytes of each sample.
        shard_size: bytes per shard; a sample larger than that is a shard of its own.

    Returns:
        int64 ``[S + 1]``: shard ``k`` holds samples ``bounds[k]:bounds[k + 1]``.
    """
    ends = np.cumsum(sizes, dtype=np.int64)
    bounds = [0]
    while bounds[-1] < len(ends):
        start = bounds[-1]
        limit = (ends[start - 1] if start else 0) + shard_size
        bounds.append(max(start + 1, int(np.searchsorted(ends, limit, side="right"))))
    return np.array(bounds, dtype=np.int64)


# NOTE [text shard cost]: a shard costs about 10 ms besides its bytes: ~5 ms to fsync it, the rest its
# metadata (tokenizer with its vocabulary, length percentiles) and whole-file crc32. Measured on the 2-core VM
# writing 10,000 synthetic reviews (5.4 MB of ids, 9k words) from memory, 3 runs, hdf5: one file 9-18 ms; one
# shard 43-55 ms; 6 shards (1 MiB) 68-112 ms; 22 shards (256 KiB) 261-308 ms, 123-188 ms without fsync. The
# whole conversion (tokenizing, 2 workers) took 3.5-7 s, single file and folder alike, within the VM's noise.
def write_shard_folder(root, settings, sink, table, labels, metadata, truncated, kept, num_inputs):
    """Write the ids of ``sink`` (mapped through ``table`` unless None) into ``root`` as shards, then the index.

    NOTE [shards from the end]: shards are written from the last to the
    first, each from the ids read off the end of the staging file, which is
    then cut short: the ids are never on disk twice, so the peak is the
    staged ids plus one shard (the issue asks for "final size + one shard").
    Provisional ids take 4 bytes, so a built vocabulary of 2-byte ids still
    peaks at about twice the folder. Measured (fastdata.measure.conversion's
    run_watched, disk sampled every 5 ms, 10,000 synthetic reviews, words):
    peak 16.1 MB for a folder of 5.6-5.9 MB when the ids were renumbered
    into a second staging file and the shards written after it (2.7-2.9x),
    10.7 MB now (1.8-1.9x); a single file still peaks at 16.1 MB (2.9x).

    Shard ``k`` records its sample range's inputs: from its first sample's
    input (0 for the first shard) to the next shard's, so skipped inputs
    belong to the shard after them and the ranges cover every input.
    """
    container, offsets = settings["container"], sink.offsets()
    lengths = np.diff(offsets)
    bounds = _shard_bounds(lengths * np.dtype(metadata["sample_dtype"]).itemsize + _SAMPLE_BYTES,
                           settings["shard_size"])
    inputs = np.concatenate([[0], np.asarray(kept, dtype=np.int64)[bounds[1:-1]], [num_inputs]])
    per_sample = {key: metadata[key] for key in _SHARD_KEYS}
    conversion, shards = conversion_id([settings, metadata]), []  # see NOTE [shard identity] in formats/shards.py
    for number in reversed(range(len(bounds) - 1)):
        start, stop = int(bounds[number]), int(bounds[number + 1])
        ids = sink.pop_from(offsets[start])
        part = Columns(ids if table is None else np.take(table, ids), labels[start:stop],
                       offsets[start : stop + 1] - offsets[start])
        place = {"number": number, "inputs": inputs[number : number + 2].tolist()}
        facts = write_shard(root, number, container, part, {
            **per_sample,
            "num_samples": stop - start,
            "lengths": length_stats(lengths[start:stop], truncated[start:stop]),
            "shard": {**place, "conversion": conversion},
        })
        shards.append({**facts, **place, "num_samples": stop - start})
    shards.reverse()
    settings = {**settings, "preprocessing": metadata["preprocessing"], "source": metadata["source"]}
    columns = {"labels": write_column(root, "labels", labels), "lengths": write_column(root, "lengths", lengths)}
    write_index(root, container, metadata, settings, shards, columns, conversion)
