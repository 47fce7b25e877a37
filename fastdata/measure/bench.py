"""`fastdata bench`: raw files against packed files, measured side by side on the user's data."""

import os
import sys
import tempfile
import time

import numpy as np

from fastdata._cpu import usable_cpus
from fastdata._optional import require
from fastdata.errors import OptionError, SourceError
from fastdata.formats.shards import is_shard_folder
from fastdata.measure.baselines import PadCollate, PerItem, RawFolderDataset, RawTextDataset
from fastdata.measure.engine import measure_loader, measure_rate
from fastdata.measure.limits import DecodeEpochs, copy_epochs
from fastdata.measure.machine import describe_machine
from fastdata.measure.tables import Row, markdown_table

# A row's ``build()`` returns a loader, or for a limit row an epoch function.


def benchmark(target, *, batch_size=256, workers=(0, 2), repeats=3, min_seconds=0.25, size=64, progress=False):
    """Measure loading ``target``: a packed file (``bench_file``) or an image or text folder (``bench_folder``).

    Example:
        >>> results = benchmark("train.h5", workers=(0, 2))
        >>> print(format_results(results))
    """
    options = dict(batch_size=batch_size, workers=workers, repeats=repeats, min_seconds=min_seconds, progress=progress)
    if os.path.isdir(target) and not is_shard_folder(target):
        return bench_folder(target, size=size, **options)
    return bench_file(target, **options)


def bench_file(path, *, batch_size=256, workers=(0, 2), repeats=3, min_seconds=0.25, progress=False):
    """Measure make_loader on a packed file or shard folder against a per-item DataLoader and the read limit.

    Rows: make_loader with defaults and with each of ``workers`` > 0; a stock
    DataLoader reading ``dataset[i]`` per item; for raw images, the memcpy
    limit (np.take of sorted batches into one array); for JPEG images, the
    tight-loop decode limit on threads. Epochs are shuffled.

    Returns:
        dict (JSON-serializable): ``rows`` of samples/s and what
        ``format_results`` needs; ratios are against the per-item row.
    """
    from fastdata.loading.datasets import open_dataset

    started = time.perf_counter()
    dataset = open_dataset(path)
    if dataset.kind == "records":
        raise OptionError(f"fastdata bench compares (sample, label) files with the raw folder and other tools; "
                          f"{os.fspath(path)!r} holds records of named fields: `fastdata tune` times its loader "
                          "settings, and `python benchmarks/run.py --only records` compares record files with the "
                          "other tools")
    rows = _loader_rows(dataset, _file_label(dataset), batch_size, workers) + _contrast_rows(dataset, batch_size)
    measured = _measure_rows(rows, repeats, min_seconds, len(dataset), progress)
    files = [_file_entry(path, dataset, None)]
    return _results(path, "file", dataset, files, measured, batch_size, workers, repeats, min_seconds, started)


