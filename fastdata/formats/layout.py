"""What every packed file holds, whatever its container (HDF5 or Arrow).

A packed file has ``num_samples`` rows. Each row is a sample and a label:

* fixed samples: one array ``samples`` of shape ``[N, *sample_shape]``
  (raw images, uint8 C x H x W);
* ragged samples: a flat ``values`` array plus int64 ``offsets`` of shape
  ``[N + 1]``; sample ``i`` is ``values[offsets[i]:offsets[i + 1]]``
  (JPEG bytes, token ids);
* ``labels``: int64 ``[N]`` (-1 where a sample has no label).

Metadata is one JSON object (never pickle) stored beside the arrays. From
format version 2 each stored column also has chunk checksums (NOTE [checksums]).
"""

import json
import zlib
from dataclasses import dataclass

import numpy as np

from fastdata.errors import FormatError
from fastdata.formats.schema import check_dataset_fields

FORMAT_NAME = "fastdata"
FORMAT_VERSION = 2  # 2: chunk checksums; version 1 files still read, without them
RECORDS_FORMAT_VERSION = 3  # 3: records of named fields (records.py); (sample, label) files stay version 2
METADATA_KEY = "fastdata"
_REQUIRED_KEYS = ("kind", "num_samples", "sample_shape", "sample_dtype")
_REQUIRED_RECORD_KEYS = ("kind", "num_samples", "fields")

# NOTE [checksums]: every stored column (samples, labels, offsets) is hashed
# in chunks of CHECKSUM_CHUNK_BYTES of its bytes, so that `fastdata verify`
# locates damage to the samples of one chunk. The hash is zlib's crc32: in
# the standard library, so every reader can check it, and fast. Measured on
# this 2-core machine over 256 MiB of random bytes in 256 KiB chunks (MB/s):
# crc32 3555, adler32 3008, blake2b(digest_size=8) 679, md5 543; xxhash's
# xxh3_64 11008 and xxh64 7487 are faster but not in the standard library,
# and crc32 is already ~100x faster than conversion produces bytes.
# Cost, measured on the same machine: the writers hash the columns they are
# given (one more pass, from the page cache). checksum_columns on the written
# columns takes 0.26% of a 64px raw conversion (.h5, 600 photos, 2.6 ms),
# 1.9% at 224px raw (.arrow, 90 MB: the most bytes per image; 45 ms), 0.08%
# for 224px JPEG and 0.06% for text (3000 docs). Whole conversions with and
# without checksums, 7 interleaved pairs in one process (workers=1, process
# CPU time, checksum_columns swapped for a no-op in the writers) differ by
# -1.5%, +0.5%, -3.5% and +3.1%: within the noise of a shared machine. Inputs:
# measure.synthetic's make_imagefolder(4 classes x 150, 500x375) and
# make_text_corpus(per_class=1500).
CHECKSUM_ALGORITHM = "crc32"
CHECKSUM_CHUNK_BYTES = 256 << 10

# NOTE [aligned columns]: the readers that reach the disk's rate lay a
# folder's sample columns side by side, in address space (NOTE [stitched
# rows] in reading/stitch.py, page maps) or in a buffer filled with direct
# I/O (NOTE [window reads] in reading/windows.py, 512 or 4,096 byte
# blocks), and both work in whole pages or blocks. Unaligned, a column's
# offset followed the length of the headers before it: in a 64 px folder
# written before the columns were aligned, shard 0's pixels began at byte
# 15,488 and every other shard's at 15,496 (its metadata was longer), so
# neither fast path could apply to every shard. Both containers now start
# the sample column on a multiple of COLUMN_ALIGNMENT (HDF5's file alignment
# of objects that large, or as large as a smaller column: a last shard of one
# 32 px sample is aligned too; Arrow's schema padded), at most a few KiB a
# file; the readers still place each shard by its own offset, so older
# files and other writers' read too.
COLUMN_ALIGNMENT = 4096


