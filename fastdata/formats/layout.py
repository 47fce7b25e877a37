"""What every packed file holds, whatever its container (HDF5 or Arrow).

A packed file has ``num_samples`` rows. Each row is a sample and a label:

* fixed samples: one array ``samples`` of shape ``[N, *sample_shape]``
  (raw images, uint8 C x H x W);
* ragged samples: a flat ``values`` array plus int64 ``offsets`` of shape
  ``[N + 1]``; sample ``i`` is ``values[offsets[i]:offsets[i + 1]]``
  (JPEG bytes, token ids);
* ``labels``: int64 ``[N]`` (-1 where a sample has no label).

Metadata is one JSON object (never pickle) stored beside the arrays.
"""

import json
from dataclasses import dataclass

import numpy as np

from fastdata.errors import FormatError

FORMAT_NAME = "fastdata"
FORMAT_VERSION = 1
METADATA_KEY = "fastdata"
_REQUIRED_KEYS = ("kind", "num_samples", "sample_shape", "sample_dtype")


@dataclass(frozen=True)
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


def encode_metadata(metadata):
    """Return the JSON text stored in a file, with the format name and version."""
    full = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **metadata}
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
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FormatError(
            f"{path!r}: format version {version}, this fastdata reads up to "
            f"{FORMAT_VERSION}. Upgrade fastdata or re-run \"fastdata convert\"."
        )
    missing = [key for key in _REQUIRED_KEYS if key not in metadata]
    if missing:
        raise FormatError(f"{path!r}: fastdata metadata lacks {missing}; re-run \"fastdata convert\"")
    return metadata


def check_columns(columns, metadata, path):
    """Check that the arrays agree with the metadata; raise FormatError if not."""
    n = metadata["num_samples"]
    if columns.labels.shape != (n,):
        raise FormatError(f"{path!r}: expected {n} labels, found {columns.labels.shape}")
    if columns.ragged:
        if columns.offsets.shape != (n + 1,):
            raise FormatError(f"{path!r}: expected {n + 1} offsets")
        if n and (columns.offsets[0] != 0 or columns.offsets[-1] != len(columns.samples)):
            raise FormatError(f"{path!r}: offsets do not cover the stored values")
    elif columns.samples.shape != (n, *metadata["sample_shape"]):
        raise FormatError(f"{path!r}: sample array has shape {columns.samples.shape}")
