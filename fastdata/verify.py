"""Check a packed file or shard folder for damage and name the damaged samples: what `fastdata verify` runs."""

import os

import numpy as np

from fastdata.codecs.images import decode_jpeg
from fastdata.errors import FormatError, NotFoundError
from fastdata.formats import read_checksums, read_metadata, read_packed
from fastdata.formats.layout import (
    bad_label_samples,
    bad_offset_samples,
    format_samples,
    label_bounds,
    longest_sample,
    sample_ranges,
    stored_columns,
)
from fastdata.formats.records import RECORDS_KIND
from fastdata.formats.schema import check_dataset_fields
from fastdata.formats.shards import (
    INDEX_NAME,
    file_checksum,
    parse_column,
    read_index,
    shard_differences,
    shard_mismatch,
)
from fastdata.verifyrecords import verify_records
from fastdata.verifyreport import Problem, VerifyReport, count_of, mismatched_chunks

_SCAN = 1 << 22  # token ids per numpy pass of the vocabulary check


def verify(path, quick=False):
    """Check the packed file at ``path``: checksums, structure, offsets, labels, stored JPEGs, token ids.

    A file of records is checked field by field (see ``verify_records``).
    A shard folder is checked shard by shard (see ``verify_folder``).

    Args:
        path: a .h5, .hdf5 or .arrow file written by a fastdata converter, or a shard folder.
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
    if os.path.isdir(path):
        return verify_folder(path, quick)
    report = VerifyReport(path, quick)
    try:
        if read_metadata(path)["kind"] == RECORDS_KIND:
            return verify_records(path, quick)
        columns, metadata = read_packed(path, check=False)
        check_dataset_fields(metadata, path, complete="shard" not in metadata)  # a shard's index holds the rest
    except FormatError as exc:
        report.problems.append(Problem("structure", str(exc)))
        return report
    report.format_version, report.num_samples = metadata["format_version"], metadata["num_samples"]
    report.checked.append("structure")
    offsets_ok = _check_offsets(report, columns, metadata) if not quick else True
    try:  # a damaged checksum group is one problem: the columns are still checked
        stored = read_checksums(path)
    except FormatError as exc:
        report.problems.append(Problem("checksum", str(exc)))
    else:
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
    for name, chunks, chunk_bytes in mismatched_chunks(report, metadata, stored_columns(columns), stored):
        report.problems.append(_checksum_problem(name, chunks, chunk_bytes, columns, offsets_ok))


def _checksum_problem(name, chunks, chunk_bytes, columns, offsets_ok):
    nbytes = stored_columns(columns)[name].nbytes
    byte_ranges = [(start * chunk_bytes, min(stop * chunk_bytes, nbytes)) for start, stop in sample_ranges(chunks)]
    where = "bytes " + ", ".join(f"{start}-{stop - 1}" for start, stop in byte_ranges[:8])
    message = (f"column {name!r}: checksum mismatch in {count_of(len(chunks), 'chunk')} of {chunk_bytes} bytes "
               f"({where})")
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
        counts = np.bincount(np.asarray(labels)[np.asarray(labels) >= 0], minlength=len(metadata["class_counts"]))
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
    vocab_size = metadata.get("tokenizer", {}).get("vocab_size")
    if not isinstance(vocab_size, int):
        report.problems.append(Problem("structure", f"the metadata lacks the tokenizer's vocab_size: {vocab_size!r}"))
        return
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


def verify_folder(root, quick=False):
    """Check a shard folder: its index, each shard's size and whole-file crc32, then each shard as one file.

    Problems name the shard file; their samples are the dataset's (global)
    indices. ``quick`` skips the whole-file crc32 and checks each shard
    quickly (its chunk checksums).

    Returns:
        VerifyReport of the folder.
    """
    report = VerifyReport(os.fspath(root), quick)
    try:
        index = read_index(root)
    except (FormatError, NotFoundError) as exc:
        report.problems.append(Problem("index", str(exc)))
        return report
    report.num_samples = index.num_samples
    report.checked += [INDEX_NAME, f"{index.num_shards} shard sizes"] + ([] if quick else ["whole-file crc32"])
    counts, shard_reports = np.zeros(len(index.metadata.get("classes", [])), np.int64), []
    for shard in range(index.num_shards):
        found = _verify_shard(report, index, shard, quick)
        if found is not None:
            shard_report, labels = found
            report.format_version = report.format_version or shard_report.format_version
            shard_reports.append(shard_report)
            if labels is not None and _labels_in_classes(report, index, shard, labels) and len(counts):
                counts += np.bincount(labels[labels >= 0], minlength=len(counts))
    report.checked += _merge_checked(shard_reports)
    counted = not quick and report.ok and "class_counts" in index.metadata  # every shard read, its labels in range
    if counted and counts.tolist() != index.metadata["class_counts"]:
        report.problems.append(
            Problem("labels", f"the shards' labels count {counts.tolist()} per class, the index "
                              f"{index.metadata['class_counts']}")
        )
    _verify_columns(report, index, quick)
    _note_unlisted(report, index)
    return report


def _labels_in_classes(report, index, shard, labels):
    """Report the labels of ``shard`` that name none of the classes the index lists; return whether all do."""
    bad = bad_label_samples(labels, index.metadata)
    if len(bad):
        start = int(index.starts[shard])
        message = (f"{index.names[shard]!r}: labels outside {label_bounds(index.metadata)}, the classes "
                   f"{INDEX_NAME} lists, at dataset {format_samples(bad + start)} (label {labels[bad[0]]}): the "
                   "index's classes are cut short, or the shard is another dataset's")
        report.problems.append(Problem("labels", message, bad + start))
    return not len(bad)


def _verify_columns(report, index, quick):
    """Check the column files the index lists (NOTE [column files] in formats/shards.py): size and crc32, and
    unless ``quick`` (or a shard is damaged already), that they hold the shards' labels and lengths."""
    for name, entry in sorted(index.columns.items()):
        path = os.path.join(index.root, entry["name"])
        try:
            with open(path, "rb") as f:
                values = parse_column(f.read(), entry, index.num_samples, path)
        except FileNotFoundError:
            report.problems.append(Problem("columns", f"{entry['name']!r} is missing: the index lists it. Restore "
                                                      "it, or convert again"))
            continue
        except FormatError as exc:
            report.problems.append(Problem("columns", str(exc)))
            continue
        report.checked.append(f"{entry['name']} crc32")
        if name == "labels" and len(bad := bad_label_samples(values, index.metadata)):
            report.problems.append(Problem("columns", f"{entry['name']!r}: labels outside "
                                                      f"{label_bounds(index.metadata)}, the classes {INDEX_NAME} "
                                                      f"lists, at {format_samples(bad)}", bad))
        if quick or not report.ok:
            continue
        differ = np.flatnonzero(values != _shards_column(index, name))
        if len(differ):
            report.problems.append(Problem("columns", f"{entry['name']!r} differs from the shards' {name} at "
                                                      f"{format_samples(differ)}: restore it, or convert again",
                                           differ))
        report.checked.append(f"{entry['name']} equals the shards' {name}")