@dataclass(frozen=True, eq=False)  # compared by identity: `None in opened` in reading/store.py is one C call per shard
class Columns:
    """The arrays of a packed file, as numpy arrays or memory maps.

    Attributes:
        samples: fixed samples ``[N, ...]``, or the flat values of ragged ones.
        labels: int64 ``[N]``.
        offsets: int64 ``[N + 1]`` for ragged samples, None for fixed ones.
    """

    samples: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray | None = None

    @property
    def num_samples(self):
        return len(self.labels)

    @property
    def ragged(self):
        return self.offsets is not None


def stored_columns(columns):
    """Return ``{name: array}`` of the columns a file stores, the names its checksums use."""
    stored = {"samples": columns.samples, "labels": columns.labels}
    if columns.ragged:
        stored["offsets"] = columns.offsets
    return stored


def chunk_checksums(array, chunk_bytes):
    """Return uint32 ``[ceil(nbytes / chunk_bytes)]``: the crc32 of each chunk of ``array``'s bytes."""
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    sums = [zlib.crc32(data[start : start + chunk_bytes]) for start in range(0, len(data), chunk_bytes)]
    return np.array(sums, dtype=np.uint32)


def checked_checksums(values, name, path):
    """Return the stored checksums ``values`` of column ``name`` as uint32 ``[chunks]``.

    Raises:
        FormatError: they are not a 1-D array of 32-bit unsigned integers (a damaged file ``path``).
    """
    values = np.asarray(values)
    if values.ndim != 1 or values.dtype.kind != "u" or values.dtype.itemsize != 4:
        raise FormatError(f"{path!r}: the stored checksums of column {name!r} are {values.dtype}{list(values.shape)}, "
                          "not uint32 [chunks]; the file is damaged")
    return values.astype(np.uint32, copy=False)


def checksum_columns(columns):
    """Return ``(info, {name: uint32 checksums})`` of the stored columns; ``info`` goes into the metadata."""
    return checksum_arrays(stored_columns(columns))