def bench_folder(root, *, size=64, batch_size=256, workers=(0, 2), repeats=3, min_seconds=0.25, progress=False,
                 workdir=None):
    """Convert an image or text folder to temporary .h5 and .arrow files, then compare raw and packed loading.

    Rows: a stock DataLoader over the raw files (Pillow decode + resize per
    image, or read + tokenize per text) for each of ``workers``; make_loader
    on each packed file with defaults and with each of ``workers`` > 0; the
    per-item and limit rows of ``bench_file`` on the HDF5 file.

    Args:
        root: ``root/<class>/<image>`` or ``root/<label>/<sample>.txt``.
        size: images: stored side in pixels (the raw rows resize to it too).
        workdir: where the temporary files go (default: the system's).

    Returns:
        dict as ``bench_file``; ratios are against the raw folder at 0 workers.

    Raises:
        SourceError: ``root`` is neither kind of folder.
    """
    from fastdata.loading.datasets import open_dataset

    started = time.perf_counter()
    kind, paths, labels = _find_folder(root)
    with tempfile.TemporaryDirectory(prefix="fastdata-bench-", dir=workdir) as folder:
        files, datasets = [], []
        for ext in (".h5", ".arrow"):
            out = os.path.join(folder, f"{os.path.basename(os.path.abspath(root))}{ext}")
            seconds = _convert(kind, root, out, size, progress)
            datasets.append(open_dataset(out))
            files.append(_file_entry(out, datasets[-1], seconds))
        # The raw rows read what the converter kept, so every row yields the same samples.
        skipped = {entry["path"] for entry in datasets[0].metadata["skipped"]}
        kept = np.array([path not in skipped for path in paths], dtype=bool)
        paths = [os.path.join(os.path.abspath(root), path) for path in np.asarray(paths)[kept]]
        rows = _raw_rows(kind, paths, labels[kept], datasets[0], size, batch_size, workers)
        for dataset in datasets:
            rows += _loader_rows(dataset, _file_label(dataset), batch_size, workers)
        rows += _contrast_rows(datasets[0], batch_size)
        measured = _measure_rows(rows, repeats, min_seconds, len(datasets[0]), progress)
        return _results(root, "folder", datasets[0], files, measured, batch_size, workers, repeats, min_seconds,
                        started)


def _find_folder(root):
    """Return ``(kind, paths relative to root, labels int64 [N])`` of an image or text folder."""
    from fastdata.converters import find_images, find_texts

    for kind, find in (("image", find_images), ("text", find_texts)):
        try:
            _, paths, labels = find(root)
        except SourceError:
            continue
        return kind, paths, labels
    raise SourceError(f"{os.fspath(root)!r} is neither an image folder ({root}/<class>/<image>) nor a text folder "
                      f"({root}/<label>/<sample>.txt); pass one of those, or a packed .h5/.arrow file")


def _convert(kind, root, out, size, progress):
    from fastdata.converters import convert_imagefolder, convert_text

    started = time.perf_counter()
    if kind == "image":
        convert_imagefolder(root, out, size=size, progress=progress)
    else:
        convert_text(root, out, progress=progress)
    return time.perf_counter() - started


def _file_label(dataset):
    return f"{'HDF5' if dataset.format == 'hdf5' else 'Arrow'} {dataset.storage}"


def _file_entry(path, dataset, convert_seconds):
    return {"path": os.path.abspath(path), "format": dataset.format, "storage": dataset.storage,
            "bytes": sum(os.path.getsize(shard) for shard in dataset.shard_paths), "convert_seconds": convert_seconds}


def _loader_rows(dataset, label, batch_size, workers):
    from fastdata.loading.loader import make_loader

    key = f"{dataset.format}-{dataset.storage}"
    rows = [Row(key, f"fastdata {label}: make_loader", "0 (defaults)",
                 lambda: make_loader(dataset, batch_size, shuffle=True), dataset=dataset)]
    for count in sorted(set(workers) - {0}):
        rows.append(Row(f"{key}_workers{count}", f"fastdata {label}: make_loader", f"{count} (persistent)",
                         lambda count=count: make_loader(dataset, batch_size, shuffle=True, num_workers=count),
                         memory=True))
    return rows


def _contrast_rows(dataset, batch_size):
    """The per-item stock DataLoader row, then the limit row of raw or JPEG images."""
    from torch.utils.data import DataLoader

    from fastdata.formats import read_packed

    collate = PadCollate(dataset.metadata["tokenizer"]["pad_id"]) if dataset.kind == "text" else None
    method = f"stock DataLoader on {_file_label(dataset)}: dataset[i] per item, default collate"
    rows = [Row("per_item", method, "0",
                 lambda: DataLoader(PerItem(dataset), batch_size, shuffle=True, collate_fn=collate))]
    if dataset.kind == "image":  # a shard folder: the limit of reading its first shard
        columns, _ = read_packed(dataset.shard_paths[0])
        if dataset.storage == "raw":
            method = "memcpy limit: np.take of sorted batches into a preallocated array, mode='clip'"
            rows.append(Row("copy_limit", method, "1 thread", lambda: copy_epochs(columns.samples, batch_size),
                            limit=True))
        else:
            method = "JPEG decode limit: decode_jpeg (as the loader) in a tight loop"
            rows.append(Row("decode_limit", method, f"{usable_cpus()} threads",
                            lambda: DecodeEpochs(columns, usable_cpus()), limit=True))
    return rows


