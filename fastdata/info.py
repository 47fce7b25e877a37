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
    elif metadata["kind"] == "text":
        lines += _text_lines(metadata)
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
