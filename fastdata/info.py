"""Describe a packed file for people: what `fastdata info` prints."""

import os

from fastdata.formats import format_of, read_packed

_SHOWN_SKIPS = 10


def describe(path):
    """Return a multi-line, human-readable description of the packed file at ``path``."""
    columns, metadata = read_packed(path)
    size = os.path.getsize(path)
    lines = [
        f"file:        {os.fspath(path)} ({format_of(path)}, format version {metadata['format_version']})",
        f"size:        {_human_bytes(size)}",
        f"kind:        {metadata['kind']}",
        f"samples:     {metadata['num_samples']}",
    ]
    if metadata["kind"] == "image":
        shape = "x".join(map(str, metadata["sample_shape"]))
        lines.append(f"sample:      {metadata['sample_dtype']} [{shape}] (C x H x W), stored as {metadata['storage']}")
        lines.append(f"mean:        {metadata['mean']}")
        lines.append(f"std:         {metadata['std']}")
    lines.append(f"classes:     {len(metadata.get('classes', []))}")
    for name, count in zip(metadata.get("classes", []), metadata.get("class_counts", [])):
        lines.append(f"  {count:>8}  {name}")
    settings = metadata.get("preprocessing", {})
    lines.append("preprocessing: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
    lines.append(f"source:      {metadata.get('source', {})}")
    skipped = metadata.get("skipped", [])
    lines.append(f"skipped:     {len(skipped)}")
    for item in skipped[:_SHOWN_SKIPS]:
        lines.append(f"  {item['path']}: {item['reason']}")
    if len(skipped) > _SHOWN_SKIPS:
        lines.append(f"  ... and {len(skipped) - _SHOWN_SKIPS} more")
    del columns
    return "\n".join(lines)


def _human_bytes(size):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{size} B"
        size /= 1024
