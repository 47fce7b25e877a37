"""Describe a packed file or shard folder for people: what `fastdata info` prints.

Paths and names are printed escaped (``repr``), so a newline or a control
character in a file name can never split or fake a line.
"""

import os

import numpy as np

from fastdata.errors import FormatError
from fastdata.formats import format_of, read_metadata, read_packed, read_records
from fastdata.formats.records import RECORDS_KIND, schema_of_metadata
from fastdata.formats.schema import check_dataset_fields
from fastdata.formats.shards import read_index

_SHOWN_SKIPS = 10


def describe(path, all_skipped=False):
    """Return a multi-line, human-readable description of the packed file or shard folder at ``path``.

    Lists the first skipped inputs, or every one with ``all_skipped``.
    """
    if os.path.isdir(path):
        header, metadata = _folder_lines(path)
        if metadata.get("kind") == RECORDS_KIND:
            return "\n".join(header + _records_lines(schema_of_metadata(metadata, path), metadata, all_skipped))
    elif read_metadata(path)["kind"] == RECORDS_KIND:
        _, fields, metadata = read_records(path)  # checked: a damaged file is named here
        check_dataset_fields(metadata, os.fspath(path))
        return "\n".join(_file_lines(path, metadata) + _records_lines(fields, metadata, all_skipped))
    else:
        _, metadata = read_packed(path)  # checked: a damaged file is named here
        check_dataset_fields(metadata, os.fspath(path))  # every field printed below
        header = _file_lines(path, metadata)
    return "\n".join(header + _dataset_lines(metadata, all_skipped, path))


def _file_lines(path, metadata):
    return [f"file:        {os.fspath(path)!r} ({format_of(path)}, format version {metadata['format_version']})",
            f"size:        {_human_bytes(os.path.getsize(path))}"]


def _records_lines(fields, metadata, all_skipped):
    """Return the lines that describe a record file: its records, each field's type and storage, its skips."""
    lines = [f"kind:        records of {len(fields)} named fields", f"records:     {metadata['num_samples']}"]
    for name, field in fields.items():
        options = ", ".join(f"{key}={value}" for key, value in field.to_dict(name).items()
                            if key not in ("name", "type"))
        lines.append(f"  {name}: {field.type}" + (f" ({options})" if options else ""))
    return lines + _skipped_lines(metadata, all_skipped)


def _folder_lines(root):
    """Return ``(lines, dataset metadata)`` of a shard folder: its container, shards and their sizes."""
    index = read_index(root)
    sizes = index.sizes
    counts = np.diff(index.starts)
    absent = [name for name, size in zip(index.names, sizes.tolist()) if _size_of(os.path.join(root, name)) != size]
    lines = [
        f"folder:      {os.fspath(root)!r} ({index.container} shards)",
        f"size:        {_human_bytes(int(sizes.sum()))} in {index.num_shards} "
        + ("shard" if index.num_shards == 1 else "shards")
        + (f" ({_human_bytes(int(sizes.min()))} to {_human_bytes(int(sizes.max()))}, "
           f"{counts.min()} to {counts.max()} samples each)" if index.num_shards else ""),
    ]
    if absent:
        shown = ", ".join(map(repr, absent[:_SHOWN_SKIPS])) + (" ..." if len(absent) > _SHOWN_SKIPS else "")
        lines.append(f"damaged:     {len(absent)} shards missing or not the size the index says: {shown} "
                     f'(run "fastdata verify {os.fspath(root)}")')
    return lines, index.metadata


def _size_of(path):
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def _dataset_lines(metadata, all_skipped, path):
    """Return the lines that describe the dataset: kind, samples, record fields, shapes, classes, source, skips."""
    lines = [
        f"kind:        {metadata['kind']}",
        f"samples:     {metadata['num_samples']}",
        _record_view_line(metadata, path),
    ]
    if metadata["kind"] == "image":
        shape = "x".join(map(str, metadata["sample_shape"]))
        lines.append(f"sample:      {metadata['sample_dtype']} [{shape}] (C x H x W), stored as {metadata['storage']}")
        lines.append(f"mean:        {metadata['mean']}")
        lines.append(f"std:         {metadata['std']}")
    elif metadata["kind"] == "text":
        lines += _text_lines(metadata)
    lines.append(f"classes:     {len(metadata.get('classes', []))}")
    for name, count in zip(metadata.get("classes", []), metadata.get("class_counts", [])):
        lines.append(f"  {count:>8}  {_printable(name)}")
    settings = metadata.get("preprocessing", {})
    lines.append("preprocessing: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
    source = dict(metadata.get("source", {}))
    ignored = source.pop("ignored", {})
    lines.append("source:      " + ", ".join(f"{key}={value!r}" for key, value in sorted(source.items())))
    kinds = ", ".join(f"{_printable(kind)}: {count}" for kind, count in ignored.items())
    lines.append(f"ignored:     {sum(ignored.values())} files that are not inputs" + (f" ({kinds})" if kinds else ""))
    return lines + _skipped_lines(metadata, all_skipped)


def _record_view_line(metadata, path):
    """Return the line naming the fields RecordDataset reads a (sample, label) file as (NOTE [samples as records])."""
    try:
        fields = schema_of_metadata(metadata, path)
    except FormatError as exc:
        return f"as records:  none ({exc})"
    return "as records:  " + ", ".join(f"{name} ({field.type})" for name, field in fields.items()) + \
        " with fastdata.RecordDataset"


def _skipped_lines(metadata, all_skipped):
    skipped = metadata.get("skipped", [])
    lines = [f"skipped:     {len(skipped)}"]
    shown = skipped if all_skipped else skipped[:_SHOWN_SKIPS]
    lines += [f"  {item['path']!r}: {_printable(item['reason'])}" for item in shown]
    if len(shown) < len(skipped):
        lines.append(f"  ... and {len(skipped) - len(shown)} more (fastdata info --all lists them all)")
    return lines


def _printable(text):
    """Return ``text`` as it is when it prints on one line, else escaped (``repr``)."""
    return text if text.isprintable() else repr(text)


def _text_lines(metadata):
    tokenizer, lengths = metadata["tokenizer"], metadata["lengths"]
    percentiles = ", ".join(f"{key} {lengths[key]:g}" for key in ("p50", "p90", "p95", "p99"))
    return [
        f"sample:      {metadata['sample_dtype']} token ids, variable length, stored as {metadata['storage']}",
        f"tokenizer:   {tokenizer['kind']}, {tokenizer['vocab_size']} ids, pad id {tokenizer['pad_id']}, "
        f"unk id {tokenizer['unk_id']}, lowercase={tokenizer['lowercase']}, strip_html={tokenizer['strip_html']}, "
        f"max_length={tokenizer['max_length']}",
        f"lengths:     min {lengths['min']}, mean {lengths['mean']:g}, max {lengths['max']}; {percentiles}",
        f"tokens:      {lengths['num_tokens']} ({metadata['unk_fraction']:.2%} unknown), "
        f"{lengths['truncated']} samples truncated",
        f"unlabeled:   {metadata['num_unlabeled']}",
    ]


def _human_bytes(size):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{size} B"
        size /= 1024