def _raw_rows(kind, paths, labels, packed, size, batch_size, workers):
    from torch.utils.data import DataLoader

    if kind == "image":
        dataset, collate = RawFolderDataset(paths, labels, size), None
        method = "raw folder: Pillow decode + Resize + CenterCrop per item, default collate"
    else:
        from fastdata.codecs.tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(packed.path)
        dataset, collate = RawTextDataset(paths, labels, tokenizer), PadCollate(tokenizer.pad_id)
        method = "raw folder: read + tokenize each .txt per item, pad collate"
    rows = []
    for count in sorted(set(workers) | {0}):
        label = "0" if count == 0 else f"{count} (persistent)"
        rows.append(Row(f"raw_folder_workers{count}" if count else "raw_folder", method, label,
                         lambda count=count: DataLoader(dataset, batch_size, shuffle=True, num_workers=count,
                                                        collate_fn=collate, persistent_workers=count > 0),
                         memory=count > 0))
    return rows


def _measure_rows(rows, repeats, min_seconds, expected, progress):
    measured = []
    for row in rows:
        if progress:
            print(f"  {row.method} [{row.workers}] ...", end="", file=sys.stderr, flush=True)
        if row.limit:
            run_epoch = row.build()
            try:
                # A limit reads its own rows: a shard folder's is its first shard (see _contrast_rows).
                rate = measure_rate(run_epoch, repeats, min_seconds=min_seconds)
            finally:
                getattr(run_epoch, "close", lambda: None)()
            more = {}
        else:
            before = row.dataset.read_paths() if row.dataset is not None else None
            rate = measure_loader(row.build, repeats=repeats, min_seconds=min_seconds, expected=expected,
                                  memory=row.memory)
            more = {} if before is None else {"read_paths": {  # see NOTE [no silent fallbacks] in readpaths.py
                path: count - before[path] for path, count in row.dataset.read_paths().items()}}
        if progress:
            print(f" {rate.samples_per_s:,.0f} samples/s", file=sys.stderr, flush=True)
        measured.append(row.result(rate, is_limit=row.limit, **more))
    return measured


def _results(target, source, dataset, files, rows, batch_size, workers, repeats, min_seconds, started):
    reference = rows[0] if source == "folder" else next(row for row in rows if row["key"] == "per_item")
    limit = next((row for row in rows if row["is_limit"]), None)
    for row in rows:
        row["vs_reference"] = row["samples_per_s"] / reference["samples_per_s"]
        row["fraction_of_limit"] = row["samples_per_s"] / limit["samples_per_s"] if limit else None
    return {
        "benchmark": "fastdata bench",
        "target": os.path.abspath(target),
        "source": source,
        "kind": dataset.kind,
        "num_samples": len(dataset),
        "sample": _sample_text(dataset),
        "config": {"batch_size": batch_size, "workers": sorted(set(workers)), "repeats": repeats,
                   "min_seconds": min_seconds, "shuffle": True},
        "files": files,
        "reference": reference["key"],
        "limit": limit["key"] if limit else None,
        "rows": rows,
        "machine": describe_machine(),
        "seconds": time.perf_counter() - started,
    }


def _sample_text(dataset):
    dtype = dataset.metadata["sample_dtype"]
    if dataset.kind == "text":
        return f"{dtype} token ids, variable length"
    return f"{dtype} [{', '.join(map(str, dataset.sample_shape))}], stored {dataset.storage}"