def checksum_arrays(stored):
    """Return ``(info, {name: uint32 checksums})`` of ``{column name: array}``; ``info`` goes into the metadata."""
    chunk_bytes = CHECKSUM_CHUNK_BYTES
    info = {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": chunk_bytes}
    return info, {name: chunk_checksums(array, chunk_bytes) for name, array in stored.items()}


def encode_metadata(metadata, checksums):
    """Return the JSON text stored in a file: ``metadata`` with the format name, version and checksum info."""
    version = RECORDS_FORMAT_VERSION if metadata.get("kind") == "records" else FORMAT_VERSION
    full = {**metadata, "format": FORMAT_NAME, "format_version": version, "checksums": checksums}
    return json.dumps(full, sort_keys=True, separators=(",", ":"))


def decode_metadata(text, path):
    """Parse and check stored metadata text; raise FormatError naming ``path``."""
    if text is None:
        raise FormatError(
            f"{path!r} is not a fastdata file (no fastdata metadata). "
            'Write it with "fastdata convert".'
        )
    try:
        metadata = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{path!r}: fastdata metadata is not valid JSON") from exc
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise FormatError(f"{path!r} is not a fastdata file")
    version = metadata.get("format_version")
    if not isinstance(version, int) or version > RECORDS_FORMAT_VERSION:
        raise FormatError(
            f"{path!r}: format version {version}, this fastdata reads up to "
            f"{RECORDS_FORMAT_VERSION}. Upgrade fastdata or re-run \"fastdata convert\"."
        )
    required = _REQUIRED_RECORD_KEYS if metadata.get("kind") == "records" else _REQUIRED_KEYS
    missing = [key for key in required if key not in metadata]
    if missing:
        raise FormatError(f"{path!r}: fastdata metadata lacks {missing}; re-run \"fastdata convert\"")
    check_dataset_fields(metadata, path, complete=False)  # what is there has its type: a damaged file is named
    return metadata


def check_columns(columns, metadata, path):
    """Check that the array shapes agree with the metadata; raise FormatError if not."""
    n = metadata["num_samples"]
    if columns.labels.shape != (n,):
        raise FormatError(f"{path!r}: expected {n} labels, found {columns.labels.shape}")
    if columns.ragged:
        if columns.offsets.shape != (n + 1,):
            raise FormatError(f"{path!r}: expected {n + 1} offsets")
    elif columns.samples.shape != (n, *metadata["sample_shape"]):
        raise FormatError(f"{path!r}: sample array has shape {columns.samples.shape}")


def check_values(columns, metadata, path):
    """Check offsets and labels with a few numpy passes; raise FormatError naming the damaged samples.

    This keeps a damaged file from returning impossible values (a sample
    past the end of the file, a negative length, a label no class has);
    `fastdata verify` also checks the bytes themselves.
    """
    if columns.ragged:
        bad = bad_offset_samples(columns.offsets, len(columns.samples), longest_sample(metadata))
        if len(bad):
            raise FormatError(
                f"{path!r} is damaged: the offsets of {format_samples(bad)} are out of order or out of bounds "
                "(or longer than the longest sample stored). "
                f'Run "fastdata verify" on it for details, and re-run "fastdata convert".'
            )
    bad = bad_label_samples(columns.labels, metadata)
    if len(bad):
        raise FormatError(
            f"{path!r} is damaged: labels outside {label_bounds(metadata)} at {format_samples(bad)} "
            f"(sample {bad[0]}: {columns.labels[bad[0]]}). "
            f'Run "fastdata verify" on it for details, and re-run "fastdata convert".'
        )


_SCAN = 1 << 20  # entries per numpy pass of the value checks: bounded temporaries on huge files


def longest_sample(metadata):
    """Return the longest stored sample the metadata records (text files), or None."""
    return metadata.get("lengths", {}).get("max")


def bad_offset_samples(offsets, num_values, max_length=None):
    """Return int64 indices of the samples whose ``offsets[i]:offsets[i + 1]`` is not a range of the values.

    With ``max_length``, samples longer than that are reported too.
    """
    n = len(offsets) - 1
    if n < 1:
        return np.empty(0, np.int64)
    found = [np.array([0] if offsets[0] != 0 else []), np.array([n - 1] if offsets[-1] != num_values else [])]
    for start in range(0, n, _SCAN):
        part = np.asarray(offsets[start : start + _SCAN + 1])
        lo, hi = part[:-1], part[1:]
        bad = (hi < lo) | (lo < 0) | (hi > num_values)
        if max_length is not None:
            bad |= hi - lo > max_length  # wraps only where hi < lo, which is bad already
        found.append(np.flatnonzero(bad) + start)
    return np.unique(np.concatenate(found).astype(np.int64))


def label_bounds(metadata):
    """Return ``"-1..C-1"``: the labels a file with ``C`` classes may hold (-1: no label)."""
    return f"-1..{len(metadata['classes']) - 1}" if "classes" in metadata else "-1.."


def bad_label_samples(labels, metadata):
    """Return int64 indices of the samples whose label is below -1 or names no class."""
    top = len(metadata["classes"]) if "classes" in metadata else None
    found = []
    for start in range(0, len(labels), _SCAN):
        part = np.asarray(labels[start : start + _SCAN])
        bad = part < -1 if top is None else (part < -1) | (part >= top)
        found.append(np.flatnonzero(bad) + start)
    return np.concatenate(found).astype(np.int64) if found else np.empty(0, np.int64)


def format_samples(indices, limit=8):
    """Return ``"samples 3, 7-9 and 2 more ranges"`` for sorted int sample ``indices``."""
    ranges = sample_ranges(indices)
    text = ", ".join(f"{start}" if stop == start + 1 else f"{start}-{stop - 1}" for start, stop in ranges[:limit])
    more = f" and {len(ranges) - limit} more ranges" if len(ranges) > limit else ""
    return f"{'sample' if len(indices) == 1 else 'samples'} {text}{more}"


def sample_ranges(indices):
    """Return the ``[(start, stop), ...]`` runs of consecutive values in sorted int ``indices``."""
    indices = np.asarray(indices, dtype=np.int64)
    if not len(indices):
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts, stops = indices[np.r_[0, breaks]], indices[np.r_[breaks - 1, len(indices) - 1]] + 1
    return list(zip(starts.tolist(), stops.tolist()))
