"""Describe a packed file for people: what `fastdata info` prints.

Paths and names are printed escaped (``repr``), so a newline or a control
character in a file name can never split or fake a line.
"""

import os

from fastdata.formats import format_of, read_packed

_SHOWN_SKIPS = 10


def describe(path, all_skipped=False):
    """Return a multi-line, human-readable description of the packed file at ``path``.

    Lists the first skipped inputs, or every one with ``all_skipped``.
    """
    columns, metadata = read_packed(path)
    size = os.path.getsize(path)
    lines = [
        f"file:        {os.fspath(path)!r} ({format_of(path)}, format version {metadata['format_version']})",
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
        lines.append(f"  {count:>8}  {_printable(name)}")
    settings = metadata.get("preprocessing", {})
    lines.append("preprocessing: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
    source = dict(metadata.get("source", {}))
    ignored = source.pop("ignored", {})
    lines.append("source:      " + ", ".join(f"{key}={value!r}" for key, value in sorted(source.items())))
    kinds = ", ".join(f"{_printable(kind)}: {count}" for kind, count in ignored.items())
    lines.append(f"ignored:     {sum(ignored.values())} files that are not inputs" + (f" ({kinds})" if kinds else ""))
    skipped = metadata.get("skipped", [])
    lines.append(f"skipped:     {len(skipped)}")
    shown = skipped if all_skipped else skipped[:_SHOWN_SKIPS]
    lines += [f"  {item['path']!r}: {_printable(item['reason'])}" for item in shown]
    if len(shown) < len(skipped):
        lines.append(f"  ... and {len(skipped) - len(shown)} more (fastdata info --all lists them all)")
    del columns
    return "\n".join(lines)


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