# ---------------------------------------------------------------- reporting


def results_table(results):
    """Return the Markdown table of ``benchmark`` results: one line per row."""
    reference = "raw folder (0 workers)" if results["source"] == "folder" else "per-item DataLoader"
    headers = ["method", "workers", "samples/s", f"vs {reference}", "of limit", "MB/worker dirty (growth)",
               "batches read by"]
    body = []
    for row in results["rows"]:
        limit = "-" if row["fraction_of_limit"] is None else f"{row['fraction_of_limit']:.3g}"
        paths = ", ".join(f"{path} {count:,}" for path, count in row.get("read_paths", {}).items() if count)
        body.append((row["method"] + (" = LIMIT" if row["is_limit"] else ""), row["workers"],
                     f"{row['samples_per_s']:,.0f}", f"{row['vs_reference']:,.2f}x", limit, _worker_mb(row),
                     paths or "-"))
    return markdown_table(headers, body, "llrrrrl")


def _worker_mb(row):
    memory = row.get("worker_memory") or {}
    key = "private_dirty" if memory.get("mean_private_dirty") is not None else "uss"  # psutil: USS only
    if memory.get(f"mean_{key}") is None:
        return "-"
    growth = memory[f"mean_{key}_growth"]
    return f"{memory[f'mean_{key}'] / 2**20:.0f}" + ("" if growth is None else f" ({growth / 2**20:+.1f})")


def format_results(results):
    """Return what `fastdata bench` prints: a heading, the conversions of a folder, the table and how to read it."""
    config = results["config"]
    lines = [f"## Loading {results['num_samples']:,} {results['kind']} samples ({results['sample']}) from "
             f"{results['target']}, batch {config['batch_size']}, shuffled", ""]
    for entry in results["files"]:
        if entry["convert_seconds"] is not None:
            lines.append(f"converted to {entry['format']} {entry['storage']} in {entry['convert_seconds']:.1f}s "
                         f"({entry['bytes'] / 2**20:,.1f} MiB, temporary)")
    if lines[-1]:
        lines.append("")
    lines += [results_table(results), "",
              f"samples/s: median of {config['repeats']} timed passes of whole epochs (>= {config['min_seconds']}s "
              "each) after one warm-up epoch. Workers are persistent, so their start-up falls in the warm-up. "
              "MB/worker: private dirty memory of each worker (what it costs; USS where /proc is unreadable) at the "
              "end, and its growth over the timed passes.",
              f"took {results['seconds']:.0f}s on {results['machine']['usable_cpus']} usable CPUs"]
    return "\n".join(lines)


def plot_results(results, path):
    """Draw the rows' samples/s as horizontal bars (log scale) into the image file ``path``.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'fastdata[plot]'``).
    """
    require("matplotlib", "plot", "plotting benchmark results")
    from matplotlib.figure import Figure  # no pyplot: no global backend or window

    rows = results["rows"]
    rates = [row["samples_per_s"] for row in rows]
    figure = Figure(figsize=(11, 1.5 + 0.4 * len(rows)), layout="constrained")
    axes = figure.add_subplot()
    colours = ["tab:grey" if row["is_limit"] else "tab:blue" if "fastdata" in row["method"] else "tab:orange"
               for row in rows]
    axes.barh(range(len(rows)), rates, color=colours)
    axes.set_yticks(range(len(rows)), [f"{row['method']} [{row['workers']}]" for row in rows], fontsize=7)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("samples/s (log scale)")
    axes.set_title(f"{os.path.basename(results['target'])}: {results['num_samples']:,} {results['kind']} samples, "
                   f"batch {results['config']['batch_size']}", fontsize=9)
    for index, rate in enumerate(rates):
        axes.text(rate, index, f" {rate:,.0f}", va="center", fontsize=7)
    figure.savefig(path, dpi=120)
    return os.fspath(path)