def _shards_column(index, name):
    """Return every shard's labels (or stored lengths) concatenated, read from the shard files."""
    parts = [np.empty(0, np.int64)]
    for shard in range(index.num_shards):
        columns, _ = read_packed(index.path(shard))
        parts.append(np.asarray(columns.labels) if name == "labels" else np.diff(np.asarray(columns.offsets)))
    return np.concatenate(parts)


def _verify_shard(report, index, shard, quick):
    """Check one shard of ``index``; return ``(its VerifyReport, its labels or None)``, or None if unreadable."""
    name, start = index.names[shard], int(index.starts[shard])
    samples = np.arange(start, int(index.starts[shard + 1]))
    path = index.path(shard)
    if not os.path.isfile(path):
        report.problems.append(Problem("shard", f"{name!r} is missing ({format_samples(samples)})", samples))
        return None
    size = os.path.getsize(path)
    if size != index.sizes[shard]:
        message = f"{name!r} has {size} bytes, the index says {index.sizes[shard]} ({format_samples(samples)})"
        report.problems.append(Problem("shard", message, samples))
    elif not quick and (crc := file_checksum(path)) != index.checksums[shard]:
        message = f"{name!r}: crc32 {crc}, the index says {index.checksums[shard]} (any problems below locate it)"
        report.problems.append(Problem("checksum", message))
    shard_report = verify(path, quick)
    if shard_report.num_samples is not None and shard_report.num_samples != len(samples):
        message = f"{name!r} holds {shard_report.num_samples} samples, the index says {len(samples)}"
        report.problems.append(Problem("shard", message, samples))
    for problem in shard_report.problems:  # the shard's own sample numbers, then the dataset's
        where = f" (dataset {format_samples(problem.samples + start)})" if len(problem.samples) else ""
        report.problems.append(Problem(problem.check, f"{name!r}: {problem.message}{where}", problem.samples + start))
    report.notes += [f"{name!r}: {note}" for note in shard_report.notes]
    if shard_report.format_version is None:  # its structure is damaged: nothing more to read
        return shard_report, None
    if index.metadata.get("kind") == RECORDS_KIND:  # a record shard: no labels, its fields as the index's
        metadata, labels = read_metadata(path), None
    else:
        columns, metadata = read_packed(path, check=False)
        labels = np.asarray(columns.labels)
    differ = shard_differences(metadata, index.metadata)
    if differ:
        message = (f"{name!r} differs from the dataset in {', '.join(differ)}: a shard of another conversion, "
                   "or the index edited")
        report.problems.append(Problem("shard", message, samples))
    if (mismatch := shard_mismatch(index, shard, metadata)) is not None:  # see NOTE [shard identity]
        report.problems.append(Problem("shard", f"{name!r} {mismatch} ({format_samples(samples)})", samples))
    return shard_report, None if quick or not shard_report.ok else labels


def _merge_checked(reports):
    """Return what the shards' ``reports`` checked, each item once and their JPEG counts added up."""
    items, jpegs = {}, None
    for item in (item for report in reports for item in report.checked):
        if item.endswith(" JPEGs decode"):
            jpegs = (jpegs or 0) + int(item.split()[0])
        else:
            items[item] = None
    return list(items) + ([] if jpegs is None else [f"{jpegs} JPEGs decode"])


def _note_unlisted(report, index):
    """Note files in the folder that look like shards but are not in the index (left by another run)."""
    listed = set(index.names)
    unlisted = sorted(name for name in os.listdir(index.root) if name.startswith("shard-") and name not in listed)
    if unlisted:
        report.notes.append(f"{len(unlisted)} files not in the index, not read: {', '.join(map(repr, unlisted[:5]))}")
