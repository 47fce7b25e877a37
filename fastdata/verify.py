"""Check a packed file for damage and name the damaged samples: what `fastdata verify` runs."""

import os
from dataclasses import dataclass, field

import numpy as np

from fastdata.codecs.images import decode_jpeg
from fastdata.errors import FormatError
from fastdata.formats import read_checksums, read_packed
from fastdata.formats.layout import (
    CHECKSUM_ALGORITHM,
    bad_label_samples,
    bad_offset_samples,
    chunk_checksums,
    format_samples,
    label_bounds,
    longest_sample,
    sample_ranges,
    stored_columns,
)

_SCAN = 1 << 22  # token ids per numpy pass of the vocabulary check


@dataclass
class Problem:
    """One kind of damage found in a file.

    Attributes:
        check: the check that found it: "structure", "checksum", "offsets", "labels", "jpeg" or "tokens".
        message: what is wrong and where, for people.
        samples: int64 sorted indices of the damaged samples; empty where they cannot be told.
    """

    check: str
    message: str
    samples: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


@dataclass
class VerifyReport:
    """What ``verify`` found in one file; ``ok`` when nothing is damaged."""

    path: str
    quick: bool = False
    format_version: int | None = None
    num_samples: int | None = None
    checked: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def ok(self):
        return not self.problems

    @property
    def damaged_samples(self):
        """int64 sorted indices of every sample a problem names."""
        return np.unique(np.concatenate([np.empty(0, np.int64)] + [p.samples for p in self.problems]))

    def __str__(self):
        about = f"format version {self.format_version}, {self.num_samples} samples; checked: " + (
            ", ".join(self.checked) or "nothing"
        )
        state = "ok" if self.ok else f"DAMAGED, {_count(len(self.problems), 'problem')}"
        lines = [f"{self.path!r}: {state} ({about})"]
        lines += [f"  {problem.check}: {problem.message}" for problem in self.problems]
        lines += [f"  note: {note}" for note in self.notes]
        if not self.ok:
            lines.append('  the file is damaged: re-run "fastdata convert" (or restore a good copy)')
        return "\n".join(lines)


def verify(path, quick=False):
    """Check the packed file at ``path``: checksums, structure, offsets, labels, stored JPEGs, token ids.

    Args:
        path: a .h5, .hdf5 or .arrow file written by a fastdata converter.
        quick: check the stored checksums only (reads every byte once, decodes nothing).

    Returns:
        VerifyReport; ``report.ok`` is False when anything is damaged, and its
        problems name the damaged samples.

    Raises:
        FileNotFoundError: ``path`` does not exist.

    Example:
        >>> report = verify("train.h5")
        >>> report.ok, report.damaged_samples
    """
    path = os.fspath(path)
    report = VerifyReport(path, quick)
    try:
        columns, metadata = read_packed(path, check=False)
        stored = read_checksums(path)
    except FormatError as exc:
        report.problems.append(Problem("structure", str(exc)))
        return report
    report.format_version, report.num_samples = metadata["format_version"], metadata["num_samples"]
    report.checked.append("structure")
    offsets_ok = _check_offsets(report, columns, metadata) if not quick else True
    _check_checksums(report, columns, metadata, stored, offsets_ok)
    if not quick:
        _check_labels(report, columns, metadata)
        if metadata.get("storage") == "jpeg" and offsets_ok:
            _check_jpegs(report, columns, metadata)
        elif metadata.get("kind") == "text" and offsets_ok:
            _check_tokens(report, columns, metadata)
    return report


def _check_checksums(report, columns, metadata, stored, offsets_ok):
    info = metadata.get("checksums")
    if info is None and metadata["format_version"] < 2:
        report.notes.append(
            f"format version {metadata['format_version']} stores no checksums, so there are none to check; "
            're-run "fastdata convert" to add them'
        )
        return
    described = info if isinstance(info, dict) else {}
    chunk_bytes = described.get("chunk_bytes")
    if described.get("algorithm") != CHECKSUM_ALGORITHM or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        report.problems.append(Problem("structure", f"the checksum description is missing or damaged: {info!r}"))
        return
    for name, array in stored_columns(columns).items():
        actual, expected = chunk_checksums(array, chunk_bytes), stored.get(name)
        if expected is None or len(expected) != len(actual):
            found = "no" if expected is None else len(expected)
            report.problems.append(
                Problem("structure", f"column {name!r}: {_count(len(actual), 'chunk')} but {found} stored checksums")
            )
            continue
        bad = np.flatnonzero(actual != expected)
        if len(bad):
            report.problems.append(_checksum_problem(name, bad, chunk_bytes, columns, offsets_ok))
    report.checked.append(f"{CHECKSUM_ALGORITHM} checksums")


def _checksum_problem(name, chunks, chunk_bytes, columns, offsets_ok):
    nbytes = stored_columns(columns)[name].nbytes
    byte_ranges = [(start * chunk_bytes, min(stop * chunk_bytes, nbytes)) for start, stop in sample_ranges(chunks)]
    where = "bytes " + ", ".join(f"{start}-{stop - 1}" for start, stop in byte_ranges[:8])
    message = f"column {name!r}: checksum mismatch in {_count(len(chunks), 'chunk')} of {chunk_bytes} bytes ({where})"
    if name == "samples" and columns.ragged and not offsets_ok:
        return Problem("checksum", message + "; which samples they hold is unknown, the offsets are damaged too")
    samples = np.unique(np.concatenate([_samples_in(name, start, stop, columns) for start, stop in byte_ranges]))
    return Problem("checksum", f"{message}: {format_samples(samples)}", samples)


def _samples_in(name, start, stop, columns):
    """Return the samples whose stored bytes of column ``name`` overlap bytes ``start:stop``."""
    n = columns.num_samples
    if name == "labels":
        return np.arange(start // 8, -(-stop // 8))
    if name == "offsets":  # offsets[i] bounds samples i - 1 and i
        return np.arange(max(start // 8 - 1, 0), min(-(-stop // 8), n))
    if not columns.ragged:
        row_bytes = columns.samples.nbytes // n
        return np.arange(start // row_bytes, -(-stop // row_bytes))
    itemsize = columns.samples.itemsize
    first = np.searchsorted(columns.offsets, start // itemsize, side="right") - 1
    last = np.searchsorted(columns.offsets, -(-stop // itemsize), side="left")
    return np.arange(max(first, 0), min(last, n))


def _count(number, noun):
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _check_offsets(report, columns, metadata):
    """Check that every sample's offsets are a range of the stored values; return True when they are."""
    if not columns.ragged:
        return True
    report.checked.append("offsets")
    longest = longest_sample(metadata)
    bad = bad_offset_samples(columns.offsets, len(columns.samples), longest)
    if len(bad):
        beyond = "" if longest is None else f" or longer than the longest stored sample ({longest})"
        report.problems.append(Problem("offsets", f"{format_samples(bad)}: out of order, out of bounds{beyond}", bad))
    return not len(bad)


def _check_labels(report, columns, metadata):
    report.checked.append("labels")
    labels = columns.labels
    bad = bad_label_samples(labels, metadata)
    if len(bad):
        message = f"{format_samples(bad)}: outside {label_bounds(metadata)} (sample {bad[0]}: {labels[bad[0]]})"
        report.problems.append(Problem("labels", message, bad))
    elif "class_counts" in metadata:
        counts = np.bincount(np.asarray(labels)[np.asarray(labels) >= 0], minlength=len(metadata["classes"]))
        if counts.tolist() != metadata["class_counts"]:
            report.problems.append(
                Problem("labels", f"labels count {counts.tolist()} per class, the metadata {metadata['class_counts']}")
            )


def _check_jpegs(report, columns, metadata):
    """Decode every stored JPEG; each must give the stored ``[H, W, 3]`` size."""
    channels, height, width = metadata["sample_shape"]
    bad, offsets = [], columns.offsets
    for index in range(columns.num_samples):
        try:
            pixels = decode_jpeg(columns.samples[offsets[index] : offsets[index + 1]])
        except Exception:  # any decoder failure means the stored bytes are damaged
            bad.append(index)
            continue
        if pixels.shape != (height, width, channels):
            bad.append(index)
    report.checked.append(f"{columns.num_samples} JPEGs decode")
    if bad:
        bad = np.asarray(bad, np.int64)
        report.problems.append(Problem("jpeg", f"{format_samples(bad)}: do not decode to {height}x{width}", bad))


def _check_tokens(report, columns, metadata):
    """Check that every stored token id is below the tokenizer's vocabulary size."""
    vocab_size = int(metadata["tokenizer"]["vocab_size"])
    values, found = columns.samples, []
    for start in range(0, len(values), _SCAN):
        part = np.asarray(values[start : start + _SCAN])
        found.append(np.flatnonzero((part < 0) | (part >= vocab_size)) + start)
    report.checked.append(f"token ids < {vocab_size}")
    positions = np.concatenate(found) if found else np.empty(0, np.int64)
    if len(positions):
        bad = np.unique(np.searchsorted(columns.offsets, positions, side="right") - 1)
        message = f"{format_samples(bad)}: token ids outside the vocabulary of {vocab_size} ({values[positions[0]]})"
        report.problems.append(Problem("tokens", message, bad))
